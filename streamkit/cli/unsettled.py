"""What a line-by-line append left undone, for `publish` and `journals append -f lines`.

Both commands batch many input lines into each append, and appends to
different journals fail independently, so what committed when one failed is
no prefix of the input. These pieces keep the lines of the appends still in
flight, so that a failure can be accounted for exactly, and write what was
not appended to an `--unpublished FILE`, from which a second run finishes
the job with each line once.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from streamkit.cli.errors import DATA_ERROR, CliError, explain
from streamkit.client import OpFuture
from streamkit.errors import StreamkitError

__all__ = ["AppendFailed", "Unsettled", "describe", "opened_output"]


class Unsettled:
    """The input lines of appends not known to have committed yet, by append (appends
    batch many lines under one OpFuture): what a failed append leaves to publish again.
    Appends that committed are forgotten as the command goes, so this holds only the
    lines in flight."""

    _SWEEP = 256  # appends held before forgetting the committed ones

    def __init__(self) -> None:
        self.lines: dict[OpFuture, list[tuple[int, bytes]]] = {}
        self.journals: dict[OpFuture, str] = {}  # (when the caller said)

    def add(self, future: OpFuture, number: int, line: bytes, journal: str = "") -> None:
        held = self.lines.get(future)
        if held is None:
            if len(self.lines) >= self._SWEEP:
                self.lines = {f: held for f, held in self.lines.items() if not f.succeeded()}
                self.journals = {f: j for f, j in self.journals.items() if f in self.lines}
            held = self.lines[future] = []
            self.journals[future] = journal
        held.append((number, line))

    async def _wait(self) -> None:
        for future in self.lines:
            await future.wait()

    async def settle(self) -> None:
        """Wait for every append; raise AppendFailed (from the first failure) if one
        failed."""
        await self._wait()
        failure = next((f.exception() for f in self.lines if not f.succeeded()), None)
        if failure is not None:
            raise AppendFailed from failure

    async def failed(self) -> list[tuple[int, bytes]]:
        """Once every append settled, the lines of those that failed, in input order."""
        await self._wait()
        return sorted(item for future, held in self.lines.items() if not future.succeeded()
                      for item in held)

    async def failed_by_journal(self) -> Counter[str]:
        """Once every append settled, how many lines failed, by the journal given to add."""
        await self._wait()
        short: Counter[str] = Counter()
        for future, held in self.lines.items():
            if not future.succeeded():
                short[self.journals[future]] += len(held)
        return short


class AppendFailed(StreamkitError):
    """An append of the command failed (its error is the cause)."""


def describe(cause: BaseException | None) -> str:
    """A failed append's error as one line of the command's error message."""
    try:
        return "; ".join(explain(cause)[0]) if cause is not None else "an append failed"
    except Exception:  # not one of the errors explained: its type and message
        return f"{type(cause).__name__}: {cause}"


@contextlib.contextmanager
def opened_output(path: Path | None, source: IO[bytes]) -> Iterator[IO[bytes] | None]:
    """`path` opened for writing now (a bad one is said before appending anything). It
    must not be the input, `source`: opening it would empty the input before it is read
    (a retry `-i rest --unpublished rest` lost every line)."""
    if path is None:
        yield None
        return
    try:
        same = os.path.samestat(os.fstat(source.fileno()), os.stat(path))
    except (OSError, ValueError, io.UnsupportedOperation):  # no such file yet, or no fd
        same = False
    if same:
        raise CliError(f"--unpublished {path} is the input: it would be emptied before it "
                       "is read; name another file", DATA_ERROR)
    try:
        output = path.open("wb")
    except OSError as err:
        raise CliError(f"--unpublished {path}: {err.strerror or err}", DATA_ERROR) from None
    with output:
        yield output
