"""`journals append` and `journals read`: moving bytes between stdio and journals.

Appends come in two framings. With "none" the whole input is one append: it
becomes visible atomically or not at all, and a failure says which. With
"lines" every line is a record that lands whole in exactly one journal,
chosen by a mapping; lines are batched through an AppendService, so many
lines share one RPC, and appends to different journals fail apart: a
failure then accounts for the lines appended and (with --unpublished) writes
the others, as `publish` does.

Reads copy journal content to stdout as it arrives. Broker chunks don't
respect record boundaries, so for line-oriented journals (by their
content-type label) output is held back to the last newline; that keeps
lines whole when several journals are followed into one stream. Reads of
messages instead decode each frame with the journal's framing and print it
as one JSON line, optionally read-committed (exactly once, acknowledged only).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import click
import orjson
from google.protobuf import json_format
from google.protobuf.message import Message as ProtoMessage
from pydantic import BaseModel

from streamkit.cli.errors import DATA_ERROR, INTERRUPTED, CliError, explain, warn
from streamkit.cli.line_input import LineInput
from streamkit.cli.output import plural
from streamkit.cli.unsettled import (
    AppendFailed,
    Unsettled,
    describe,
    keep_unknown,
    outcome_unknown,
    stop_on_signals,
)
from streamkit.client import (
    AppendService,
    BrokerClient,
    OffsetJump,
    OffsetNotYetAvailable,
    RetryReader,
)
from streamkit.client.appender import CHUNK_SIZE, append_with_retries
from streamkit.client.reader import read_write_head
from streamkit.message.framing import UnknownFraming
from streamkit.message.message import MessageLike
from streamkit.message.reader import ReadCommitted, ReadUncommitted, journal_framing
from streamkit.protocol import pb
from streamkit.protocol.spec import MAX_OFFSET

__all__ = [
    "MAPPINGS",
    "append_lines",
    "append_raw",
    "is_line_oriented",
    "read_journals",
]

MAPPINGS = ("random", "modulo", "direct")
_LINE_TYPES = ("application/x-ndjson", "application/jsonl", "text/")

# A line (with its newline) -> (journal, bytes to append).
Mapper = Callable[[bytes], tuple[str, bytes]]


# --- append ---------------------------------------------------------------------


def _chunks(source: IO[bytes]) -> Iterator[bytes]:
    source.seek(0)
    while chunk := source.read(CHUNK_SIZE):
        yield chunk


# Failures of an append that leave open whether the broker committed it.
def _raw_failure(err: Exception, journal: str, source: IO[bytes],
                 unappended: IO[bytes] | None) -> CliError:
    """The error of a failed raw append, saying whether the input was appended: an append
    commits whole or not at all, and one the broker refused did not commit."""
    lines, code = explain(err)  # (raises `err` itself if it is no failure explained)
    if not outcome_unknown(err):
        said = f"nothing was appended to {journal} (an append commits whole or not at all)"
        if unappended is not None:
            source.seek(0)
            shutil.copyfileobj(source, unappended, CHUNK_SIZE)
            said += f"; the input is in {unappended.name}: append it to finish"
    else:
        said = (f"whether the input was appended to {journal} is unknown (all of it or none): "
                "check the journal (journals read) before appending again")
    return CliError(f"{'; '.join(lines)}; {said}", code)


async def _append_file(client: BrokerClient, journal: str, source: IO[bytes],
                       unappended: IO[bytes] | None) -> None:
    if source.seek(0, os.SEEK_END) == 0:
        warn(f"nothing to append to {journal}: the input is empty")
        return
    try:
        response = await append_with_retries(client, journal, lambda: _chunks(source))
    except Exception as err:
        raise _raw_failure(err, journal, source, unappended) from None
    commit = response.commit
    click.echo(
        f"appended {plural(commit.end - commit.begin, 'byte')} to {journal} "
        f"at offsets [{commit.begin}, {commit.end})",
        err=True,
    )


async def append_raw(client: BrokerClient, journal: str, source: IO[bytes],
                     unappended: IO[bytes] | None = None) -> None:
    """Append all of `source` to `journal` as one transaction; report it on stderr.

    Input that can't be re-read (stdin, pipes) is copied to a temporary file
    first: a retried append sends its content again, and reading everything
    before the RPC starts keeps a slow producer from holding the append open.
    If the append fails, the error says whether it committed, and `unappended`
    gets the input when it did not.
    """
    if source.seekable():
        await _append_file(client, journal, source, unappended)
        return
    with tempfile.TemporaryFile() as copy:
        shutil.copyfileobj(source, copy, CHUNK_SIZE)
        await _append_file(client, journal, copy, unappended)


def _direct(journals: list[str]) -> Mapper:
    """Each line reads "JOURNAL<TAB>RECORD"; RECORD goes to JOURNAL, a selected journal."""
    allowed = set(journals)

    def mapping(line: bytes) -> tuple[str, bytes]:
        name, tab, record = line.partition(b"\t")
        journal = name.decode("utf-8", "replace")
        if not tab:
            raise ValueError("the direct mapping expects lines like JOURNAL<TAB>RECORD")
        if journal not in allowed:
            raise ValueError(f"journal {journal!r} is not one of the selected journals")
        return journal, record

    return mapping


def make_mapping(kind: str, journals: list[str]) -> Mapper:
    """How lines are spread over `journals` (see `journals append --help`)."""
    names = sorted(journals)
    if kind == "random":
        return lambda line: (random.choice(names), line)
    if kind == "modulo":  # a stable hash: equal lines always land in the same journal
        return lambda line: (names[zlib.crc32(line.rstrip(b"\n")) % len(names)], line)
    if kind == "direct":
        return _direct(names)
    raise ValueError(f"unknown mapping {kind!r}")


@dataclass
class _Tally:
    lines: int = 0
    bytes: int = 0


async def append_lines(
    client: BrokerClient, journals: list[str], source: IO[bytes], mapping: str,
    unappended: IO[bytes] | None = None,
) -> None:
    """Append each input line to one of `journals`; report the tally per journal on stderr.

    A failed append stops the command with an exact account, as `publish` gives: how many
    of the lines read were appended (by journal, for those short), and (written to
    `unappended`, then the input not read) the lines that were not, in input order, so
    that appending that file with the same options appends each line once.
    """
    mapper = make_mapping(mapping, journals)
    tallies: dict[str, _Tally] = {}
    unsettled = Unsettled()  # a journal's appends commit in order, but journals fail apart
    lines = LineInput(source)
    number, rest = 0, []
    async with AppendService(client) as service, stop_on_signals() as stop:
        try:
            while not rest and (batch := await lines.batch(stop)) is not None:
                for index, bare in enumerate(batch):
                    if stop.is_set():  # Ctrl-C: no line after it; an account of those before
                        rest = [line + b"\n" for line in batch[index:]]
                        break
                    number += 1
                    line = bare + b"\n"
                    try:
                        journal, record = mapper(line)
                    except ValueError as err:
                        # An append that failed before this line is the one reported, and
                        # this line and the batch's after it are among those to append
                        # again; otherwise this line is.
                        rest, number = [b + b"\n" for b in batch[index:]], number - 1
                        await unsettled.settle()
                        done = sum(tally.lines for tally in tallies.values())
                        raise CliError(
                            f"input line {number + 1}: {err} (stopped there; the "
                            f"{plural(done, 'line')} before it "
                            f"{'was' if done == 1 else 'were'} appended)", DATA_ERROR,
                        ) from None
                    future = await service.append(journal, record)
                    unsettled.add(future, number, line, journal)
                    tally = tallies.setdefault(journal, _Tally())
                    tally.lines += 1
                    tally.bytes += len(record)
                    if future.done() and future.exception() is not None:
                        rest = [b + b"\n" for b in batch[index + 1:]]
                        raise AppendFailed from future.exception()  # later ones would fail too
                if stop.is_set():
                    break
            await unsettled.settle()
        except AppendFailed as failure:
            await _report_failure(failure.__cause__, unsettled, tallies, number, rest, lines,
                                  unappended)
        if stop.is_set():
            await _report_failure(None, unsettled, tallies, number, rest, lines, unappended,
                                  interrupted=lines.file)
    for journal, tally in sorted(tallies.items()):
        click.echo(
            f"appended {plural(tally.lines, 'line')} ({plural(tally.bytes, 'byte')}) to {journal}",
            err=True,
        )
    if not tallies:
        warn("nothing appended: the input is empty")


async def _report_failure(cause: BaseException | None, unsettled: Unsettled,
                          tallies: dict[str, _Tally], read: int, rest: list[bytes],
                          lines: LineInput, unappended: IO[bytes] | None, *,
                          interrupted: bool | None = None) -> None:
    """Raise the CliError of a failed append (or of an interruption: whether the input's
    unread rest can be kept, a file's): what committed, and what to append again."""
    failed, unknown = await unsettled.failed(), await unsettled.unknown()
    short = await unsettled.failed_by_journal()
    total = sum(tally.lines for tally in tallies.values())
    by_journal = "; ".join(f"to {journal}: {tallies[journal].lines - count:,} of its "
                           f"{tallies[journal].lines:,}"
                           for journal, count in sorted(short.items()))
    account = (f"{total - len(failed) - len(unknown):,} of the {total:,} lines read were "
               f"appended, {len(failed):,} were not{keep_unknown(unknown, unappended, b'')}"
               + (f" (appended {by_journal})" if by_journal else ""))
    if unappended is None:
        hint = ("; appending the same input again would append the appended ones twice "
                "(--unpublished FILE writes the lines not appended, and the rest of the "
                "input, to append once)")
    else:
        for _, line in failed:
            unappended.write(line)
        for line in rest:
            unappended.write(line)
        # (interrupted is False: a pipe, read no further)
        hint = await lines.keep_unread(unappended, interrupted is False, read)
        if interrupted is not False:
            hint += ": append it with the same options to finish"
    if interrupted is not None:
        raise CliError(f"interrupted: {account}{hint}", INTERRUPTED)
    raise CliError(f"{describe(cause)}; {account}{hint}")


# --- read -----------------------------------------------------------------------


def is_line_oriented(spec: pb.JournalSpec) -> bool:
    """Whether the journal's content-type says its records are lines."""
    for label in spec.labels.labels:
        if label.name == "content-type":
            media = label.value.split(";", 1)[0].strip().lower()
            return any(media == kind or media.startswith(kind) for kind in _LINE_TYPES)
    return False


def _write_stdout(data: bytes | bytearray) -> None:
    """Write and flush at once: a reader downstream sees content as it arrives."""
    out = sys.stdout.buffer
    out.write(data)
    out.flush()


class _JournalCopy:
    """Copies one journal to stdout, keeping lines whole if the journal holds lines."""

    def __init__(
        self, client: BrokerClient, spec: pb.JournalSpec, offset: int, *, block: bool
    ) -> None:
        self.journal = spec.name
        self.lines = is_line_oriented(spec)
        self.reader = RetryReader(
            client, pb.ReadRequest(journal=spec.name, offset=offset, block=block)
        )
        self.pending = bytearray()  # the start of a line whose end hasn't arrived

    @property
    def offset(self) -> int:
        """The offset after the last byte written."""
        return self.reader.offset - len(self.pending)

    def _emit(self, data: bytes) -> None:
        if not self.lines:
            _write_stdout(data)
            return
        self.pending += data
        cut = self.pending.rfind(b"\n") + 1
        if cut:
            _write_stdout(self.pending[:cut])
            del self.pending[:cut]

    async def run(self) -> None:
        """Copy until the write head (non-blocking) or forever (blocking)."""
        try:
            while True:
                try:
                    data = await self.reader.read()
                except OffsetJump as jump:
                    warn(f"journal {self.journal}: skipped offsets "
                         f"{jump.from_offset}..{jump.to_offset} (fragments missing)")
                    continue
                except OffsetNotYetAvailable:
                    break
                if not data:
                    break
                self._emit(data)
            if self.pending:  # the journal ends mid-line: that is its content
                _write_stdout(self.pending)
                self.pending.clear()
        finally:
            self.reader.close()


def _json_line(message: MessageLike) -> bytes:
    """One message as a line of JSON, whatever its kind."""
    if isinstance(message, BaseModel):
        return message.__pydantic_serializer__.to_json(message) + b"\n"
    if isinstance(message, ProtoMessage):
        message = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return orjson.dumps(message, default=str, option=orjson.OPT_APPEND_NEWLINE)


class _MessageCopy:
    """Prints one journal's messages to stdout as JSON lines, maybe read-committed."""

    def __init__(
        self, client: BrokerClient, spec: pb.JournalSpec, offset: int, *, block: bool,
        committed: bool,
    ) -> None:
        self.journal = spec.name
        self.client = client
        self.start = offset
        self.block = block
        self.committed = committed
        self.reader: ReadCommitted | ReadUncommitted | None = None

    @property
    def offset(self) -> int:
        """Where to resume: after the last message printed."""
        return self.start if self.reader is None else self.reader.offset

    async def run(self) -> None:
        """Print messages until the write head (non-blocking) or forever (blocking)."""
        try:
            framing = await journal_framing(self.client, self.journal)
        except UnknownFraming as err:
            raise CliError(f"journal {self.journal}: {err}", DATA_ERROR) from None
        kind = ReadCommitted if self.committed else ReadUncommitted
        self.reader = reader = kind(self.client, self.journal, dict, self.start, self.block,
                                    framing=framing)
        out = bytearray()
        try:
            async for env in reader:
                out += _json_line(env.message)
                if not reader.buffered:  # flush before the reader may wait for the broker
                    _write_stdout(out)
                    out.clear()
        finally:
            if out:
                _write_stdout(out)
            reader.close()


def load_offsets(path: Path | None) -> dict[str, int]:
    """Start offsets by journal, from a file `--offsets-out` wrote."""
    if path is None:
        return {}
    try:
        offsets = json.loads(path.read_text())
    except OSError as err:
        raise CliError(f"cannot read offsets file {path}: {err.strerror}", DATA_ERROR) from None
    except ValueError as err:
        raise CliError(f"offsets file {path} is not JSON: {err}", DATA_ERROR) from None
    if not isinstance(offsets, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and -1 <= v <= MAX_OFFSET
        for k, v in offsets.items()
    ):
        raise CliError(f"offsets file {path} must map journal names to offsets >= -1 "
                       f"(64-bit)", DATA_ERROR)
    return offsets


def _save_offsets(path: Path, copies: list[_JournalCopy | _MessageCopy]) -> None:
    offsets = {copy.journal: copy.offset for copy in copies}
    path.write_text(json.dumps(offsets, indent=2, sort_keys=True) + "\n")


async def read_journals(
    client: BrokerClient,
    specs: list[pb.JournalSpec],
    offsets: dict[str, int],
    *,
    default_offset: int,
    block: bool,
    offsets_out: Path | None,
    messages: bool = False,
    committed: bool = False,
) -> None:
    """Copy each journal to stdout: one after another, or all at once when following.

    With `messages` (implied by `committed`), print decoded messages as JSON lines.
    """
    copies: list[_JournalCopy | _MessageCopy] = []
    for spec in specs:
        offset = offsets.get(spec.name, default_offset)
        if offset < 0:  # a tail starts at the real write head, so its reported offset is real
            offset = await read_write_head(client, spec.name)
        if messages or committed:
            copies.append(_MessageCopy(client, spec, offset, block=block, committed=committed))
        else:
            copies.append(_JournalCopy(client, spec, offset, block=block))
    beyond: list[str] = []
    try:
        if block:  # a start past the head waits for it: a read of what's still to come
            await asyncio.gather(*(copy.run() for copy in copies))
        else:
            for copy in copies:
                start = copy.offset
                await copy.run()
                if copy.offset == start > 0:
                    head = await read_write_head(client, copy.journal)
                    if start > head:
                        beyond.append(f"{copy.journal}: offset {start:,} is past its write "
                                      f"head {head:,}")
    finally:
        if offsets_out is not None:
            _save_offsets(offsets_out, copies)
    if beyond:
        # Read nothing and said nothing, a mistyped offset (or an offsets file of journals
        # since recreated) looked like a journal with nothing new; resuming there would
        # skip whatever is appended up to it.
        raise CliError(f"{'; '.join(beyond)}: nothing there to read yet (--tail starts at "
                       "the write head; --block waits for the offset)", DATA_ERROR)
