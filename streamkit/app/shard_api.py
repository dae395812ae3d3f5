"""The consumer Shard service a member serves over gRPC: Stat, List, Apply, GetHints, Unassign.

List, Apply, GetHints and Unassign are the KeySpace operations of
`streamkit.app.shard_ops`. Stat needs the shard's primary: a member answers for
its own primaries and forwards the request (with `StatClient`) to the member
the KeySpace names as primary otherwise. A forwarded request carries a header
(as Gazette's peers set one), and a member never forwards a request that
already has one, so a stale view can't bounce a request around.

Errors become statuses by type: `BadRequest` (the client's mistake) is
INVALID_ARGUMENT naming the field, `CorruptHints` DATA_LOSS, KeySpace trouble
UNAVAILABLE, an authorization refusal UNAUTHENTICATED or PERMISSION_DENIED,
and anything else — a bug, or the application's `read_through`
failing — INTERNAL, logged with its traceback. A ValueError is not taken for a
bad request: only the request checks say what is the client's fault.

With auth keys, the server's `ServerAuth` interceptor (SHARD_CAPABILITIES)
checks each call's capability and binds its claims; the shards they don't
cover (by `id` and labels) are then left out of List, and Stat, GetHints,
Apply and Unassign of them are refused with PERMISSION_DENIED naming the shard,
as Gazette's consumer does. Apply checks a shard's labels before and after the
change, so a token can't move a shard into or out of its reach.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from streamkit.app.assignment import FAILED, PRIMARY, AllocState, MemberId
from streamkit.app.shard_ops import (
    BadRequest,
    CorruptHints,
    apply_shards,
    check_shard_id,
    endpoint_of,
    get_hints,
    list_shards,
    read_state,
    response_header,
    shard_route,
    unassign_shards,
)
from streamkit.app.stat_client import StatClient, find_primary, forwarded
from streamkit.app.waits import first_of
from streamkit.auth.grpc_auth import status_code
from streamkit.auth.scope import current_claims, require_shard, shard_allowed
from streamkit.auth.settings import Security
from streamkit.auth.tokens import AuthError
from streamkit.client.broker_client import normalize_address
from streamkit.keyspace.keyspace import KeySpace, KeySpaceError
from streamkit.protocol import consumer_pb, pb
from streamkit.protocol import consumer_pb2_grpc as consumer_grpc

if TYPE_CHECKING:
    from streamkit.app.replica import Replica
    from streamkit.app.service import Service

__all__ = ["ShardAPI", "stat_extension"]

log = logging.getLogger(__name__)
T = TypeVar("T")

Code = consumer_pb.ReplicaStatus.Code
_LOCAL_POLL = 0.25  # seconds between re-checks while a local replica becomes primary


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
    check_shard_id(request.shard, "Stat: shard")
    for journal, offset in request.read_through.items():
        if offset < 0:
            raise BadRequest(f"Stat: read_through[{journal}]: offset must be >= 0 (got {offset})")


class ShardAPI(consumer_grpc.ShardServicer):
    """Serves the Shard API for one member (`service` None: a process running no shards).

    Stat requests forwarded to other members go through `stats` (by default a
    StatClient of this servicer's own, dialling with `security`, closed by `close()`).
    """

    def __init__(
        self,
        keyspace: KeySpace,
        root: str,
        service: Service | None,
        member_endpoint: str,
        member_id: MemberId | None = None,
        stats: StatClient | None = None,
        security: Security | None = None,
    ) -> None:
        self.keyspace = keyspace
        self.root = root.rstrip("/")
        self.service = service
        self.member_endpoint = member_endpoint
        self.member_id = member_id
        self._owns_stats = stats is None
        self.stats = stats if stats is not None else StatClient(security)

    async def close(self) -> None:
        """Close the channels to other members (when the StatClient is this servicer's own)."""
        if self._owns_stats:
            await self.stats.close()

    # --- plumbing ---

    async def _run(self, what: str, context: grpc.aio.ServicerContext, call: Awaitable[T]) -> T:
        """Await `call`, answering every failure with the gRPC status its type calls for."""
        try:
            return await call
        except grpc.aio.AbortError:
            raise  # `call` already chose the status
        except BadRequest as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except CorruptHints as err:
            await context.abort(grpc.StatusCode.DATA_LOSS, str(err))
        except KeySpaceError as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KeySpace: {err}")
        except AuthError as err:
            await context.abort(status_code(err), str(err))
        except Exception as err:
            log.exception("Shard API %s failed", what)
            await context.abort(grpc.StatusCode.INTERNAL, f"{what}: {type(err).__name__}: {err}")
        raise AssertionError("unreachable: abort raises")

    def _is_me(self, state: AllocState, member: MemberId) -> bool:
        if self.member_id is not None and member == self.member_id:
            return True
        endpoint = endpoint_of(state, member)
        return bool(endpoint) and normalize_address(endpoint) == normalize_address(
            self.member_endpoint
        )

    async def _require_shards(
        self, shards: Iterable[str], labels: dict[str, pb.LabelSet] | None = None
    ) -> None:
        """Raise PermissionDenied unless the call's claims cover each shard with its current
        labels (and with `labels[shard]`, what an Apply gives it). Without claims: nothing."""
        if current_claims() is None:
            return
        items = (await read_state(self.keyspace, self.root)).items
        for shard in shards:
            spec = items.get(shard)
            require_shard(shard, spec.labels if spec is not None else None)
            if labels is not None and shard in labels:
                require_shard(shard, labels[shard])

    def _local(self, shard: str) -> Replica | None:
        return self.service.replicas.get(shard) if self.service is not None else None

    # --- RPCs ---

    async def List(
        self, request: consumer_pb.ListRequest, context: Any
    ) -> consumer_pb.ListResponse:
        return await self._run("List", context, self._list(request))

    async def _list(self, request: consumer_pb.ListRequest) -> consumer_pb.ListResponse:
        response = await list_shards(self.keyspace, self.root, request.selector)
        if current_claims() is not None:
            kept = [s for s in response.shards if shard_allowed(s.spec.id, s.spec.labels)]
            del response.shards[:]
            response.shards.extend(kept)
        return response

    async def Apply(
        self, request: consumer_pb.ApplyRequest, context: Any
    ) -> consumer_pb.ApplyResponse:
        return await self._run("Apply", context, self._apply(request))

    async def _apply(self, request: consumer_pb.ApplyRequest) -> consumer_pb.ApplyResponse:
        changes = list(request.changes)
        upserts = {c.upsert.id: c.upsert.labels for c in changes if c.HasField("upsert")}
        await self._require_shards(
            [c.upsert.id if c.HasField("upsert") else c.delete for c in changes], upserts
        )
        return await apply_shards(self.keyspace, self.root, changes)

    async def GetHints(
        self, request: consumer_pb.GetHintsRequest, context: Any
    ) -> consumer_pb.GetHintsResponse:
        return await self._run("GetHints", context, self._get_hints(request))

    async def _get_hints(
        self, request: consumer_pb.GetHintsRequest
    ) -> consumer_pb.GetHintsResponse:
        await self._require_shards([request.shard])
        return await get_hints(self.keyspace, self.root, request.shard)

    async def Unassign(
        self, request: consumer_pb.UnassignRequest, context: Any
    ) -> consumer_pb.UnassignResponse:
        return await self._run("Unassign", context, self._unassign(request))

    async def _unassign(
        self, request: consumer_pb.UnassignRequest
    ) -> consumer_pb.UnassignResponse:
        await self._require_shards(request.shards)
        return await unassign_shards(
            self.keyspace,
            self.root,
            request.shards,
            only_failed=request.only_failed,
            dry_run=request.dry_run,
        )

    async def Stat(
        self, request: consumer_pb.StatRequest, context: Any
    ) -> consumer_pb.StatResponse:
        """Answer once the primary read through `read_through` (the RPC's deadline bounds it)."""
        return await self._run(f"Stat of {request.shard}", context, self._stat(request, context))

    async def _stat(
        self, request: consumer_pb.StatRequest, context: grpc.aio.ServicerContext
    ) -> consumer_pb.StatResponse:
        _check_stat(request)
        shard = request.shard
        await self._require_shards([shard])
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
                return await self._proxy(request, state, context)
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
            status=status, header=response_header(state.revision, self.member_id, route)
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
        return response_header(await self.keyspace.revision(), self.member_id)

    async def _proxy(
        self,
        request: consumer_pb.StatRequest,
        state: AllocState,
        context: grpc.aio.ServicerContext,
    ) -> consumer_pb.StatResponse:
        """Forward the request to the shard's primary member, marked as forwarded."""
        primary = find_primary(state, request.shard)
        if primary is None:  # the primary announced no endpoint
            return self._stat_status(consumer_pb.NO_SHARD_PRIMARY, state, request.shard)
        try:
            return await self.stats.stat(
                primary.endpoint,
                forwarded(request, state, primary.member),
                timeout=context.time_remaining(),
            )
        except grpc.aio.AioRpcError as err:
            await context.abort(
                err.code(),
                f"forwarding Stat of {request.shard} to its primary {primary.member} "
                f"at {primary.endpoint}: {err.details()}",
            )
        raise AssertionError("unreachable: abort raises")
