"""Calling Stat on a shard's primary member, over one cached channel per member.

Stat is the one Shard RPC the KeySpace can't answer: only the shard's primary
knows how far the shard got. `streamkit shards stat` and a member forwarding a
Stat it can't answer itself route it the same way: find the primary and its
endpoint in a KeySpace snapshot and call Stat there. This module is that
route and that call, with the channel to each member kept open between calls
instead of dialled per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from streamkit.app.assignment import AllocState, MemberId
from streamkit.app.shard_ops import endpoint_of, response_header, shard_route
from streamkit.auth.settings import Security
from streamkit.auth.tokens import Capability
from streamkit.client.broker_client import normalize_address
from streamkit.client.closing import AsyncClosing
from streamkit.protocol import consumer_pb
from streamkit.protocol import consumer_pb2_grpc as consumer_grpc

__all__ = ["Primary", "StatClient", "find_primary", "forwarded"]

_Connectivity = grpc.ChannelConnectivity


@dataclass(frozen=True)
class Primary:
    """A shard's primary member and the endpoint of its Shard API."""

    member: MemberId
    endpoint: str


def find_primary(state: AllocState, shard: str) -> Primary | None:
    """The shard's primary as `state` has it; None without a primary or without an endpoint
    to reach it (a member that left, or one that never announced one)."""
    assignment = state.primary_of(shard)
    if assignment is None:
        return None
    endpoint = endpoint_of(state, assignment.member)
    return Primary(assignment.member, endpoint) if endpoint else None


def forwarded(
    request: consumer_pb.StatRequest, state: AllocState, primary: MemberId
) -> consumer_pb.StatRequest:
    """A copy of `request` marked (with a header, as Gazette's peers set one) as forwarded,
    so that the member receiving it answers instead of forwarding it again."""
    copy = consumer_pb.StatRequest()
    copy.CopyFrom(request)
    copy.header.CopyFrom(
        response_header(state.revision, primary, shard_route(state, request.shard)[0])
    )
    return copy


class StatClient(AsyncClosing):
    """Stat calls to members, one gRPC channel per endpoint, opened on first use.

    A channel found broken after a failed call is dropped, so members that went
    away don't pile up. Close with `close()` (or use as an async context manager).
    `security` dials `https://` members with TLS and, with keys, signs each call a
    token for READ of the one shard asked about.
    """

    def __init__(self, security: Security | None = None) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.security = security or Security()
        self._signer = self.security.signer()

    @property
    def endpoints(self) -> list[str]:
        """The members (host:port) a channel is open to."""
        return list(self._channels)

    def _channel(self, endpoint: str) -> grpc.aio.Channel:
        target = normalize_address(endpoint)
        channel = self._channels.get(target)
        if channel is None:
            channel = self._channels[target] = self.security.open_channel(target)
        return channel

    async def stat(
        self, endpoint: str, request: consumer_pb.StatRequest, *, timeout: float | None
    ) -> consumer_pb.StatResponse:
        """Stat at the member serving `endpoint`; raises grpc.aio.AioRpcError as the call does."""
        channel = self._channel(endpoint)
        metadata = (self._signer.for_shard(Capability.READ, request.shard)
                    if self._signer is not None else None)
        try:
            return await consumer_grpc.ShardStub(channel).Stat(request, timeout=timeout,
                                                               metadata=metadata)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                await self._drop_if_broken(normalize_address(endpoint), channel)
            raise

    async def _drop_if_broken(self, target: str, channel: grpc.aio.Channel) -> None:
        """Forget `channel` if it can't connect: its member is gone or moved. A member
        answering UNAVAILABLE itself (KeySpace trouble) keeps its channel."""
        state = channel.get_state(try_to_connect=False)
        if state in (_Connectivity.TRANSIENT_FAILURE, _Connectivity.SHUTDOWN):
            if self._channels.get(target) is channel:
                del self._channels[target]
            await channel.close()

    async def close(self) -> None:
        """Close every channel (cancelling calls still under way on them)."""
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
