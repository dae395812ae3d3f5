"""The Shard API's KeySpace operations: List, Apply, GetHints and Unassign.

These need nothing but the application's KeySpace, so they are plain functions
that the members' gRPC servicer (`streamkit.app.shard_api`) and
`streamkit shards ...` both call, with the same checks and answers.

A malformed request raises `BadRequest` naming the field (spec and selector
problems found while validating a request are raised as `BadRequest` too), so
a caller can tell the client's mistake from any other failure by its type
alone. Conditions the protocol has a status for (SHARD_NOT_FOUND,
ETCD_TRANSACTION_FAILED, ...) are answered with that status.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from streamkit.app.assignment import FAILED, AllocState, MemberId, build_state, item_key
from streamkit.app.hints import backup_key, decode_hints, encode_hints, primary_key
from streamkit.errors import StreamkitError
from streamkit.keyspace.keyspace import Compare, Delete, KeySpace, Op, Put
from streamkit.protocol import consumer_pb, pb
from streamkit.protocol.apply import NO_CHECK, check_apply_changes
from streamkit.protocol.labels import SelectorError, label_set, matches, union, validate_selector
from streamkit.protocol.problems import SpecError
from streamkit.protocol.shard_spec import shard_id_problem, validate_shard_proto

__all__ = [
    "BadRequest",
    "CorruptHints",
    "apply_shards",
    "check_changes",
    "check_shard_id",
    "endpoint_of",
    "get_hints",
    "list_shards",
    "read_state",
    "response_header",
    "shard_route",
    "unassign_shards",
]


class BadRequest(StreamkitError, ValueError):
    """A malformed request: the client's mistake, answered with INVALID_ARGUMENT and this
    message. Only this type means "bad request"; any other ValueError is a failure."""


class CorruptHints(StreamkitError):
    """Hints stored in the KeySpace that can't be decoded (DATA_LOSS, not the client's fault)."""


# --- reading the KeySpace --------------------------------------------------------------


async def read_state(keyspace: KeySpace, root: str) -> AllocState:
    """One consistent snapshot of the app's shard specs, members and assignments."""
    root = root.rstrip("/")
    kvs, revision = await keyspace.range(root + "/")
    return build_state(root, kvs, revision)


def response_header(
    revision: int, process: MemberId | None = None, route: pb.Route | None = None
) -> pb.Header:
    """The header of an answer (or of a forwarded request) at KeySpace `revision`."""
    header = pb.Header(
        route=pb.Route(primary=-1),  # unrouted unless `route` is given
        # Etcd revisions start at 1; an empty KeySpace (revision 0) reads as its first.
        etcd=pb.Header.Etcd(cluster_id=1, member_id=1, revision=max(revision, 1), raft_term=1),
    )
    if process is not None:
        header.process_id.zone, header.process_id.suffix = process.zone, process.suffix
    if route is not None:
        header.route.CopyFrom(route)
    return header


def endpoint_of(state: AllocState, member: MemberId) -> str:
    """The member's Shard API endpoint as it announced it; "" when it has none (or left)."""
    entry = state.members.get(member)
    return entry[0].process_spec.endpoint if entry else ""


def shard_route(state: AllocState, shard: str) -> tuple[pb.Route, list[consumer_pb.ReplicaStatus]]:
    """The shard's assigned members ordered by (zone, suffix), as Gazette's routes are,
    with `primary` the index of the slot-0 one (-1 without), their endpoints, and the
    status each reported."""
    route = pb.Route(primary=-1)
    statuses = []
    members = sorted(state.assignments_of(shard), key=lambda a: (a.zone, a.suffix))
    for index, assignment in enumerate(members):
        route.members.add(zone=assignment.zone, suffix=assignment.suffix)
        route.endpoints.append(endpoint_of(state, assignment.member))
        statuses.append(assignment.status)
        if assignment.slot == 0:
            route.primary = index
    return route, statuses


def _shard_labels(spec: consumer_pb.ShardSpec) -> pb.LabelSet:
    """A shard's labels plus its meta-label `id`, what List selectors match against."""
    return union(spec.labels, label_set(("id", spec.id)))


def check_shard_id(shard: str, field: str) -> None:
    """Raise BadRequest naming `field` unless `shard` is a valid shard id."""
    if problem := shard_id_problem(shard):
        raise BadRequest(f"{field}: {problem}")


# --- List, Apply, GetHints, Unassign -------------------------------------------------------


async def list_shards(
    keyspace: KeySpace, root: str, selector: pb.LabelSelector | None = None
) -> consumer_pb.ListResponse:
    """Shards whose labels (with `id`) match `selector`, by id, with routes and statuses."""
    selector = selector if selector is not None else pb.LabelSelector()
    try:
        validate_selector(selector)
    except SelectorError as err:
        raise BadRequest(f"List: selector: {err}") from err
    state = await read_state(keyspace, root)
    response = consumer_pb.ListResponse(
        status=consumer_pb.OK, header=response_header(state.revision)
    )
    for shard in sorted(state.items):
        spec = state.items[shard]
        if not matches(selector, _shard_labels(spec)):
            continue
        kv = state.item_kvs[shard]
        route, statuses = shard_route(state, shard)
        response.shards.add(
            spec=spec,
            mod_revision=kv.mod_revision,
            create_revision=kv.create_revision,
            route=route,
            status=statuses,
        )
    return response


def check_changes(changes: Sequence[consumer_pb.ApplyRequest.Change]) -> None:
    """Raise BadRequest naming the change and field that is wrong."""
    check_apply_changes(changes, "shard", _upserted, check_shard_id, BadRequest)
    for i, change in enumerate(changes):
        if change.HasField("primary_hints"):
            _check_primary_hints(i, change)


def _upserted(spec: consumer_pb.ShardSpec) -> str:
    try:
        validate_shard_proto(spec)
    except SpecError as err:  # the request's spec: the client's mistake
        raise BadRequest(str(err)) from err
    return spec.id


def _check_primary_hints(index: int, change: consumer_pb.ApplyRequest.Change) -> None:
    where = f"Apply: changes[{index}].primary_hints"
    if not change.HasField("upsert"):
        raise BadRequest(f"{where}: hints can only be given with an upsert")
    spec = change.upsert
    if not spec.recovery_log_prefix:
        raise BadRequest(f"{where}: shard {spec.id!r} has no recovery log to hint")
    log_name = f"{spec.recovery_log_prefix}/{spec.id}"
    if change.primary_hints.log != log_name:
        raise BadRequest(
            f"{where}: log must be the shard's recovery log {log_name!r} "
            f"(got {change.primary_hints.log!r})"
        )


async def apply_shards(
    keyspace: KeySpace, root: str, changes: Sequence[consumer_pb.ApplyRequest.Change]
) -> consumer_pb.ApplyResponse:
    """Create, update and delete shard specs in one transaction.

    Each change's expect_mod_revision must still match its spec's (0: it must
    not exist; -1: no check), else nothing is written and the answer is
    ETCD_TRANSACTION_FAILED. Hints given with an upsert are written with it.
    """
    check_changes(changes)
    compares: list[Compare] = []
    ops: list[Op] = []
    for change in changes:
        if change.HasField("upsert"):
            key = item_key(root, change.upsert.id)
            ops.append(Put(key, change.upsert.SerializeToString(deterministic=True)))
            if change.HasField("primary_hints"):
                ops.append(Put(primary_key(change.upsert), encode_hints(change.primary_hints)))
        else:
            key = item_key(root, change.delete)
            ops.append(Delete(key))
        if change.expect_mod_revision != NO_CHECK:
            compares.append(Compare(key, mod_revision=change.expect_mod_revision))
    result = await keyspace.txn(compares, ops)
    status = consumer_pb.OK if result.succeeded else consumer_pb.ETCD_TRANSACTION_FAILED
    return consumer_pb.ApplyResponse(status=status, header=response_header(result.revision))


def _hints_at(kv_value: bytes | None, key: str) -> consumer_pb.GetHintsResponse.ResponseHints:
    found = consumer_pb.GetHintsResponse.ResponseHints()
    if kv_value:
        try:
            found.hints.CopyFrom(decode_hints(kv_value))
        except Exception as error:
            raise CorruptHints(f"hints at {key} can't be decoded: {error}") from None
    return found


async def get_hints(keyspace: KeySpace, root: str, shard: str) -> consumer_pb.GetHintsResponse:
    """The shard's primary hints and backup hints (newest first); unset where none are stored."""
    check_shard_id(shard, "GetHints: shard")
    kv = await keyspace.get(item_key(root, shard))
    revision = await keyspace.revision()
    if kv is None:
        return consumer_pb.GetHintsResponse(
            status=consumer_pb.SHARD_NOT_FOUND, header=response_header(revision)
        )
    spec = consumer_pb.ShardSpec.FromString(kv.value)
    response = consumer_pb.GetHintsResponse(status=consumer_pb.OK, header=response_header(revision))
    if not spec.hint_prefix:
        return response  # no recovery log, so no hints
    keys = [primary_key(spec)] + [backup_key(spec, i) for i in range(spec.hint_backups)]
    values = [await keyspace.get(key) for key in keys]
    response.primary_hints.CopyFrom(_hints_at(values[0].value if values[0] else None, keys[0]))
    for key, value in zip(keys[1:], values[1:], strict=True):
        response.backup_hints.append(_hints_at(value.value if value else None, key))
    return response


async def unassign_shards(
    keyspace: KeySpace,
    root: str,
    shards: Iterable[str],
    *,
    only_failed: bool = False,
    dry_run: bool = False,
) -> consumer_pb.UnassignResponse:
    """Remove shards' FAILED assignments, and their primaries too unless `only_failed`.

    The leader then assigns them afresh. One transaction, guarded by every
    removed assignment's revision; the answer lists the shards changed.
    """
    shards = list(dict.fromkeys(shards))
    if not shards:
        raise BadRequest("Unassign: shards: at least one shard is required")
    for i, shard in enumerate(shards):
        check_shard_id(shard, f"Unassign: shards[{i}]")
    state = await read_state(keyspace, root)
    compares: list[Compare] = []
    ops: list[Op] = []
    changed = []
    for shard in shards:
        assignments = state.assignments_of(shard)
        if shard not in state.items and not assignments:
            return consumer_pb.UnassignResponse(status=consumer_pb.SHARD_NOT_FOUND)
        removed = [a for a in assignments if a.code == FAILED or (a.is_primary and not only_failed)]
        for a in removed:
            compares.append(Compare(a.key, mod_revision=a.mod_revision))
            ops.append(Delete(a.key))
        if removed:
            changed.append(shard)
    if ops and not dry_run:
        result = await keyspace.txn(compares, ops)
        if not result.succeeded:
            return consumer_pb.UnassignResponse(status=consumer_pb.ETCD_TRANSACTION_FAILED)
    return consumer_pb.UnassignResponse(status=consumer_pb.OK, shards=changed)
