"""Spools: the local files behind a journal's open (and not yet persisted) fragments.

A spool is two files in the journal's spool directory:

* ``<begin:016x>.spool`` holds the raw journal bytes [begin, end), so it can be
  served by ``pread`` and compressed into a fragment file as it is;
* ``<begin:016x>.commits`` is a log of small checksummed commit records, one
  per committed append, each naming the new committed end (and the journal's
  registers when they changed).

An append writes its content past the committed end, fdatasyncs the spool, then
appends and fdatasyncs a commit record. Only then is the append acknowledged.
A small append (at most INLINE_MAX bytes) also carries its content inside the
commit record, and skips the spool's fdatasync: the log is its write-ahead copy,
replayed into the spool on recovery. That halves the syncs of small appends.
Recovery after a crash keeps exactly the prefix named by the last intact commit
record, so an acknowledged append is always present and an unacknowledged one is
wholly present or wholly absent.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import logging
import os
import struct
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from streamkit.broker.local_disk import on_disk
from streamkit.errors import StreamkitError
from streamkit.protocol import pb
from streamkit.protocol.fragments import sum_of

logger = logging.getLogger(__name__)

# A commit record: end offset, commit time (unix ms), registers length (or
# NO_REGISTERS when unchanged), inline content length, then the registers
# bytes, the inline content (the append's bytes, ending at `end`) and a CRC-32
# of it all.
_HEAD = struct.Struct("<qQII")
_CRC = struct.Struct("<I")
NO_REGISTERS = 0xFFFFFFFF
INLINE_MAX = 16 << 10
# Synced spool bytes further than this behind the head leave the page cache
# (see Spool.release_cache); tailing readers still find recent bytes there.
CACHE_WINDOW = 32 << 20
_OFFLOAD_BYTES = 64 << 10  # chunks at least this large are written off the event loop
# Writer threads of their own, so a busy default executor (fsyncs, listings,
# compression) never delays a chunk behind the append that follows it.
_WRITERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="spool-write")


def _encode_record(
    end: int, when_ms: int, registers: pb.LabelSet | None, inline: bytes = b""
) -> bytes:
    body = b"" if registers is None else registers.SerializeToString()
    size = NO_REGISTERS if registers is None else len(body)
    head = _HEAD.pack(end, when_ms, size, len(inline)) + body + inline
    return head + _CRC.pack(zlib.crc32(head))


@dataclass
class CommitLog:
    """What a spool's commit log says after its last intact record."""

    end: int
    registers: pb.LabelSet | None
    first_append_ms: int  # commit time of the first record that added bytes; 0 if none
    valid_bytes: int  # length of the intact prefix of the log file
    inline: list[tuple[int, bytes]]  # (offset, content) of appends carried in the log


def read_commit_log(path: Path, begin: int, limit: int | None = None) -> CommitLog:
    """Scan a commit log, stopping at the first torn or corrupt record (or the first
    one committing past `limit`)."""
    data = path.read_bytes() if path.exists() else b""
    log = CommitLog(end=begin, registers=None, first_append_ms=0, valid_bytes=0, inline=[])
    pos = 0
    while pos + _HEAD.size + _CRC.size <= len(data):
        rec_end, when_ms, size, inline_len = _HEAD.unpack_from(data, pos)
        regs_len = 0 if size == NO_REGISTERS else size
        stop = pos + _HEAD.size + regs_len + inline_len
        if stop + _CRC.size > len(data):
            break
        (crc,) = _CRC.unpack_from(data, stop)
        if crc != zlib.crc32(data[pos:stop]) or rec_end - inline_len < log.end:
            break
        if limit is not None and rec_end > limit:
            break
        if size != NO_REGISTERS:
            log.registers = pb.LabelSet.FromString(data[pos + _HEAD.size : stop - inline_len])
        if inline_len:
            log.inline.append((rec_end - inline_len, data[stop - inline_len : stop]))
        if rec_end > log.end and not log.first_append_ms:
            log.first_append_ms = when_ms
        log.end, pos = rec_end, stop + _CRC.size
        log.valid_bytes = pos
    return log


def write_all(fd: int, data: bytes, offset: int | None = None) -> None:
    """Write all of `data` (at `offset`, else at the file's end), or raise OSError.

    A write may store fewer bytes than asked (a full disk, RLIMIT_FSIZE); the
    rest is retried, and a write that makes no progress is an error, so a
    partial write is never mistaken for a whole one.
    """
    view, done = memoryview(data), 0
    while done < len(view):
        n = (os.write(fd, view[done:]) if offset is None
             else os.pwrite(fd, view[done:], offset + done))
        if n <= 0:
            raise OSError(errno.ENOSPC, "the write made no progress (disk full?)")
        done += n


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SpoolDamaged(StreamkitError, OSError):
    """A spool's file no longer holds the bytes committed to it (damaged from outside the
    broker): it is neither sealed nor persisted, and stays local for the restart's recovery."""

    def __init__(self, spool: Spool, what: str) -> None:
        super().__init__(f"journal {spool.journal}: DAMAGED: spool {spool.data_path} {what}; "
                         f"left unpersisted")


@dataclass
class Spool:
    """One local fragment file of a journal: [begin, end) committed bytes.

    Only the journal's append lock holder mutates a spool; readers use
    `read` bounded by the committed `end` they observed.
    """

    journal: str
    directory: Path
    begin: int
    codec: int
    end: int = 0
    first_append_ms: int = 0
    _sha1: hashlib._Hash = field(default_factory=hashlib.sha1)
    _fd: int = -1
    _log_fd: int = -1
    _uncached: int = 0  # file bytes [0, _uncached) were dropped from the page cache
    # Why no append may write to it until the broker restarts and recovers it: a failed
    # commit that could not be cut back out of the log, or a file damaged from outside.
    fenced: str = ""

    @property
    def data_path(self) -> Path:
        return self.directory / f"{self.begin:016x}.spool"

    @property
    def log_path(self) -> Path:
        return self.directory / f"{self.begin:016x}.commits"

    @classmethod
    def create(
        cls, journal: str, directory: Path, begin: int, codec: int, registers: pb.LabelSet
    ) -> Spool:
        """Start a new, empty spool at `begin`, recording the current registers."""
        directory.mkdir(parents=True, exist_ok=True)
        spool = cls(journal=journal, directory=directory, begin=begin, codec=codec, end=begin)
        spool._open(truncate=True)
        try:
            write_all(spool._log_fd, _encode_record(begin, 0, registers))
            os.fsync(spool._log_fd)
        except BaseException:
            spool.remove_files()
            raise
        try:
            os.fsync(spool._fd)
            _fsync_dir(directory)
        except BaseException:
            spool.close()
            raise
        return spool

    @classmethod
    def recover(cls, journal: str, data_path: Path, codec: int) -> tuple[Spool, CommitLog]:
        """Reopen a spool after a restart, discarding anything not committed."""
        begin = int(data_path.stem, 16)
        log = read_commit_log(data_path.with_suffix(".commits"), begin)
        spool = cls(journal=journal, directory=data_path.parent, begin=begin, codec=codec)
        spool._open(truncate=False)
        try:
            log = spool._recover(log)
        except BaseException:
            spool.close()  # (its descriptors must not leak when a journal's open fails)
            raise
        return spool, log

    def _recover(self, log: CommitLog) -> CommitLog:
        """Bring the opened files back to what `log` says was committed; the log kept."""
        begin = self.begin
        os.ftruncate(self._log_fd, log.valid_bytes)
        for offset, content in log.inline:  # small appends whose spool write was not synced
            write_all(self._fd, content, offset - begin)
        if log.inline:
            os.fdatasync(self._fd)
        size = os.fstat(self._fd).st_size
        if size < log.end - begin:
            # The file lost committed bytes (damage from outside: a truncation, a disk
            # fault). Serve the committed prefix that is intact rather than nothing.
            committed = log.end
            log = read_commit_log(self.log_path, begin, limit=begin + size)
            os.ftruncate(self._log_fd, log.valid_bytes)
            logger.error(
                "journal %s: DAMAGED: spool %s holds %d bytes but [%d, %d) were committed; "
                "serving [%d, %d), the rest is lost (restore it from a copy if there is one)",
                self.journal, self.data_path, size, begin, committed, begin, log.end,
            )
        os.ftruncate(self._fd, log.end - begin)
        self.end = log.end
        self.first_append_ms = log.first_append_ms
        self._rehash()
        return log

    def _open(self, truncate: bool) -> None:
        flags = os.O_RDWR | os.O_CREAT | (os.O_TRUNC if truncate else 0)
        self._fd = os.open(self.data_path, flags, 0o644)
        try:
            self._log_fd = os.open(self.log_path, flags | os.O_APPEND, 0o644)
        except BaseException:
            os.close(self._fd)
            self._fd = -1
            raise

    def _rehash(self) -> None:
        self._sha1 = hashlib.sha1()
        pos, stop = 0, self.end - self.begin
        while pos < stop:
            chunk = os.pread(self._fd, min(1 << 22, stop - pos), pos)
            self._sha1.update(chunk)
            pos += len(chunk)

    @property
    def length(self) -> int:
        return self.end - self.begin

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def fragment(self) -> pb.Fragment:
        """The committed span as a local (not yet persisted) fragment."""
        digest = self._sha1.digest() if self.end > self.begin else bytes(20)
        return pb.Fragment(
            journal=self.journal,
            begin=self.begin,
            end=self.end,
            sum=sum_of(digest),
            compression_codec=self.codec,
        )

    def check_intact(self) -> None:
        """Fence the spool if its file lost committed bytes (truncated from outside the
        broker): an append written past the file's end would leave a hole of zeros below
        it, served and persisted as committed content. One fstat, before each append."""
        if self.fenced or self._fd < 0:
            return
        size = os.fstat(self._fd).st_size
        if size < self.length:
            self.fenced = (f"its spool {self.data_path} holds {size} of the {self.length} "
                           f"bytes committed (damaged from outside the broker): "
                           f"[{self.begin + size}, {self.end}) is lost")
            logger.error("journal %s: DAMAGED: %s; appends are refused until the broker "
                         "restarts and recovers the spool's intact prefix", self.journal,
                         self.fenced)

    def read(self, offset: int, size: int, end: int) -> bytes:
        """Read committed bytes at `offset`, never past `end`."""
        size = min(size, end - offset)
        return os.pread(self._fd, size, offset - self.begin) if size > 0 else b""

    def release_cache(self) -> None:
        """Let the kernel drop synced bytes older than CACHE_WINDOW from its page cache.

        A broker writes an endless stream of new bytes; each needs a fresh page
        of cache. Freeing old, already-durable pages as we go lets the kernel
        reuse them for the next writes, which on VMs is several times faster than
        faulting in new memory (measured here: ~330 MB/s vs GB/s). Reads of older
        bytes then come from the device, which is rarely needed: tailing readers
        stay within the window and history is served from persisted fragments.
        """
        keep_from = self.length - CACHE_WINDOW
        if keep_from - self._uncached >= CACHE_WINDOW // 2:
            os.posix_fadvise(self._fd, 0, keep_from, os.POSIX_FADV_DONTNEED)
            self._uncached = keep_from

    def seal(self) -> None:
        """Cut off bytes of rolled-back appends: the file becomes exactly [begin, end).

        Nothing appends to a sealed spool, so its commit log is closed too. A file cut
        short from outside is never extended (the hole would read, and persist, as
        committed zeros): the spool is fenced and SpoolDamaged raised, the spool left as
        it is for the restart's recovery (which keeps its intact prefix).
        """
        size = os.fstat(self._fd).st_size
        if size < self.length:
            self.check_intact()
            raise SpoolDamaged(self, f"holds {size} bytes, not {self.length}")
        if size > self.length:
            os.ftruncate(self._fd, self.length)
        if self._log_fd >= 0:
            os.close(self._log_fd)
            self._log_fd = -1

    def cut_to_end(self) -> None:
        """Cut off bytes past the committed end (a rolled-back append's), freeing their
        space now rather than when the spool rolls. Never extends the file."""
        if self._fd >= 0 and os.fstat(self._fd).st_size > self.length:
            os.ftruncate(self._fd, self.length)

    def start_append(self) -> SpoolAppend:
        return SpoolAppend(self)

    def close(self) -> None:
        for fd in (self._fd, self._log_fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._log_fd = -1

    def remove_files(self) -> None:
        """Delete both files (after the fragment is persisted or found empty)."""
        self.close()
        self.data_path.unlink(missing_ok=True)
        self.log_path.unlink(missing_ok=True)


class SpoolAppend:
    """Content of one append in progress: written past `end`, visible only on commit."""

    def __init__(self, spool: Spool) -> None:
        self.spool = spool
        self.begin = spool.end
        self.length = 0
        self._spool_sha1 = spool._sha1.copy()
        self._sha1 = hashlib.sha1()
        self._small: list[bytes] | None = []  # content kept while it may go inline
        self._in_flight: Future[None] | None = None  # the chunk a writer thread holds

    async def write(self, data: bytes) -> None:
        """Write a chunk past the committed end and fold it into both checksums.

        A large chunk is written and hashed by a worker thread (pwrite and SHA-1
        release the GIL) while the event loop receives the next one; at most one
        chunk of an append is in flight, which keeps order and bounds memory.
        """
        await self.settle()
        at = self.length
        self.length += len(data)
        if len(data) < _OFFLOAD_BYTES:
            self._write(data, at)
        else:
            self._in_flight = _WRITERS.submit(self._write, data, at)
        if self._small is not None:
            self._small.append(data)
            if self.length > INLINE_MAX:
                self._small = None

    async def settle(self) -> None:
        """Wait until no chunk of this append is being written; re-raise its error.

        Holds the thread's own Future: an asyncio wrapper, once cancelled, would
        report "done" while the thread is still writing.
        """
        future = self._in_flight
        if future is None:
            return
        if not future.done():
            await asyncio.wrap_future(future)
        self._in_flight = None
        if not future.cancelled():
            future.result()

    async def discard(self) -> None:
        """Roll the append back: once no chunk is being written, give the space of what it
        wrote back (on a full disk, its bytes kept every journal's appends failing)."""
        with contextlib.suppress(OSError):
            await self.settle()
        # (Not a fenced spool's: a commit record it could not undo may name these bytes.)
        if self.length and not self.spool.fenced:
            with contextlib.suppress(OSError):
                await on_disk(self.spool.cut_to_end)

    def _write(self, data: bytes, at: int) -> None:
        write_all(self.spool._fd, data, self.begin - self.spool.begin + at)
        self._spool_sha1.update(data)
        self._sha1.update(data)

    async def commit(self, registers: pb.LabelSet | None) -> pb.Fragment:
        """Make the append durable, then visible. Returns the committed span.

        `registers` is the journal's new register set if this append changed
        it, else None.
        """
        await self.settle()
        spool = self.spool
        end = self.begin + self.length
        now_ms = int(time.time() * 1000)
        if self.length or registers is not None:
            inline = b"".join(self._small) if self._small is not None else b""
            record = _encode_record(end, now_ms, registers, inline)
            sync_spool = self.length > len(inline)
            await on_disk(_sync_commit, spool, spool._log_fd, record, sync_spool)
        spool.end = end
        spool._sha1 = self._spool_sha1
        if self.length and not spool.first_append_ms:
            spool.first_append_ms = now_ms
        digest = self._sha1.digest() if self.length else bytes(20)
        return pb.Fragment(
            journal=spool.journal,
            begin=self.begin,
            end=end,
            sum=sum_of(digest),
            compression_codec=spool.codec,
        )


def _sync_commit(spool: Spool, log_fd: int, record: bytes, sync_spool: bool) -> None:
    """Make the content durable, then append and sync its commit record.

    If anything fails, the log is cut back to where it was: a stray record
    would make recovery resurrect this (unacknowledged) append and drop every
    later one. If even that fails, the spool is fenced against further appends.
    """
    if sync_spool:
        os.fdatasync(spool._fd)
        spool.release_cache()
    size = os.fstat(log_fd).st_size
    try:
        write_all(log_fd, record)
        os.fdatasync(log_fd)
    except BaseException:
        try:
            os.ftruncate(log_fd, size)
            os.fsync(log_fd)
        except OSError:
            spool.fenced = "a commit failed and could not be undone"
        raise
