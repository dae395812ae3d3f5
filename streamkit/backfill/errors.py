"""The one error type a backfill raises for problems the user can act on."""

from __future__ import annotations

from streamkit.errors import StreamkitError

__all__ = ["BackfillError"]


class BackfillError(StreamkitError):
    """A backfill can't be planned or run: the message says what to fix.

    Raised in Spark tasks too; the driver finds it (by its class name) in the
    executor's traceback that Spark reports, and raises it again, alone.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[type[BackfillError], tuple[str]]:
        return (type(self), (self.message,))
