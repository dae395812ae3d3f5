"""A member keeps its lease while user code blocks its event loop (the keeper's own thread)."""

from __future__ import annotations

import time
from pathlib import Path

from streamkit.app.allocator import Allocator
from streamkit.app.assignment import MemberId, member_key
from streamkit.app.supervise import LoopFailure
from streamkit.keyspace import SQLiteKeySpace, open_keyspace

pytest_plugins = ["tests.etcdproc"]  # the etcd fixtures


async def test_a_blocked_event_loop_keeps_the_lease(tmp_path: Path) -> None:
    """The loop blocks for six lease TTLs (as a finalize_txn stuck in time.sleep would): the
    member key is still there afterwards, under the same lease, and nothing failed."""
    failures: list[LoopFailure] = []
    me = MemberId("zone", "a")
    ttl = 0.5
    async with SQLiteKeySpace(tmp_path / "ks.db") as keyspace:
        allocator = Allocator(keyspace, "/t", me, lease_ttl=ttl, on_failure=failures.append)
        await allocator.start()
        lease = allocator.lease
        time.sleep(6 * ttl)  # blocking on purpose: what is tested
        # Any KeySpace operation first expires lapsed leases (SQLiteKeySpace is lazy).
        async with SQLiteKeySpace(tmp_path / "ks.db") as other:
            kv = await other.get(member_key("/t", me))
        assert kv is not None, "the member's key lapsed while its event loop was blocked"
        assert kv.lease == lease == allocator.lease
        await allocator.leave()
    assert not failures


async def test_keepalives_stop_with_the_allocator(tmp_path: Path) -> None:
    """After close() (as after a crash) nobody keeps the lease: the key lapses within a TTL
    or two."""
    me = MemberId("zone", "b")
    ttl = 0.5
    async with SQLiteKeySpace(tmp_path / "ks.db") as keyspace:
        allocator = Allocator(keyspace, "/t", me, lease_ttl=ttl)
        await allocator.start()
        await allocator.close()
        deadline = time.monotonic() + 60  # liveness bound, not a speed claim
        while (kv := await keyspace.get(member_key("/t", me))) is not None:
            assert time.monotonic() < deadline, f"member key still there: {kv}"
            await keyspace.revision()
            time.sleep(ttl / 5)  # lets the lease age; the loop has nothing else to do


async def test_a_blocked_event_loop_keeps_an_etcd_lease(etcd_url: str) -> None:
    """The same with etcd: the keeper thread's own client (KeySpace.reopen) keeps the lease
    (etcd's TTLs are whole seconds and at least its minimum: block for three of them)."""
    me = MemberId("zone", "c")
    failures: list[LoopFailure] = []
    async with open_keyspace(etcd_url) as keyspace:
        allocator = Allocator(keyspace, "/t", me, lease_ttl=1.0, on_failure=failures.append)
        await allocator.start()
        lease = allocator.lease
        time.sleep(3.5)  # blocking on purpose: what is tested
        async with open_keyspace(etcd_url) as other:
            kv = await other.get(member_key("/t", me))
        assert kv is not None, "the member's key lapsed while its event loop was blocked"
        assert kv.lease == lease == allocator.lease
        await allocator.leave()
    assert not failures
