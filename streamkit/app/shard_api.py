"""The consumer Shard service: Stat, List, Apply, GetHints and Unassign.

Everything but Stat works on the application's KeySpace alone, so each is a
plain function (`list_shards`, `apply_shards`, `get_hints`, `unassign_shards`)
that the gRPC servicer and `streamkit shards ...` both call. Stat needs the
shard's primary: a member answers for its own primaries and forwards the
request to the member the KeySpace names as primary otherwise. A forwarded
request carries a header (as Gazette's peers set one), and a member never
forwards a request that already has one, so a stale view can't bounce a
request around.

Malformed requests raise `BadRequest` (or SpecError/SelectorError, all
ValueErrors), which the servicer answers with INVALID_ARGUMENT naming the
field; conditions the protocol has a status for (SHARD_NOT_FOUND,
ETCD_TRANSACTION_FAILED, ...) are answered with that status.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Awaitable, Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

import grpc
from aiohttp import web

from streamkit.app.assignment import FAILED, PRIMARY, AllocState, MemberId, build_state, item_key
from streamkit.app.hints import backup_key, decode_hints, encode_hints, primary_key
from streamkit.app.http_api import start_http
from streamkit.client.broker_client import normalize_address
from streamkit.keyspace.keyspace import Compare, Delete, KeySpace, KeySpaceError, Op, Put
from streamkit.protocol import consumer_pb, pb
from streamkit.protocol import consumer_pb2_grpc as consumer_grpc
from streamkit.protocol.apply import NO_CHECK, check_apply_changes
from streamkit.protocol.labels import label_set, matches, union, validate_selector
from streamkit.protocol.shard_spec import shard_id_problem, validate_shard_proto

if TYPE_CHECKING:
    from streamkit.app.member import Member
    from streamkit.app.replica import Replica
    from streamkit.app.service import Service
from streamkit.app.waits import first_of

__all__ = [
    "BadRequest",
    "CorruptHints",
    "ShardAPI",
    "apply_shards",
    "get_hints",
    "list_shards",
    "read_state",
    "serve_member_apis",
    "shard_route",
    "stat_extension",
    "unassign_shards",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

Code = consumer_pb.ReplicaStatus.Code
MAX_MESSAGE = 64 << 20
_LOCAL_POLL = 0.25  # seconds between re-checks while a local replica becomes primary


class BadRequest(ValueError):
    """A malformed request; answered with INVALID_ARGUMENT and this message."""


class CorruptHints(Exception):
    """Hints stored in the KeySpace that can't be decoded."""


# --- reading the KeySpace --------------------------------------------------------------


async def read_state(keyspace: KeySpace, root: str) -> AllocState:
    """One consistent snapshot of the app's shard specs, members and assignments."""
    root = root.rstrip("/")
    kvs, revision = await keyspace.range(root + "/")
    return build_state(root, kvs, revision)


def _header(
    revision: int, process: MemberId | None = None, route: pb.Route | None = None
) -> pb.Header:
    header = pb.Header(
        etcd=pb.Header.Etcd(cluster_id=1, member_id=1, revision=revision, raft_term=1)
    )
    if process is not None:
        header.process_id.zone, header.process_id.suffix = process.zone, process.suffix
    if route is not None:
        header.route.CopyFrom(route)
    return header


def _endpoint_of(state: AllocState, member: MemberId) -> str:
    entry = state.members.get(member)
    return entry[0].process_spec.endpoint if entry else ""


def shard_route(state: AllocState, shard: str) -> tuple[pb.Route, list[consumer_pb.ReplicaStatus]]:
    """The shard's assigned members in slot order (primary first, when there is one),
    their endpoints, and the status each reported."""
    route = pb.Route(primary=-1)
    statuses = []
    for assignment in state.assignments_of(shard):
        route.members.add(zone=assignment.zone, suffix=assignment.suffix)
        route.endpoints.append(_endpoint_of(state, assignment.member))
        statuses.append(assignment.status)
    if state.primary_of(shard) is not None:
        route.primary = 0
    return route, statuses


def _shard_labels(spec: consumer_pb.ShardSpec) -> pb.LabelSet:
    """A shard's labels plus its meta-label `id`, what List selectors match against."""
    return union(spec.labels, label_set(("id", spec.id)))


def _check_shard_id(shard: str, field: str) -> None:
    if problem := shard_id_problem(shard):
        raise BadRequest(f"{field}: {problem}")


# --- List, Apply, GetHints, Unassign -------------------------------------------------------


async def list_shards(
    keyspace: KeySpace, root: str, selector: pb.LabelSelector | None = None
) -> consumer_pb.ListResponse:
    """Shards whose labels (with `id`) match `selector`, by id, with routes and statuses."""
    selector = selector if selector is not None else pb.LabelSelector()
    validate_selector(selector)
    state = await read_state(keyspace, root)
    response = consumer_pb.ListResponse(status=consumer_pb.OK, header=_header(state.revision))
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
    """Raise BadRequest (or SpecError) naming the change and field that is wrong."""
    check_apply_changes(changes, "shard", _upserted, _check_shard_id, BadRequest)
    for i, change in enumerate(changes):
        if change.HasField("primary_hints"):
            _check_primary_hints(i, change)


def _upserted(spec: consumer_pb.ShardSpec) -> str:
    validate_shard_proto(spec)
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
    return consumer_pb.ApplyResponse(status=status, header=_header(result.revision))


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
    _check_shard_id(shard, "GetHints: shard")
    kv = await keyspace.get(item_key(root, shard))
    revision = await keyspace.revision()
    if kv is None:
        return consumer_pb.GetHintsResponse(
            status=consumer_pb.SHARD_NOT_FOUND, header=_header(revision)
        )
    spec = consumer_pb.ShardSpec.FromString(kv.value)
    response = consumer_pb.GetHintsResponse(status=consumer_pb.OK, header=_header(revision))
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
        _check_shard_id(shard, f"Unassign: shards[{i}]")
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


# --- Stat ------------------------------------------------------------------------------


def stat_extension(replica: Replica) -> bytes:
    """What Stat adds in `extension`: the replica's counters, as JSON."""
    loop = replica.loop
    return json.dumps(
        {
            "messages": replica.shard.messages,
            "transactions": replica.shard.transactions,
            "last_commit": loop.last_commit if loop is not None else None,
            "status": Code.Name(replica.status.code),
        }
    ).encode()


def _check_stat(request: consumer_pb.StatRequest) -> None:
    _check_shard_id(request.shard, "Stat: shard")
    for journal, offset in request.read_through.items():
        if offset < 0:
            raise BadRequest(f"Stat: read_through[{journal}]: offset must be >= 0 (got {offset})")


class ShardAPI(consumer_grpc.ShardServicer):
    """Serves the Shard API for one member (`service` None: a process running no shards)."""

    def __init__(
        self,
        keyspace: KeySpace,
        root: str,
        service: Service | None,
        member_endpoint: str,
        member_id: MemberId | None = None,
    ) -> None:
        self.keyspace = keyspace
        self.root = root.rstrip("/")
        self.service = service
        self.member_endpoint = member_endpoint
        self.member_id = member_id

    # --- plumbing ---

    async def _run(self, context: grpc.aio.ServicerContext, call: Awaitable[T]) -> T:
        """Await `call`, answering bad requests and KeySpace trouble with a gRPC status."""
        try:
            return await call
        except ValueError as err:  # BadRequest, SpecError, SelectorError
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except CorruptHints as err:
            await context.abort(grpc.StatusCode.DATA_LOSS, str(err))
        except KeySpaceError as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KeySpace: {err}")
        raise AssertionError("unreachable: abort raises")

    def _is_me(self, state: AllocState, member: MemberId) -> bool:
        if self.member_id is not None and member == self.member_id:
            return True
        endpoint = _endpoint_of(state, member)
        return bool(endpoint) and normalize_address(endpoint) == normalize_address(
            self.member_endpoint
        )

    def _local(self, shard: str) -> Replica | None:
        return self.service.replicas.get(shard) if self.service is not None else None

    # --- RPCs ---

    async def List(self, request: consumer_pb.ListRequest, context) -> consumer_pb.ListResponse:
        return await self._run(context, list_shards(self.keyspace, self.root, request.selector))

    async def Apply(self, request: consumer_pb.ApplyRequest, context) -> consumer_pb.ApplyResponse:
        return await self._run(
            context, apply_shards(self.keyspace, self.root, list(request.changes))
        )

    async def GetHints(
        self, request: consumer_pb.GetHintsRequest, context
    ) -> consumer_pb.GetHintsResponse:
        return await self._run(context, get_hints(self.keyspace, self.root, request.shard))

    async def Unassign(
        self, request: consumer_pb.UnassignRequest, context
    ) -> consumer_pb.UnassignResponse:
        return await self._run(
            context,
            unassign_shards(
                self.keyspace,
                self.root,
                request.shards,
                only_failed=request.only_failed,
                dry_run=request.dry_run,
            ),
        )

    async def Stat(self, request: consumer_pb.StatRequest, context) -> consumer_pb.StatResponse:
        """Answer once the primary read through `read_through` (the RPC's deadline bounds it)."""
        return await self._run(context, self._stat(request, context))

    async def _stat(
        self, request: consumer_pb.StatRequest, context: grpc.aio.ServicerContext
    ) -> consumer_pb.StatResponse:
        _check_stat(request)
        shard = request.shard
        while True:
            replica = self._local(shard)
            if replica is not None and replica.status.code == PRIMARY:
                return await self._stat_local(replica, request)
            state = await read_state(self.keyspace, self.root)
            if shard not in state.items:
                return self._stat_status(consumer_pb.SHARD_NOT_FOUND, state)
            primary = state.primary_of(shard)
            if primary is None:
                # With no assignment and no member at all, the Service was told to run
                # its shards as primaries (allocate=False): a local replica is the primary.
                if replica is None or state.assignments_of(shard) or state.members:
                    return self._stat_status(consumer_pb.NO_SHARD_PRIMARY, state)
            elif not self._is_me(state, primary.member):
                if request.HasField("header"):  # forwarded once already: don't bounce it on
                    return self._stat_status(consumer_pb.NOT_SHARD_PRIMARY, state, shard)
                return await self._proxy(request, state, primary.member, context)
            # The primary is (to be) here: wait for the replica to get there, re-resolving
            # now and then in case the assignment moves meanwhile.
            if replica is not None and replica.status.code == FAILED:
                return self._stat_status(consumer_pb.SHARD_STOPPED, state, shard)
            if self.service is None:
                return self._stat_status(consumer_pb.NOT_SHARD_PRIMARY, state, shard)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.service.changed.wait(), _LOCAL_POLL)

    def _stat_status(
        self, status: int, state: AllocState, shard: str | None = None
    ) -> consumer_pb.StatResponse:
        route = shard_route(state, shard)[0] if shard else None
        return consumer_pb.StatResponse(
            status=status, header=_header(state.revision, self.member_id, route)
        )

    async def _stat_local(
        self, replica: Replica, request: consumer_pb.StatRequest
    ) -> consumer_pb.StatResponse:
        """Wait until the replica's committed progress covers the request, then answer."""
        asked = dict(request.read_through)
        store = replica.store
        if store is not None and asked:
            asked = replica.app.read_through(replica.shard, store, asked)
        progress = replica.shard.progress
        sources = set(replica.shard.sources) | set(progress.read_through)
        wanted = {j: o for j, o in asked.items() if j in sources}
        while not progress.covers(wanted):
            if replica.status.code != PRIMARY:
                return consumer_pb.StatResponse(
                    status=consumer_pb.SHARD_STOPPED, header=await self._local_header()
                )
            changed = replica.changed
            await first_of([progress.wait_for(wanted), changed.wait()])
        return consumer_pb.StatResponse(
            status=consumer_pb.OK,
            header=await self._local_header(),
            read_through=progress.read_through,
            publish_at=progress.publish_at,
            extension=stat_extension(replica),
        )

    async def _local_header(self) -> pb.Header:
        return _header(await self.keyspace.revision(), self.member_id)

    async def _proxy(
        self,
        request: consumer_pb.StatRequest,
        state: AllocState,
        primary: MemberId,
        context: grpc.aio.ServicerContext,
    ) -> consumer_pb.StatResponse:
        """Forward the request to the primary member, marked as forwarded."""
        endpoint = _endpoint_of(state, primary)
        if not endpoint:
            return self._stat_status(consumer_pb.NO_SHARD_PRIMARY, state, request.shard)
        forwarded = consumer_pb.StatRequest()
        forwarded.CopyFrom(request)
        forwarded.header.CopyFrom(
            _header(state.revision, primary, shard_route(state, request.shard)[0])
        )
        async with grpc.aio.insecure_channel(normalize_address(endpoint)) as channel:
            stub = consumer_grpc.ShardStub(channel)
            try:
                return await stub.Stat(forwarded, timeout=context.time_remaining())
            except grpc.aio.AioRpcError as err:
                await context.abort(
                    err.code(),
                    f"forwarding Stat of {request.shard} to its "
                    f"primary {primary} at {endpoint}: {err.details()}",
                )
        raise AssertionError("unreachable")


# --- serving a member ----------------------------------------------------------------


def _pair_free(host: str, port: int) -> bool:
    """Whether `port` (for HTTP) can be bound on `host` right now."""
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


async def serve_member_apis(
    member: Member, host: str = "127.0.0.1", port: int = 0
) -> tuple[grpc.aio.Server, web.AppRunner, int]:
    """Start a member's gRPC Shard API on `port` and its HTTP API on `port + 1`.

    With port 0 a free pair is picked. Sets `member.options.endpoint` when it
    is empty, so call this before `member.start()` announces the member.
    Stop with `await server.stop(grace)` and `await runner.cleanup()`.
    """
    for _ in range(50):
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE),
                ("grpc.max_send_message_length", MAX_MESSAGE),
                ("grpc.so_reuseport", 0),
            ]
        )
        try:
            bound = server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:
            bound = 0
        if bound == 0:
            raise OSError(f"cannot listen on {host}:{port} (is the port in use?)")
        if port == 0 and (bound >= 65535 or not _pair_free(host, bound + 1)):
            await server.stop(None)
            continue
        endpoint = f"grpc://{host}:{bound}"
        if not member.options.endpoint:
            member.options.endpoint = endpoint
        api = ShardAPI(
            member.keyspace,
            member.config.keyspace_root,
            member.service,
            endpoint,
            member.options.member_id(),
        )
        consumer_grpc.add_ShardServicer_to_server(api, server)
        await server.start()
        try:
            runner = await start_http(member.service, host, bound + 1)
        except OSError:
            await server.stop(None)
            if port != 0:
                raise
            continue
        log.info(
            "member %s: Shard API on %s, HTTP on %s:%d",
            member.options.member_id(),
            endpoint,
            host,
            bound + 1,
        )
        return server, runner, bound
    raise OSError(f"found no free pair of ports on {host}")
