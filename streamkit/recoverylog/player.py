"""Player: plays a recovery log back into a local directory.

Playback learns each hinted log's write head with a zero-byte append (as
Gazette does: an append is sequenced after every append that committed
before it, which a metadata read of the head does not promise), then seeks
to each hinted segment in turn, so that log outside the hinted segments is
never read. Files are staged as `<dir>/.fnodes/<fnode>` and hard-linked into
place only when playback finishes, so an interrupted or failed playback never
leaves a plausible-looking but wrong tree: on error the directory is removed.

Ops of other authors than the hints expect, and ops older than the next
expected seq_no, are skipped (dead branches and duplicates). Anything else
that does not fit the history - a bad frame, a checksum mismatch, a lost op,
an op on an unknown Fnode, a frame cut short at the write head - stops
playback with a RecoveryLogError naming the log and offset.

Once at the head, playback either finishes (`finish_at_write_head`), or
injects a hand-off no-op that fences the previous Recorder and finishes when
that no-op reads back as applied (`inject_handoff`), or keeps tailing new
ops as a hot standby until told to do one of the two.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from google.protobuf.message import DecodeError

from streamkit.client import BrokerClient, OffsetJump, OffsetNotYetAvailable, RetryReader
from streamkit.client.appender import append_with_retries, write_head
from streamkit.protocol import pb
from streamkit.protocol import recoverylog_pb2 as rpb
from streamkit.recoverylog.fsm import (
    FRAME_HEADER,
    FRAME_MAGIC,
    FSM,
    MAX_OP_SIZE,
    FSMError,
    Outcome,
    RecoveryLogError,
    author_fence,
    encode_frame,
)
from streamkit.tasks import cancel_and_wait

__all__ = ["STAGING_DIR", "Player"]

STAGING_DIR = ".fnodes"
_HEADER_LEN = FRAME_HEADER.size
_SEEK_OVER = 1 << 20  # skipped write data longer than this is seeked over, not read


class _State(enum.Enum):
    BACKFILL = enum.auto()  # reading history up to the head learned at start
    TAIL = enum.auto()  # at the head; following new ops (hot standby)
    EXIT_AT_HEAD = enum.auto()  # finish once the head is reached
    INJECT_AT_HEAD = enum.auto()  # append a hand-off no-op once the head is reached
    READ_HANDOFF = enum.auto()  # reading until the injected no-op comes back


class _Truncated(Exception):
    """The journal ended (for now) before the bytes asked for."""


class _LogReader:
    """Buffered, seekable reads of one journal at a time, recording what was fetched."""

    def __init__(self, client: BrokerClient) -> None:
        self.client = client
        self.log = ""
        self.offset = 0  # journal offset of self._buf[self._pos]
        self.blocking = False
        self.fetched: list[tuple[str, int, int]] = []  # (log, begin, end) actually read
        self._rr: RetryReader | None = None
        self._buf = bytearray()
        self._pos = 0

    @property
    def buffered(self) -> int:
        return len(self._buf) - self._pos

    def seek(self, log: str, offset: int) -> None:
        """Continue at `log`:`offset`, reusing buffered bytes when they cover it."""
        if log == self.log and self.offset <= offset <= self.offset + self.buffered:
            self._pos += offset - self.offset
            self.offset = offset
            return
        self._restart(log, offset)

    def set_blocking(self, blocking: bool) -> None:
        if blocking != self.blocking:
            self.blocking = blocking
            if self._rr is not None:
                self._rr.close()
                self._rr = None

    def _restart(self, log: str, offset: int) -> None:
        self.close()
        self.log, self.offset = log, offset
        self._buf, self._pos = bytearray(), 0

    async def _read_more(self) -> bytes:
        """The next chunk; raises OffsetNotYetAvailable at the head when not blocking."""
        if self._rr is None:
            end = self.offset + self.buffered
            request = pb.ReadRequest(journal=self.log, offset=end, block=self.blocking)
            self._rr = RetryReader(self.client, request)
        begin = self._rr.offset
        chunk = await self._rr.read()
        if chunk:
            self._note(begin, begin + len(chunk))
        return chunk

    def _note(self, begin: int, end: int) -> None:
        last = self.fetched[-1] if self.fetched else None
        if last is not None and last[0] == self.log and last[2] == begin:
            self.fetched[-1] = (self.log, last[1], end)
        else:
            self.fetched.append((self.log, begin, end))

    async def fill(self, n: int) -> None:
        """Buffer at least `n` bytes. Cancel-safe: a cancelled fill loses nothing."""
        while self.buffered < n:
            chunk = await self._read_more()
            if not chunk:
                raise _Truncated
            if self._pos > (1 << 20) and self._pos * 2 > len(self._buf):
                del self._buf[: self._pos]
                self._pos = 0
            self._buf += chunk

    def take(self, n: int) -> memoryview:
        """The next `n` buffered bytes (valid until the next fill)."""
        view = memoryview(self._buf)[self._pos : self._pos + n]
        self._pos += n
        self.offset += n
        return view

    async def copy_to(self, fd: int, file_offset: int, length: int) -> None:
        """Write the next `length` bytes of the log at `file_offset` of `fd`.

        Chunks wholly inside the write go straight to the file, unbuffered, from
        a worker thread while the next chunk is being received.
        """
        loop = asyncio.get_running_loop()
        writing: asyncio.Future[None] | None = None
        try:
            while length:
                if self.buffered:
                    n = min(length, self.buffered)
                    with self.take(n) as view:
                        _pwrite_all(fd, view, file_offset)
                else:
                    chunk = await self._read_more()
                    if not chunk:
                        raise _Truncated
                    n = len(chunk)
                    if n > length:
                        self._buf, self._pos = bytearray(chunk), 0
                        continue
                    if writing is not None:
                        await writing
                    writing = loop.run_in_executor(None, _pwrite_all, fd, chunk, file_offset)
                    self.offset += n
                file_offset += n
                length -= n
        finally:
            if writing is not None:
                await writing

    async def skip(self, length: int) -> None:
        """Move past `length` bytes; a long unbuffered stretch is seeked over, not fetched."""
        if length - self.buffered > _SEEK_OVER:
            self.seek(self.log, self.offset + length)
            return
        await self.fill(length)
        self.seek(self.log, self.offset + length)

    def close(self) -> None:
        if self._rr is not None:
            self._rr.close()
            self._rr = None


@contextlib.contextmanager
def _cut_short(log: str, first: int, what: str) -> Iterator[None]:
    """Report the log ending (or skipping) inside the op at `first` as corruption."""
    try:
        yield
    except (OffsetNotYetAvailable, _Truncated, OffsetJump):
        raise RecoveryLogError(log, first, f"{what} is cut short") from None


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    written = 0
    while written < len(data):
        written += os.pwrite(fd, data[written:], offset + written)


class Player:
    """Plays FSMHints back into a directory; see the module docstring.

    `play` runs until `finish_at_write_head` or `inject_handoff` has been
    called (either before or during playback) and completed, returning the
    recovered FSM. `tailing` is set once playback first reaches the head.
    After a hand-off, `handoff_end` is the log's offset just past it: where
    the new author's first op lands at the earliest.
    """

    def __init__(self, client: BrokerClient) -> None:
        self.client = client
        self.tailing = asyncio.Event()
        self.handoff_end = 0
        self.fsm: FSM | None = None
        self.dir: Path | None = None
        self._request: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._reader = _LogReader(client)
        self._playback: _Playback | None = None

    def progress(self) -> str:
        """Where playback is, for a person wondering why it takes so long."""
        playback, reader = self._playback, self._reader
        if playback is None:
            return "not started"
        return (f"{playback.state.name.lower().replace('_', ' ')} at {reader.log}@{reader.offset}"
                f" ({'blocking' if reader.blocking else 'non-blocking'} read, op seq_no "
                f"{playback.fsm.next_seq_no}, reading through {playback.read_through})")

    @property
    def fetched(self) -> list[tuple[str, int, int]]:
        """(log, begin, end) ranges playback read from brokers, in order."""
        return self._reader.fetched

    def finish_at_write_head(self) -> None:
        """Finish playback upon reaching the log's current write head."""
        self._set_request(0)

    def inject_handoff(self, author: int) -> None:
        """Finish playback by sequencing a no-op of `author` at the head, fencing others."""
        if author == 0:
            raise ValueError("a hand-off author must be non-zero")
        self._set_request(author)

    def _set_request(self, author: int) -> None:
        if self._request.done():
            raise RuntimeError("finish_at_write_head or inject_handoff was already called")
        self._request.set_result(author)

    async def play(self, hints: rpb.FSMHints, directory: str | os.PathLike[str]) -> FSM:
        """Rebuild `directory` (emptied first) from the log; the recovered FSM."""
        root = Path(directory)
        fsm = FSM(hints)
        shutil.rmtree(root, ignore_errors=True)
        (root / STAGING_DIR).mkdir(parents=True)
        playback = self._playback = _Playback(self, fsm, root, hints.log)
        try:
            await playback.run()
        except BaseException:
            playback.close_files()
            shutil.rmtree(root, ignore_errors=True)
            raise
        finally:
            self._reader.close()
        self.fsm, self.dir = fsm, root
        return fsm


class _Playback:
    """The state of one `Player.play`."""

    def __init__(self, player: Player, fsm: FSM, root: Path, log: str) -> None:
        self.player = player
        self.reader = player._reader
        self.fsm = fsm
        self.root = root
        self.log = log
        self.files: dict[int, int] = {}  # staged Fnode -> open fd
        self.state = _State.BACKFILL
        self.handoff = 0
        self.heads: dict[str, int] = {}
        self.read_through = 0

    # --- the loop ------------------------------------------------------------

    async def run(self) -> None:
        logs = {self.log, *(s.log for s in self.fsm.hinted_segments)}
        for log in sorted(logs):
            self.heads[log] = await self._write_head(log)
        for segment in self.fsm.hinted_segments:
            head = self.heads[segment.log]
            if segment.first_offset >= head or segment.last_offset > head:
                raise RecoveryLogError(segment.log, head, f"write head is before hinted {segment}"
                                                          " (data loss?)")
        reader, request = self.reader, self.player._request
        while True:
            self._position()
            if self.state in (_State.BACKFILL, _State.TAIL) and request.done():
                self.handoff = request.result()
                self.state = _State.INJECT_AT_HEAD if self.handoff else _State.EXIT_AT_HEAD
            tailing = self.state in (_State.TAIL, _State.READ_HANDOFF)
            reader.set_blocking(tailing or reader.offset < self.read_through)
            try:
                if self.state is _State.TAIL and not reader.buffered:
                    await self._await_op_or_request()
                    continue
                await reader.fill(_HEADER_LEN)
            except OffsetNotYetAvailable:
                if await self._at_head():
                    return
                continue
            except _Truncated:
                raise RecoveryLogError(reader.log, reader.offset, "log ended mid-frame") from None
            except OffsetJump as jump:
                self._jumped(jump)
                continue
            if await self._play_op():
                return

    def _position(self) -> None:
        """Seek to the next hinted segment, or to the hinted log once hints are used up."""
        reader, segment = self.reader, self.fsm.next_hinted_segment
        if segment is not None:
            if reader.log != segment.log or reader.offset < segment.first_offset:
                reader.seek(segment.log, segment.first_offset)
                self.read_through = self.heads[segment.log]
            elif reader.offset >= self.read_through:
                raise RecoveryLogError(reader.log, reader.offset,
                                       "reached the write head with hints unused (data loss?)")
        elif not reader.log:  # no hints: the whole log
            reader.seek(self.log, 0)
            self.read_through = self.heads[self.log]

    def _jumped(self, jump: OffsetJump) -> None:
        """Content is missing (deleted fragments): fatal unless it lies before the next hint.

        Without a hinted segment ahead to resume at, nothing tells what the gap
        held: if no later op revealed its missing seq_nos, playback would end at
        an older state and a hand-off would build on it. So only a gap ending at
        or before the next hinted segment's first offset is skipped.
        """
        reader, segment = self.reader, self.fsm.next_hinted_segment
        skippable = (segment is not None and segment.log == reader.log
                     and jump.to_offset <= segment.first_offset)
        if reader.buffered or not skippable:
            raise RecoveryLogError(reader.log, jump.from_offset,
                                   f"log content is missing up to {jump.to_offset}")
        reader.seek(reader.log, jump.to_offset)

    async def _await_op_or_request(self) -> None:
        """While tailing: wait for the next op's first bytes, or for a finish request."""
        fill = asyncio.ensure_future(self.reader.fill(1))
        await asyncio.wait((fill, self.player._request), return_when=asyncio.FIRST_COMPLETED)
        if not fill.done():
            await cancel_and_wait(fill, f"reading {self.reader.log}")
            return
        fill.result()  # re-raise a failure

    async def _at_head(self) -> bool:
        """React to reaching the write head (non-blocking read); True when playback is done."""
        reader = self.reader
        if self.fsm.has_remaining_hints:
            raise RecoveryLogError(reader.log, reader.offset,
                                   "reached the write head with hints unused (data loss?)")
        self.player.tailing.set()
        if self.state is _State.BACKFILL:
            self.state = _State.TAIL
            return False
        if self.state is _State.EXIT_AT_HEAD:
            self._make_live()
            return True
        if self.state is _State.INJECT_AT_HEAD:
            await self._inject()
            return False
        raise AssertionError(f"non-blocking read in state {self.state}")

    async def _inject(self) -> None:
        """Append a no-op sequenced after what we applied, taking the author register."""
        op = rpb.RecordedOp(seq_no=self.fsm.next_seq_no, checksum=self.fsm.next_checksum,
                            author=self.handoff)
        header, payload = encode_frame(op)
        response = await append_with_retries(
            self.player.client, self.log, lambda: (header, payload),
            union_registers=author_fence(self.handoff),
        )
        self.state, self.read_through = _State.READ_HANDOFF, response.commit.end
        self.player.handoff_end = response.commit.end

    # --- one op ----------------------------------------------------------------

    async def _play_op(self) -> bool:
        """Decode, apply and re-enact the op at the reader; True when hand-off completed."""
        reader, fsm = self.reader, self.fsm
        log, first = reader.log, reader.offset
        magic, size = FRAME_HEADER.unpack_from(reader.take(_HEADER_LEN))
        if magic != FRAME_MAGIC:
            raise RecoveryLogError(log, first, f"bad frame magic {bytes(magic).hex()}")
        if size > MAX_OP_SIZE:
            raise RecoveryLogError(log, first, f"frame length {size} is implausible")
        self._block_until(reader.offset + size)
        with _cut_short(log, first, "op frame"):
            await reader.fill(size)
        payload = bytes(reader.take(size))
        op = rpb.RecordedOp()
        try:
            op.ParseFromString(payload)
        except DecodeError as exc:
            raise RecoveryLogError(log, first, f"undecodable op: {exc}") from None
        length = op.write.length if op.HasField("write") else 0
        if length < 0:
            raise RecoveryLogError(log, first, f"negative write length {length}")
        last = reader.offset + length
        self._block_until(last)
        try:
            outcome = fsm.apply(op, payload, log, first, last)
        except FSMError as exc:
            raise RecoveryLogError(log, first, str(exc)) from None

        if outcome is Outcome.APPLIED:
            await self._reenact(op, log, first)
        elif length:
            with _cut_short(log, first, "write data"):
                await reader.skip(length)

        if self.handoff and op.author == self.handoff and self.state is _State.READ_HANDOFF:
            if outcome.applied:
                self._make_live()
                return True
            self.state = _State.INJECT_AT_HEAD  # lost a race with another writer: retry
        return False

    def _block_until(self, end: int) -> None:
        """Read the rest of an op blocking only where the log is known to hold it.

        Appends are atomic, so an op cut short before the known head is
        corruption, to report rather than wait on. (While tailing, past the
        head, there is nothing to compare with: a cut-short op is waited on.)
        """
        self.reader.set_blocking(self.state is _State.TAIL or end <= self.read_through)

    async def _reenact(self, op: rpb.RecordedOp, log: str, first: int) -> None:
        """Do locally what an applied op did."""
        if op.HasField("create"):
            path = self._staged(op.seq_no)
            self.files[op.seq_no] = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        elif op.HasField("unlink"):
            fnode = op.unlink.fnode
            if fnode not in self.fsm.live_nodes:
                os.close(self.files.pop(fnode))
                os.unlink(self._staged(fnode))
        elif op.HasField("write"):
            write = op.write
            with _cut_short(log, first, "write data"):
                await self.reader.copy_to(self.files[write.fnode], write.offset, write.length)

    def _staged(self, fnode: int) -> Path:
        return self.root / STAGING_DIR / str(fnode)

    def _make_live(self) -> None:
        """Link staged files into their paths, write properties, drop the staging dir."""
        for fnode, node in self.fsm.live_nodes.items():
            staged = self._staged(fnode)
            for link in sorted(node.links):
                target = self.root / link.lstrip("/")
                target.parent.mkdir(parents=True, exist_ok=True)
                os.link(staged, target)
            os.close(self.files.pop(fnode))
            staged.unlink()
        if self.files:
            raise AssertionError(f"staged files not in the FSM: {sorted(self.files)}")
        (self.root / STAGING_DIR).rmdir()
        for path, content in self.fsm.properties.items():
            target = self.root / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)

    def close_files(self) -> None:
        for fd in self.files.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.files.clear()

    async def _write_head(self, log: str) -> int:
        """The write head of `log`, from a zero-byte append barrier."""
        return await write_head(self.player.client, log)
