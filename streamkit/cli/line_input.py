"""An input's lines for `publish` and `journals append -f lines`, read on a thread of its own.

The reads run on a daemon thread, not the loop's executor: a read waiting on an idle pipe or
terminal must not hold up the command's exit (asyncio joins its executor's threads), and
Ctrl-C must be seen while it waits. Chunks go to the loop as plain callbacks (no coroutine
is made on the thread: one the loop never ran, closing, was reported as never awaited) and
a semaphore keeps a few chunks at most ahead, so a slow command holds back the reading. On
a stop, `buffered` hands over what was read and not yet used, without waiting for more:
nothing read is dropped.
"""

from __future__ import annotations

import asyncio
import functools
import io
import os
import select
import stat
import threading
from collections.abc import Callable
from typing import IO

__all__ = ["READ_SIZE", "LineInput", "regular_file"]

READ_SIZE = 1 << 18
_QUEUED = 4  # chunks read ahead of the command


class LineInput:
    """The lines of `source` (without their b"\\n"), a read's worth at a time."""

    def __init__(self, source: IO[bytes], read_size: int = READ_SIZE) -> None:
        self.file = regular_file(source)  # (else a pipe or terminal, read no further on a stop)
        self._queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
        self._room = threading.Semaphore(_QUEUED)  # released as the loop takes a chunk
        self._pieces: list[bytes] = []  # a line's start, joined once its end is read: a long
        self._ended = False             # line is copied once, not at each read
        # The reader's hand-over, under the lock: once `_stopping`, it reads nothing more;
        # `_handing` counts chunks read that are on their way to the queue.
        self._lock = threading.Lock()
        self._stopping = False
        self._handing = 0
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, args=(loop, source, read_size), daemon=True,
                         name="input-reader").start()

    def _read(self, loop: asyncio.AbstractEventLoop, source: IO[bytes], size: int) -> None:
        read, fd = _reader(source)
        poll = None
        if fd is not None:
            poll = select.poll()
            poll.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        item: bytes | BaseException | None
        while True:
            # A read only once there is room and something to read (or the end): a stop
            # meanwhile is seen within a tenth of a second, and nothing is read after it.
            while not self._room.acquire(timeout=0.1):
                if self._stopping:
                    return
            while poll is not None and not poll.poll(100):
                if self._stopping:
                    return
            with self._lock:
                if self._stopping:
                    return
                self._handing += 1
            try:
                item = read(size) or None
            except Exception as error:  # (an unreadable input: the command says so)
                item = error
            try:
                loop.call_soon_threadsafe(self._hand, item)
            except RuntimeError:  # the loop ended: nobody reads any more
                return
            if not isinstance(item, bytes):
                return

    def _hand(self, item: bytes | BaseException | None) -> None:
        """On the loop: a chunk read joins the queue."""
        self._queue.put_nowait(item)
        with self._lock:
            self._handing -= 1

    async def batch(self, stop: asyncio.Event | None = None) -> list[bytes] | None:
        """The next lines read; None at the input's end, or once `stop` is set while the
        input is a pipe or terminal (a file's lines are there to be read: it goes on)."""
        while not self._ended:
            if stop is not None and not self.file and self._queue.empty():
                waiting = asyncio.ensure_future(self._queue.get())
                stopped = asyncio.ensure_future(stop.wait())
                try:
                    await asyncio.wait((waiting, stopped), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    stopped.cancel()
                if not waiting.done():
                    waiting.cancel()  # (nothing taken: what comes is left to `buffered`)
                    return None
                item = waiting.result()
            else:
                item = await self._queue.get()
            lines = self._take(item)
            if lines:
                return lines
        return None

    def _take(self, item: bytes | BaseException | None) -> list[bytes]:
        self._room.release()
        if isinstance(item, BaseException):
            raise item
        if item is None:
            self._ended = True
            rest, self._pieces = b"".join(self._pieces), []
            return [rest] if rest else []
        self._pieces.append(item)
        if b"\n" not in item:
            return []
        lines = b"".join(self._pieces).split(b"\n")
        self._pieces = [lines.pop()]
        return lines

    async def buffered(self) -> tuple[list[bytes], bytes]:
        """Stop reading; the lines read and not handed out yet (a chunk on its way included),
        without waiting for more input; and the start of an unterminated line read after
        them (b"" if none)."""
        with self._lock:
            self._stopping = True
        lines: list[bytes] = []
        while True:
            while not self._ended and not self._queue.empty():
                lines += self._take(self._queue.get_nowait())
            if not self._handing:
                break
            await asyncio.sleep(0.005)  # (its chunk's put runs on this loop)
        while not self._ended and not self._queue.empty():
            lines += self._take(self._queue.get_nowait())
        return lines, b"".join(self._pieces)

    async def copy_rest(self, out: IO[bytes]) -> None:
        """Write every line not handed out yet to `out` (each ending in b"\\n"), reading the
        input to its end."""
        while (lines := await self.batch()) is not None:
            for line in lines:
                out.write(line + b"\n")

    async def keep_unread(self, out: IO[bytes], stopped: bool, read: int) -> str:
        """Write the input not handed out to `out`: if `stopped` (a pipe, read no further),
        the lines read ahead; else the rest of the input. The account's words for what
        `out` holds after line `read`."""
        if stopped:
            buffered, piece = await self.buffered()
            for line in buffered:
                out.write(line + b"\n")
            return (f"; those, and the lines read after line {read:,}, are in {out.name}; "
                    "the input after them was not read"
                    + (f" ({len(piece):,} bytes of a line begun were)" if piece else ""))
        await self.copy_rest(out)
        return f"; those, and the input after line {read:,}, are in {out.name}"


def regular_file(source: IO[bytes]) -> bool:
    """Whether `source` is a file (not a pipe or terminal): its unread rest can be kept."""
    try:
        return stat.S_ISREG(os.fstat(source.fileno()).st_mode)
    except (OSError, ValueError, io.UnsupportedOperation):
        return False


def _reader(source: IO[bytes]) -> tuple[Callable[[int], bytes], int | None]:
    """Reads of the file descriptor itself where there is one (and it): a read blocked in a
    buffered file object holds its lock, which the interpreter's exit then can't take."""
    try:
        fd = source.fileno()
    except (OSError, ValueError, io.UnsupportedOperation):
        return getattr(source, "read1", source.read), None
    return functools.partial(os.read, fd), fd
