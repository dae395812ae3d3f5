"""Replica rollover rules and fragment index selection, without a server."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from google.protobuf.duration_pb2 import Duration
from hypothesis import given, settings
from hypothesis import strategies as st

from streamkit.broker.index import FragmentIndex
from streamkit.broker.replica import Replica
from streamkit.protocol import pb
from tests import wire
from tests.waiting import DEADLINE, LIVENESS


async def _replica(tmp_path: Path, spec: pb.JournalSpec) -> tuple[Replica, list]:
    rolled: list = []
    replica = await Replica.open(spec, tmp_path, [], lambda r, s: rolled.append(s))
    return replica, rolled


async def _append(replica: Replica, data: bytes) -> None:
    txn = replica.spool.start_append()
    await txn.write(data)
    await txn.commit(None)
    replica.committed(replica.spool)


async def test_rolls_when_flush_interval_boundary_passes(tmp_path: Path) -> None:
    spec = wire.spec("roll/flush", length=1 << 20)
    spec.fragment.flush_interval.CopyFrom(Duration(seconds=60))
    replica, rolled = await _replica(tmp_path, spec)
    await _append(replica, b"x")
    first_ms = replica.spool.first_append_ms
    boundary = (first_ms // 60_000 + 1) * 60.0
    assert not replica.maybe_roll(now=boundary - 0.5)  # same interval: keep going
    assert replica.maybe_roll(now=boundary + 0.5)  # crossed the minute boundary
    assert [s.end for s in rolled] == [1] and replica.spool.begin == 1
    assert not replica.maybe_roll(now=boundary + 120)  # an empty spool never rolls


async def test_rolls_at_fragment_length_and_recovers_rolled_spools(tmp_path: Path) -> None:
    spec = wire.spec("roll/length", length=1024)
    replica, _rolled = await _replica(tmp_path, spec)
    await _append(replica, b"a" * 1000)
    assert not replica.maybe_roll()
    await _append(replica, b"b" * 100)  # a fragment may overshoot by one append
    assert replica.maybe_roll() and replica.spool.begin == 1100
    await replica.close()
    # Reopened: the rolled spool is handed back for persisting, the open one resumes.
    reopened, rolled_again = await _replica(tmp_path, spec)
    assert [(s.begin, s.end) for s in rolled_again] == [(0, 1100)]
    assert (reopened.spool.begin, reopened.write_head) == (1100, 1100)


def _fragment(begin: int, end: int, store: str = "") -> pb.Fragment:
    return pb.Fragment(journal="j/x", begin=begin, end=end, backing_store=store)


def test_index_prefers_the_longest_cover_then_local() -> None:
    index = FragmentIndex()
    for f in (_fragment(0, 100, "s"), _fragment(0, 300, "s"), _fragment(100, 300),
              _fragment(500, 600, "s"), _fragment(300, 400)):
        index.add(f)
    assert index.query(50).fragment.end == 300
    hit = index.query(150).fragment  # equal reach: the local spool wins (no decompression)
    assert (hit.begin, hit.end, hit.backing_store) == (100, 300, "")
    index.add(_fragment(100, 300))  # same local entry again: replaced, not duplicated
    assert len(index) == 5
    assert index.query(350).fragment.begin == 300
    jump = index.query(420)
    assert (jump.offset, jump.fragment.begin) == (500, 500)
    assert index.query(600) is None
    index.add(_fragment(300, 450))  # the local spool grew
    assert index.query(420).fragment.end == 450 and len(index) == 5


def _reference_query(fragments: list[pb.Fragment], offset: int) -> tuple[int, int, str, int] | None:
    """The lookup rule by brute force: the furthest-reaching cover (local first on ties;
    the first in (begin, end, store) order among equals), else the longest next one."""
    ordered = sorted(fragments, key=lambda f: (f.begin, f.end, f.backing_store))
    covers = [f for f in ordered if f.begin <= offset < f.end]
    if covers:
        best = max(covers, key=lambda f: (f.end, not f.backing_store))  # max: first of equals
        return best.begin, best.end, best.backing_store, offset
    later = [f for f in ordered if f.begin > offset]
    if not later:
        return None
    first = min(f.begin for f in later)
    best = max((f for f in later if f.begin == first), key=lambda f: (f.end, not f.backing_store))
    return best.begin, best.end, best.backing_store, best.begin


_INDEX_OPS = st.lists(st.tuples(
    st.sampled_from(["remote", "local", "remove_local", "relist"]),
    st.integers(0, 20), st.integers(1, 8), st.sampled_from(["s3://a/", "file:///"])),
    max_size=40)


@settings(max_examples=300, deadline=None)
@given(ops=_INDEX_OPS)
def test_index_lookups_match_the_brute_force_rule(ops: list[tuple[str, int, int, str]]) -> None:
    """Lookups bisect over kept prefix maxima; they answer as scanning every fragment does."""
    index = FragmentIndex()
    for op, at, length, store in ops:
        begin = at * 10
        if op == "remote":
            index.add(_fragment(begin, begin + length * 10, store))
        elif op == "local":
            index.add(_fragment(begin, begin + length * 10))
        elif op == "remove_local":
            index.remove_local(begin)
        else:  # a fresh store listing: some of the remote fragments again, and one more
            remote = [f for f in index.fragments() if f.backing_store][::2]
            index.replace_remote([*remote, _fragment(begin, begin + length * 10, store)])
        fragments = index.fragments()
        assert index.end == max((f.end for f in fragments), default=0)
        for offset in range(0, 300, 5):
            lookup = index.query(offset)
            got = None if lookup is None else (
                lookup.fragment.begin, lookup.fragment.end, lookup.fragment.backing_store,
                lookup.offset)
            assert got == _reference_query(fragments, offset), (offset, fragments)


async def _content_of(replica: Replica) -> bytes:
    spool = replica.spool
    return spool.read(spool.begin, spool.length, spool.end)


async def test_a_cancelled_append_still_commits_whole_before_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from streamkit.broker import spool as spool_module
    from streamkit.broker.appends import append

    real_sync = spool_module._sync_commit
    inside, disk_done = threading.Event(), threading.Event()

    def slow_sync(*args, **kwargs) -> None:
        inside.set()
        disk_done.wait(LIVENESS)  # a slow disk: the client gives up mid-commit
        real_sync(*args, **kwargs)

    monkeypatch.setattr(spool_module, "_sync_commit", slow_sync)
    replica, _ = await _replica(tmp_path, wire.spec("cancel/commit"))

    async def chunks(*parts: bytes):
        for part in parts:
            yield part

    request, header = pb.AppendRequest(journal="cancel/commit"), pb.Header()
    first = asyncio.create_task(append(replica, request, chunks(b"A" * 100), header))
    assert await asyncio.to_thread(inside.wait, DEADLINE), "the commit never synced"
    first.cancel()  # now inside the commit's fdatasync
    second_task = asyncio.create_task(append(replica, request, chunks(b"B" * 50), header))
    await asyncio.sleep(0)  # the second append queues up for the journal
    disk_done.set()
    second = await second_task
    # The first commit completed before the lock passed on: no overwrite.
    assert (second.commit.begin, second.commit.end) == (100, 150)
    seen = await _content_of(replica)
    assert seen == b"A" * 100 + b"B" * 50
    await replica.close()
    monkeypatch.setattr(spool_module, "_sync_commit", real_sync)
    reopened, _ = await _replica(tmp_path, wire.spec("cancel/commit"))
    assert await _content_of(reopened) == seen


async def test_rolled_back_large_chunk_never_lands_on_the_next_append(tmp_path: Path) -> None:
    from streamkit.broker.appends import RolledBack, append

    replica, _ = await _replica(tmp_path, wire.spec("cancel/rollback"))
    big = b"A" * (1 << 20)  # written by a worker thread

    async def then_fail():
        yield big
        raise RolledBack("client went away")

    with pytest.raises(RolledBack):
        await append(replica, pb.AppendRequest(journal="cancel/rollback"), then_fail(),
                     pb.Header())

    async def small():
        yield b"B" * 1000

    response = await append(replica, pb.AppendRequest(journal="cancel/rollback"), small(),
                            pb.Header())
    assert (response.commit.begin, response.commit.end) == (0, 1000)
    # A negative check (kept): no event marks "a late write did not happen"; give one time.
    await asyncio.sleep(0.2)  # a late write of the rolled-back chunk would land now
    assert await _content_of(replica) == b"B" * 1000
