"""Codecs: round trips, interoperable formats, streaming in bounded steps, corrupt input."""

from __future__ import annotations

import gzip
import io
import random
import shutil
import struct
import subprocess
import tracemalloc
from typing import BinaryIO

import cramjam
import pytest
import zstandard

from streamkit.protocol import pb
from streamkit.protocol.codecs import (
    CodecError,
    UnknownCodecError,
    new_compressor,
    open_decompressed,
)

CODECS = [pb.NONE, pb.GZIP, pb.ZSTANDARD, pb.SNAPPY, pb.GZIP_OFFLOAD_DECOMPRESSION]
COMPRESSING = [pb.GZIP, pb.ZSTANDARD, pb.SNAPPY]


def _text(size: int) -> bytes:
    rng = random.Random(7)
    words = [b"alpha", b"beta", b"gamma", b"delta", b"\xce\xbb", b'{"n": 1}']
    out = bytearray()
    while len(out) < size:
        out += rng.choice(words) + (b"\n" if rng.random() < 0.1 else b" ")
    return bytes(out[:size])


DATA = {
    "empty": b"",
    "byte": b"x",
    "random": random.Random(1).randbytes(3 << 20),
    "text": _text(5 << 20),
}


def _compress(codec: int, data: bytes, piece: int = 100_003) -> bytes:
    """Compress `data` fed in uneven pieces, as the persister does."""
    c = new_compressor(codec)
    out = [c.compress(data[i : i + piece]) for i in range(0, len(data), piece)]
    return b"".join([*out, c.flush()])


def _read_all(stream: BinaryIO, size: int) -> bytes:
    parts = []
    while part := stream.read(size):
        parts.append(part)
    return b"".join(parts)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("kind", DATA)
def test_round_trip(codec: int, kind: str) -> None:
    data = DATA[kind]
    stored = _compress(codec, data)
    assert open_decompressed(io.BytesIO(stored), codec).read() == data
    # Small and odd read sizes cross every internal chunk boundary.
    assert _read_all(open_decompressed(io.BytesIO(stored), codec), 65_537) == data
    if kind == "text" and codec in COMPRESSING:
        assert len(stored) < len(data) // 2


@pytest.mark.parametrize("codec", CODECS)
def test_many_small_pieces(codec: int) -> None:
    data = DATA["text"][: 1 << 20]
    stored = _compress(codec, data, piece=997)
    assert _read_all(open_decompressed(io.BytesIO(stored), codec), 4093) == data


@pytest.mark.parametrize("codec", CODECS)
def test_raw_source_giving_short_reads(codec: int) -> None:
    """Network bodies return fewer bytes than asked; decoding must not care."""

    class Trickle(io.RawIOBase):
        def __init__(self, data: bytes) -> None:
            self._data = io.BytesIO(data)

        def readable(self) -> bool:
            return True

        def readinto(self, b: memoryview) -> int:  # type: ignore[override]
            return self._data.readinto(memoryview(b)[:7])

    data = DATA["text"][:200_000]
    out = open_decompressed(Trickle(_compress(codec, data)), codec)  # type: ignore[arg-type]
    assert _read_all(out, 10_000) == data


def test_gzip_output_is_standard_gzip() -> None:
    data = DATA["text"]
    assert gzip.decompress(_compress(pb.GZIP, data)) == data
    assert _compress(pb.GZIP_OFFLOAD_DECOMPRESSION, data) == _compress(pb.GZIP, data)


def test_gzip_reads_several_members() -> None:
    parts = [b"first member\n", b"", DATA["text"][:300_000], b"last\n"]
    stored = b"".join(gzip.compress(p) for p in parts)
    for codec in (pb.GZIP, pb.GZIP_OFFLOAD_DECOMPRESSION):
        assert _read_all(open_decompressed(io.BytesIO(stored), codec), 1000) == b"".join(parts)


def test_zstd_output_is_standard_zstd() -> None:
    data = DATA["text"]
    stored = _compress(pb.ZSTANDARD, data)
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(stored))
    assert reader.read() == data


def test_zstd_reads_streamed_frames_back_to_back() -> None:
    """Go writers stream frames without a content size and with a checksum; any count of them."""
    streaming = zstandard.ZstdCompressor(write_content_size=False, write_checksum=True)
    one_shot = zstandard.ZstdCompressor(level=9)
    parts = [DATA["text"][:400_000], b"", DATA["random"][:100_000]]
    stored = streaming.compress(parts[0]) + one_shot.compress(parts[1])
    writer_out = io.BytesIO()
    with streaming.stream_writer(writer_out, closefd=False) as w:
        w.write(parts[2])
    stored += writer_out.getvalue()
    assert open_decompressed(io.BytesIO(stored), pb.ZSTANDARD).read() == b"".join(parts)


@pytest.mark.skipif(shutil.which("zstd") is None, reason="zstd command not installed")
def test_zstd_reads_reference_cli_output() -> None:
    data = DATA["text"]
    command = ["zstd", "-q", "-c", "-3", "--no-progress", "-"]
    stored = subprocess.run(command, input=data, capture_output=True, check=True).stdout
    assert open_decompressed(io.BytesIO(stored), pb.ZSTANDARD).read() == data


def _crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def _snappy_chunk(kind: int, body: bytes, content: bytes | None) -> bytes:
    """One chunk of the snappy framing format; content chunks carry a masked CRC-32C."""
    if content is not None:
        crc = _crc32c(content)
        masked = (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
        body = struct.pack("<I", masked) + body
    return bytes([kind]) + len(body).to_bytes(3, "little") + body


SNAPPY_IDENTIFIER = _snappy_chunk(0xFF, b"sNaPpY", None)


def test_snappy_reads_every_chunk_kind() -> None:
    """Go's buffered writer mixes compressed and uncompressed chunks; readers skip padding."""
    plain, packed = b"stored as is\n", b"compressible " * 50
    stored = (
        SNAPPY_IDENTIFIER
        + _snappy_chunk(0x01, plain, plain)
        + _snappy_chunk(0xFE, bytes(5), None)  # padding
        + _snappy_chunk(0x80, b"skip me", None)  # reserved, skippable
        + _snappy_chunk(0x00, bytes(cramjam.snappy.compress_raw(packed)), packed)
        + SNAPPY_IDENTIFIER  # a concatenated stream repeats the identifier
        + _snappy_chunk(0x01, plain, plain)
    )
    assert open_decompressed(io.BytesIO(stored), pb.SNAPPY).read() == plain + packed + plain


def test_snappy_output_is_framing_format() -> None:
    data = DATA["text"]
    stored = _compress(pb.SNAPPY, data)
    assert stored.startswith(SNAPPY_IDENTIFIER)
    assert bytes(cramjam.snappy.decompress(stored)) == data


def test_snappy_identifier_alone_is_an_empty_stream() -> None:
    assert open_decompressed(io.BytesIO(SNAPPY_IDENTIFIER), pb.SNAPPY).read() == b""


@pytest.mark.parametrize(
    ("codec", "damage"),
    [
        (pb.GZIP, lambda b: b[:-5]),
        (pb.GZIP, lambda b: b[: len(b) // 2]),
        (pb.GZIP, lambda b: b + b"trailing garbage"),
        (pb.GZIP, lambda b: b[:100] + bytes(100) + b[200:]),
        (pb.SNAPPY, lambda b: b[:-3]),
        (pb.SNAPPY, lambda b: b + b"\x00\x10"),
        (pb.SNAPPY, lambda b: b[:30] + bytes(8) + b[38:]),
        (pb.ZSTANDARD, lambda b: b + b"garbage!"),
        (pb.ZSTANDARD, lambda b: b[:100] + bytes(100) + b[200:]),
    ],
)
def test_corrupt_input_raises(codec: int, damage: object) -> None:
    stored = damage(_compress(codec, DATA["text"][:500_000]))  # type: ignore[operator]
    with pytest.raises(CodecError):
        open_decompressed(io.BytesIO(stored), codec).read()


@pytest.mark.parametrize("codec", COMPRESSING)
def test_decompression_is_bounded(codec: int) -> None:
    """A fragment of zeros inflates enormously: reading it must not inflate it whole."""
    stored = _compress(codec, bytes(48 << 20), piece=8 << 20)
    tracemalloc.start()
    try:
        stream = open_decompressed(io.BytesIO(stored), codec)
        assert stream.read(1000) == bytes(1000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


@pytest.mark.parametrize("codec", CODECS)
def test_closing_closes_the_source(codec: int) -> None:
    raw = io.BytesIO(_compress(codec, b"some content"))
    stream = open_decompressed(raw, codec)
    assert stream.read(4) == b"some"
    stream.close()
    assert raw.closed


@pytest.mark.parametrize("codec", [pb.INVALID, 99])
def test_unknown_codec(codec: int) -> None:
    with pytest.raises(UnknownCodecError):
        new_compressor(codec)
    with pytest.raises(UnknownCodecError):
        open_decompressed(io.BytesIO(b""), codec)


def test_levels_apply() -> None:
    data = DATA["text"]
    fast = new_compressor(pb.ZSTANDARD, level=1)
    small = new_compressor(pb.ZSTANDARD, level=19)
    assert len(small.compress(data) + small.flush()) < len(fast.compress(data) + fast.flush())
