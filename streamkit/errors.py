"""The root of streamkit's exceptions.

Every error the library raises on purpose derives from `StreamkitError`, so an
application can tell "streamkit said no" from a bug in its own code with one
`except` clause. Each layer keeps its own subclasses next to the code that
raises them (`client.errors`, `protocol.problems`, `stores.store`, ...); this
module holds only the root, so that every layer may import it.

Most subclasses also derive from the built-in exception that describes them
(`ValueError` for bad input, `OSError` for storage), so existing handlers of
those keep working.
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["StreamkitError", "causes"]


class StreamkitError(Exception):
    """Something streamkit refused or failed to do; the message says what and where."""


def causes(error: BaseException) -> Iterator[BaseException]:
    """`error`, then what it was raised from or while handling, outermost first: where a
    wrapper (a failed transaction, a store's one-line message) hides the original."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__
