"""RecordedFS: the small file API stores write through, recording each operation.

Every mutation happens on the local file first and is then recorded (the
Recorder records only what already happened). `fsync` does not need the
local disk: the directory is always rebuilt from the log, so durability
means "the log append committed", which is what it waits for.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType

from streamkit.client import OpFuture
from streamkit.recoverylog.recorder import Recorder, normalize_path

__all__ = ["RecordedFS", "RecordedFile"]

_WRITE_FLAGS = {
    "r": 0,
    "r+": os.O_RDWR,
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "w+": os.O_RDWR | os.O_CREAT | os.O_TRUNC,
    "a": os.O_WRONLY | os.O_CREAT,
    "a+": os.O_RDWR | os.O_CREAT,
    "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
    "x+": os.O_RDWR | os.O_CREAT | os.O_EXCL,
}


class RecordedFile:
    """A binary, unbuffered file whose writes and truncates are recorded."""

    def __init__(self, fs: RecordedFS, path: str, mode: str) -> None:
        key = mode.replace("b", "")
        if key not in _WRITE_FLAGS:
            raise ValueError(f"unsupported mode {mode!r}")
        self.fs, self.path, self.mode = fs, path, mode
        self.writable = key != "r"
        self._append = key.startswith("a")
        flags = _WRITE_FLAGS[key] or os.O_RDONLY
        self._fd = os.open(fs.local(path), flags, 0o644)
        self.fnode = 0
        if self.writable:
            previous = fs.recorder.fnode_of(path)
            try:
                self.fnode = fs.recorder.record_open(
                    path,
                    create=bool(flags & os.O_CREAT),
                    truncate=bool(flags & os.O_TRUNC),
                    exclusive=bool(flags & os.O_EXCL),
                )
            except BaseException:  # e.g. the recorder failed: no handle to close the fd
                os.close(self._fd)
                self._fd = -1
                raise
            if previous is not None and previous != self.fnode:
                fs._replaced(previous, self.fnode)  # truncated: open handles follow
            fs._opened(self)
        self._pos = os.lseek(self._fd, 0, os.SEEK_END) if self._append else 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if not self.writable:
            raise OSError(f"{self.path} is open read-only")
        if self._append:
            self._pos = os.lseek(self._fd, 0, os.SEEK_END)
        data = bytes(data)
        written = 0
        try:
            while written < len(data):
                written += os.pwrite(self._fd, data[written:], self._pos + written)
        except OSError as error:  # a full disk, say: name the file (a bare fd error doesn't)
            raise OSError(error.errno, error.strerror, str(self.fs.local(self.path))) from None
        if self.fs.recorder.is_live(self.fnode):  # not if removed while open
            self.fs.recorder.record_write(self.fnode, data, self._pos)
        self._pos += len(data)
        return len(data)

    def read(self, n: int = -1) -> bytes:
        if n < 0:
            n = max(os.fstat(self._fd).st_size - self._pos, 0)
        data = os.pread(self._fd, n, self._pos)
        self._pos += len(data)
        return data

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_CUR:
            offset += self._pos
        elif whence == os.SEEK_END:
            offset += os.fstat(self._fd).st_size
        self._pos = offset
        return offset

    def tell(self) -> int:
        return self._pos

    def truncate(self, size: int | None = None) -> int:
        """Truncate (or extend) to `size` bytes, default the position; recorded as a rewrite."""
        size = self._pos if size is None else size
        os.ftruncate(self._fd, size)
        if self.fs.recorder.is_live(self.fnode):
            content = os.pread(self._fd, size, 0) if size else b""
            self.fs._replaced(self.fnode, self.fs.recorder.record_replace(self.fnode, content))
        return size

    def flush(self) -> None:
        """Nothing to do: writes are unbuffered and recorded as they happen."""

    def fsync(self) -> OpFuture:
        """Resolves once this file's (and every earlier) recorded op has committed."""
        return self.fs.fsync()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self.fs._closed(self)

    def __enter__(self) -> RecordedFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class RecordedFS:
    """Files under `root`, with every change recorded by `recorder`. Paths are relative."""

    def __init__(self, root: str | os.PathLike[str], recorder: Recorder) -> None:
        self.root = Path(root)
        self.recorder = recorder
        self._open: dict[int, list[RecordedFile]] = {}  # fnode -> open writable files

    def local(self, path: str) -> Path:
        """The local path of `path` (validated to stay under the root)."""
        return self.root / normalize_path(path).lstrip("/")

    def open(self, path: str, mode: str = "rb") -> RecordedFile:
        return RecordedFile(self, path, mode)

    def rename(self, src: str, dst: str) -> None:
        """Rename `src` over `dst` (replacing it), as os.replace."""
        os.replace(self.local(src), self.local(dst))
        self.recorder.record_rename(src, dst)

    def link(self, src: str, dst: str) -> None:
        os.link(self.local(src), self.local(dst))
        self.recorder.record_link(src, dst)

    def remove(self, path: str) -> None:
        os.unlink(self.local(path))
        self.recorder.record_remove(path)

    def makedirs(self, path: str, exist_ok: bool = True) -> None:
        """Directories are not recorded: playback creates them for the files they hold."""
        self.local(path).mkdir(parents=True, exist_ok=exist_ok)

    def exists(self, path: str) -> bool:
        return self.local(path).exists()

    def listdir(self, path: str = "") -> list[str]:
        return sorted(os.listdir(self.local(path)))

    def fsync(self) -> OpFuture:
        """A recorder barrier: resolves once every recorded op has committed to the log."""
        return self.recorder.barrier()

    def _opened(self, file: RecordedFile) -> None:
        self._open.setdefault(file.fnode, []).append(file)

    def _closed(self, file: RecordedFile) -> None:
        files = self._open.get(file.fnode, [])
        if file in files:
            files.remove(file)
        if not files:
            self._open.pop(file.fnode, None)

    def _replaced(self, old: int, new: int) -> None:
        """A truncate re-created `old` as `new`: every open handle follows."""
        files = self._open.pop(old, [])
        for file in files:
            file.fnode = new
        if files:
            self._open[new] = files
