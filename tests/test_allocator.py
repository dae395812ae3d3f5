"""The shard allocator: the pure solver and converge planner, then real members
sharing a SQLite KeySpace, in this event loop and in a killed child process."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamkit.app.allocator import Allocator, apply_changes, converge, plan_changes
from streamkit.app.assignment import (
    BACKFILL,
    FAILED,
    IDLE,
    PRIMARY,
    STANDBY,
    AllocState,
    MemberId,
    assignment_key,
    build_state,
    is_consistent,
    item_key,
    member_key,
    parse_assignment_key,
    parse_member_key,
)
from streamkit.app.solver import Placement, moves, placement_of, solve
from streamkit.keyspace import Delete, KeyValue, Put, SQLiteKeySpace
from streamkit.protocol import consumer_pb
from tests.waiting import DEADLINE, eventually

REPO = Path(__file__).resolve().parent.parent
ROOT = "/gazette/consumers/test"
A, B, C = MemberId("zone-a", "one"), MemberId("zone-b", "two"), MemberId("zone-c", "three")


def shard_spec(item: str, standbys: int = 0, disable: bool = False) -> bytes:
    return consumer_pb.ShardSpec(
        id=item, hot_standbys=standbys, disable=disable
    ).SerializeToString()


def status(code: int) -> bytes:
    return consumer_pb.ReplicaStatus(code=code).SerializeToString()


# -- an in-memory keyspace image, for the pure parts ---------------------------


class Image:
    """Keys as a KeySpace would hold them, with revisions, without a store."""

    def __init__(self) -> None:
        self.kvs: dict[str, KeyValue] = {}
        self.revision = 0

    def put(self, key: str, value: bytes, lease: int = 0) -> None:
        self.revision += 1
        old = self.kvs.get(key)
        create = old.create_revision if old else self.revision
        version = old.version + 1 if old else 1
        self.kvs[key] = KeyValue(key, value, create, self.revision, version, lease)

    def delete(self, key: str) -> None:
        self.revision += 1
        self.kvs.pop(key, None)

    def member(self, m: MemberId, limit: int = 0) -> None:
        spec = consumer_pb.ConsumerSpec(shard_limit=limit)
        spec.process_spec.id.zone, spec.process_spec.id.suffix = m.zone, m.suffix
        self.put(member_key(ROOT, m), spec.SerializeToString(), lease=hash(m) & 0xFFFF)

    def item(self, item: str, standbys: int = 0, disable: bool = False) -> None:
        self.put(item_key(ROOT, item), shard_spec(item, standbys, disable))

    def assign(self, item: str, m: MemberId, slot: int, code: int = IDLE) -> None:
        self.put(assignment_key(ROOT, item, m, slot), status(code), lease=hash(m) & 0xFFFF)

    def state(self) -> AllocState:
        return build_state(ROOT, self.kvs.values(), self.revision)

    def apply(self, ops: list) -> None:
        self.revision += 1
        for op in ops:
            if isinstance(op, Delete):
                self.kvs.pop(op.key, None)
        for op in ops:
            if isinstance(op, Put):
                self.put(op.key, op.value, op.lease)

    def settle_statuses(self) -> None:
        """What shard runtimes would report: slot 0 PRIMARY, others STANDBY (FAILED stays)."""
        for a in self.state().assignments:
            want = PRIMARY if a.slot == 0 else STANDBY
            if a.code not in (want, FAILED):
                self.put(a.key, status(want), a.lease)

    def converge(
        self, leader: MemberId, rounds: int = 20, prefer: Placement | None = None
    ) -> Placement:
        """Run plan/apply rounds (statuses settling in between) until nothing is left to do.

        Like the Allocator, each round's solve prefers the previous answer;
        returns the last one.
        """
        desired = prefer
        for _ in range(rounds):
            self.settle_statuses()
            desired = solve(self.state(), prefer=desired)
            changes = plan_changes(ROOT, self.state(), desired, leader)
            if not changes:
                return desired
            for change in changes:
                self.apply(change.ops)
        raise AssertionError("did not converge")


def loads(placement: dict[str, frozenset[MemberId]]) -> Counter[MemberId]:
    return Counter(m for members in placement.values() for m in members)


# -- keys ---------------------------------------------------------------------


def test_keys_round_trip() -> None:
    key = assignment_key(ROOT, "a/shard-001", A, 2)
    assert key == f"{ROOT}/assign/a/shard-001#zone-a#one#2"
    assert parse_assignment_key(ROOT, key) == ("a/shard-001", A, 2)
    assert parse_member_key(ROOT, member_key(ROOT, B)) == B
    assert parse_assignment_key(ROOT, f"{ROOT}/assign/x#y") is None
    assert parse_member_key(ROOT, f"{ROOT}/items/x") is None
    with pytest.raises(ValueError):
        MemberId("zone#a", "x")


def test_state_indexes_and_leader() -> None:
    img = Image()
    img.member(B)
    img.member(A)
    img.item("s1", standbys=1)
    img.assign("s1", A, 1, STANDBY)
    img.assign("s1", B, 0, PRIMARY)
    state = img.state()
    assert state.leader == B, "the oldest member key leads, whatever its name"
    assert [a.member for a in state.assignments_of("s1")] == [B, A]
    assert state.primary_of("s1") is not None and state.primary_of("s1").member == B
    assert [a.item for a in state.assignments_of_member(A)] == ["s1"]


# -- solver -------------------------------------------------------------------


def test_eight_shards_two_members_one_standby() -> None:
    img = Image()
    img.member(A)
    img.member(B)
    for i in range(8):
        img.item(f"shard-{i:03}", standbys=1)
    img.converge(A)
    state = img.state()
    assert all(len(state.assignments_of(f"shard-{i:03}")) == 2 for i in range(8))
    primaries = Counter(a.member for a in state.assignments if a.slot == 0)
    assert primaries == {A: 4, B: 4}, "new primaries are spread evenly"
    assert solve(state) == placement_of(state)


def test_disabled_shard_gets_nothing_and_loses_what_it_had() -> None:
    img = Image()
    img.member(A)
    img.member(B)
    img.item("on", standbys=1)
    img.item("off", disable=True)
    img.converge(A)
    assert img.state().assignments_of("off") == []
    img.item("on", standbys=1, disable=True)
    img.converge(A)
    assert img.state().assignments == []


def test_limits_are_hard_and_primaries_come_first() -> None:
    img = Image()
    img.member(A, limit=2)
    img.member(B, limit=1)
    for i in range(3):
        img.item(f"s{i}", standbys=1)
    desired = solve(img.state())
    assert loads(desired) == {A: 2, B: 1}
    assert all(len(members) == 1 for members in desired.values()), "one replica each first"


def test_replicas_of_a_shard_spread_over_zones() -> None:
    """Two zones of two members, a standby per shard: every shard has a replica in each
    zone, so losing a whole zone leaves each shard one (`serve --zone`). Zones are a
    preference below balance: with zones of unequal size, balance comes first."""
    img = Image()
    members = [MemberId(zone, f"{zone}-{i}") for zone in ("east", "west") for i in (1, 2)]
    for m in members:
        img.member(m)
    for i in range(6):
        img.item(f"s{i}", standbys=1)
    desired = solve(img.state())
    assert all({m.zone for m in chosen} == {"east", "west"} for chosen in desired.values()), \
        desired
    assert sorted(loads(desired).values()) == [3, 3, 3, 3]


def test_failed_primary_is_pinned() -> None:
    img = Image()
    img.member(A)
    img.member(B)
    img.item("s", standbys=0)
    img.item("t", standbys=0)
    img.assign("s", A, 0, FAILED)
    img.assign("t", A, 0, PRIMARY)
    desired = solve(img.state())
    assert desired["s"] == {A}, "a FAILED replica is never moved to rebalance"
    assert desired["t"] == {B}
    img.converge(A)
    assert img.state().primary_of("s").code == FAILED
    # Unassigning it (as `shards unassign` does) lets the allocator place it afresh.
    img.delete(img.state().primary_of("s").key)
    img.converge(A)
    assert img.state().primary_of("s").code == PRIMARY


def test_member_joining_moves_its_share_only() -> None:
    img = Image()
    img.member(A)
    img.member(B)
    for i in range(12):
        img.item(f"s{i:02}", standbys=1)
    img.converge(A)
    before = placement_of(img.state())
    img.member(C)
    after = solve(img.state())
    assert loads(after) == {A: 8, B: 8, C: 8}
    assert moves(before, after) == 8


# -- planner ------------------------------------------------------------------


def test_primaries_are_handed_off_to_even_out() -> None:
    img = Image()
    img.member(A)
    for i in range(4):
        img.item(f"s{i}", standbys=1)
    img.converge(A)
    assert Counter(a.member for a in img.state().assignments) == {A: 4}
    img.member(B)  # B joins after A became primary of everything
    img.converge(A)
    state = img.state()
    assert Counter(a.member for a in state.assignments if a.slot == 0) == {A: 2, B: 2}
    assert Counter(a.member for a in state.assignments) == {A: 4, B: 4}


def test_lost_primary_promotes_most_caught_up_standby() -> None:
    img = Image()
    for m in (A, B, C):
        img.member(m)
    img.item("s", standbys=2)
    img.assign("s", B, 1, BACKFILL)
    img.assign("s", C, 2, STANDBY)  # primary at A vanished with A's lease
    img.delete(member_key(ROOT, A))
    state = img.state()
    (change,) = plan_changes(ROOT, state, solve(state), B)
    standby_key = assignment_key(ROOT, "s", C, 2)
    promoted = assignment_key(ROOT, "s", C, 0)
    assert Delete(standby_key) in change.ops
    put = next(op for op in change.ops if isinstance(op, Put))
    assert put.key == promoted and put.value == status(STANDBY), "status carried over"
    assert change.compares[promoted].mod_revision == 0
    assert change.compares[standby_key].mod_revision == state.assignments_of("s")[1].mod_revision


def test_removal_waits_for_a_consistent_replacement() -> None:
    img = Image()
    img.member(A)
    img.item("s")
    img.assign("s", A, 0, PRIMARY)
    img.member(B)
    state = img.state()
    leader = A
    desired = {"s": frozenset({B})}
    (change,) = plan_changes(ROOT, state, desired, leader)
    assert [type(op) for op in change.ops] == [Put], "add the new replica, keep the primary"
    img.apply(change.ops)
    assert plan_changes(ROOT, img.state(), desired, leader) == [], "wait while B backfills"
    img.assign("s", B, 1, STANDBY)
    (change,) = plan_changes(ROOT, img.state(), desired, leader)
    img.apply(change.ops)
    (a,) = img.state().assignments_of("s")
    assert (a.member, a.slot, a.code) == (B, 0, STANDBY), "hand-off in one transaction"


# -- solver properties --------------------------------------------------------


@dataclass
class Scenario:
    members: dict[MemberId, int]  # limit
    items: dict[str, tuple[int, bool]]  # standbys, disabled
    current: dict[str, list[tuple[MemberId, int]]]  # member, status code

    def image(self, members: dict[MemberId, int] | None = None) -> Image:
        img = Image()
        for m, limit in (members if members is not None else self.members).items():
            img.member(m, limit)
        for item, (standbys, disabled) in self.items.items():
            img.item(item, standbys, disabled)
        for item, holders in self.current.items():
            for slot, (m, code) in enumerate(holders):
                img.assign(item, m, slot, code)
        return img

    def wanted(self, item: str) -> int:
        standbys, disabled = self.items[item]
        return 0 if disabled else min(1 + standbys, len(self.members))


@st.composite
def scenarios(draw: st.DrawFn, limits: bool = True) -> Scenario:
    n = draw(st.integers(1, 6))
    pool = [MemberId(f"zone-{i % 3}", f"m{i}") for i in range(8)]
    members = {
        m: (draw(st.sampled_from([0, 0, 1, 2, 4])) if limits else 0)
        for m in draw(st.lists(st.sampled_from(pool), min_size=n, max_size=n, unique=True))
    }
    items: dict[str, tuple[int, bool]] = {}
    current: dict[str, list[tuple[MemberId, int]]] = {}
    codes = st.sampled_from([IDLE, BACKFILL, STANDBY, STANDBY, PRIMARY, FAILED])
    for i in range(draw(st.integers(0, 16))):
        item = f"s{i:02}"
        items[item] = (draw(st.integers(0, 2)), draw(st.booleans()) and draw(st.booleans()))
        holders = draw(st.lists(st.sampled_from(pool), max_size=3, unique=True))
        current[item] = [(m, draw(codes)) for m in holders]
    return Scenario(members, items, current)


def no_failed(s: Scenario) -> Scenario:
    current = {i: [(m, c) for m, c in h if c != FAILED] for i, h in s.current.items()}
    return Scenario(s.members, s.items, current)


FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(scenarios(limits=False))
def test_unlimited_members_get_every_replica_evenly(s: Scenario) -> None:
    s = no_failed(s)
    desired = solve(s.image().state())
    for item, members in desired.items():
        assert len(members) == s.wanted(item)
    counts = [loads(desired)[m] for m in s.members]
    assert max(counts) - min(counts) <= 1


@FAST
@given(scenarios())
def test_limits_hold_and_capacity_is_used(s: Scenario) -> None:
    state = s.image().state()
    desired = solve(state)
    pinned = Counter(a.member for a in state.assignments if a.code == FAILED)
    load = loads(desired)
    active = sum(1 for i in s.items if s.wanted(i))
    for m, limit in s.members.items():
        assert load[m] <= max(limit or active, pinned[m])
    for item, members in desired.items():
        assert len(members) <= max(s.wanted(item), 0) or all(
            a.code == FAILED for a in state.assignments_of(item) if a.member in members
        )
    if not pinned:
        wants = {i: s.wanted(i) for i in s.items}
        caps = {m: min(limit or active, active) for m, limit in s.members.items()}
        assert sum(load.values()) == max_flow(wants, caps)
        # Every shard gets a first replica before any gets a second.
        if any(len(m) > 1 for m in desired.values()):
            assert all(desired[i] for i in s.items if s.wanted(i))


def max_flow(wants: dict[str, int], caps: dict[MemberId, int]) -> int:
    """Most replicas placeable at distinct members within caps (plain Ford-Fulkerson)."""
    held: dict[str, set[MemberId]] = {i: set() for i in wants}
    load = Counter[MemberId]()
    total = 0
    for item, want in wants.items():
        for _ in range(want):
            # DFS over members for a path item -> m1 (-j1-> m2 ...) ending with room.
            def search(i: str, seen: set[MemberId]) -> bool:
                for m in caps:
                    if m in held[i] or m in seen:
                        continue
                    seen.add(m)
                    if load[m] < caps[m]:
                        held[i].add(m)
                        load[m] += 1
                        return True
                    for j in [j for j in held if m in held[j]]:
                        held[j].discard(m)
                        held[i].add(m)
                        if search(j, seen):
                            return True
                        held[i].discard(m)
                        held[j].add(m)
                return False

            if search(item, set()):
                total += 1
    return total


@FAST
@given(scenarios())
def test_solution_is_a_fixed_point_in_flight_and_after(s: Scenario) -> None:
    """No flapping: mid-way and at the end, solving again gives the same answer.

    FAILED replicas are left out: removing a FAILED standby legitimately frees
    its member for that shard, which can improve the next answer (once).
    """
    s = no_failed(s)
    img = s.image()
    first = solve(img.state())
    # Mid-way: one converge step applied; new replicas are IDLE, and removals
    # that wait for them to catch up haven't happened.
    for change in plan_changes(ROOT, img.state(), first, min(s.members)):
        img.apply(change.ops)
    assert solve(img.state(), prefer=first) == first
    # Converged.
    img.converge(min(s.members), prefer=first)
    assert placement_of(img.state()) == first
    assert solve(img.state()) == first, "a settled placement needs no memory"


@FAST
@given(scenarios())
def test_converging_reaches_a_fixed_point(s: Scenario) -> None:
    img = s.image()
    desired = img.converge(min(s.members))
    assert placement_of(img.state()) == desired
    assert solve(img.state(), prefer=desired) == desired


@FAST
@given(scenarios(limits=False), st.integers(0, 7))
def test_joining_and_leaving_move_a_fair_share(s: Scenario, pick: int) -> None:
    s = no_failed(s)
    img = s.image()
    img.converge(min(s.members))
    before = placement_of(img.state())
    total = sum(len(m) for m in before.values())
    newcomer = MemberId("zone-x", f"new{pick}")
    img.member(newcomer)
    after = solve(img.state())
    grown = sum(len(m) for m in after.values())
    share = math.ceil(grown / (len(s.members) + 1))
    assert loads(after)[newcomer] >= grown // (len(s.members) + 1)
    # Mostly exactly its share; a second hop happens when two members shed the
    # same shard (preferred to moving a primary). Standbys that were impossible
    # with fewer members may appear anywhere.
    assert moves(before, after) <= 2 * share + grown - total
    # Leaving: the leaver's replicas move, plus at most one hop each when the
    # distinct-member rule forces one.
    leaver = sorted(s.members)[pick % len(s.members)]
    img = s.image()
    img.converge(min(s.members))
    img.delete(member_key(ROOT, leaver))
    for a in img.state().assignments_of_member(leaver):
        img.delete(a.key)
    after = solve(img.state())
    assert moves(before, after) <= 2 * loads(before)[leaver]


def consistent(state: AllocState, item: str) -> int:
    primary = state.primary_of(item)
    code = primary.code if primary else None
    return sum(1 for a in state.assignments_of(item) if is_consistent(a, code))


@FAST
@given(scenarios())
def test_converge_steps_never_drop_below_wanted_consistency(s: Scenario) -> None:
    # Assignments share their member's lease, so none outlive their member.
    s.current = {i: [(m, c) for m, c in h if m in s.members] for i, h in s.current.items()}
    img = s.image()
    img.settle_statuses()
    leader = min(s.members)
    desired = None
    for _ in range(20):
        state = img.state()
        desired = solve(state, prefer=desired)
        changes = plan_changes(ROOT, state, desired, leader)
        if not changes:
            break
        for change in changes:
            # Consistency as Gazette counts it.
            ok_before = consistent(state, change.item)
            img.apply(change.ops)
            after = img.state().assignments_of(change.item)
            ok_after = consistent(img.state(), change.item)
            primary = state.primary_of(change.item)
            code = primary.code if primary else None
            # Replicas that are FAILED (and not counted consistent) are never waited for.
            want = len(desired.get(change.item, ())) - sum(
                1
                for a in state.assignments_of(change.item)
                if a.code == FAILED
                and not is_consistent(a, code)
                and a.member in desired.get(change.item, ())
            )
            if {a.member for a in after} == {a.member for a in state.assignments_of(change.item)}:
                # A primary hand-off: the old primary restarts as an IDLE standby.
                assert ok_after >= ok_before - 1
            else:
                assert ok_after >= min(ok_before, want), "a removal lost a consistent replica"
            assert len({a.member for a in after}) == len(after)
            assert sum(1 for a in after if a.slot == 0) <= 1
        img.settle_statuses()
    else:
        raise AssertionError("did not converge")
    assert placement_of(img.state()) == solve(img.state(), prefer=desired)


# -- real members over a SQLite KeySpace --------------------------------------


async def drive(alloc: Allocator) -> None:
    """Stand in for the shard runtime: report slot 0 PRIMARY, others STANDBY."""
    revision = -1
    while True:
        state = await alloc.wait_for_change(revision)
        revision = state.revision
        for a in state.assignments_of_member(alloc.member):
            want = PRIMARY if a.slot == 0 else STANDBY
            if a.code not in (want, FAILED):
                await alloc.update_status(a, consumer_pb.ReplicaStatus(code=want))


@contextlib.asynccontextmanager
async def member(
    db: Path, m: MemberId, *, ttl: float = 1.0, limit: int = 0, expect: int = 1
) -> AsyncIterator[Allocator]:
    """A member with its own KeySpace connection and a status driver."""
    async with SQLiteKeySpace(db) as ks:
        alloc = Allocator(ks, ROOT, m, consumer_pb.ConsumerSpec(shard_limit=limit), lease_ttl=ttl,
                          expect_members=expect)
        await alloc.start()
        driver = asyncio.create_task(drive(alloc))
        try:
            yield alloc
        finally:
            driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await driver
            await alloc.close()


def settled(items: list[str], members: set[MemberId]) -> Callable[[AllocState], bool]:
    """Each item fully replicated over `members`, statuses PRIMARY/STANDBY by slot,
    primaries spread evenly."""
    want = min(2, len(members))

    def check(state: AllocState) -> bool:
        for item in items:
            got = state.assignments_of(item)
            if len(got) != want or {a.member for a in got} - members:
                return False
            if any(a.code != (PRIMARY if a.slot == 0 else STANDBY) for a in got):
                return False
            if state.primary_of(item) is None:
                return False
        # Primaries spread evenly (hand-offs done).
        per = Counter(a.member for a in state.assignments if a.slot == 0)
        counts = [per[m] for m in members]
        return max(counts) - min(counts) <= 1

    return check


async def wait(
    alloc: Allocator, predicate: Callable[[AllocState], bool], timeout: float = DEADLINE
):
    """Until `alloc`'s view satisfies `predicate`. The deadline only bounds a broken test:
    how fast the allocator converges is a measurement (bench/), printed here at most."""
    async with asyncio.timeout(timeout):
        return await alloc.wait_for(predicate)


@pytest.fixture
async def ks(tmp_path: Path) -> AsyncIterator[SQLiteKeySpace]:
    async with SQLiteKeySpace(tmp_path / "ks.db") as ks:
        yield ks


async def put_shards(ks: SQLiteKeySpace, n: int, standbys: int = 1) -> list[str]:
    items = [f"shard-{i:03}" for i in range(n)]
    for item in items:
        await ks.put(item_key(ROOT, item), shard_spec(item, standbys))
    return items


async def test_two_members_share_eight_shards(ks: SQLiteKeySpace, tmp_path: Path) -> None:
    items = await put_shards(ks, 8)
    async with member(tmp_path / "ks.db", A) as a, member(tmp_path / "ks.db", B) as b:
        state = await wait(a, settled(items, {A, B}))
        assert a.is_leader and not b.is_leader
        assert Counter(a.member for a in state.assignments if a.slot == 0) == {A: 4, B: 4}
        assert len(state.assignments_of_member(A)) == len(state.assignments_of_member(B)) == 8
        # Every assignment key is under its own member's lease.
        leases = {m: state.member_kv(m).lease for m in (A, B)}
        assert all(x.lease == leases[x.member] for x in state.assignments)


async def test_members_started_together_get_their_shares_at_once(
        ks: SQLiteKeySpace, tmp_path: Path) -> None:
    """With `expect_members`, the leader makes no assignment until the expected members
    joined: the first assignment is already balanced, and nothing moves afterwards."""
    await put_shards(ks, 8, standbys=0)
    async with member(tmp_path / "ks.db", A, expect=2) as a:
        await asyncio.sleep(0.3)
        assert a.is_leader and not a.state.assignments  # waiting for the second member
        async with member(tmp_path / "ks.db", B, expect=2):
            state = await wait(a, lambda s: len(s.assignments) == 8)
            first = {x.item: x.member for x in state.assignments}
            assert Counter(first.values()) == {A: 4, B: 4}
            await asyncio.sleep(0.3)
            assert {x.item: x.member for x in a.state.assignments} == first


async def test_graceful_leave_promotes_standbys(ks: SQLiteKeySpace, tmp_path: Path) -> None:
    items = await put_shards(ks, 8)
    db = tmp_path / "ks.db"
    async with member(db, A) as a:
        async with member(db, B) as b:
            await wait(a, settled(items, {A, B}))
            handed = {x.item for x in a.state.assignments if x.slot == 0 and x.member == B}
            start = await ks.revision()
            t0 = time.monotonic()
            await b.leave()
        await wait(a, settled(items, {A}))
        elapsed = time.monotonic() - t0
        print(f"graceful leave: all primaries at A after {elapsed * 1000:.0f} ms")
        # The slot-0 keys of B's former shards first appeared as STANDBY: promoted, not fresh.
        kvs_seen: dict[str, bytes] = {}
        async with contextlib.aclosing(ks.watch(f"{ROOT}/assign/", start)) as events:
            async with asyncio.timeout(DEADLINE):
                async for batch in events:
                    for e in batch:
                        if e.kind == "put":
                            kvs_seen.setdefault(e.kv.key, e.kv.value)
                    if all(assignment_key(ROOT, i, A, 0) in kvs_seen for i in handed):
                        break
        assert {kvs_seen[assignment_key(ROOT, i, A, 0)] for i in handed} == {status(STANDBY)}


async def test_crashed_leader_is_replaced(ks: SQLiteKeySpace, tmp_path: Path) -> None:
    items = await put_shards(ks, 4)
    db = tmp_path / "ks.db"
    async with member(db, A, ttl=0.6) as a, member(db, B, ttl=0.6) as b:
        await wait(b, settled(items, {A, B}))
        assert a.is_leader
        t0 = time.monotonic()
        await a.close()  # stops keepalives: A's keys linger until the lease lapses
        await wait(b, settled(items, {B}))
        print(f"leader crash: B primary for all after {time.monotonic() - t0:.2f} s (ttl 0.6)")
        assert b.is_leader


CHILD = """
import asyncio, sys
from streamkit.app.allocator import Allocator
from streamkit.app.assignment import MemberId, PRIMARY, STANDBY
from streamkit.keyspace import SQLiteKeySpace
from streamkit.protocol import consumer_pb

async def main(db, root, zone, suffix, ttl):
    async with SQLiteKeySpace(db) as ks:
        alloc = Allocator(ks, root, MemberId(zone, suffix), lease_ttl=float(ttl))
        await alloc.start()
        print("ready", flush=True)
        revision = -1
        while True:
            state = await alloc.wait_for_change(revision)
            revision = state.revision
            for a in state.assignments_of_member(alloc.member):
                want = PRIMARY if a.slot == 0 else STANDBY
                if a.code != want:
                    await alloc.update_status(a, consumer_pb.ReplicaStatus(code=want))

asyncio.run(main(*sys.argv[1:]))
"""


@pytest.mark.parametrize("child_leads", [False, True], ids=["follower-killed", "leader-killed"])
async def test_killed_process_fails_over_to_standby(
    ks: SQLiteKeySpace, tmp_path: Path, child_leads: bool
) -> None:
    items = await put_shards(ks, 8)
    db = tmp_path / "ks.db"
    ttl = 1.0

    async def spawn() -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            CHILD,
            str(db),
            ROOT,
            B.zone,
            B.suffix,
            str(ttl),
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert proc.stdout is not None
        assert await proc.stdout.readline() == b"ready\n"
        return proc

    proc = await spawn() if child_leads else None
    try:
        async with member(db, A, ttl=ttl) as a:
            proc = proc or await spawn()
            await wait(a, settled(items, {A, B}))
            assert a.is_leader is not child_leads
            lost = {x.item for x in a.state.assignments if x.slot == 0 and x.member == B}
            assert len(lost) == 4
            proc.send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            await proc.wait()

            def promoted(state: AllocState) -> bool:
                return all((p := state.primary_of(i)) is not None and p.member == A for i in lost)

            await wait(a, promoted)
            elapsed = time.monotonic() - t0
            print(
                f"SIGKILL ({'leader' if child_leads else 'follower'}): promoted in {elapsed:.2f} s"
            )
            assert a.is_leader
            await wait(a, settled(items, {A}))
    finally:
        if proc and proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_deposed_leader_cannot_write(ks: SQLiteKeySpace, tmp_path: Path) -> None:
    items = await put_shards(ks, 4)
    db = tmp_path / "ks.db"
    async with member(db, A) as a, member(db, B) as b:
        await wait(b, settled(items, {A, B}))
        stale = a.state
        assert stale.leader == A
        await a.close()
        await ks.revoke(a.lease)  # as if A's lease lapsed while it was paused
        await wait(b, settled(items, {B}))
        # A wakes up believing it still leads, with a view in which work is due.
        await ks.put(item_key(ROOT, "shard-new"), shard_spec("shard-new"))
        new_kv = await ks.get(item_key(ROOT, "shard-new"))
        assert new_kv is not None
        view = AllocState(
            {**stale.items, "shard-new": consumer_pb.ShardSpec(id="shard-new")},
            stale.members,
            stale.assignments,
            stale.revision,
        )
        changes = plan_changes(ROOT, view, solve(view), A)
        assert changes, "the stale view has work to do"
        head = await ks.revision()
        assert await apply_changes(ks, changes) == (False, 0)
        assert await converge(ks, ROOT, view, A) == (False, 0)
        assert await ks.revision() == head, "nothing was written"
        # The live leader places it.
        await wait(b, lambda s: s.primary_of("shard-new") is not None)


async def test_disabling_a_shard_unassigns_it(ks: SQLiteKeySpace, tmp_path: Path) -> None:
    items = await put_shards(ks, 3)
    await ks.put(item_key(ROOT, "off"), shard_spec("off", disable=True))
    db = tmp_path / "ks.db"
    async with member(db, A) as a, member(db, B):
        await wait(a, settled(items, {A, B}))
        assert a.state.assignments_of("off") == []
        await ks.put(item_key(ROOT, items[0]), shard_spec(items[0], 1, disable=True))
        await wait(a, lambda s: s.assignments_of(items[0]) == [])
        await ks.put(item_key(ROOT, items[0]), shard_spec(items[0], 1))
        await wait(a, settled(items, {A, B}))


async def test_failed_primary_stays_until_unassigned(ks: SQLiteKeySpace, tmp_path: Path) -> None:
    items = await put_shards(ks, 2)
    db = tmp_path / "ks.db"
    async with member(db, A) as a, member(db, B):
        await wait(a, settled(items, {A, B}))
        primary = a.state.primary_of(items[0])
        assert primary is not None
        failed = consumer_pb.ReplicaStatus(code=FAILED, errors=["boom"])
        assert await a.update_status(primary, failed) is not None
        async with member(db, C):
            # Rebalancing onto C happens around the failure: until C serves its share.
            await wait(
                a,
                lambda s: (
                    bool(mine := s.assignments_of_member(C))
                    and all(x.code == (PRIMARY if x.slot == 0 else STANDBY) for x in mine)
                ),
            )
            kept = a.state.primary_of(items[0])
            assert kept is not None and kept.key == primary.key and kept.code == FAILED
            assert list(kept.status.errors) == ["boom"]
            # Unassign: delete the FAILED assignment; a standby takes over, and the shard
            # settles at one primary and one standby (rebalancing onto C may still add one
            # before it removes one: poll for the settled state, not for the first primary).
            await ks.delete(primary.key)
            await wait(
                a,
                lambda s: (
                    (p := s.primary_of(items[0])) is not None
                    and p.code == PRIMARY
                    and p.member != primary.member
                    and len(s.assignments_of(items[0])) == 2
                ),
            )


async def test_update_status_is_guarded(ks: SQLiteKeySpace, tmp_path: Path) -> None:
    items = await put_shards(ks, 1, standbys=0)
    async with member(tmp_path / "ks.db", A) as a:
        state = await wait(a, settled(items, {A}))
        (x,) = state.assignments
        newer = await a.update_status(x, consumer_pb.ReplicaStatus(code=PRIMARY))
        assert newer is not None and newer.mod_revision > x.mod_revision
        assert await a.update_status(x, consumer_pb.ReplicaStatus(code=STANDBY)) is None


async def test_shard_limit_is_respected(ks: SQLiteKeySpace, tmp_path: Path) -> None:
    items = await put_shards(ks, 6, standbys=0)
    db = tmp_path / "ks.db"
    async with member(db, A, limit=1) as a, member(db, B):
        state = await wait(a, lambda s: all(s.primary_of(i) for i in items))
        assert len(state.assignments_of_member(A)) == 1
        assert len(state.assignments_of_member(B)) == 5


async def test_a_second_member_of_the_same_name_waits_saying_why(
        ks: SQLiteKeySpace, caplog: pytest.LogCaptureFixture) -> None:
    """A member started under the name of one that runs waits for its key; it said only
    that the key "exists", not that the other member holds it, nor what to do."""
    name = MemberId("zone", "twice")
    async with Allocator(ks, ROOT, name, lease_ttl=5.0):
        second = Allocator(ks, ROOT, name, lease_ttl=5.0)
        starting = asyncio.create_task(second.start())
        await eventually(lambda: any("give this one another --suffix" in r.getMessage()
                                     for r in caplog.records), 10, "the warning")
        assert not starting.done()
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
