"""Where each shard's replicas should run: a pure function of an `AllocState`.

Gazette solves placement as a push-relabel max-flow over a network of items,
zones and members. Our clusters are small (up to a few hundred shards, a
handful of processes), so `solve` uses a plainer scheme with the same goals,
in this order of importance:

1. every shard gets `1 + hot_standbys` replicas (0 when disabled), at
   distinct members, capped by the number of members;
2. no member exceeds its `shard_limit` (0 = unlimited); when capacity is
   short, primaries come first: every shard gets one replica before any
   shard gets a second;
3. load is balanced: per-member targets are filled evenly, differing by at
   most one where limits allow;
4. current placements are kept wherever 1-3 allow, so a joining or leaving
   member moves about its fair share of replicas and no more.

Steps: keep every current replica on a live member; trim shards that have
too many replicas and members above their target, dropping the replica
that hurts least (a standby before a primary, a lagging one before a
caught-up one, the most loaded member first); then place missing replicas
layer by layer (first replicas, then second ones, ...) on the member with
the most room, preferring a zone the shard doesn't use yet. When every
member with room already holds the shard, a breadth-first augmenting path
moves other replicas along to make room, which is what a max-flow would do.

FAILED replicas are pinned: they are kept, and never moved to rebalance, so
a failing shard stays put (and visible) until an operator unassigns it,
rather than crash-looping across members. The one exception is a FAILED
standby of a shard with more replicas than it wants (its standby count was
lowered): it is the first to go.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping

from streamkit.app.assignment import (
    FAILED,
    PRIMARY,
    STANDBY,
    AllocState,
    Assignment,
    MemberId,
    desired_replication,
)

Placement = dict[str, frozenset[MemberId]]


def solve(state: AllocState, prefer: Placement | None = None) -> Placement:
    """The desired members of every item (empty for disabled items).

    `prefer` is the caller's previous answer. Mid-way through a change the
    state holds old and new replicas side by side, and several placements
    can be equally good; ties then go the way of `prefer`, so the leader
    keeps following one plan instead of wavering between equals.
    """
    return _Solver(state, prefer or {}).run()


def placement_of(state: AllocState) -> Placement:
    """The current placement of every item, in the same shape as `solve`'s."""
    out: Placement = {}
    for item in state.items:
        out[item] = frozenset(a.member for a in state.assignments_of(item))
    return out


def moves(before: Mapping[str, frozenset[MemberId]], after: Placement) -> int:
    """How many replicas `after` places where `before` had none."""
    return sum(len(members - before.get(item, frozenset())) for item, members in after.items())


class _Solver:
    def __init__(self, state: AllocState, prefer: Placement) -> None:
        self.prefer = prefer
        self.members = sorted(state.members)
        self.items = sorted(state.items)
        self.zones = {m: m.zone for m in self.members}
        live = set(self.members)
        wanted = {
            item: min(desired_replication(spec), len(self.members))
            for item, spec in state.items.items()
        }
        active = sum(1 for w in wanted.values() if w)
        # A member can hold one replica of each shard at most.
        self.limit = {
            m: min(state.members[m][0].shard_limit or active, active) for m in self.members
        }
        # held[item][member]: the current assignment, or None for a new placement.
        self.held: dict[str, dict[MemberId, Assignment | None]] = {}
        for item in self.items:
            here: dict[MemberId, Assignment | None] = {}
            if wanted[item]:
                for a in state.assignments_of(item):
                    if a.member in live and a.member not in here:
                        here[a.member] = a
            self.held[item] = here
        self.want = self._fit_capacity(wanted, sum(self.limit.values()))
        self.load = Counter(m for here in self.held.values() for m in here)
        self.prefer_load = Counter(m for ms in prefer.values() for m in ms)
        self.target = self._targets(sum(self.want.values()))
        self.dropped: Counter[str] = Counter()
        # A dropped FAILED standby must really go, not come back as "kept".
        self.banned: set[tuple[str, MemberId]] = set()

    def run(self) -> Placement:
        if self.members:
            self._trim_items()
            self._trim_members()
            self._fill(self.target)
            self._fill(self.limit)  # targets may be infeasible; limits are the hard cap
        return {item: frozenset(self.held[item]) for item in self.items}

    # -- demand and targets --------------------------------------------------

    def _fit_capacity(self, wanted: dict[str, int], capacity: int) -> dict[str, int]:
        """Cut replication layer by layer when members can't hold it all.

        Within the last partial layer, shards that had that many replicas in
        the preferred placement, then those that have them now, keep them
        (fewer moves); ties go by shard id.
        """
        if sum(wanted.values()) <= capacity:
            return wanted
        fitted = dict.fromkeys(wanted, 0)
        layer = 1
        while capacity > 0:
            layer_items = [i for i in self.items if wanted[i] >= layer]
            if not layer_items:
                break
            if len(layer_items) > capacity:
                layer_items.sort(
                    key=lambda i: (
                        len(self.prefer.get(i, ())) < layer,
                        len(self.held[i]) < layer,
                        i,
                    )
                )
                layer_items = layer_items[:capacity]
            for i in layer_items:
                fitted[i] = layer
            capacity -= len(layer_items)
            layer += 1
        return fitted

    def _targets(self, total: int) -> dict[MemberId, int]:
        """Water-fill `total` over members under their limits.

        Members capped by a low limit take their limit; the rest share evenly,
        and the remainder's extra units go to the currently most loaded
        members, so that a balanced placement is a fixed point.
        """
        target: dict[MemberId, int] = {}
        rest = sorted(self.members, key=lambda m: (self.limit[m], m))
        remaining = total
        while rest:
            share = remaining // len(rest)
            if self.limit[rest[0]] <= share:
                m = rest.pop(0)
                target[m] = self.limit[m]
                remaining -= target[m]
                continue
            extra = remaining - share * len(rest)
            short = [i for i in self.items if len(self.held[i]) < self.want[i]]
            can_take = {m: sum(1 for i in short if m not in self.held[i]) for m in rest}
            by_load = sorted(
                rest, key=lambda m: (-self.prefer_load[m], -self.load[m], -can_take[m], m)
            )
            for n, m in enumerate(by_load):
                target[m] = share + (1 if n < extra else 0)
            break
        return target

    # -- trimming ----------------------------------------------------------

    def _preferred(self, item: str, member: MemberId) -> bool:
        return member in self.prefer.get(item, ())

    def _drop_cost(self, item: str, member: MemberId) -> tuple[int, ...]:
        """Lower is cheaper to drop."""
        preferred = int(self._preferred(item, member))
        a = self.held[item][member]
        if a is None:
            return (preferred, 0, 0, 0, 0)
        caught_up = a.code in (STANDBY, PRIMARY)
        return (preferred, int(a.is_primary), self.dropped[item], int(caught_up), -a.slot)

    def _pinned(self, item: str, member: MemberId) -> bool:
        a = self.held[item][member]
        return a is not None and a.code == FAILED

    def _failed_standby(self, item: str, member: MemberId) -> bool:
        a = self.held[item][member]
        return a is not None and a.code == FAILED and not a.is_primary

    def _drop(self, item: str, member: MemberId) -> None:
        if self._pinned(item, member):
            self.banned.add((item, member))
        del self.held[item][member]
        self.load[member] -= 1
        self.dropped[item] += 1

    def _trim_items(self) -> None:
        """Drop replicas beyond a shard's wanted count, from the most overloaded members.

        A FAILED standby goes first here (it is no use as a replica), but a
        FAILED primary never does.
        """
        for item in self.items:
            while len(self.held[item]) > self.want[item]:
                options = [
                    m
                    for m in self.held[item]
                    if not self._pinned(item, m) or self._failed_standby(item, m)
                ]
                if not options:
                    break
                member = min(
                    options,
                    key=lambda m: (
                        not self._failed_standby(item, m),
                        self._preferred(item, m),
                        self.target.get(m, 0) - self.load[m],
                        self._drop_cost(item, m),
                        m,
                    ),
                )
                self._drop(item, member)

    def _trim_members(self) -> None:
        """Bring every member down to its target, one replica per member per round."""
        while True:
            over = [m for m in self.members if self.load[m] > self.target[m]]
            progressed = False
            for member in sorted(over, key=lambda m: (self.target[m] - self.load[m], m)):
                options = [
                    i for i in self.items if member in self.held[i] and not self._pinned(i, member)
                ]
                if options:
                    item = min(options, key=lambda i: (self._drop_cost(i, member), i))
                    self._drop(item, member)
                    progressed = True
            if not progressed:
                return

    # -- placing -------------------------------------------------------------

    def _fill(self, cap: Mapping[MemberId, int]) -> None:
        """Place missing replicas layer by layer, so first replicas come first.

        Within a layer, direct placements go before augmenting paths: a path
        moves existing replicas, which is only worth it when nothing simpler
        gives the shard its replica.
        """
        for layer in range(1, max(self.want.values(), default=0) + 1):
            short = [i for i in self.items if self.want[i] >= layer and len(self.held[i]) < layer]
            stuck = [i for i in short if not self._place(i, cap)]
            for item in stuck:
                self._augment(item, cap)

    def _open(self, item: str) -> list[MemberId]:
        """Members that could take a new replica of `item`."""
        here = self.held[item]
        return [m for m in self.members if m not in here and (item, m) not in self.banned]

    def _place(self, item: str, cap: Mapping[MemberId, int]) -> bool:
        """Place one replica on a member with room, if there is one."""
        here = self.held[item]
        zones = {m.zone for m in here}
        room = [m for m in self._open(item) if self.load[m] < cap[m]]
        if not room:
            return False
        member = min(
            room,
            key=lambda m: (
                not self._preferred(item, m),
                m.zone in zones,
                self.load[m] - cap[m],
                m,
            ),
        )
        here[member] = None
        self.load[member] += 1
        return True

    def _augment(self, item: str, cap: Mapping[MemberId, int]) -> bool:
        """Make room for `item` by shifting other replicas along a shortest path.

        Path: `item` goes to full member m1, which hands some shard j1 to m2,
        which hands j2 to m3, ..., until a member with room. Pinned replicas
        never move; new placements move before existing ones.
        """
        parent: dict[MemberId, tuple[MemberId | None, str]] = {}
        queue: deque[MemberId] = deque()
        for m in self._open(item):
            parent[m] = (None, item)
            queue.append(m)
        end = None
        while queue:
            m = queue.popleft()
            if self.load[m] < cap[m]:
                end = m
                break
            movable = [
                i
                for i in self.items
                if m in self.held[i] and i != parent[m][1] and not self._pinned(i, m)
            ]
            movable.sort(key=lambda i: (self._drop_cost(i, m), i))
            for j in movable:
                for m2 in self._open(j):
                    if m2 not in parent:
                        parent[m2] = (m, j)
                        queue.append(m2)
        if end is None:
            return False
        self.load[end] += 1
        cur: MemberId | None = end
        while cur is not None:
            prev, moved = parent[cur]
            self.held[moved][cur] = None
            if prev is not None:
                del self.held[moved][prev]
            cur = prev
        return True
