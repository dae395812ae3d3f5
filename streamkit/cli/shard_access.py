"""Where `streamkit shards …` reaches an app's shards: its KeySpace, or one member's Shard API.

By default the commands work on the app's KeySpace directly, with the same
functions the members' Shard API serves (Stat alone goes to the shard's
primary, found in the KeySpace). With `--consumer URL` (or gazctl's
`$CONSUMER_ADDRESS`) they call that member's Shard API instead, as gazctl
does: for operators who can reach a member but not the KeySpace. Both sides
answer with the Shard service's own response messages, so a command doesn't
care which one it has.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import grpc

from streamkit.app.shard_ops import (
    apply_shards,
    get_hints,
    list_shards,
    read_state,
    unassign_shards,
)
from streamkit.app.stat_client import StatClient, find_primary
from streamkit.auth.settings import Security
from streamkit.auth.signer import Metadata
from streamkit.auth.tls import presents_certificate, tls_trouble, without_ok
from streamkit.auth.tokens import Capability
from streamkit.cli.errors import CliError
from streamkit.client.broker_client import normalize_address
from streamkit.errors import StreamkitError
from streamkit.keyspace.keyspace import KeySpace
from streamkit.protocol import consumer_pb, pb
from streamkit.protocol import consumer_pb2_grpc as consumer_grpc
from streamkit.protocol.labels import label_set

__all__ = ["CONSUMER_ENV", "KeySpaceShards", "MemberShards", "ShardAccess", "Unreachable"]

CONSUMER_ENV = "CONSUMER_ADDRESS"  # gazctl's name for a consumer member's address
Changes = Sequence[consumer_pb.ApplyRequest.Change]


class Unreachable(StreamkitError):
    """A Stat could not get an answer: `status` is the Shard service's reason, or the RPC
    error is attached as the cause; `where` names whom the call went to."""

    def __init__(self, status: int = consumer_pb.OK, where: str = "") -> None:
        super().__init__(consumer_pb.Status.Name(status))
        self.status, self.where = status, where


def _unreachable(err: grpc.aio.AioRpcError, shard: str, where: str, endpoint: str,
                 security: Security) -> Exception:
    """What a failed Stat raises: Unreachable, with the RPC error as its cause; or, when TLS
    with the member failed, a CliError saying what to change (gRPC's "Socket closed" alone
    reads like a member that is down)."""
    if err.code() == grpc.StatusCode.UNAVAILABLE and (advice := tls_trouble(
            err.details() or "", tls=endpoint.lower().startswith("https://"), peer="member",
            client_cert=presents_certificate(security.client_tls))):
        return CliError(f"shard {shard}'s primary {where}: TLS failed: {advice} "
                        f"({without_ok(err.details() or '')})")
    return Unreachable(where=where)


class ShardAccess(abc.ABC):
    """The Shard service's five calls, answered from wherever the shards were reached."""

    @abc.abstractmethod
    async def list(self, selector: pb.LabelSelector | None = None
                   ) -> consumer_pb.ListResponse: ...

    @abc.abstractmethod
    async def apply(self, changes: Changes) -> consumer_pb.ApplyResponse: ...

    @abc.abstractmethod
    async def unassign(self, shards: Sequence[str], *, only_failed: bool,
                       dry_run: bool) -> consumer_pb.UnassignResponse: ...

    @abc.abstractmethod
    async def hints(self, shard: str) -> consumer_pb.GetHintsResponse: ...

    @abc.abstractmethod
    async def stat(self, request: consumer_pb.StatRequest, timeout: float
                   ) -> tuple[consumer_pb.StatResponse, str, str]:
        """The shard's Stat, the member that answered it and the endpoint called; raises
        Unreachable (with the RPC error as its cause when the call failed)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release what the calls opened."""


class KeySpaceShards(ShardAccess):
    """The app's KeySpace, read and written as the members' Shard API does."""

    def __init__(self, keyspace: KeySpace, root: str, security: Security) -> None:
        self.keyspace, self.root = keyspace, root
        self._stats = StatClient(security)

    async def list(self, selector: pb.LabelSelector | None = None) -> consumer_pb.ListResponse:
        return await list_shards(self.keyspace, self.root, selector)

    async def apply(self, changes: Changes) -> consumer_pb.ApplyResponse:
        return await apply_shards(self.keyspace, self.root, changes)

    async def unassign(self, shards: Sequence[str], *, only_failed: bool,
                       dry_run: bool) -> consumer_pb.UnassignResponse:
        return await unassign_shards(self.keyspace, self.root, shards,
                                     only_failed=only_failed, dry_run=dry_run)

    async def hints(self, shard: str) -> consumer_pb.GetHintsResponse:
        return await get_hints(self.keyspace, self.root, shard)

    async def stat(self, request: consumer_pb.StatRequest, timeout: float
                   ) -> tuple[consumer_pb.StatResponse, str, str]:
        state = await read_state(self.keyspace, self.root)
        if request.shard not in state.items:
            raise Unreachable(consumer_pb.SHARD_NOT_FOUND)
        primary = find_primary(state, request.shard)
        if primary is None:
            raise Unreachable(consumer_pb.NO_SHARD_PRIMARY)
        try:
            response = await self._stats.stat(primary.endpoint, request, timeout=timeout)
        except grpc.aio.AioRpcError as err:
            raise _unreachable(err, request.shard, f"{primary.member} at {primary.endpoint}",
                               primary.endpoint, self._stats.security) from err
        return response, str(primary.member), primary.endpoint

    async def close(self) -> None:
        await self._stats.close()


class MemberShards(ShardAccess):
    """One member's Shard API: it reads the KeySpace for us, and forwards a Stat to the
    shard's primary. With keys, each call carries a token for just what it needs."""

    def __init__(self, address: str, security: Security) -> None:
        self.address = normalize_address(address)
        self._channel = security.open_channel(self.address)
        self._stub = consumer_grpc.ShardStub(self._channel)
        self._signer = security.signer()
        self._security = security

    def _token(self, cap: Capability, shard: str | None = None) -> Metadata | None:
        if self._signer is None:
            return None
        if shard is not None:
            return self._signer.for_shard(cap, shard)
        return self._signer.for_selector(cap)

    async def list(self, selector: pb.LabelSelector | None = None) -> consumer_pb.ListResponse:
        request = consumer_pb.ListRequest(selector=selector or pb.LabelSelector())
        return await self._stub.List(request, metadata=self._token(Capability.LIST))

    async def apply(self, changes: Changes) -> consumer_pb.ApplyResponse:
        return await self._stub.Apply(consumer_pb.ApplyRequest(changes=list(changes)),
                                      metadata=self._token(Capability.APPLY))

    async def unassign(self, shards: Sequence[str], *, only_failed: bool,
                       dry_run: bool) -> consumer_pb.UnassignResponse:
        request = consumer_pb.UnassignRequest(shards=list(shards), only_failed=only_failed,
                                              dry_run=dry_run)
        return await self._stub.Unassign(request, metadata=self._token(Capability.APPLY))

    async def hints(self, shard: str) -> consumer_pb.GetHintsResponse:
        return await self._stub.GetHints(consumer_pb.GetHintsRequest(shard=shard),
                                         metadata=self._token(Capability.READ, shard))

    async def stat(self, request: consumer_pb.StatRequest, timeout: float
                   ) -> tuple[consumer_pb.StatResponse, str, str]:
        try:
            response = await self._stub.Stat(request, timeout=timeout,
                                             metadata=self._token(Capability.READ, request.shard))
        except grpc.aio.AioRpcError as err:
            raise _unreachable(err, request.shard, f"through member {self.address}",
                               self.address, self._security) from err
        answered = response.header.process_id  # the primary, when the member forwarded it
        member = f"{answered.zone}#{answered.suffix}" if answered.suffix else self.address
        return response, member, await self._primary_endpoint(request.shard) or self.address

    async def _primary_endpoint(self, shard: str) -> str | None:
        """The endpoint of the shard's primary, as its route says (the member asked may
        have forwarded the Stat there: its own address would name the wrong member)."""
        try:
            listed = await self.list(pb.LabelSelector(include=label_set(("id", shard))))
        except grpc.aio.AioRpcError:  # a token without LIST, say: the member asked it is
            return None
        for found in listed.shards:
            route = found.route
            if found.spec.id == shard and 0 <= route.primary < len(route.endpoints):
                return route.endpoints[route.primary]
        return None

    async def close(self) -> None:
        await self._channel.close()
