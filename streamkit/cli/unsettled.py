"""What a line-by-line append left undone, for `publish` and `journals append -f lines`.

Both commands batch many input lines into each append, and appends to
different journals fail independently, so what committed when one failed is
no prefix of the input. These pieces keep the lines of the appends still in
flight, so that a failure can be accounted for exactly, and write what was
not appended to an `--unpublished FILE`, from which a second run finishes
the job with each line once.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import IO

from streamkit.cli.errors import DATA_ERROR, CliError, explain
from streamkit.client import BrokerError, OpFuture, TransportError
from streamkit.errors import StreamkitError

__all__ = ["UNSURE_CODES", "AppendFailed", "Unsettled", "describe", "keep_unknown",
           "opened_output", "outcome_unknown", "stop_on_signals"]


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
        """Once every append settled, the lines of those that failed for sure (not
        committed), in input order."""
        return await self._settled_lines(unknown=False)

    async def unknown(self) -> list[tuple[int, bytes]]:
        """Once every append settled, the lines of those whose outcome is unknown (their
        answer was lost), in input order: appending them again may append them twice."""
        return await self._settled_lines(unknown=True)

    async def _settled_lines(self, *, unknown: bool) -> list[tuple[int, bytes]]:
        await self._wait()
        return sorted(item for future, held in self.lines.items() if not future.succeeded()
                      and outcome_unknown(future.exception()) is unknown for item in held)

    async def failed_by_journal(self) -> Counter[str]:
        """Once every append settled, how many lines failed (for sure or maybe), by the
        journal given to add."""
        await self._wait()
        short: Counter[str] = Counter()
        for future, held in self.lines.items():
            if not future.succeeded():
                short[self.journals[future]] += len(held)
        return short


# gRPC codes of a call whose outcome is unknown: the broker may have committed it.
UNSURE_CODES = ("UNKNOWN", "INTERNAL", "DEADLINE_EXCEEDED", "CANCELLED", "DATA_LOSS")


def outcome_unknown(error: BaseException | None) -> bool:
    """Whether an append that failed with `error` may still have committed: the broker's
    own answer (a status) says it didn't, as do transport failures before any answer."""
    if error is None or isinstance(error, BrokerError | AppendFailed):
        return False
    return not isinstance(error, TransportError) or error.code in UNSURE_CODES


def keep_unknown(unknown: list[tuple[int, bytes]], kept: IO[bytes] | None,
                 ending: bytes) -> str:
    """Write the lines of appends whose outcome is unknown beside `kept` (FILE.unknown):
    not in FILE, which a rerun appends once, since they may be in the journal already.
    Returns what the account says of them ("" for none)."""
    if not unknown:
        return ""
    said = (f", and {len(unknown):,} unknown (the broker's answer was lost: they may be "
            "in the journal")
    if kept is None:
        return said + ")"
    path = Path(kept.name + ".unknown")
    with path.open("wb") as out:
        for _, line in unknown:
            out.write(line + ending)
    return said + f"; they are in {path}, to check against it before appending them)"


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


@contextlib.asynccontextmanager
async def stop_on_signals() -> AsyncIterator[asyncio.Event]:
    """An event set by Ctrl-C or SIGTERM, so that a command stops between lines and
    accounts for what committed; a second signal stops at once (cancels the command).
    Afterwards the command's own handling is back: Ctrl-C as asyncio.run had it (Python's
    handler), SIGTERM cancelling the command (`errors._stoppable`'s)."""
    loop, task, stop = asyncio.get_running_loop(), asyncio.current_task(), asyncio.Event()

    def stopping() -> None:
        if stop.is_set() and task is not None:
            task.cancel()
        stop.set()

    sigint = signal.getsignal(signal.SIGINT)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping)
    try:
        yield stop
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        signal.signal(signal.SIGINT, sigint)
        if task is not None:
            loop.add_signal_handler(signal.SIGTERM, task.cancel)
        else:
            loop.remove_signal_handler(signal.SIGTERM)
