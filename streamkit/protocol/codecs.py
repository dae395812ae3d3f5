"""Streaming compression and decompression of fragment files, per codec.

Formats match what Gazette's Go brokers write and read, so either side can
read the other's fragments:

- NONE: the bytes as they are.
- GZIP and GZIP_OFFLOAD_DECOMPRESSION: gzip; readers accept several members
  one after another (as `gzip -d` and Go's reader do).
- ZSTANDARD: zstd frames, any number of them back to back.
- SNAPPY: the snappy *framing* format (stream identifier "sNaPpY", CRC-checked
  chunks of at most 64 KiB), not raw snappy blocks.

All work happens in C over large buffers; Python only moves chunks around.
Decompression output is produced in bounded steps, so a highly compressed
fragment never has to be inflated into memory whole.
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Callable
from typing import BinaryIO, Protocol, cast

import cramjam
import snappy
import zstandard

from streamkit.errors import StreamkitError
from streamkit.protocol import broker_pb2 as pb

__all__ = [
    "CodecError",
    "Compressor",
    "UnknownCodecError",
    "new_compressor",
    "open_decompressed",
]

# zlib's and Go's default: gzip is chosen for compatibility more than speed.
GZIP_LEVEL = 6
# Level 1 compresses about twice as fast as zstd's default of 3 here, at a similar ratio.
ZSTD_LEVEL = 1

_READ_SIZE = 1 << 20  # compressed bytes pulled from the stored file at a time
_SNAPPY_READ_SIZE = 1 << 18  # snappy inflates at most ~21x, so this bounds each step
_CHUNK_SIZE = 1 << 20  # most decompressed bytes produced per step (gzip, zstd)
_GZIP_WBITS = 31  # 16 + 15: the gzip wrapper with the largest window
_SNAPPY_STREAM_IDENTIFIER = b"\xff\x06\x00\x00sNaPpY"
_GZIP_CODECS = (pb.GZIP, pb.GZIP_OFFLOAD_DECOMPRESSION)
# What the libraries raise on corrupt input; surfaced to callers as CodecError.
_LIBRARY_ERRORS = (zlib.error, zstandard.ZstdError, cramjam.DecompressionError)


class UnknownCodecError(StreamkitError, ValueError):
    """The compression codec is not one this module knows."""


class CodecError(StreamkitError, OSError):
    """Stored bytes are corrupt or truncated for their codec."""


class Compressor(Protocol):
    """Incremental compressor: feed `compress` any number of times, then `flush` once.

    `flush` ends the stream (writes trailers); the compressor is done after it.
    """

    def compress(self, data: bytes) -> bytes: ...

    def flush(self) -> bytes: ...


class _Passthrough:
    """The NONE codec's compressor."""

    def compress(self, data: bytes) -> bytes:
        return bytes(data)

    def flush(self) -> bytes:
        return b""


def _require_known(codec: int) -> None:
    if codec not in (pb.NONE, pb.ZSTANDARD, pb.SNAPPY, *_GZIP_CODECS):
        raise UnknownCodecError(f"unknown compression codec {codec!r}")


def new_compressor(codec: int, level: int | None = None) -> Compressor:
    """A compressor writing `codec`'s format; `level` applies to gzip and zstd."""
    _require_known(codec)
    if codec in _GZIP_CODECS:
        gzip_level = GZIP_LEVEL if level is None else level
        return zlib.compressobj(gzip_level, zlib.DEFLATED, _GZIP_WBITS)
    if codec == pb.ZSTANDARD:
        zstd_level = ZSTD_LEVEL if level is None else level
        return zstandard.ZstdCompressor(level=zstd_level, write_checksum=True).compressobj()
    if codec == pb.SNAPPY:
        return snappy.StreamCompressor()
    return _Passthrough()


def open_decompressed(raw: BinaryIO, codec: int) -> BinaryIO:
    """A buffered, blocking stream of the uncompressed bytes of `raw`.

    Closing it closes `raw`. NONE returns `raw` itself. Corrupt input raises
    CodecError while reading; so does input that ends inside a gzip member or
    a snappy chunk (a zstd stream cut at a block boundary cannot be told apart
    from its end by the library: check the fragment's SHA-1 where that matters).
    An empty `raw` reads as empty for every codec.
    """
    _require_known(codec)
    if codec == pb.NONE:
        return raw
    if codec in _GZIP_CODECS:
        reader = _ChunkReader(_GzipChunks(raw), raw.close)
    elif codec == pb.ZSTANDARD:
        zstd = zstandard.ZstdDecompressor().stream_reader(
            raw, read_size=_READ_SIZE, read_across_frames=True, closefd=True
        )
        reader = _ChunkReader(lambda: zstd.read(_CHUNK_SIZE), zstd.close)
    else:
        reader = _ChunkReader(_SnappyChunks(raw), raw.close)
    return cast(BinaryIO, io.BufferedReader(reader, buffer_size=1 << 16))


class _ChunkReader(io.RawIOBase):
    """A raw stream over a function returning successive decompressed chunks (b"" at the end)."""

    def __init__(self, next_chunk: Callable[[], bytes], on_close: Callable[[], object]) -> None:
        super().__init__()
        self._next_chunk = next_chunk
        self._on_close = on_close
        self._chunk = memoryview(b"")
        self._eof = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        while not self._chunk:
            if self._eof:
                return 0
            try:
                chunk = self._next_chunk()
            except _LIBRARY_ERRORS as e:
                raise CodecError(f"corrupt compressed data: {e}") from e
            self._eof = not chunk
            self._chunk = memoryview(chunk)
        n = min(len(buffer), len(self._chunk))
        buffer[:n] = self._chunk[:n]
        self._chunk = self._chunk[n:]
        return n

    def close(self) -> None:
        if not self.closed:
            self._chunk = memoryview(b"")
            self._on_close()
        super().close()


class _GzipChunks:
    """Inflates gzip members back to back, at most _CHUNK_SIZE bytes per call."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self._inflater = zlib.decompressobj(_GZIP_WBITS)
        self._pending = b""  # input read but not yet consumed by the inflater
        self._in_member = False  # bytes of the current member were fed
        self._may_have_output = False  # the last call stopped at the output limit

    def __call__(self) -> bytes:
        while True:
            if self._pending or self._may_have_output:
                data, self._pending = self._pending, b""
            else:
                data = self._raw.read(_READ_SIZE)
                if not data:
                    if self._in_member:
                        raise CodecError("gzip stream ends inside a member")
                    return b""
            self._in_member = self._in_member or bool(data)
            out = self._inflater.decompress(data, _CHUNK_SIZE)
            if self._inflater.eof:
                # The member ended; what follows it starts the next member.
                self._pending = self._inflater.unused_data
                self._inflater = zlib.decompressobj(_GZIP_WBITS)
                self._in_member = False
                self._may_have_output = False
            else:
                self._pending = self._inflater.unconsumed_tail
                self._may_have_output = len(out) == _CHUNK_SIZE
            if out:
                return out


class _SnappyChunks:
    """Decodes snappy framing format through python-snappy's StreamDecompressor."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self._decoder = snappy.StreamDecompressor()

    def __call__(self) -> bytes:
        while data := self._raw.read(_SNAPPY_READ_SIZE):
            try:
                out = self._decoder.decompress(data)
            except OSError as e:  # cramjam reports a bad chunk checksum as a plain OSError
                raise CodecError(f"corrupt snappy data: {e}") from e
            if out:
                return out
        # The decoder keeps an incomplete trailing chunk (sometimes behind a
        # stream identifier it added itself) until more input arrives.
        if self._decoder.remains and self._decoder.remains != _SNAPPY_STREAM_IDENTIFIER:
            raise CodecError("snappy stream ends inside a chunk")
        return b""
