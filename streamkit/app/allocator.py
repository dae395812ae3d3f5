"""Shard allocation: membership, leader election, and converging assignments.

Every consumer process runs an `Allocator`. It announces the process as a
member (a key under its own lease, kept alive in the background), and keeps
`state` current from a watch over the application's root. The member with
the oldest key is the leader: on every change it solves the desired
placement (`streamkit.app.solver.solve`) and writes the difference as
KeySpace transactions (`plan_changes`, `apply_changes`):

* new replicas are put under the *assigned* member's lease, so they vanish
  with that process;
* a replica is removed only while enough consistent replicas remain
  (`assignment.is_consistent`), so a move never opens a gap in hot
  standbys: the new replica first catches up, then the old one goes;
* a shard without a slot-0 assignment gets one by promoting its most
  caught-up standby (delete the standby key, create the slot-0 key with the
  same status), which is how failover happens when a primary's lease
  expires;
* a member holding two or more primaries more than another member that
  stands by for one of them hands that primary over (`_plan_handoff`);
* every transaction compares the leader's own member key and every key the
  decision read, so a deposed leader, or one deciding on stale state,
  writes nothing.

Failover latency is about the lease TTL: a dead process's lease lapses
`lease_ttl` after its last keepalive; the next KeySpace operation by anyone
deletes its keys (SQLiteKeySpace expires lazily, and every live allocator's
watch polls the store every `poll_interval`); the leader then promotes
within one settle delay plus one transaction.

The three background loops run supervised (`streamkit.app.supervise`), each
with its own policy on a crash:

* keepalive: never restarted. The keepalives themselves are sent from a thread
  of their own (`LeaseKeeper`), so that a hook blocking the event loop doesn't
  cost the member its lease; this loop watches what the thread heard. A
  keepalive the KeySpace answers "expired" (the
  process was paused past its lease) announces the member again under a new
  lease: its old assignments went with the old one, and once the watch shows
  them gone the member stops those replicas. Keepalives that fail (an error,
  or no answer) for `DOUBT` of `lease_ttl` since the last one the KeySpace
  answered put the lease *in doubt* (`lease_in_doubt`): it may lapse any
  moment as far as the others know, and a KeySpace this member can't reach
  won't tell it when, so the member stops serving its shards at once, before
  the lease can expire and the others take them over. A keepalive answered
  again ends the doubt (the lease lived: an etcd restart or leader change
  extends leases, and the member serves its assignments again), or finds the
  lease expired (announce again, as above). Only a KeySpace silent for
  `KEYSPACE_PATIENCE` seconds past the TTL raises `LeaseLost`: an outage that
  long is the operator's to see. Time the process itself was frozen (the loop's
  sleep overslept by more than the TTL) is not the KeySpace's silence: the lease
  is doubted at once, and a keepalive has the TTL plus `KEYSPACE_PATIENCE`
  afresh from the thaw to be answered. `LeaseLost`, like any other crash,
  gives the allocator up (below).
* watch and converge: restarted with backoff (`RESTART`); they rebuild their
  state on starting (the watch reads the KeySpace afresh, converge plans from
  the current state), so a transient bug costs a pause. After too many quick
  crashes in a row they are given up on as well. KeySpace errors are expected
  and retried inside the loops, without counting as crashes.

Giving up stops all three loops at once, so the lease lapses if nobody
revokes it sooner, and calls `on_failure`: a `Member` then stops its shards
and revokes the lease, and the process exits non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

from streamkit.app.assignment import (
    FAILED,
    PRIMARY,
    STANDBY,
    AllocState,
    Assignment,
    MemberId,
    assignment_key,
    build_state,
    is_consistent,
    member_key,
)
from streamkit.app.lease_keeper import LeaseKeeper
from streamkit.app.peer_watch import refuses
from streamkit.app.solver import Placement, solve
from streamkit.app.supervise import LoopFailure, Restart, supervised
from streamkit.errors import StreamkitError
from streamkit.keyspace import (
    ClusterChangedError,
    CompactedError,
    Compare,
    Delete,
    KeySpace,
    KeySpaceError,
    KeyValue,
    Op,
    Put,
)
from streamkit.protocol import consumer_pb
from streamkit.tasks import wait_finished

log = logging.getLogger(__name__)

# Items per converge transaction; a failed batch is retried item by item.
BATCH_ITEMS = 32
# The part of its TTL a lease may go without an answered keepalive before it is in doubt and
# the member stops serving its shards: the keeper sends one every TTL/6, leaving over half
# the TTL for one to be answered on a busy machine; the keepalive loop looks every TTL/20,
# so the shards stop by 0.8 TTL, before the lease can lapse.
DOUBT = 3 / 4
# Seconds past its TTL that a lease may go unanswered before the member gives it up
# (`LeaseLost`) rather than wait, not serving, for the KeySpace to come back.
KEYSPACE_PATIENCE = 10.0
# At most this long a new leader holds its first assignment back for expected members.
EXPECT_PATIENCE = 10.0
# The first pause before watching the KeySpace again after an error (doubling to 1 s).
_WATCH_RETRY = 0.1
# How the watch and converge loops are restarted after a crash.
RESTART = Restart()


class LeaseLost(StreamkitError):
    """No keepalive was answered for long past a lease's TTL: the KeySpace is out of reach,
    and the others may have taken the member's shards."""


@dataclass
class ItemChange:
    """The writes that move one item toward its desired placement, and their guard."""

    item: str
    compares: dict[str, Compare] = field(default_factory=dict)
    ops: list[Op] = field(default_factory=list)

    def guard(self, kv: KeyValue | None, key: str) -> None:
        self.compares[key] = Compare(key, mod_revision=kv.mod_revision if kv else 0)


def plan_changes(
    root: str, state: AllocState, desired: Placement, leader: MemberId
) -> list[ItemChange]:
    """Writes taking `state` one safe step toward `desired`, one change per item.

    Safe means: removals keep at least as many consistent replicas as the
    item wants; a primary is replaced by promoting an existing replica when
    one is usable. The plan is a step, not the whole way: the leader plans
    again when the statuses it waits on change.
    """
    leader_kv = state.member_kv(leader)
    if leader_kv is None:
        return []
    primaries = Counter(a.member for a in state.assignments if a.slot == 0)
    changes = []
    settled = []
    for item in sorted(set(state.items) | set(state.assigned_items())):
        change = _plan_item(root, state, item, desired.get(item, frozenset()), primaries)
        if change.ops:
            changes.append(change)
        else:
            settled.append(change)
    for change in settled:
        _plan_handoff(root, state, change, desired.get(change.item, frozenset()), primaries)
        if change.ops:
            changes.append(change)
    for change in changes:
        change.guard(leader_kv, leader_kv.key)
    return changes


def _plan_handoff(
    root: str,
    state: AllocState,
    change: ItemChange,
    wanted: frozenset[MemberId],
    primaries: Counter[MemberId],
) -> None:
    """Swap a settled item's primary with a standby when that evens out primaries.

    Without this, whoever starts first stays primary of everything that has
    standbys, and the others only tail logs. Only settled items qualify (the
    placement matches, the primary is PRIMARY, the standby is STANDBY), and
    only when the two members' primary counts differ by two or more, so each
    swap strictly evens the spread and swaps can't go back and forth.
    """
    current = state.assignments_of(change.item)
    primary = state.primary_of(change.item)
    if primary is None or primary.code != PRIMARY or {a.member for a in current} != wanted:
        return
    standbys = [a for a in current if a.slot != 0 and a.code == STANDBY]
    if not standbys:
        return
    best = min(standbys, key=lambda a: (primaries[a.member], a.slot))
    if primaries[primary.member] - primaries[best.member] < 2:
        return
    up_kv, down_kv = state.member_kv(best.member), state.member_kv(primary.member)
    assert up_kv is not None and down_kv is not None
    up_key = assignment_key(root, change.item, best.member, 0)
    down_key = assignment_key(root, change.item, primary.member, best.slot)
    change.ops += [
        Delete(primary.key),
        Delete(best.key),
        Put(up_key, best.status.SerializeToString(), up_kv.lease),
        Put(down_key, b"", down_kv.lease),  # back to IDLE: it must catch up as a standby
    ]
    change.guard(None, up_key)
    change.guard(None, down_key)
    change.guard(up_kv, up_kv.key)
    change.guard(down_kv, down_kv.key)
    primaries[primary.member] -= 1
    primaries[best.member] += 1


def _plan_item(
    root: str,
    state: AllocState,
    item: str,
    wanted: frozenset[MemberId],
    primaries: Counter[MemberId],
) -> ItemChange:
    change = ItemChange(item)
    current = state.assignments_of(item)
    for a in current:
        change.compares[a.key] = Compare(a.key, mod_revision=a.mod_revision)
    primary = state.primary_of(item)
    primary_code = primary.code if primary else None

    # Removals. Replicas of departed members, and duplicates, go unconditionally;
    # unwanted ones only while enough consistent replicas stay behind.
    removed: set[str] = set()
    pool: list[Assignment] = []
    seen: set[MemberId] = set()
    for a in current:
        if a.member not in state.members or a.member in seen:
            removed.add(a.key)
        else:
            pool.append(a)
        seen.add(a.member)
    unwanted = sorted(
        (a for a in pool if a.member not in wanted),
        key=lambda a: (is_consistent(a, primary_code), -a.slot),
    )
    # Wanted replicas that are FAILED (and not counted consistent) will never
    # catch up, so waiting for them would wait forever.
    hopeless = sum(
        1
        for a in pool
        if a.member in wanted and a.code == FAILED and not is_consistent(a, primary_code)
    )
    need = len(wanted) - hopeless
    for a in unwanted:
        left = sum(
            1
            for c in pool
            if c is not a and c.key not in removed and is_consistent(c, primary_code)
        )
        if not is_consistent(a, primary_code) or left >= need:
            removed.add(a.key)
    change.ops.extend(Delete(a.key) for a in current if a.key in removed)
    remaining = [a for a in current if a.key not in removed]
    if primary and primary.key in removed:
        primaries[primary.member] -= 1

    used = {a.slot for a in remaining}
    # Promotion: the most caught-up healthy replica takes slot 0.
    if 0 not in used:
        usable = [a for a in remaining if a.code != FAILED]
        if usable:
            best = max(
                usable,
                key=lambda a: (
                    is_consistent(a, primary_code),
                    a.code,
                    -primaries[a.member],
                    -a.slot,
                ),
            )
            kv = state.member_kv(best.member)
            assert kv is not None  # remaining replicas are of live members
            new_key = assignment_key(root, item, best.member, 0)
            change.ops.append(Delete(best.key))
            change.ops.append(Put(new_key, best.status.SerializeToString(), kv.lease))
            change.guard(None, new_key)
            change.guard(kv, kv.key)
            primaries[best.member] += 1
            used.discard(best.slot)
            used.add(0)

    # Additions, under each new member's own lease.
    held = {a.member for a in remaining}
    added = sorted(wanted - held, key=lambda m: (primaries[m], m))
    for member in added:
        kv = state.member_kv(member)
        if kv is None:
            continue
        slot = 0
        while slot in used:
            slot += 1
        used.add(slot)
        if slot == 0:
            primaries[member] += 1
        key = assignment_key(root, item, member, slot)
        change.ops.append(Put(key, b"", kv.lease))  # an empty ReplicaStatus is IDLE
        change.guard(None, key)
        change.guard(kv, kv.key)
    return change


async def apply_changes(keyspace: KeySpace, changes: Sequence[ItemChange]) -> tuple[bool, int]:
    """Write changes in batched transactions; (all succeeded, highest revision written).

    A batch whose guard fails is retried item by item, so one item that
    changed under us doesn't hold back the others.
    """
    ok, revision = True, 0
    for start in range(0, len(changes), BATCH_ITEMS):
        batch = changes[start : start + BATCH_ITEMS]
        groups = [batch] if len(batch) == 1 else [batch, *([c] for c in batch)]
        for group in groups:
            compares: dict[str, Compare] = {}
            ops: list[Op] = []
            for change in group:
                compares.update(change.compares)
                ops.extend(change.ops)
            result = await keyspace.txn(list(compares.values()), ops)
            if result.succeeded:
                revision = max(revision, result.revision)
                if group is batch:
                    break
            elif len(group) == 1:
                ok = False
    return ok, revision


async def converge(
    keyspace: KeySpace,
    root: str,
    state: AllocState,
    leader: MemberId,
    desired: Placement | None = None,
) -> tuple[bool, int]:
    """Write one step from `state` toward `desired` (default: `solve(state)`), as `leader`."""
    if desired is None:
        desired = solve(state)
    return await apply_changes(keyspace, plan_changes(root, state, desired, leader))


class Allocator:
    """One process's membership in a consumer application, and its share of leading.

    `start()` announces the member and begins watching; `state` is then kept
    current. Leave with `leave()` (hands off at once) or stop with
    `close()` (keys linger until the lease lapses, as after a crash).
    `on_failure` is called when a background loop is given up on (see the
    module docstring); the loops have stopped by then. `on_doubt` is called
    (synchronously) when the lease comes in doubt: the owner must stop
    serving at once, not at its next look at `lease_in_doubt`.
    """

    def __init__(
        self,
        keyspace: KeySpace,
        root: str,
        member: MemberId,
        spec: consumer_pb.ConsumerSpec | None = None,
        *,
        lease_ttl: float = 2.0,
        settle: float = 0.02,
        on_failure: Callable[[LoopFailure], None] | None = None,
        on_doubt: Callable[[], None] | None = None,
        expect_members: int = 1,
    ) -> None:
        if lease_ttl <= 0:
            raise ValueError("lease_ttl must be positive")
        self.keyspace = keyspace
        self.root = root.rstrip("/")
        self.member = member
        self.spec = consumer_pb.ConsumerSpec()
        if spec is not None:
            self.spec.CopyFrom(spec)
        spec_id = self.spec.process_spec.id
        if spec_id.zone or spec_id.suffix:
            if (spec_id.zone, spec_id.suffix) != (member.zone, member.suffix):
                raise ValueError(f"spec names member {spec_id.zone}#{spec_id.suffix}, not {member}")
        else:
            spec_id.zone, spec_id.suffix = member.zone, member.suffix
        self.key = member_key(self.root, member)
        self.lease_ttl = lease_ttl
        self.settle = settle
        # Members started together (`run --workers N`): as leader, make no first assignment
        # until this many joined (at most EXPECT_PATIENCE), or shards would be moved, with
        # their recovery and the work they did, a moment later.
        self.expect_members = expect_members
        self._expect_until: float | None = None
        self.lease = 0
        self._state = build_state(self.root, (), 0)
        self._kvs: dict[str, KeyValue] = {}
        self._changed = asyncio.Event()
        self._dirty = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._desired: Placement | None = None
        self._on_failure = on_failure
        self._keeper: LeaseKeeper | None = None  # from start() on
        self._in_doubt = False
        self._doubt_changed = asyncio.Event()
        self._on_doubt = on_doubt  # called as the lease comes in doubt: stop serving now

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        """Announce this member, load the current state, and start the background tasks."""
        if self._tasks:
            raise RuntimeError("allocator already started")
        await self._announce()
        self._keeper = LeaseKeeper(self.keyspace, self.lease_ttl, str(self.member))
        self._keeper.start(self.lease)
        await self._reload()
        owner, give_up = f"member {self.member}", self._give_up
        self._tasks = [
            supervised(
                "allocator-keepalive", self._keepalive_loop, owner=owner, on_give_up=give_up
            ),
            supervised(
                "allocator-watch",
                self._watch_loop,
                owner=owner,
                on_give_up=give_up,
                restart=RESTART,
            ),
            supervised(
                "allocator-converge",
                self._converge_loop,
                owner=owner,
                on_give_up=give_up,
                restart=RESTART,
            ),
        ]

    def _give_up(self, failure: LoopFailure) -> None:
        """A loop failed for good: stop the others (the lease is no longer kept alive, and
        this member no longer leads) and tell the owner."""
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self._stop_keeper()
        if self._on_failure is not None:
            self._on_failure(failure)

    async def leave(self) -> None:
        """Leave now: stop leading, and revoke the lease, deleting this member's
        key and all its assignments in one revision (standbys elsewhere are
        promoted by the leader)."""
        await self._stop()
        if self.lease:
            await self.keyspace.revoke(self.lease)
            self.lease = 0

    async def close(self) -> None:
        """Stop the background tasks without touching the KeySpace."""
        await self._stop()

    async def _stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            await wait_finished(task, task.get_name())
        self._stop_keeper()

    def _stop_keeper(self) -> None:
        """No more keepalives; the thread ends within TTL/6 (not waited for: it's a daemon
        whose last keepalive, if any, only delays the lapse of a lease being given up)."""
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.stop(timeout=0)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.leave()

    async def _announce(self) -> None:
        """Grant a lease and create the member key, waiting out a previous
        incarnation whose key hasn't expired yet."""
        self.lease = await self.keyspace.grant(self.lease_ttl)
        warned = False
        while True:
            result = await self.keyspace.txn(
                [Compare(self.key, create_revision=0)],
                [Put(self.key, self.spec.SerializeToString(), self.lease)],
            )
            if result.succeeded:
                return
            if await self._revoke_dead_predecessor():
                continue
            if not warned:
                log.warning("member %s: its key %s is held by a live process (another "
                            "member of this name, or this one's previous run while its lease "
                            "lasts); waiting for it to go: if that member goes on running, "
                            "give this one another --suffix", self.member, self.key)
                warned = True
            await asyncio.sleep(min(0.1, self.lease_ttl / 4))
            if not await self.keyspace.keepalive(self.lease):
                self.lease = await self.keyspace.grant(self.lease_ttl)

    async def _revoke_dead_predecessor(self) -> bool:
        """Revoke the lease of this member's previous incarnation (a process under the same
        name that was killed: a restart) when its Shard API refuses connections, instead of
        waiting for the lease to lapse. A live process of the same name keeps its key."""
        kv = await self.keyspace.get(self.key)
        if kv is None or not kv.lease or kv.lease == self.lease:
            return kv is None
        endpoint = consumer_pb.ConsumerSpec.FromString(kv.value).process_spec.endpoint
        if not endpoint or not await refuses(endpoint):
            return False
        log.info("member %s: its previous incarnation at %s is gone; revoking its lease %d",
                 self.member, endpoint, kv.lease)
        try:
            await self.keyspace.revoke(kv.lease)
        except KeySpaceError as err:  # already gone meanwhile
            log.info("member %s: revoking lease %d: %s", self.member, kv.lease, err)
        return True

    # -- state -----------------------------------------------------------------

    @property
    def state(self) -> AllocState:
        """The latest parsed snapshot of the application's keys."""
        return self._state

    @property
    def is_leader(self) -> bool:
        return self._state.leader == self.member

    async def fresh_state(self) -> AllocState:
        """The application's keys read afresh from the KeySpace, not the watch's view.

        The watch may lag: a decision that must not rest on a stale view (whether a
        fenced primary takes its shard back) reads this instead.
        """
        kvs, revision = await self.keyspace.range(self.root + "/")
        return build_state(self.root, kvs, revision)

    async def wait_for_change(self, after_revision: int) -> AllocState:
        """Wait for a state newer than `after_revision`."""
        while self._state.revision <= after_revision:
            await self._changed.wait()
        return self._state

    async def wait_for(self, predicate: Callable[[AllocState], bool]) -> AllocState:
        """Wait for a state satisfying `predicate` (wrap in asyncio.timeout to bound it)."""
        while not predicate(self._state):
            await self.wait_for_change(self._state.revision)
        return self._state

    @property
    def lease_in_doubt(self) -> bool:
        """Whether keepalives went unanswered long enough that the lease may lapse any moment
        (see the module docstring): the member must not serve its shards meanwhile."""
        return self._in_doubt

    def doubt_changes(self) -> asyncio.Event:
        """Set when `lease_in_doubt` next changes: taken before looking at it, so that a
        change while the caller works on what it saw (doubt, then none again) is not lost."""
        return self._doubt_changed

    def _set_doubt(self, in_doubt: bool) -> None:
        if in_doubt != self._in_doubt:
            self._in_doubt = in_doubt
            changed, self._doubt_changed = self._doubt_changed, asyncio.Event()
            changed.set()
            if in_doubt and self._on_doubt is not None:
                self._on_doubt()

    def my_assignments(self) -> list[Assignment]:
        return self._state.assignments_of_member(self.member)

    async def update_status(
        self, assignment: Assignment, status: consumer_pb.ReplicaStatus
    ) -> Assignment | None:
        """Set an assignment's status if it is unchanged since it was read.

        Returns the updated assignment, or None if it changed or vanished
        meanwhile (re-read `state` and decide again).
        """
        value = status.SerializeToString()
        result = await self.keyspace.txn(
            [Compare(assignment.key, mod_revision=assignment.mod_revision)],
            [Put(assignment.key, value, assignment.lease)],
        )
        if not result.succeeded:
            return None
        copy = consumer_pb.ReplicaStatus()
        copy.CopyFrom(status)
        return dataclasses.replace(assignment, status=copy, mod_revision=result.revision)

    async def _reload(self) -> int:
        """Read the whole state afresh; its revision."""
        kvs, revision = await self.keyspace.range(self.root + "/")
        self._kvs = {kv.key: kv for kv in kvs}
        self._publish(revision)
        return revision

    def _publish(self, revision: int) -> None:
        self._state = build_state(self.root, self._kvs.values(), revision)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        self._dirty.set()

    # -- background tasks ------------------------------------------------------

    async def _keepalive_loop(self) -> None:
        """Watch the lease keeper's thread; announce again when the KeySpace said the lease
        expired, doubt the lease while keepalives go unanswered, and raise LeaseLost once
        none was answered for `lease_ttl` + KEYSPACE_PATIENCE (see the module docstring)."""
        keeper = self._keeper
        assert keeper is not None
        warned: str | None = None
        period = self.lease_ttl / 20  # often: doubt must come well before the lease can lapse
        # Since when the KeySpace's silence counts toward KEYSPACE_PATIENCE: the last answered
        # keepalive, or the end of a freeze of the process, if later.
        thawed_at = 0.0
        unannounced_since: float | None = None  # when announcing again began to fail
        unannounced_error: str | None = None
        while True:
            slept_from = time.monotonic()
            await asyncio.sleep(period)
            frozen = time.monotonic() - slept_from - period
            if frozen > self.lease_ttl:
                # The process was paused as a whole (SIGSTOP, a VM pause), not the KeySpace
                # silent: nothing ran to keep the lease alive, so it may well have lapsed
                # (stop serving at once), but the keeper gets its full patience from now on
                # to hear whether it did. (An event loop blocked by user code looks the same;
                # if the keeper, running meanwhile, was answered, there is nothing to doubt.)
                thawed_at = time.monotonic()
                if thawed_at - keeper.answered_at >= DOUBT * self.lease_ttl:
                    if not self._in_doubt:
                        log.warning(
                            "member %s: nothing ran for %.1fs (the process was paused, or its "
                            "event loop blocked; lease TTL %gs): its lease may have lapsed, so "
                            "it stops serving its shards", self.member, frozen, self.lease_ttl,
                        )
                    self._set_doubt(True)
            if keeper.expired_lease == self.lease:
                if unannounced_since is None:
                    log.warning("member %s lost its lease; announcing again", self.member)
                self._set_doubt(True)  # its assignments are gone: serve none until announced
                try:
                    await self._announce()
                except KeySpaceError as e:
                    # A KeySpace that can't be written (a full disk) gets the patience a
                    # silent one gets, tried once a TTL (each try writes), said once.
                    now = time.monotonic()
                    unannounced_since = unannounced_since or now
                    if now - unannounced_since >= self.lease_ttl + KEYSPACE_PATIENCE:
                        raise LeaseLost(f"member {self.member} could not announce itself "
                                        f"again for {now - unannounced_since:.1f}s: {e}") from e
                    if str(e) != unannounced_error:
                        log.warning("member %s could not announce itself again (retrying "
                                    "every %gs): %s", self.member, self.lease_ttl, e)
                        unannounced_error = str(e)
                    await asyncio.sleep(self.lease_ttl)
                    continue
                unannounced_since = unannounced_error = None
                keeper.keep(self.lease)
                self._set_doubt(False)
                continue
            error = keeper.error
            now = time.monotonic()
            silent = now - keeper.answered_at
            if now - max(keeper.answered_at, thawed_at) >= self.lease_ttl + KEYSPACE_PATIENCE:
                raise LeaseLost(
                    f"no keepalive of lease {self.lease} answered for {silent:.1f}s "
                    f"(TTL {self.lease_ttl:g}s; last error: {error or 'none'}): "
                    "the lease has lapsed"
                )
            if silent >= DOUBT * self.lease_ttl:
                if not self._in_doubt:
                    log.warning(
                        "member %s: no keepalive of lease %d answered for %.1fs (TTL %gs; last "
                        "error: %s): its lease may lapse, so it stops serving its shards",
                        self.member, self.lease, silent, self.lease_ttl, error or "none",
                    )
                    self._set_doubt(True)
            elif self._in_doubt:
                log.warning(
                    "member %s: keepalives of lease %d are answered again; serving its "
                    "assignments again", self.member, self.lease,
                )
                self._set_doubt(False)
            if error is not None and error != warned:
                log.warning("member %s keepalive failed: %s", self.member, error)
            warned = error

    async def _watch_loop(self) -> None:
        """Keep `state` current; reads the whole state first, as a restart must."""
        prefixes = tuple(f"{self.root}/{part}/" for part in ("items", "members", "assign"))
        revision: int | None = None  # None: read the whole state (again)
        failed: str | None = None  # the last error said
        pause = _WATCH_RETRY
        while True:
            try:
                if revision is None:
                    revision = await self._reload()
                    failed, pause = None, _WATCH_RETRY
                async with contextlib.aclosing(
                    self.keyspace.watch(self.root + "/", revision)
                ) as events:
                    async for batch in events:
                        failed, pause = None, _WATCH_RETRY
                        relevant = False
                        for event in batch:
                            if not event.kv.key.startswith(prefixes):
                                continue
                            relevant = True
                            if event.kind == "put":
                                self._kvs[event.kv.key] = event.kv
                            else:
                                self._kvs.pop(event.kv.key, None)
                        revision = batch[-1].revision
                        if relevant:
                            self._publish(revision)
            except CompactedError:
                revision = None
            except ClusterChangedError:
                raise  # no revision means anything there: the member must restart
            except KeySpaceError as e:
                # A pause growing to a second, said once per kind of error (not ten a second).
                if str(e) != failed:
                    log.warning("allocator watch failed (%s); retrying", e)
                    failed = str(e)
                await asyncio.sleep(pause)
                pause = min(pause * 2, 1.0)

    def _awaiting_members(self, state: AllocState) -> bool:
        """Whether to hold the first assignment back for the expected members (see __init__)."""
        if self.expect_members <= 1:
            return False
        loop = asyncio.get_running_loop()
        if self._expect_until is None:
            self._expect_until = loop.time() + EXPECT_PATIENCE
        remaining = self._expect_until - loop.time()
        if len(state.members) >= self.expect_members or state.assignments or remaining <= 0:
            self.expect_members = 1  # it only ever holds back the first assignment
            return False
        loop.call_later(remaining, self._dirty.set)  # converge then, whoever joined
        return True

    async def _converge_loop(self) -> None:
        """Lead while this member is the leader; starts afresh from the current state."""
        self._desired = None
        self._dirty.set()
        while True:
            await self._dirty.wait()
            await asyncio.sleep(self.settle)
            self._dirty.clear()
            state = self._state
            if state.leader != self.member:
                self._desired = None
                continue
            if self._awaiting_members(state):
                continue
            # Solving with the previous answer as tie-breaker keeps the leader
            # on one plan while a change is under way.
            self._desired = solve(state, prefer=self._desired)
            try:
                ok, revision = await converge(
                    self.keyspace, self.root, state, self.member, self._desired
                )
            except KeySpaceError as e:
                log.warning("allocator converge failed: %s", e)
                ok, revision = False, 0
            if not ok:
                # Something changed under us; the watch will bring it, but
                # don't depend on that to try again.
                await asyncio.sleep(0.05)
                self._dirty.set()
            elif revision:
                # Plan the next step only from a state that includes this one.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await self.wait_for_change(revision - 1)
