"""Waking a thread from a signal handler.

Python runs a signal handler in the main thread between two bytecodes, wherever
that thread is: possibly inside a lock a threading.Event or Thread.start holds,
and possibly inside another call of the same handler (signals come in bursts:
a killed `run`'s parent-death signal reached its workers several times). A
handler that takes such a lock then waits for ever. `Waker.set` takes none: it
writes a byte to a pipe, which the waiting thread selects on.
"""

from __future__ import annotations

import contextlib
import os
import select

__all__ = ["Waker"]


class Waker:
    """A wake-up one thread waits for (`wait`) and any thread or signal handler gives
    (`set`): a pipe, so `set` takes no lock."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        # poll, not select: a process that raised its open-file limit (a member's RocksDB
        # files) may give the pipe a descriptor above select's 1023.
        self._poll = select.poll()
        self._poll.register(self._read, select.POLLIN)

    def set(self) -> None:
        with contextlib.suppress(BlockingIOError):  # full: wake-ups are waiting already
            os.write(self._write, b"w")

    def wait(self, timeout: float | None = None) -> None:
        """Until `set` was called (since the last wait) or `timeout` seconds passed."""
        self._poll.poll(None if timeout is None else timeout * 1000)
        with contextlib.suppress(BlockingIOError):
            os.read(self._read, 4096)

    def close(self) -> None:
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)
