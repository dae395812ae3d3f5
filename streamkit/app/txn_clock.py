"""The clock a transaction loop measures its durations and waits by.

The loop's rules are about time (min and max durations, waiting for an ACK
at most until the max), so tests drive it with a fake clock instead of
sleeping; production uses `MONOTONIC`, the event loop's own monotonic time.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import Any, Protocol

from streamkit.app.waits import first_of

__all__ = ["MONOTONIC", "MonotonicClock", "TxnClock"]


class TxnClock(Protocol):
    """Monotonic seconds, and waiting for the first of some awaitables until a deadline."""

    def now(self) -> float:
        """Seconds on this clock (monotonic; only differences mean anything)."""
        ...

    async def wait(self, waits: list[Awaitable[Any]], deadline: float | None = None) -> None:
        """Until the first of `waits` finishes, or `now()` reaches `deadline` (None: no limit).

        Coroutines are wrapped in tasks and cancelled afterwards; tasks passed
        in (a commit in flight) are left running, as with `first_of`.
        """
        ...


class MonotonicClock:
    """The real clock: `time.monotonic`, which asyncio's default event loop runs on too."""

    now = staticmethod(time.monotonic)

    async def wait(self, waits: list[Awaitable[Any]], deadline: float | None = None) -> None:
        await first_of(waits, None if deadline is None else max(0.0, deadline - time.monotonic()))


MONOTONIC: TxnClock = MonotonicClock()
