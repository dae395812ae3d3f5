"""The etcd KeySpace against a real etcd 3.5: what tests/test_keyspace.py can't show.

The interface-level behaviour (revisions, txn and compare-and-swap, prefix
ranges, ordered watches, processes racing to create) runs against etcd there.
Here: URLs, key prefixes, watch batching and compaction, etcd's leases, and
riding out an etcd restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import signal
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import aetcd
import grpc
import pytest

from streamkit.keyspace import (
    ClusterChangedError,
    CompactedError,
    Compare,
    DeletePrefix,
    EtcdKeySpace,
    Event,
    KeySpace,
    KeySpaceError,
    KeySpaceURLError,
    LeaseNotFoundError,
    Put,
    open_keyspace,
)
from streamkit.keyspace.etcd import parse_url
from tests.test_keyspace import collect, summary
from tests.waiting import DEADLINE, LIVENESS, eventually

if TYPE_CHECKING:
    from tests.etcdproc import EtcdServer

pytest_plugins = ["tests.etcdproc"]  # the etcd fixtures


@pytest.fixture
async def ks(etcd_url: str) -> AsyncIterator[KeySpace]:
    async with open_keyspace(etcd_url) as keyspace:
        yield keyspace


def dead_endpoint() -> str:
    """A local address where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


async def batches(ks: KeySpace, prefix: str, after: int, until: int) -> list[list[Event]]:
    """The batches a watch of `prefix` delivers after `after`, up to revision `until`."""
    seen: list[list[Event]] = []
    async with asyncio.timeout(DEADLINE), contextlib.aclosing(ks.watch(prefix, after)) as watch:
        async for batch in watch:
            seen.append(batch)
            if batch[-1].revision >= until:
                return seen
    raise AssertionError("watch ended")


@pytest.mark.parametrize(
    ("url", "endpoints", "prefix"),
    [
        ("etcd://127.0.0.1:2379", ["127.0.0.1:2379"], ""),
        ("etcd://127.0.0.1:2379/", ["127.0.0.1:2379"], ""),
        ("etcd://a:1,b.example:2,[::1]:3/app/x/", ["a:1", "b.example:2", "[::1]:3"], "app/x/"),
    ],
)
def test_url_names_endpoints_and_prefix(url: str, endpoints: list[str], prefix: str) -> None:
    assert parse_url(url) == (endpoints, prefix)
    ks = open_keyspace(url, retry_timeout=1)
    assert isinstance(ks, EtcdKeySpace)
    assert ks.url == f"etcd://{','.join(endpoints)}/{prefix}"


@pytest.mark.parametrize(
    "url",
    [
        *("etcd://", "etcd:///p", "etcd://host/p", "etcd://host:0", "etcd://h:1,/p", "etcd://h:x"),
        # typos, which must not become a SQLite file of that name
        *("etcd:/bad", "etcd:h:2379/x", "etcd//h:2379/x", "etcd:", "etcd:/h:2379/x", "etcd:1/p"),
    ],
)
def test_invalid_url_says_what_is_expected(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    expected = r"expected etcd://host:port\[,host:port...\]/prefix"
    with pytest.raises(KeySpaceURLError, match=expected):
        open_keyspace(url)
    with pytest.raises(KeySpaceError, match=re.escape(url)):
        open_keyspace(url)
    assert not list(tmp_path.iterdir()), "a mistyped etcd URL is not a SQLite file"


async def test_prefixes_keep_keyspaces_apart(etcd_server: EtcdServer) -> None:
    root = open_keyspace(etcd_server.url())
    one, two = open_keyspace(etcd_server.url("iso-1/")), open_keyspace(etcd_server.url("iso-2/"))
    async with root, one, two:
        start = await one.put("k", b"one")
        await two.txn((), [Put("k", b"two"), Put("j", b"")])
        assert (await one.get("k")).value == b"one"  # type: ignore[union-attr]
        assert [(kv.key, kv.value) for kv in (await one.range(""))[0]] == [("k", b"one")]
        assert [kv.key for kv in (await root.range("iso-"))[0]] == ["iso-1/k", "iso-2/j", "iso-2/k"]

        deleted = (await one.txn((), [DeletePrefix("")])).revision
        assert [kv.key for kv in (await root.range("iso-"))[0]] == ["iso-2/j", "iso-2/k"]
        head = await root.put("iso-1/again", b"")
        assert summary(await collect(one, "", start, head)) == [
            ("delete", "k", deleted),
            ("put", "again", head),
        ], "one's watch sees neither two's keys nor root's prefix"
        await root.delete("iso-1/again")
        await two.txn((), [DeletePrefix("")])


async def test_watch_batches_whole_revisions_in_order(ks: KeySpace) -> None:
    start = await ks.revision()
    await ks.txn((), [Put(f"w/{i:03}", b"x" * 100) for i in range(100)])
    for i in range(20):
        await ks.put(f"w/{i:03}", b"again")
    await ks.txn((), [DeletePrefix("w/")])
    head = await ks.revision()
    seen = await batches(ks, "w/", start, head)
    revisions = [e.revision for batch in seen for e in batch]
    assert revisions == sorted(revisions) and len(revisions) == 220
    assert sorted(set(revisions)) == list(range(start + 1, head + 1))
    for earlier, later in itertools.pairwise(seen):
        assert earlier[-1].revision < later[0].revision, "a revision is never split"
    assert [e.kv.key for e in seen[0][:100]] == [f"w/{i:03}" for i in range(100)]


async def test_watch_resumes_from_any_revision(ks: KeySpace) -> None:
    revisions = [await ks.put(f"r/{i}", str(i).encode()) for i in range(6)]
    events = await collect(ks, "r/", revisions[2], revisions[-1])
    assert [e.kv.value for e in events] == [b"3", b"4", b"5"]
    _, head = await ks.range("r/")
    watching = asyncio.create_task(collect(ks, "r/", head, head + 1))
    await ks.put("r/6", b"6")
    assert summary(await watching) == [("put", "r/6", head + 1)]


async def test_watch_from_compacted_revision_fails(private_etcd: EtcdServer) -> None:
    async with open_keyspace(private_etcd.url("c/")) as ks:
        revisions = [await ks.put(f"k/{i}", b"") for i in range(10)]
        compact_at = revisions[5]
        host, port = private_etcd.endpoint.split(":")
        async with aetcd.Client(host, int(port)) as client:
            await client.compact(compact_at, physical=True)
        with pytest.raises(CompactedError) as info:
            await anext(ks.watch("k/", revisions[2]))
        assert (info.value.requested, info.value.compact_revision) == (revisions[2], compact_at)
        events = await collect(ks, "k/", compact_at, revisions[-1])
        assert [e.revision for e in events] == revisions[6:], "history after it is whole"


async def test_lease_ttl_rounds_up_and_expiry_deletes_keys(ks: KeySpace, etcd_url: str) -> None:
    started = time.monotonic()
    lease = await ks.grant(0.3)  # etcd counts whole seconds: this lease lives 1 s
    put_revision = await ks.put("member/a", b"", lease=lease)
    await ks.put("plain", b"")
    async with open_keyspace(etcd_url) as observer:
        events = await collect(observer, "member/", put_revision, put_revision + 2)
    # A lower bound only, timed from before the grant: the lease cannot end before it began
    # plus its (rounded up) TTL, however slow the machine. When it ends, collect's deadline
    # bounds: how soon is no business of a test.
    assert time.monotonic() - started > 0.6, "the TTL was rounded up to 1 s"
    assert summary(events) == [("delete", "member/a", put_revision + 2)]
    assert await ks.get("member/a") is None and await ks.get("plain") is not None
    assert not await ks.keepalive(lease)
    with pytest.raises(LeaseNotFoundError):
        await ks.put("member/b", b"", lease=lease)


async def test_keepalive_holds_and_revoke_releases(ks: KeySpace) -> None:
    lease = await ks.grant(2)
    r = await ks.put("member/a", b"", lease=lease)
    for _ in range(6):  # 3 s: well past the TTL
        await asyncio.sleep(0.5)  # pacing, what is tested: time passes between keepalives
        assert await ks.keepalive(lease)
    assert await ks.get("member/a") is not None
    await ks.revoke(lease)
    assert await ks.get("member/a") is None
    assert await ks.revision() == r + 1
    await ks.revoke(lease)
    assert not await ks.keepalive(lease)


async def test_unreachable_etcd_fails_in_time_naming_endpoints() -> None:
    endpoints = f"{dead_endpoint()},{dead_endpoint()}"
    # "In time": the error names the 0.5 s retry budget it gave up after. The timeout is
    # only a liveness bound (that it gives up at all); how fast is no business of a test.
    async with (
        open_keyspace(f"etcd://{endpoints}/x/", retry_timeout=0.5) as ks,
        asyncio.timeout(LIVENESS),
    ):
        with pytest.raises(KeySpaceError, match=f"etcd at {endpoints} unavailable for 0.5s"):
            await ks.put("k", b"")
        with pytest.raises(KeySpaceError, match=endpoints):
            await anext(ks.watch("", 0))


async def test_dead_endpoint_is_skipped(etcd_server: EtcdServer) -> None:
    url = f"etcd://{dead_endpoint()},{etcd_server.endpoint}/skip/"
    async with open_keyspace(url, retry_timeout=5) as ks:
        revision = await ks.put("k", b"v")
        assert (await ks.get("k")).mod_revision == revision  # type: ignore[union-attr]
        await ks.delete("k")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["stop", "crash"])
async def test_watch_and_writes_ride_out_a_restart(
    private_etcd: EtcdServer,
    sig: signal.Signals,
) -> None:
    async with open_keyspace(private_etcd.url("app/"), retry_timeout=LIVENESS) as ks:
        start = await ks.revision()
        before = await ks.put("w/before", b"")
        seen: list[Event] = []

        async def watch() -> None:
            async with asyncio.timeout(LIVENESS), contextlib.aclosing(ks.watch("w/", start)) as w:
                async for batch in w:
                    seen.extend(batch)
                    if batch[-1].revision >= before + 2:
                        return

        watching = asyncio.create_task(watch())
        await eventually(lambda: seen, what="the watch to stream w/before")

        private_etcd.stop(sig)
        # Let the client see the connection drop first: a txn already on the
        # wire when etcd dies fails as "may or may not have been applied".
        (channel,) = ks._channels  # type: ignore[attr-defined]
        await eventually(
            lambda: channel.get_state() != grpc.ChannelConnectivity.READY,
            what="the client to see the connection drop",
        )
        put = asyncio.create_task(ks.put("w/during", b""))
        # A negative check (what is tested): for this long, while etcd is down, the put waits.
        await asyncio.sleep(0.5)
        assert not put.done(), "the put waits for etcd to come back"
        await asyncio.to_thread(private_etcd.start)
        during = await put
        after = await ks.put("w/after", b"")

        assert during == before + 1 and after == before + 2
        await watching
        assert summary(seen) == [
            ("put", "w/before", before),
            ("put", "w/during", during),
            ("put", "w/after", after),
        ]


async def test_a_wiped_etcd_fails_watches_and_calls_for_good(private_etcd: EtcdServer) -> None:
    url = private_etcd.url("app/")
    async with (
        open_keyspace(url, retry_timeout=LIVENESS) as ks,
        open_keyspace(url, retry_timeout=LIVENESS) as writer,
    ):
        start = await ks.revision()
        for i in range(3):  # revisions a wiped etcd, starting again at 1, is below
            await writer.put(f"w/{i}", b"")
        seen: list[Event] = []

        async def watch() -> None:
            async with contextlib.aclosing(ks.watch("w/", start)) as w:
                async for batch in w:
                    seen.extend(batch)

        watching = asyncio.create_task(watch())
        await eventually(lambda: len(seen) == 3, what="the watch to stream the puts")
        await asyncio.to_thread(private_etcd.wipe)

        wiped = (
            rf"^etcd at {private_etcd.endpoint} is a different cluster \(its revision went back "
            r"from \d+ to 1; its data was wiped or replaced\): restart this process$"
        )
        with pytest.raises(ClusterChangedError, match=wiped):
            async with asyncio.timeout(LIVENESS):
                await watching
        with pytest.raises(ClusterChangedError, match=wiped):
            await ks.put("w/again", b"")  # for good: nothing is done on the new etcd
        with pytest.raises(ClusterChangedError, match=wiped):
            await writer.get("w/0")  # a client that only read and wrote notices as well
        async with open_keyspace(url) as fresh:  # as the restarted process does
            assert await fresh.range("w/") == ([], 1)


async def test_another_cluster_at_the_address_is_refused(private_etcd: EtcdServer) -> None:
    async with open_keyspace(private_etcd.url(), retry_timeout=LIVENESS) as ks:
        await ks.put("k", b"")
        await asyncio.to_thread(private_etcd.wipe, another_cluster=True)
        async with open_keyspace(private_etcd.url()) as fresh:
            for _ in range(3):  # ahead of ks: only the cluster id tells them apart
                await fresh.put("k", b"")
        with pytest.raises(ClusterChangedError, match=r"is a different cluster \(cluster id"):
            await ks.get("k")


async def test_answers_out_of_order_are_no_wiped_etcd(ks: KeySpace, etcd_url: str) -> None:
    """Concurrent calls' answers, and watch events, arrive in any order: one at a revision
    below another already seen is no sign of a wiped etcd unless it was asked after that."""

    async def cas() -> None:
        for _ in range(100):
            kv = await ks.get("c")
            await ks.txn([Compare("c", mod_revision=kv.mod_revision if kv else 0)], [Put("c", b"")])

    async with open_keyspace(etcd_url) as other:
        head = await ks.revision()
        watching = asyncio.create_task(collect(ks, "w/", head, head + 10**6))
        writes = [keyspace.put("w/k", b"") for keyspace in (ks, other) for _ in range(200)]
        await asyncio.gather(cas(), cas(), cas(), *writes)
        assert not watching.done(), watching  # still streaming: it raised nothing
        watching.cancel()
        await asyncio.wait([watching])


def unavailable_error(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details
    )


async def test_only_requests_that_never_left_are_retried_for_txn() -> None:
    ks = EtcdKeySpace([dead_endpoint()], retry_timeout=0.3)
    attempts: list[str] = []

    async def cut_off(details: str) -> None:
        attempts.append(details)
        raise unavailable_error(details)

    not_sent = "failed to connect to all addresses; last error: Connection refused"
    with pytest.raises(KeySpaceError, match=r"unavailable for 0\.3s"):
        await ks._call("txn", lambda _, __: cut_off(not_sent), idempotent=False)
    assert len(attempts) > 2, "a request that never left is retried"

    attempts.clear()
    with pytest.raises(
        KeySpaceError, match=r"txn: UNAVAILABLE .* may or may not have been applied"
    ):
        await ks._call("txn", lambda _, __: cut_off("Socket closed"), idempotent=False)
    assert len(attempts) == 1, "a txn that may have been applied is not repeated"

    attempts.clear()
    with pytest.raises(KeySpaceError, match=r"unavailable for 0\.3s: Socket closed"):
        await ks._call("get", lambda _, __: cut_off("Socket closed"))
    assert len(attempts) > 2, "reads are retried"
    await ks.close()


async def test_frozen_etcd_times_out_with_an_uncertain_txn(private_etcd: EtcdServer) -> None:
    async with open_keyspace(private_etcd.url("f/"), retry_timeout=1) as ks:
        await ks.revision()
        private_etcd.freeze()
        try:
            with pytest.raises(KeySpaceError, match="did not answer txn within 1s; it may or"):
                await ks.put("k", b"")
            with pytest.raises(KeySpaceError, match=r"did not answer get within 1s$"):
                await ks.get("k")
        finally:
            private_etcd.thaw()
        assert await ks.revision() >= 1


async def test_an_empty_header_is_no_other_cluster(etcd_url: str) -> None:
    """etcd's grpc-proxy answers some watch creates with an empty header (cluster id 0): no
    news about the cluster, not another one (which fails every call for good)."""
    from types import SimpleNamespace

    async with open_keyspace(etcd_url) as ks:
        await ks.revision()  # a real header: its cluster id is known from here on
        ks._check_cluster(SimpleNamespace(cluster_id=0, revision=0))
        await ks.put("still", b"fine")
