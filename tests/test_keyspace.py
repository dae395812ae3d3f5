"""KeySpace behaviour shared by instances and by OS processes.

Tests taking `keyspace`/`backend` run against both backends: SQLite files and
a real etcd (tests/etcdproc.py), each test under its own key prefix there. As
the etcd is shared, these tests count revisions from the one they start at.
The rest are about the SQLite backend only.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from streamkit.keyspace import (
    CompactedError,
    Compare,
    Delete,
    DeletePrefix,
    Event,
    KeySpace,
    KeySpaceError,
    KeySpaceURLError,
    LeaseNotFoundError,
    Put,
    SQLiteKeySpace,
    TxnResult,
    open_keyspace,
    sqlite_path,
)
from tests.waiting import DEADLINE

pytest_plugins = ["tests.etcdproc"]  # the etcd fixtures

ROOT = Path(__file__).resolve().parent.parent

# A second process working on the same keyspace URL. It prints "ready", waits
# for a line on stdin (so that several children start together), then runs a
# mode that prints one line per acknowledged write.
CHILD = """
import asyncio, sys
from streamkit.keyspace import Compare, Put, open_keyspace

async def counter(ks, name, n):
    done = 0
    while done < n:
        kv = await ks.get("counter")
        value = int(kv.value) + 1 if kv else 1
        guard = Compare("counter", mod_revision=kv.mod_revision if kv else 0)
        result = await ks.txn([guard], [Put("counter", str(value).encode())])
        if result.succeeded:
            done += 1
            print(result.revision, flush=True)

async def create(ks, name, n):
    for i in range(n):
        key = f"k/{i}"
        result = await ks.txn([Compare(key, mod_revision=0)], [Put(key, name.encode())])
        if result.succeeded:
            print(key, flush=True)

async def writes(ks, name, n):
    for i in range(n):
        print(await ks.put(f"w/{i}", name.encode()), flush=True)
        if i % 3 == 2:
            print(await ks.delete(f"w/{i - 1}"), flush=True)

async def main(url, mode, name, n):
    async with open_keyspace(url) as ks:
        print("ready", flush=True)
        sys.stdin.readline()
        await globals()[mode](ks, name, int(n))

asyncio.run(main(*sys.argv[1:]))
"""


@pytest.fixture
def db(tmp_path: Path) -> str:
    return str(tmp_path / "keyspace.db")


@pytest.fixture
async def ks(db: str) -> AsyncIterator[SQLiteKeySpace]:
    async with SQLiteKeySpace(db, poll_interval=0.01) as keyspace:
        yield keyspace


@dataclass
class Backend:
    """One store under test: `open` makes another instance on it, as another process would."""

    url: str
    options: dict[str, Any] = field(default_factory=dict)

    def open(self) -> KeySpace:
        return open_keyspace(self.url, **self.options)


@pytest.fixture(params=["sqlite", "etcd"])
def backend(request: pytest.FixtureRequest, db: str) -> Backend:
    if request.param == "sqlite":
        return Backend(db, {"poll_interval": 0.01})
    return Backend(request.getfixturevalue("etcd_url"))


@pytest.fixture
async def keyspace(backend: Backend) -> AsyncIterator[KeySpace]:
    async with backend.open() as opened:
        yield opened


async def collect(ks: KeySpace, prefix: str, after: int, until: int) -> list[Event]:
    """Watch `prefix` from `after` until an event at revision `until` arrives."""
    events: list[Event] = []
    async with asyncio.timeout(DEADLINE), contextlib.aclosing(ks.watch(prefix, after)) as watch:
        async for batch in watch:
            events.extend(batch)
            if batch[-1].revision >= until:
                return events
    raise AssertionError("watch ended")


def summary(events: list[Event]) -> list[tuple[str, str, int]]:
    return [(e.kind, e.kv.key, e.revision) for e in events]


async def spawn(url: str, mode: str, name: str, n: int) -> asyncio.subprocess.Process:
    """Start a child on keyspace `url` and wait until it has opened it."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CHILD,
        url,
        mode,
        name,
        str(n),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None
    assert await proc.stdout.readline() == b"ready\n"
    return proc


async def run_children(url: str, mode: str, n: int, count: int = 2) -> list[list[str]]:
    """Run `count` children in `mode` at once; returns each one's output lines."""
    procs = await asyncio.gather(*(spawn(url, mode, f"p{i}", n) for i in range(count)))
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
    outputs = await asyncio.gather(*(proc.communicate() for proc in procs))
    assert [proc.returncode for proc in procs] == [0] * count
    return [out.decode().split() for out, _ in outputs]


async def test_revisions_and_key_bookkeeping(keyspace: KeySpace) -> None:
    r = await keyspace.revision()
    assert await keyspace.put("a", b"1") == r + 1
    assert await keyspace.put("a", b"2") == r + 2
    assert await keyspace.put("b", b"x") == r + 3
    kv = await keyspace.get("a")
    assert kv is not None
    assert (kv.value, kv.create_revision, kv.mod_revision, kv.version) == (b"2", r + 1, r + 2, 2)

    assert await keyspace.delete("a") == r + 4
    assert await keyspace.get("a") is None
    assert await keyspace.delete("a") == r + 4, "deleting a missing key is not a write"
    assert await keyspace.put("a", b"3") == r + 5
    kv = await keyspace.get("a")
    assert kv is not None
    assert (kv.create_revision, kv.mod_revision, kv.version) == (r + 5, r + 5, 1)
    assert await keyspace.revision() == r + 5


async def test_txn_changes_share_one_revision(keyspace: KeySpace) -> None:
    r = await keyspace.put("x/old", b"")
    result = await keyspace.txn((), [Put("a", b"1"), Put("b", b"2"), DeletePrefix("x/")])
    assert result.succeeded and result.revision == r + 1
    kvs, revision = await keyspace.range("")
    assert revision == r + 1
    assert [(kv.key, kv.mod_revision) for kv in kvs] == [("a", r + 1), ("b", r + 1)]


async def test_create_only_and_compare_and_swap(keyspace: KeySpace) -> None:
    ks = keyspace
    r = await ks.revision()
    create = [Compare("k", mod_revision=0)]
    first = await ks.txn(create, [Put("k", b"v1")], [Put("lost", b"")])
    assert (first.succeeded, first.revision) == (True, r + 1)
    second = await ks.txn(create, [Put("k", b"v2")], [Put("lost", b"")])
    assert (second.succeeded, second.revision) == (False, r + 2)
    assert (await ks.get("k")).value == b"v1"  # type: ignore[union-attr]

    stale = await ks.txn([Compare("k", mod_revision=0)], [Put("k", b"stale")])
    assert (stale.succeeded, stale.revision) == (False, r + 2), "no branch ops: no new revision"
    swap = await ks.txn([Compare("k", mod_revision=r + 1)], [Put("k", b"v2")])
    assert swap == TxnResult(True, r + 3)

    held = [
        Compare("k", create_revision=r + 1),
        Compare("k", version=2),
        Compare("k", value=b"v2"),
        Compare("missing", create_revision=0),
    ]
    assert (await ks.txn(held, [Put("ok", b"")])).succeeded


async def test_failed_compare_applies_nothing_of_success(keyspace: KeySpace) -> None:
    ks = keyspace
    r = await ks.put("k", b"v")
    compares = [Compare("k", value=b"v"), Compare("missing", value=b"")]
    result = await ks.txn(compares, [Put("a", b""), Delete("k")])
    assert not result.succeeded
    assert await ks.get("a") is None and await ks.get("k") is not None
    assert await ks.revision() == r


@pytest.mark.parametrize(
    "ops",
    [
        [Put("a", b"1"), Put("a", b"2")],
        [Put("a", b"1"), Delete("a")],
        [Put("p/a", b"1"), DeletePrefix("p/")],
    ],
)
async def test_txn_rejects_order_dependent_ops(keyspace: KeySpace, ops: list[Put]) -> None:
    r = await keyspace.revision()
    with pytest.raises(KeySpaceError):
        await keyspace.txn((), ops)
    assert await keyspace.revision() == r


def test_compare_needs_exactly_one_target() -> None:
    with pytest.raises(ValueError):
        Compare("k")
    with pytest.raises(ValueError):
        Compare("k", mod_revision=1, value=b"")


async def test_range_by_prefix(keyspace: KeySpace) -> None:
    ks = keyspace
    r = await ks.revision()
    for key in ["b", "a/2", "ab", "a/10", "a/\u00e9", "a/1", "a\U0010ffff"]:
        await ks.put(key, key.encode())
    kvs, revision = await ks.range("a/")
    assert [kv.key for kv in kvs] == ["a/1", "a/10", "a/2", "a/\u00e9"]
    assert revision == r + 7
    assert [kv.key for kv in (await ks.range("a\U0010ffff"))[0]] == ["a\U0010ffff"]
    assert len((await ks.range(""))[0]) == 7


async def test_watch_sees_both_instances_in_order(keyspace: KeySpace, backend: Backend) -> None:
    ks = keyspace
    start = await ks.put("other/x", b"")
    async with backend.open() as second:
        watching = asyncio.create_task(collect(ks, "w/", start, start + 5))
        await ks.put("w/a", b"1")
        await second.put("w/b", b"2")
        await second.put("other/y", b"")
        await ks.delete("w/a")
        await second.txn((), [Put("w/c", b"3"), DeletePrefix("w/b")])
        events = await watching
    assert summary(events) == [
        ("put", "w/a", start + 1),
        ("put", "w/b", start + 2),
        ("delete", "w/a", start + 4),
        ("put", "w/c", start + 5),
        ("delete", "w/b", start + 5),
    ]
    assert events[1].kv.value == b"2" and events[2].kv.mod_revision == start + 4


async def test_watch_sees_writes_of_another_process(keyspace: KeySpace, backend: Backend) -> None:
    r = await keyspace.revision()
    watching = asyncio.create_task(collect(keyspace, "w/", r, r + 8))
    [lines] = await run_children(backend.url, "writes", 6, count=1)
    events = await watching
    assert [e.revision for e in events] == [int(line) for line in lines]
    assert [e.revision for e in events] == list(range(r + 1, r + 9))
    assert summary(events)[2:4] == [("put", "w/2", r + 3), ("delete", "w/1", r + 4)]


async def test_a_busy_sqlite_keyspace_polls_sooner(db: str) -> None:
    """Right after its head moved, an instance polls every BUSY_POLL, not every
    poll_interval: another instance's write in that second is seen at once."""
    async with SQLiteKeySpace(db, poll_interval=600) as ks, SQLiteKeySpace(db) as other:
        r = await ks.put("mine", b"")  # the head moved: busy
        watching = asyncio.create_task(collect(ks, "w/", r, r + 1))
        await asyncio.sleep(0.02)  # the watch is waiting on a poll by now
        await other.put("w/a", b"1")
        # (collect's DEADLINE is far below poll_interval)
        assert summary(await watching) == [("put", "w/a", r + 1)]


async def test_watch_from_the_future_waits(keyspace: KeySpace) -> None:
    r = await keyspace.put("a", b"")
    watching = asyncio.create_task(collect(keyspace, "", r + 1, r + 2))
    await keyspace.put("b", b"")
    await keyspace.put("c", b"")
    assert summary(await watching) == [("put", "c", r + 2)]


async def test_processes_never_lose_a_cas_increment(keyspace: KeySpace, backend: Backend) -> None:
    r = await keyspace.revision()
    outputs = await run_children(backend.url, "counter", 60)
    revisions = sorted(int(line) for lines in outputs for line in lines)
    assert revisions == list(range(r + 1, r + 121)), "every increment got its own revision"
    counter = await keyspace.get("counter")
    assert counter is not None and counter.value == b"120" and counter.version == 120


async def test_processes_never_both_win_a_create(keyspace: KeySpace, backend: Backend) -> None:
    r = await keyspace.revision()
    won = [set(lines) for lines in await run_children(backend.url, "create", 150)]
    assert not won[0] & won[1]
    assert won[0] | won[1] == {f"k/{i}" for i in range(150)}
    kvs, revision = await keyspace.range("k/")
    assert revision == r + 150
    assert all(kv.key in won[int(kv.value.decode()[1:])] for kv in kvs)


async def test_killed_writer_leaves_every_acknowledged_write(
    keyspace: KeySpace, backend: Backend
) -> None:
    ks = keyspace
    start = await ks.revision()
    proc = await spawn(backend.url, "writes", "p", 1_000_000)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(b"go\n")
    acked = [int(await proc.stdout.readline()) for _ in range(40)]
    proc.send_signal(signal.SIGKILL)
    await proc.wait()

    head = await ks.revision()
    assert head >= acked[-1]
    events = await collect(ks, "", start, head)
    assert [e.revision for e in events] == list(range(start + 1, head + 1))
    live: dict[str, bytes] = {}
    for e in events:
        if e.kind == "put":
            live[e.kv.key] = e.kv.value
        else:
            del live[e.kv.key]
    kvs, _ = await ks.range("")
    assert {kv.key: kv.value for kv in kvs} == live, "history replays to the current state"
    assert await ks.put("after", b"") == head + 1, "the dead writer holds no lock"


async def test_lease_expiry_deletes_keys_visibly(ks: SQLiteKeySpace, db: str) -> None:
    lease = await ks.grant(0.2)
    put_revision = await ks.put("member/a", b"", lease=lease)
    await ks.put("plain", b"")
    async with SQLiteKeySpace(db, poll_interval=0.01) as observer:
        events = await collect(observer, "member/", put_revision, put_revision + 2)
    assert summary(events) == [("delete", "member/a", put_revision + 2)]
    assert await ks.get("member/a") is None and await ks.get("plain") is not None
    assert not await ks.keepalive(lease)
    with pytest.raises(LeaseNotFoundError):
        await ks.put("member/b", b"", lease=lease)


class FakeClock:
    """Stands in for the `time` module of streamkit.keyspace.sqlite, whose leases expire by
    wall-clock time: the test moves time on, so a loaded machine cannot lapse a lease."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def time(self) -> float:
        return self.now


async def test_keepalive_holds_and_revoke_releases(
    ks: SQLiteKeySpace, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    monkeypatch.setattr("streamkit.keyspace.sqlite.time", clock)
    lease = await ks.grant(0.15)
    await ks.put("member/a", b"", lease=lease)
    for _ in range(5):
        clock.now += 0.1  # within the TTL of the last keepalive; 0.5 s in all, past the TTL
        assert await ks.keepalive(lease)
    assert await ks.get("member/a") is not None
    await ks.revoke(lease)
    assert await ks.get("member/a") is None
    assert await ks.revision() == 2
    await ks.revoke(lease)
    assert not await ks.keepalive(lease)


async def test_put_with_unknown_lease_fails_whole_txn(keyspace: KeySpace) -> None:
    r = await keyspace.revision()
    with pytest.raises(LeaseNotFoundError):
        await keyspace.txn((), [Put("a", b""), Put("b", b"", lease=12345)])
    assert await keyspace.get("a") is None and await keyspace.revision() == r


async def test_watch_from_compacted_revision_fails(db: str) -> None:
    async with SQLiteKeySpace(db, history_revisions=5) as ks:
        for i in range(10):
            await ks.put(f"k/{i}", b"")
        with pytest.raises(CompactedError) as info:
            await anext(ks.watch("k/", 3))
        assert info.value.compact_revision == 5
        events = await collect(ks, "k/", 5, 10)
        assert [e.revision for e in events] == [6, 7, 8, 9, 10]


async def test_cancelled_and_closed_watches_end_cleanly(backend: Backend) -> None:
    async def watch_forever(streaming: asyncio.Event) -> None:
        async with contextlib.aclosing(ks.watch("", r)) as watch:
            async for _ in watch:
                streaming.set()
        raise AssertionError("watch ended")

    ks = backend.open()
    r = await ks.revision()
    streaming = [asyncio.Event(), asyncio.Event()]
    cancelled = asyncio.create_task(watch_forever(streaming[0]))
    closed = asyncio.create_task(watch_forever(streaming[1]))
    await ks.put("a", b"")
    async with asyncio.timeout(DEADLINE):  # both watches are streaming: they saw the put
        await asyncio.gather(*(s.wait() for s in streaming))
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    await ks.close()
    with pytest.raises(KeySpaceError, match="closed"):
        await closed
    with pytest.raises(KeySpaceError, match="closed"):
        await ks.get("a")
    await ks.close()


async def test_open_keyspace_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for url in [f"sqlite://{tmp_path}/a.db", str(tmp_path / "nested" / "b.db")]:
        async with open_keyspace(url, poll_interval=0.01) as ks:
            assert isinstance(ks, SQLiteKeySpace)
            assert await ks.put("k", b"v") == 1
    assert sqlite_path(f"sqlite://{tmp_path}/a.db") == f"{tmp_path}/a.db"
    assert sqlite_path("etcd:/bad") is None, "the etcd backend's to check"
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir())
    mistyped = ["sqlite:x.db", "sqlite:/abs.db", "etcd:/bad"]  # errors, never file names
    for url in ["sqlite://relative.db", "redis://x", "etcd://no-port/", *mistyped]:
        with pytest.raises(KeySpaceURLError, match=re.escape(url)):
            open_keyspace(url)
    assert sorted(os.listdir()) == before
