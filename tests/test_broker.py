"""The broker against raw gRPC requests, as a Gazette client would send them."""

from __future__ import annotations

import contextlib
import hashlib
import random

import grpc
import pytest

from streamkit.protocol import pb
from streamkit.protocol.fragments import digest_of
from streamkit.protocol.labels import label_set, parse_selector
from tests import wire
from tests.waiting import Worker, join_all

# GZIP_OFFLOAD_DECOMPRESSION needs a store that honours Content-Encoding (not file://).
CODECS = [pb.NONE, pb.GZIP, pb.ZSTANDARD, pb.SNAPPY]


@pytest.fixture(scope="module")
def journals(shared_broker):
    return wire.stub(shared_broker.address)


def _name(request: pytest.FixtureRequest, suffix: str = "") -> str:
    return f"tests/{request.node.name.replace('[', '-').rstrip(']')}{suffix}"


def test_append_then_read_round_trip(journals, request) -> None:
    name = _name(request)
    wire.create(journals, wire.spec(name))
    first = wire.append(journals, name, b"hello, ", b"world\n")
    assert first.status == pb.OK
    assert (first.commit.begin, first.commit.end) == (0, 13)
    assert digest_of(first.commit.sum) == hashlib.sha1(b"hello, world\n").digest()
    second = wire.append(journals, name, b"more\n")
    assert (second.commit.begin, second.commit.end) == (13, 18)
    content, metadata = wire.read(journals, name)
    assert content == b"hello, world\nmore\n"
    assert metadata[0].header.route.primary == 0
    assert metadata[-1].status == pb.OFFSET_NOT_YET_AVAILABLE
    assert metadata[-1].write_head == 18
    assert wire.read(journals, name, offset=7, end=12)[0] == b"world"


@pytest.mark.parametrize("codec", CODECS, ids=[pb.CompressionCodec.Name(c) for c in CODECS])
def test_rollover_persist_and_read_back_every_codec(journals, request, codec) -> None:
    name = _name(request)
    wire.create(journals, wire.spec(name, length=4096, codec=codec))
    # Mixed compressibility; random bytes, but the same on every run.
    blocks = [random.Random(i).randbytes(1000) + bytes(1500) for i in range(12)]
    for block in blocks:
        assert wire.append(journals, name, block).status == pb.OK
    expected = b"".join(blocks)

    def persisted() -> list[pb.Fragment]:
        listed = wire.fragments(journals, name)
        return [f for f in listed if f.backing_store] if len(listed) >= 3 else []

    remote = wire.wait_until(lambda: len(persisted()) >= 3 and persisted())
    for fragment in remote:
        assert fragment.compression_codec == codec
        assert fragment.end - fragment.begin >= 4096
    assert wire.read(journals, name)[0] == expected
    # A read that starts inside a persisted fragment is served from the store.
    content, metadata = wire.read(journals, name, offset=5000, end=9000)
    assert content == expected[5000:9000]
    assert metadata[0].fragment.backing_store == "file:///"


def test_list_with_selectors_and_apply_revisions(journals, request) -> None:
    base = _name(request, "/")
    a, b, c = (wire.spec(base + n, labels={"app": n}) for n in ("one", "two", "sub/three"))
    wire.create(journals, a, b, c)

    def names(selector: str) -> list[str]:
        listing = journals.List(pb.ListRequest(selector=parse_selector(selector)))
        return [j.spec.name for response in listing for j in response.journals]

    assert names(f"prefix={base}") == [a.name, c.name, b.name]
    assert names(f"prefix={base}sub/") == [c.name]
    assert names(f"name={b.name}") == [b.name]
    assert names(f"prefix={base},app in (one, two)") == [a.name, b.name]
    assert names(f"prefix={base},app!=one") == [c.name, b.name]

    listed = next(iter(journals.List(pb.ListRequest(selector=parse_selector(f"name={a.name}")))))
    revision = listed.journals[0].mod_revision
    changed = pb.JournalSpec()
    changed.CopyFrom(a)
    changed.labels.CopyFrom(label_set(("app", "changed")))
    stale = pb.ApplyRequest.Change(expect_mod_revision=revision - 1, upsert=changed)
    fresh = pb.ApplyRequest.Change(expect_mod_revision=revision, upsert=changed)
    other = pb.ApplyRequest.Change(expect_mod_revision=0, upsert=wire.spec(base + "four"))
    assert journals.Apply(pb.ApplyRequest(changes=[other, stale])).status == (
        pb.ETCD_TRANSACTION_FAILED
    )
    assert names(f"name={base}four") == []  # the whole request failed
    assert journals.Apply(pb.ApplyRequest(changes=[fresh])).status == pb.OK
    assert names(f"prefix={base},app=changed") == [a.name]
    unchecked = pb.ApplyRequest.Change(expect_mod_revision=-1, delete=b.name)
    assert journals.Apply(pb.ApplyRequest(changes=[unchecked])).status == pb.OK
    assert names(f"name={b.name}") == []


def test_registers_check_union_subtract(journals, request) -> None:
    name = _name(request)
    wire.create(journals, wire.spec(name))
    owner = parse_selector("author=a")
    # Empty registers match any selector; the union applies because bytes were appended.
    first = wire.append(journals, name, b"x", check_registers=owner,
                        union_registers=label_set(("author", "a")))
    assert first.status == pb.OK
    assert [(lb.name, lb.value) for lb in first.registers.labels] == [("author", "a")]
    refused = wire.append(journals, name, b"y", check_registers=parse_selector("author=b"))
    assert refused.status == pb.REGISTER_MISMATCH
    assert refused.registers == first.registers
    # A zero-byte append cannot change registers.
    empty = wire.append(journals, name, union_registers=label_set(("author", "b")))
    assert empty.status == pb.OK and empty.registers == first.registers
    handed = wire.append(journals, name, b"z", check_registers=owner,
                         union_registers=label_set(("author", "b"), ("epoch", "2")),
                         subtract_registers=label_set(("epoch", "")))
    assert [(lb.name, lb.value) for lb in handed.registers.labels] == [("author", "b")]
    assert wire.append(journals, name, b"w", check_registers=owner).status == pb.REGISTER_MISMATCH
    assert wire.read(journals, name)[0] == b"xz"


def test_explicit_append_offset(journals, request) -> None:
    name = _name(request)
    wire.create(journals, wire.spec(name))
    assert wire.append(journals, name, b"abc", offset=0).status == pb.OK
    assert wire.append(journals, name, b"def", offset=2).status == pb.WRONG_APPEND_OFFSET
    assert wire.append(journals, name, b"def", offset=3).commit.end == 6


def test_blocking_read_wakes_on_append(journals, request) -> None:
    name = _name(request)
    wire.create(journals, wire.spec(name))
    content, metadata = wire.read(journals, name)
    assert content == b"" and metadata[-1].status == pb.OFFSET_NOT_YET_AVAILABLE
    stream = journals.Read(pb.ReadRequest(journal=name, offset=0, block=True))
    got = bytearray()

    def consume() -> None:
        with contextlib.suppress(grpc.RpcError):  # raised by our own cancel()
            for response in stream:
                got.extend(response.content)
                if len(got) >= 6:
                    stream.cancel()

    reader = Worker(consume, name="blocking reader")
    reader.start()
    wire.append(journals, name, b"abc")
    wire.append(journals, name, b"def")
    reader.join()
    assert bytes(got) == b"abcdef"
    tail = journals.Read(pb.ReadRequest(journal=name, offset=-1, block=False))
    assert next(iter(tail)).status == pb.OFFSET_NOT_YET_AVAILABLE


def test_concurrent_appenders_never_interleave(journals, request) -> None:
    name = _name(request)
    wire.create(journals, wire.spec(name, length=1 << 16))
    writers, per_writer, chunk = 6, 20, 4096

    def write(tag: int) -> None:
        for i in range(per_writer):
            parts = [bytes([65 + tag]) * chunk for _ in range(4)]
            assert wire.append(journals, name, *parts).status == pb.OK, (tag, i)

    threads = [Worker(write, t, name=f"appender {t}") for t in range(writers)]
    for t in threads:
        t.start()
    join_all(threads)  # an appender's failed assertion fails the test
    content = wire.read(journals, name)[0]
    assert len(content) == writers * per_writer * 4 * chunk
    for at in range(0, len(content), 4 * chunk):
        record = content[at : at + 4 * chunk]
        assert record == record[:1] * len(record)


def test_do_not_proxy_returns_fragment_url(journals, request) -> None:
    name = _name(request)
    wire.create(journals, wire.spec(name, length=1024, codec=pb.ZSTANDARD))
    wire.append(journals, name, random.Random(2048).randbytes(2048))  # incompressible
    wire.append(journals, name, b"tail")
    wire.wait_until(lambda: any(f.backing_store for f in wire.fragments(journals, name)))
    content, metadata = wire.read(journals, name, do_not_proxy=True)
    assert content == b""
    assert metadata[0].fragment_url.startswith(f"file:///{name}/0000000000000000-")
    assert metadata[0].fragment_url.endswith(".zst")


def test_reads_skip_fragments_persisted_before_begin_mod_time(journals, request) -> None:
    """ReadRequest.begin_mod_time skips persisted fragments modified before it (never the
    spool's, which has no mod_time yet), as Gazette's index does; it was ignored."""
    name = _name(request)
    wire.create(journals, wire.spec(name, length=1024, codec=pb.NONE))
    wire.append(journals, name, b"a" * 2000)
    wire.append(journals, name, b"tail")  # rolls the first spool, which is persisted
    wire.wait_until(lambda: any(f.backing_store for f in wire.fragments(journals, name)))
    persisted = next(f for f in wire.fragments(journals, name) if f.backing_store)
    later = persisted.mod_time + 1
    content, metadata = wire.read(journals, name, begin_mod_time=later)
    assert content == b"tail" and metadata[0].offset == 2000
    content, _ = wire.read(journals, name, begin_mod_time=persisted.mod_time)
    assert content == b"a" * 2000 + b"tail"


def test_list_fragments_pages(journals, request) -> None:
    name = _name(request)
    wire.create(journals, wire.spec(name, length=1024, codec=pb.NONE))
    for _ in range(5):
        wire.append(journals, name, bytes(1500))
    wire.wait_until(lambda: sum(bool(f.backing_store) for f in wire.fragments(journals, name)) >= 4)
    seen, token = [], 0
    while True:
        page = journals.ListFragments(
            pb.FragmentsRequest(journal=name, page_limit=2, next_page_token=token)
        )
        assert len(page.fragments) <= 2
        seen.extend(f.spec.begin for f in page.fragments)
        token = page.next_page_token
        if not token:
            break
    assert seen == sorted(seen) and len(seen) >= 5


def test_bad_requests_get_clear_statuses_and_broker_keeps_serving(journals, request) -> None:
    name = _name(request)
    wire.create(journals, wire.spec(name))
    for bad in ("", "/abs", "a//b", "has space", "x" * 600, "ok/../up"):
        with pytest.raises(grpc.RpcError) as err:
            wire.read(journals, bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "journal" in err.value.details()
    assert wire.read(journals, "tests/missing")[1][0].status == pb.JOURNAL_NOT_FOUND
    assert wire.append(journals, "tests/missing", b"x").status == pb.JOURNAL_NOT_FOUND
    oversize = wire.spec(name + "/labels", labels={"big": "v" * 5000})
    with pytest.raises(grpc.RpcError) as err:
        wire.create(journals, oversize)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "labels" in err.value.details()
    # A stream that ends without the empty commit chunk rolls back.
    first = pb.AppendRequest(journal=name)
    with pytest.raises(grpc.RpcError):
        journals.Append(wire.append_requests(first, [b"never"], commit=False))
    with pytest.raises(grpc.RpcError) as err:
        journals.Append(iter([pb.AppendRequest(journal=name), pb.AppendRequest(journal=name)]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert wire.append(journals, name, b"kept").commit.begin == 0
    assert wire.read(journals, name)[0] == b"kept"


def test_flags_forbid_reads_or_writes(journals, request) -> None:
    ro, wo = _name(request, "-ro"), _name(request, "-wo")
    wire.create(journals, wire.spec(ro, flags=pb.JournalSpec.O_RDONLY),
                wire.spec(wo, flags=pb.JournalSpec.O_WRONLY))
    assert wire.append(journals, ro, b"x").status == pb.NOT_ALLOWED
    assert wire.append(journals, wo, b"x").status == pb.OK
    assert wire.read(journals, wo)[1][0].status == pb.NOT_ALLOWED


def test_replicate_is_declared_but_unimplemented(journals) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(journals.Replicate(iter([pb.ReplicateRequest()])))
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_missing_range_becomes_an_offset_jump(shared_broker, journals, request) -> None:
    name = _name(request)
    wire.create(journals, wire.spec(name, length=1024, codec=pb.NONE))
    for block in (b"a" * 1500, b"b" * 1500, b"c" * 100):
        wire.append(journals, name, block)
    persisted = wire.wait_until(
        lambda: [f for f in wire.fragments(journals, name) if f.backing_store][:2]
        if sum(bool(f.backing_store) for f in wire.fragments(journals, name)) >= 2 else None
    )
    first = persisted[0]
    # Delete the first fragment behind the broker's back; the next refresh drops it.
    store_dir = shared_broker.data_dir / "fragments" / name
    next(store_dir.glob(f"{first.begin:016x}-*")).unlink()
    wire.wait_until(lambda: wire.fragments(journals, name)[0].begin == first.end)
    content, metadata = wire.read(journals, name, offset=0)
    assert metadata[0].offset == first.end  # jumped over the missing range
    assert content == b"b" * 1500 + b"c" * 100


def test_list_watch_sends_a_snapshot_after_each_change(journals, request) -> None:
    base = _name(request, "/")
    wire.create(journals, wire.spec(base + "one"))
    selector = parse_selector(f"prefix={base}")
    stream = journals.List(pb.ListRequest(selector=selector, watch=True))
    snapshots, current = [], []
    for response in stream:
        if response.journals:
            current.extend(j.spec.name for j in response.journals)
            continue
        snapshots.append(current)  # an empty response ends a snapshot
        current = []
        if len(snapshots) == 1:
            wire.create(journals, wire.spec(base + "two"))
        elif base + "two" in snapshots[-1]:
            stream.cancel()
            break
    assert snapshots[0] == [base + "one"]
    assert snapshots[-1] == [base + "one", base + "two"]
