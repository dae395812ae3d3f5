"""The allocator's view of a consumer application's KeySpace, parsed.

An application keeps three kinds of keys under its root (see the contract in
the docs; the layout follows Gazette's Etcd layout so the two stay readable
side by side):

* `{root}/items/{shard}`: the ShardSpec, written by whoever applies shards;
* `{root}/members/{zone}#{suffix}`: a ConsumerSpec, under that process's lease;
* `{root}/assign/{shard}#{zone}#{suffix}#{slot}`: a ReplicaStatus, under the
  *assigned* process's lease, so a dead process loses its assignments with
  its membership, in the same revision.

`AllocState` is one consistent snapshot of those keys, with the indexes that
the solver, the converge step and the shard runtime all need.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError

from streamkit.keyspace import KeyValue
from streamkit.protocol import consumer_pb

log = logging.getLogger(__name__)

Code = consumer_pb.ReplicaStatus.Code
IDLE = consumer_pb.ReplicaStatus.IDLE
BACKFILL = consumer_pb.ReplicaStatus.BACKFILL
STANDBY = consumer_pb.ReplicaStatus.STANDBY
PRIMARY = consumer_pb.ReplicaStatus.PRIMARY
FAILED = consumer_pb.ReplicaStatus.FAILED


@dataclass(frozen=True, slots=True, order=True)
class MemberId:
    """A consumer process: its zone and a suffix unique within the zone."""

    zone: str
    suffix: str

    def __post_init__(self) -> None:
        for part in (self.zone, self.suffix):
            if not part or "#" in part or "/" in part:
                raise ValueError(f"bad member id part {part!r}: non-empty, no '#' or '/'")

    def __str__(self) -> str:
        return f"{self.zone}#{self.suffix}"


@dataclass(frozen=True, slots=True)
class Assignment:
    """One replica of a shard at a member; slot 0 is the primary."""

    item: str
    zone: str
    suffix: str
    slot: int
    status: consumer_pb.ReplicaStatus
    key: str
    create_revision: int
    mod_revision: int
    lease: int = 0

    @property
    def member(self) -> MemberId:
        return MemberId(self.zone, self.suffix)

    @property
    def code(self) -> int:
        return self.status.code

    @property
    def is_primary(self) -> bool:
        return self.slot == 0


def items_prefix(root: str) -> str:
    return f"{root}/items/"


def members_prefix(root: str) -> str:
    return f"{root}/members/"


def assign_prefix(root: str) -> str:
    return f"{root}/assign/"


def item_key(root: str, item: str) -> str:
    return f"{items_prefix(root)}{item}"


def member_key(root: str, member: MemberId) -> str:
    return f"{members_prefix(root)}{member}"


def assignment_key(root: str, item: str, member: MemberId, slot: int) -> str:
    return f"{assign_prefix(root)}{item}#{member}#{slot}"


def parse_member_key(root: str, key: str) -> MemberId | None:
    """The member a member key names, or None if the key isn't one."""
    name = key.removeprefix(members_prefix(root))
    if name == key:
        return None
    zone, sep, suffix = name.partition("#")
    try:
        return MemberId(zone, suffix) if sep else None
    except ValueError:
        return None


def parse_assignment_key(root: str, key: str) -> tuple[str, MemberId, int] | None:
    """(item, member, slot) of an assignment key, or None if the key isn't one.

    Shard ids may contain '/' but never '#', so the last three '#' split it.
    """
    rest = key.removeprefix(assign_prefix(root))
    if rest == key:
        return None
    parts = rest.rsplit("#", 3)
    if len(parts) != 4 or not parts[0] or not parts[3].isdigit():
        return None
    try:
        return parts[0], MemberId(parts[1], parts[2]), int(parts[3])
    except ValueError:
        return None


def decode_status(value: bytes) -> consumer_pb.ReplicaStatus:
    status = consumer_pb.ReplicaStatus()
    try:
        status.ParseFromString(value)
    except DecodeError:
        log.warning("undecodable ReplicaStatus %r; treating it as IDLE", value[:40])
        status = consumer_pb.ReplicaStatus()
    return status


def desired_replication(spec: consumer_pb.ShardSpec) -> int:
    """1 + hot standbys, or 0 for a disabled shard."""
    return 0 if spec.disable else 1 + spec.hot_standbys


def is_consistent(assignment: Assignment, primary_code: int | None) -> bool:
    """Whether a replica could take over without losing state (Gazette's rule).

    STANDBY and PRIMARY replicas are consistent. A FAILED one counts only
    when the primary failed too: then nothing healthier exists, and holding
    back removals on its account would only pin the shard in place.
    """
    code = assignment.code
    return code in (STANDBY, PRIMARY) or (code == FAILED and primary_code == FAILED)


@dataclass(frozen=True)
class AllocState:
    """A snapshot of items, members and assignments at one KeySpace revision."""

    items: dict[str, consumer_pb.ShardSpec]
    members: dict[MemberId, tuple[consumer_pb.ConsumerSpec, KeyValue]]
    assignments: list[Assignment]
    revision: int
    item_kvs: dict[str, KeyValue] = field(default_factory=dict)
    _by_item: dict[str, list[Assignment]] = field(init=False, repr=False, compare=False)
    _by_member: dict[MemberId, list[Assignment]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_item: dict[str, list[Assignment]] = {}
        by_member: dict[MemberId, list[Assignment]] = {}
        for a in sorted(self.assignments, key=lambda a: (a.item, a.slot, a.zone, a.suffix)):
            by_item.setdefault(a.item, []).append(a)
            by_member.setdefault(a.member, []).append(a)
        object.__setattr__(self, "_by_item", by_item)
        object.__setattr__(self, "_by_member", by_member)

    def assignments_of(self, item: str) -> list[Assignment]:
        """The item's assignments, by slot."""
        return list(self._by_item.get(item, ()))

    def assignments_of_member(self, member: MemberId) -> list[Assignment]:
        """The member's assignments, by item."""
        return list(self._by_member.get(member, ()))

    def primary_of(self, item: str) -> Assignment | None:
        """The item's slot-0 assignment, if it has one."""
        found = self._by_item.get(item)
        return found[0] if found and found[0].slot == 0 else None

    def assigned_items(self) -> Iterable[str]:
        return self._by_item.keys()

    @property
    def leader(self) -> MemberId | None:
        """The member whose key is oldest (lowest create revision)."""
        if not self.members:
            return None
        return min(self.members, key=lambda m: (self.members[m][1].create_revision, m))

    def member_kv(self, member: MemberId) -> KeyValue | None:
        entry = self.members.get(member)
        return entry[1] if entry else None


def build_state(root: str, kvs: Iterable[KeyValue], revision: int) -> AllocState:
    """Parse the keys under `root`; keys of other shapes (hints, ...) are ignored."""
    items: dict[str, consumer_pb.ShardSpec] = {}
    item_kvs: dict[str, KeyValue] = {}
    members: dict[MemberId, tuple[consumer_pb.ConsumerSpec, KeyValue]] = {}
    assignments: list[Assignment] = []
    for kv in kvs:
        if kv.key.startswith(items_prefix(root)):
            item = kv.key.removeprefix(items_prefix(root))
            spec = consumer_pb.ShardSpec()
            try:
                spec.ParseFromString(kv.value)
            except DecodeError:
                log.warning("skipping undecodable shard spec %s", kv.key)
                continue
            items[item] = spec
            item_kvs[item] = kv
        elif (member := parse_member_key(root, kv.key)) is not None:
            cspec = consumer_pb.ConsumerSpec()
            try:
                cspec.ParseFromString(kv.value)
            except DecodeError:
                log.warning("undecodable consumer spec %s; using an empty one", kv.key)
                cspec = consumer_pb.ConsumerSpec()
            members[member] = (cspec, kv)
        elif (parsed := parse_assignment_key(root, kv.key)) is not None:
            item, member, slot = parsed
            assignments.append(
                Assignment(
                    item,
                    member.zone,
                    member.suffix,
                    slot,
                    decode_status(kv.value),
                    kv.key,
                    kv.create_revision,
                    kv.mod_revision,
                    kv.lease,
                )
            )
    return AllocState(items, members, assignments, revision, item_kvs)
