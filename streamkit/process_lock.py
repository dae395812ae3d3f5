"""Locks a process holds for its life: one broker per data directory, one `run` per app.

A lock is an exclusive `flock` on a file, taken without waiting: the kernel
releases it when the process ends, however it ends, so a killed process
never leaves a stale lock behind. The file names its holder (pid and a
note, such as the address it serves), for messages and for commands looking
for the process that holds it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from streamkit.errors import StreamkitError

__all__ = ["Held", "Holder", "ProcessLock", "holder", "running"]


@dataclass(frozen=True)
class Holder:
    """The process holding a lock."""

    pid: int
    note: str  # what the holder wrote beside its pid: an address, say

    def describe(self) -> str:
        return f"pid {self.pid}, {self.note}" if self.pid else "a process starting"


class Held(StreamkitError, OSError):
    """Another process holds the lock."""

    def __init__(self, path: Path, held_by: Holder) -> None:
        super().__init__(f"{path} is held by {held_by.describe()}")
        self.held_by = held_by


class ProcessLock:
    """The exclusive lock of the file at `path` (created if missing), taken by `acquire`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self, note: str) -> None:
        """Take the lock and write this process's pid and `note` in its file; Held if
        another process holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held_by = _read_holder(fd)
            os.close(fd)
            raise Held(self.path, held_by) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {note}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # (the file stays: removing it would race a new holder)
            self._fd = None


def holder(path: Path) -> Holder | None:
    """Who holds the lock at `path` now, or None if no process does."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # missing, or unreadable: no holder to name (taking it would fail)
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_holder(fd)
        return None  # free (the shared lock just taken goes with the descriptor)
    finally:
        os.close(fd)


def _read_holder(fd: int) -> Holder:
    """Who wrote the lock's file (one that has not written it yet: pid 0)."""
    with contextlib.suppress(OSError, ValueError):
        pid, _, note = os.pread(fd, 4096, 0).decode().strip().partition(" ")
        return Holder(int(pid), note)
    return Holder(0, "")


def running(pid: int) -> bool:
    """Whether process `pid` runs on this host: one of another user's counts; a zombie
    (killed, not yet reaped by its parent, which may be slow to) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no /proc here (or it just went): as far as can be told, it runs
        return True
    return stat.rpartition(")")[2].split()[:1] != ["Z"]
