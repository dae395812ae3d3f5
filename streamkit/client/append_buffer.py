"""AppendBuffer: an append's content, in memory while small and in a temporary file once large.

Most appends are small (a transaction's messages, an ACK): creating a file
for each cost more than sending it (about half a millisecond on the event
loop per file here). Large content, or content piling up while the broker
is away, spills to an anonymous temporary file so the heap stays small.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import IO

SPILL_AT = 1 << 20  # bytes held in memory before the content moves to a file
_FILE_BUFFER = 1 << 20  # write buffer of a spilled AppendBuffer's file

__all__ = ["SPILL_AT", "AppendBuffer"]


class AppendBuffer:
    """Bytes written in order, read back in chunks as often as retries need."""

    __slots__ = ("_buffer", "_file", "_size", "spill_at")

    def __init__(self, spill_at: int = SPILL_AT) -> None:
        self.spill_at = spill_at
        self._buffer = bytearray()
        self._file: IO[bytes] | None = None
        self._size = 0

    @property
    def size(self) -> int:
        return self._size

    @property
    def spilled(self) -> bool:
        """Whether the content lives in a temporary file."""
        return self._file is not None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        file = self._file
        if file is None:
            self._buffer += data
            if len(self._buffer) > self.spill_at:
                self._spill()
        else:
            file.write(data)
        self._size += len(data)

    def truncate(self, size: int) -> None:
        """Drop everything written after the first `size` bytes."""
        if self._file is None:
            del self._buffer[size:]
        else:
            self._file.seek(size)
            self._file.truncate()
        self._size = size

    def chunks(self, chunk_size: int) -> Iterator[bytes]:
        """The content, `chunk_size` bytes at a time, as copies the caller may keep."""
        size = self._size
        file = self._file
        if file is None:
            for position in range(0, size, chunk_size):
                with memoryview(self._buffer) as view:  # released before yielding
                    chunk = bytes(view[position:position + chunk_size])
                yield chunk
            return
        file.flush()
        fd = file.fileno()
        for position in range(0, size, chunk_size):
            yield os.pread(fd, min(chunk_size, size - position), position)

    def close(self) -> None:
        """Free the content (and the file, if it spilled)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self._buffer = bytearray()
        self._size = 0

    def _spill(self) -> None:
        file = tempfile.TemporaryFile(buffering=_FILE_BUFFER)  # noqa: SIM115 (kept open)
        file.write(self._buffer)
        self._file = file
        self._buffer = bytearray()
