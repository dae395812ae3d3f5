"""Starting a member's network APIs: the gRPC Shard API, and the HTTP API on the next port.

A member's HTTP port is its gRPC port + 1: members announce only their gRPC
endpoint, and `streamkit run status` finds a member's /status from it. Both
ports are bound for real before either server starts, nothing is probed and
let go: the HTTP socket is bound first (with port 0, on a port the kernel
picks), then gRPC on the port below it; when that one is taken, the HTTP
socket is closed and another pair is tried. Another process (or member) can
therefore never take one of the pair in between, and two members starting at
once can't end up sharing a port.

A `Security` decides TLS on both (a member on TLS announces `https://`), the
token check on every Shard RPC (`SHARD_CAPABILITIES`) and HTTP request, and
refuses to listen beyond loopback without authorization.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from typing import TYPE_CHECKING, NamedTuple

import grpc

from streamkit.app.http_api import HttpApi, start_http
from streamkit.app.shard_api import ShardAPI
from streamkit.app.stat_client import find_primary
from streamkit.auth.grpc_auth import SHARD_CAPABILITIES
from streamkit.auth.settings import Security
from streamkit.protocol import consumer_pb2_grpc as consumer_grpc
from streamkit.sockets import listen

if TYPE_CHECKING:
    from streamkit.app.member import Member

__all__ = ["MemberAPIs", "serve_member_apis"]

log = logging.getLogger(__name__)

_ATTEMPTS = 50  # port pairs tried with port 0 before giving up

# Tasks closing a ShardAPI's channels to other members once its server stopped.
_closers: set[asyncio.Task[None]] = set()


class MemberAPIs(NamedTuple):
    """A member's running APIs: gRPC on `port`, HTTP on `port + 1`."""

    server: grpc.aio.Server
    runner: HttpApi
    port: int

    @property
    def http_port(self) -> int:
        return self.port + 1

    async def stop(self, grace: float | None = 1.0) -> None:
        """Stop both servers (gRPC calls get `grace` seconds to finish)."""
        await self.server.stop(grace)
        await self.runner.cleanup()


def _address(host: str, port: int) -> str:
    """host:port as gRPC and endpoints write it (IPv6 addresses in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _grpc_server(security: Security) -> grpc.aio.Server:
    return grpc.aio.server(
        interceptors=security.interceptors(SHARD_CAPABILITIES) or None,
        options=security.grpc_server_options(),
    )


async def _bind_pair(
    host: str, port: int, security: Security
) -> tuple[grpc.aio.Server, socket.socket] | None:
    """A gRPC server bound to a port (not started) and a socket listening on the next one.

    `port` 0: a pair the kernel's choice of the HTTP port gives, None when its
    gRPC port is taken. Otherwise exactly port and port + 1, or OSError.
    """
    try:
        http = listen(host, port + 1 if port else 0)
    except OSError as err:
        raise OSError(
            err.errno, f"cannot listen on {_address(host, port + 1)} for HTTP: {err.strerror}"
        ) from None
    grpc_port = port or http.getsockname()[1] - 1
    server = _grpc_server(security)
    try:
        if grpc_port <= 0:  # (the kernel gave the HTTP port 1)
            raise OSError("no port below the HTTP one")
        security.add_port(server, host, grpc_port)
    except OSError:
        http.close()
        await server.stop(None)  # nothing bound: this only releases the server
        if port:
            raise
        return None
    return server, http


def _primary_elsewhere(member: Member, shard: str) -> str | None:
    """The Shard API endpoint of `shard`'s primary when another member is, as the member's
    allocator last saw the KeySpace (read from the HTTP API's thread: a snapshot)."""
    allocator = member.allocator
    if allocator is None:
        return None
    primary = find_primary(allocator.state, shard)
    if primary is None or primary.member == member.options.member_id():
        return None
    return primary.endpoint


async def serve_member_apis(
    member: Member,
    host: str = "127.0.0.1",
    port: int = 0,
    security: Security | None = None,
    advertise: str | None = None,
    *,
    wait_http: bool = True,
) -> MemberAPIs:
    """Start a member's gRPC Shard API on `port` and its HTTP API on `port + 1`.

    With port 0 a free pair is picked. OSError when the ports given are taken;
    `Exposed` when `host` is beyond loopback and `security` authorizes nobody.
    Sets `member.options.endpoint` when it is empty (`security.endpoint`: the
    machine's name for a wildcard `host`; `advertise` names the host others reach it
    by instead), so call this before
    `member.start()` announces the member. Stop with `await apis.stop()` (or
    `await server.stop(grace)` and `await runner.cleanup()`); the Shard API's
    channels to other members close once its server stopped. With `wait_http`
    False the HTTP API may still be starting on its thread (its port already
    listens, so requests wait in the backlog): await `runner.ready()` after the
    member's own start, which its start then overlaps.
    """
    if not 0 <= port < 65535:
        raise ValueError(f"port must be 0..65534, the HTTP API taking the next (got {port})")
    security = security or Security()
    security.check_exposure(host, port, "the member")
    pair = None
    for _ in range(1 if port else _ATTEMPTS):
        pair = await _bind_pair(host, port, security)
        if pair is not None:
            break
    if pair is None:
        raise OSError(f"found no free pair of adjacent ports on {host}")
    server, http = pair
    bound = port or http.getsockname()[1] - 1
    endpoint = security.endpoint(advertise or host, bound)
    for concern in security.certificate_concerns(advertise or host):
        log.warning("%s", concern)
    if not member.options.endpoint:
        member.options.endpoint = endpoint
    api = ShardAPI(
        member.keyspace,
        member.config.keyspace_root,
        member.service,
        member.options.endpoint,
        member.options.member_id(),
        security=security,
    )
    consumer_grpc.add_ShardServicer_to_server(api, server)
    try:
        await server.start()
        runner = await start_http(
            member.service, host, sock=http, query_timeout=member.runtime.watchdog.limit,
            security=security, primary_of=functools.partial(_primary_elsewhere, member),
            wait=wait_http,
        )
    except BaseException:
        http.close()
        await server.stop(None)
        await api.close()
        raise
    _close_when_stopped(server, api)
    log.info(
        "member %s: Shard API on %s, HTTP on %s (%s)",
        member.options.member_id(),
        endpoint,
        _address(host, bound + 1),
        security.describe(),
    )
    return MemberAPIs(server, runner, bound)


def _close_when_stopped(server: grpc.aio.Server, api: ShardAPI) -> None:
    """Close `api`'s channels once `server` stopped, however its owner stops it."""

    async def close() -> None:
        await server.wait_for_termination()
        await api.close()

    task = asyncio.get_running_loop().create_task(close(), name="close Shard API channels")
    _closers.add(task)
    task.add_done_callback(_closers.discard)
