"""`async with` for client objects that own resources and have a `close()`."""

from __future__ import annotations

import inspect
from types import TracebackType
from typing import Self


class AsyncClosing:
    """Closes the object when an `async with` block exits; close() may be sync or async."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        result = self.close()  # type: ignore[attr-defined]
        if inspect.isawaitable(result):
            await result
