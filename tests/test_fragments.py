"""Fragment naming: sums, content names and paths, parsing, URLs."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streamkit.protocol import pb
from streamkit.protocol.fragments import (
    EXTENSIONS,
    FragmentNameError,
    content_name,
    content_path,
    digest_of,
    fragment_url,
    parse_content_name,
    parse_content_path,
    sum_of,
)

HELLO_SHA1 = hashlib.sha1(b"hello").digest()  # aaf4c61d…
ZEROS = "0" * 40


def _fragment(codec: int = pb.GZIP, postfix: str = "") -> pb.Fragment:
    return pb.Fragment(
        journal="examples/words/part-000",
        begin=0x1000,
        end=0x2400,
        sum=sum_of(HELLO_SHA1),
        compression_codec=codec,
        path_postfix=postfix,
    )


def test_sum_splits_big_endian() -> None:
    s = sum_of(bytes(range(20)))
    assert (s.part1, s.part2, s.part3) == (0x0001020304050607, 0x08090A0B0C0D0E0F, 0x10111213)
    assert digest_of(s) == bytes(range(20))


def test_unset_sum_is_all_zeros() -> None:
    assert digest_of(pb.SHA1Sum()) == bytes(20)
    assert digest_of(pb.Fragment().sum) == bytes(20)


def test_sum_needs_20_bytes() -> None:
    with pytest.raises(ValueError):
        sum_of(b"short")


def test_content_name_and_path() -> None:
    f = _fragment()
    name = f"0000000000001000-0000000000002400-{HELLO_SHA1.hex()}.gz"
    assert content_name(f) == name
    assert content_path(f) == f"examples/words/part-000/{name}"
    assert content_path(_fragment(postfix="date=2024-05-01")) == (
        f"examples/words/part-000/date=2024-05-01/{name}"
    )


@pytest.mark.parametrize(("codec", "ext"), sorted(EXTENSIONS.items()))
def test_extension_per_codec(codec: int, ext: str) -> None:
    assert content_name(_fragment(codec)).endswith(f"{HELLO_SHA1.hex()}{ext}")
    assert parse_content_name("j/x", content_name(_fragment(codec))).compression_codec == codec


def test_offload_codec_has_no_extension() -> None:
    assert content_name(_fragment(pb.GZIP_OFFLOAD_DECOMPRESSION)).endswith(HELLO_SHA1.hex())


def test_invalid_codec_has_no_name() -> None:
    with pytest.raises(FragmentNameError):
        content_name(_fragment(pb.INVALID))


@pytest.mark.parametrize(
    ("ext", "codec"),
    [
        (".gzip", pb.GZIP),
        (".zstandard", pb.ZSTANDARD),
        (".snappy", pb.SNAPPY),
        (".gzod", pb.GZIP_OFFLOAD_DECOMPRESSION),
        ("", pb.GZIP_OFFLOAD_DECOMPRESSION),
    ],
)
def test_parse_accepts_other_spellings(ext: str, codec: int) -> None:
    f = parse_content_name("a/journal", f"00-ff-{ZEROS}{ext}")
    assert (f.journal, f.begin, f.end, f.compression_codec) == ("a/journal", 0, 255, codec)
    assert digest_of(f.sum) == bytes(20)


@pytest.mark.parametrize(
    "name",
    [
        "notes.txt",
        f"0-1-{ZEROS}.txt",
        f"0-1-{ZEROS}.raw.bak",
        f"0-1-2-{ZEROS}.raw",
        "0-1.raw",
        f"-1-{ZEROS}.raw",
        f"0-x1-{ZEROS}.raw",
        f"2-1-{ZEROS}.raw",
        f"0-10000000000000000-{ZEROS}.raw",
        f"0-8000000000000000-{ZEROS}.raw",
        "0-1-abc.raw",
        f"0-1-{ZEROS}00.raw",
        f"0-1-{'g' * 40}.raw",
        f"0x1-0x2-{ZEROS}.raw",
        f"1_0-2_0-{ZEROS}.raw",
        f"+1-2-{ZEROS}.raw",
        f" 1-2-{ZEROS}.raw",
        f"1-2-{ZEROS[:-2]} 0.raw",
    ],
)
def test_parse_rejects(name: str) -> None:
    with pytest.raises(FragmentNameError):
        parse_content_name("j", name)


def test_parse_path_takes_directories_as_postfix() -> None:
    f = _fragment(postfix="date=2024-05-01/hour=07")
    relative = content_path(f).removeprefix(f.journal + "/")
    assert parse_content_path(f.journal, relative) == f
    assert parse_content_path(f.journal, content_name(f)).path_postfix == ""


@pytest.mark.parametrize("postfix", ["../up", "a//b", "./a", "/abs"])
def test_parse_path_rejects_unclean_postfix(postfix: str) -> None:
    with pytest.raises(FragmentNameError):
        parse_content_path("j", f"{postfix}/0-1-{ZEROS}.raw")


@given(
    begin=st.integers(0, 2**63 - 1),
    length=st.integers(0, 2**40),
    digest=st.binary(min_size=20, max_size=20),
    codec=st.sampled_from(sorted(EXTENSIONS)),
)
def test_name_round_trips(begin: int, length: int, digest: bytes, codec: int) -> None:
    f = pb.Fragment(
        journal="j/k",
        begin=begin,
        end=min(begin + length, 2**63 - 1),
        sum=sum_of(digest),
        compression_codec=codec,
    )
    assert parse_content_name(f.journal, content_name(f)) == f


@pytest.mark.parametrize(
    ("store", "expected"),
    [
        ("file:///", "file:///{path}"),
        ("file:///fragments/", "file:///fragments/{path}"),
        ("s3://bucket/pre/fix/", "s3://bucket/pre/fix/{path}"),
        ("s3://bucket/", "s3://bucket/{path}"),
        (
            "s3://bucket/p/?profile=x&region=eu-west-1",
            "s3://bucket/p/{path}?profile=x&region=eu-west-1",
        ),
        ("gs://bucket/no-slash", "gs://bucket/no-slash/{path}"),
    ],
)
def test_fragment_url(store: str, expected: str) -> None:
    f = _fragment(postfix="date=2024-05-01")
    assert fragment_url(store, f) == expected.format(path=content_path(f))
