"""Fragment stores: the file store under a root, and the S3 store against a real S3 server."""

from __future__ import annotations

import hashlib
import logging
import time
import urllib.request
import uuid
from datetime import timedelta
from pathlib import Path

import pytest

from streamkit.broker.stores import FileStore, FragmentStore, FragmentStoreError, open_store
from streamkit.broker.stores.file import TEMP_PREFIX
from streamkit.broker.stores.s3 import S3Store
from streamkit.protocol import pb
from streamkit.protocol.codecs import new_compressor, open_decompressed
from streamkit.protocol.fragments import content_name, content_path, fragment_url, sum_of
from tests.s3server import BUCKET

JOURNAL = "examples/words/part-000"
ALL_CODECS = [pb.NONE, pb.GZIP, pb.ZSTANDARD, pb.SNAPPY, pb.GZIP_OFFLOAD_DECOMPRESSION]


# --- fixtures ----------------------------------------------------------------


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> FragmentStore:
    if request.param == "file":
        return open_store("file:///fragments/", tmp_path / "root")
    return open_store(request.getfixturevalue("s3_url"), tmp_path)


# --- helpers -----------------------------------------------------------------


def _compressed(
    tmp_path: Path,
    content: bytes,
    codec: int = pb.ZSTANDARD,
    begin: int = 0,
    postfix: str = "",
    journal: str = JOURNAL,
) -> tuple[pb.Fragment, Path]:
    """A fragment of `content` and its compressed file, as the persister hands them over."""
    compressor = new_compressor(codec)
    path = tmp_path / f"upload-{uuid.uuid4().hex}"
    path.write_bytes(compressor.compress(content) + compressor.flush())
    fragment = pb.Fragment(
        journal=journal,
        begin=begin,
        end=begin + len(content),
        sum=sum_of(hashlib.sha1(content).digest()),
        compression_codec=codec,
        path_postfix=postfix,
    )
    return fragment, path


def _read(store: FragmentStore, f: pb.Fragment) -> bytes:
    with open_decompressed(store.open(f), f.compression_codec) as stream:
        return stream.read()


def _plant(store: FragmentStore, relative: str, data: bytes) -> None:
    """Put a file into the store behind its back (stray files, other writers)."""
    if isinstance(store, FileStore):
        path = store.root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    else:
        assert isinstance(store, S3Store)
        store._client.put_object(Bucket=store.bucket, Key=store.prefix + relative, Body=data)


def _located(fragments: list[pb.Fragment], store: FragmentStore) -> list[pb.Fragment]:
    """What a listing reports for `fragments` (mod_time aside)."""
    out = []
    for f in fragments:
        g = pb.Fragment()
        g.CopyFrom(f)
        g.backing_store = store.url
        out.append(g)
    return out


def _without_mod_time(fragments: list[pb.Fragment]) -> list[pb.Fragment]:
    for f in fragments:
        f.mod_time = 0
    return fragments


# --- every store ---------------------------------------------------------------


async def test_put_list_open_remove(store: FragmentStore, tmp_path: Path) -> None:
    contents = [f"record {i}\n".encode() * (1000 * (i + 1)) for i in range(len(ALL_CODECS))]
    fragments, begin = [], 0
    for codec, content in zip(ALL_CODECS, contents, strict=True):
        f, path = _compressed(tmp_path, content, codec, begin=begin)
        assert not await store.exists(f)
        await store.put(f, path)
        assert await store.exists(f)
        fragments.append(f)
        begin = f.end

    listed = await store.list(JOURNAL)
    assert all(abs(f.mod_time - time.time()) < 300 for f in listed)
    assert _without_mod_time(listed) == _located(fragments, store)
    for f, content in zip(fragments, contents, strict=True):
        assert _read(store, f) == content

    await store.remove(fragments[1])
    assert not await store.exists(fragments[1])
    await store.remove(fragments[1])  # already gone: still fine
    assert [f.begin for f in await store.list(JOURNAL)] == [
        f.begin for f in fragments if f is not fragments[1]
    ]


async def test_put_is_idempotent(store: FragmentStore, tmp_path: Path) -> None:
    f, path = _compressed(tmp_path, b"the original\n")
    await store.put(f, path)
    path.unlink()  # put may have hard-linked the file: never modify it in place
    path.write_bytes(b"something else entirely")
    await store.put(f, path)
    assert _read(store, f) == b"the original\n"
    assert len(await store.list(JOURNAL)) == 1


async def test_list_walks_path_postfixes(store: FragmentStore, tmp_path: Path) -> None:
    fragments = []
    for i, postfix in enumerate(["", "date=2024-05-01", "date=2024-05-02/hour=03"]):
        f, path = _compressed(tmp_path, b"x" * (i + 1) * 10, begin=i * 100, postfix=postfix)
        await store.put(f, path)
        fragments.append(f)
    listed = await store.list(JOURNAL)
    assert _without_mod_time(listed) == _located(fragments, store)
    assert [_read(store, f) for f in listed] == [b"x" * 10, b"x" * 20, b"x" * 30]


async def test_list_skips_what_is_not_a_fragment(
    store: FragmentStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    f, path = _compressed(tmp_path, b"real\n")
    await store.put(f, path)
    _plant(store, f"{JOURNAL}/README.txt", b"hello")
    _plant(store, f"{JOURNAL}/sub/0-1-deadbeef.raw", b"short sum")
    with caplog.at_level(logging.WARNING):
        listed = await store.list(JOURNAL)
    assert [content_name(g) for g in listed] == [content_name(f)]
    assert "README.txt" in caplog.text
    assert "deadbeef" in caplog.text


async def test_list_of_unknown_journal_is_empty(store: FragmentStore) -> None:
    assert await store.list("never/written") == []


async def test_other_journals_are_not_listed(store: FragmentStore, tmp_path: Path) -> None:
    mine, path = _compressed(tmp_path, b"mine\n", journal="logs/a")
    await store.put(mine, path)
    other, path = _compressed(tmp_path, b"theirs\n", journal="logs/ab")
    await store.put(other, path)
    assert [f.journal for f in await store.list("logs/a")] == ["logs/a"]


# --- file store ----------------------------------------------------------------


async def test_file_store_lives_under_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    store = open_store("file:///x/y/", root)
    f, path = _compressed(tmp_path, b"confined\n", pb.NONE)
    await store.put(f, path)
    stored = root / "x" / "y" / content_path(f)
    assert stored.read_bytes() == b"confined\n"
    assert stored.stat().st_mode & 0o777 == 0o644
    assert not Path("/x/y").joinpath(content_path(f)).exists()
    assert [p.name for p in stored.parent.iterdir()] == [stored.name]  # no temp files left
    assert await store.signed_url(f, timedelta(minutes=1)) == fragment_url("file:///x/y/", f)
    assert fragment_url("file:///x/y/", f) == f"file:///x/y/{content_path(f)}"


def test_file_store_at_the_root(tmp_path: Path) -> None:
    store = open_store("file:///", tmp_path)
    assert isinstance(store, FileStore)
    assert store.root == tmp_path.resolve()


@pytest.mark.parametrize(
    "url",
    [
        "file:///../outside/",
        "file:///a/../../outside/",
        "file:///a/./b/",
        "file:///a//b/",
        "file://somehost/a/",
        "file:///a/b",
        "file:///a/?find=x",
    ],
)
def test_file_store_refuses_bad_urls(url: str, tmp_path: Path) -> None:
    with pytest.raises(FragmentStoreError):
        open_store(url, tmp_path)


async def test_file_store_refuses_escaping_journal_names(tmp_path: Path) -> None:
    store = open_store("file:///", tmp_path)
    with pytest.raises(FragmentStoreError):
        await store.list("../../etc")
    f, path = _compressed(tmp_path, b"x", journal="a/../../escape")
    with pytest.raises(FragmentStoreError):
        await store.put(f, path)


async def test_file_store_skips_temp_files_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = open_store("file:///", tmp_path)
    _plant(store, f"{JOURNAL}/{TEMP_PREFIX}abc123", b"half written")
    with caplog.at_level(logging.WARNING):
        assert await store.list(JOURNAL) == []
    assert not caplog.records


async def test_failed_put_leaves_nothing_behind(tmp_path: Path) -> None:
    store = open_store("file:///", tmp_path / "root")
    f, path = _compressed(tmp_path, b"x")
    path.unlink()
    with pytest.raises(FragmentStoreError):
        await store.put(f, path)
    assert not await store.exists(f)
    assert list((tmp_path / "root" / JOURNAL).iterdir()) == []


async def test_file_open_of_missing_fragment(tmp_path: Path) -> None:
    store = open_store("file:///", tmp_path)
    f, _ = _compressed(tmp_path, b"x")
    with pytest.raises(FragmentStoreError):
        store.open(f)


# --- open_store ----------------------------------------------------------------


def test_open_store_caches_instances(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = open_store("file:///cache/", tmp_path)
    monkeypatch.chdir(tmp_path)
    assert open_store("file:///cache/", Path(".")) is a
    assert open_store("file:///cache/", tmp_path / "other") is not a
    assert open_store("file:///cache2/", tmp_path) is not a


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("gs://bucket/prefix/", "not supported by the bundled broker yet"),
        ("azure://account/container/", "not supported by the bundled broker yet"),
        ("ftp://host/path/", "unknown fragment store scheme"),
        ("fragments/", "unknown fragment store scheme"),
    ],
)
def test_open_store_refuses_other_schemes(url: str, message: str, tmp_path: Path) -> None:
    with pytest.raises(FragmentStoreError, match=message):
        open_store(url, tmp_path)


# --- S3 store ----------------------------------------------------------------


async def test_s3_signed_url_serves_the_stored_bytes(s3_url: str, tmp_path: Path) -> None:
    store = open_store(s3_url, tmp_path)
    for codec, content_type in [
        (pb.NONE, "application/octet-stream"),
        (pb.ZSTANDARD, "application/zstd"),
        (pb.GZIP_OFFLOAD_DECOMPRESSION, "application/octet-stream"),
    ]:
        f, path = _compressed(tmp_path, b"signed content\n" * 100, codec)
        await store.put(f, path)
        url = await store.signed_url(f, timedelta(minutes=1))
        assert url.startswith("http://127.0.0.1:")
        assert "Signature=" in url
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.read() == path.read_bytes()
            assert response.headers["Content-Type"] == content_type
            expected_encoding = "gzip" if codec == pb.GZIP_OFFLOAD_DECOMPRESSION else None
            assert response.headers["Content-Encoding"] == expected_encoding


async def test_s3_list_follows_pages(s3_url: str, tmp_path: Path) -> None:
    store = open_store(s3_url, tmp_path)
    assert isinstance(store, S3Store)

    requests = []

    def small_pages(params: dict[str, object], **_: object) -> None:
        params["MaxKeys"] = 3  # S3 pages hold 1000 keys: shrink them rather than write 1001
        requests.append(params)

    store._client.meta.events.register("before-parameter-build.s3.ListObjectsV2", small_pages)
    fragments = [
        pb.Fragment(journal=JOURNAL, begin=i, end=i + 1, compression_codec=pb.NONE)
        for i in range(10)
    ]
    for f in fragments:
        _plant(store, content_path(f), b"x")
    listed = await store.list(JOURNAL)
    assert [f.begin for f in listed] == list(range(10))
    assert len(requests) == 4


async def test_s3_errors_are_store_errors(s3_endpoint: str, aws_env: None, tmp_path: Path) -> None:
    store = open_store(f"s3://no-such-bucket/?endpoint={s3_endpoint}", tmp_path)
    with pytest.raises(FragmentStoreError, match="no-such-bucket"):
        await store.list(JOURNAL)


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("?endpont=http://127.0.0.1:1", "unknown query argument"),
        ("?profile=does-not-exist", "does-not-exist"),
        ("?region=a&region=b", "given twice"),
    ],
)
def test_s3_refuses_bad_urls(query: str, message: str, aws_env: None, tmp_path: Path) -> None:
    with pytest.raises(FragmentStoreError, match=message):
        open_store(f"s3://{BUCKET}/prefix/{query}", tmp_path)


def test_s3_url_options(aws_env: None, tmp_path: Path) -> None:
    store = open_store(f"s3://{BUCKET}/a/b/?Region=eu-west-1&sse=AES256&acl=private", tmp_path)
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix) == (BUCKET, "a/b/")
    assert store._client.meta.region_name == "eu-west-1"
