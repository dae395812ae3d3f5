"""The aiohttp side of a member's HTTP API (see `http_api`): its handlers and its site.

Imported on the HTTP API's own thread when it starts, so that aiohttp's import
(a tenth of a second) overlaps the member's start instead of preceding it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from streamkit.app.application import QueryError
from streamkit.app.http_api import SHUTDOWN_TIMEOUT, replica_status
from streamkit.app.query_forward import FORWARDED, PrimaryOf, forward_query
from streamkit.app.replica import Replica
from streamkit.app.service import Service
from streamkit.auth.scope import require_shard, shard_allowed
from streamkit.auth.settings import Security, body_too_large
from streamkit.auth.tokens import Capability
from streamkit.protocol import consumer_pb

__all__ = ["Handlers", "start_site"]

log = logging.getLogger(__name__)

Code = consumer_pb.ReplicaStatus.Code


def _capability_for(request: web.Request) -> Capability:
    """READ to query a shard; LIST for /status and /metrics (and anything else)."""
    if request.path.startswith("/query/"):
        return Capability.READ
    return Capability.LIST


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class Handlers:
    def __init__(self, service: Service, member_loop: asyncio.AbstractEventLoop,
                 query_timeout: float, security: Security,
                 primary_of: PrimaryOf | None) -> None:
        self.service = service
        self.member_loop = member_loop
        self.query_timeout = query_timeout
        self.security = security
        self.primary_of = primary_of

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def status(self, request: web.Request) -> web.Response:
        replicas = sorted((r for r in self.service.replicas.values()
                           if shard_allowed(r.id, r.shard.spec.labels)), key=lambda r: r.id)
        return web.json_response([replica_status(r) for r in replicas])

    async def query(self, request: web.Request) -> web.Response:
        shard = request.match_info["shard"]
        replica = self.service.replicas.get(shard)
        require_shard(shard, replica.shard.spec.labels if replica is not None else None)
        if replica is None or replica.status.code != Code.PRIMARY:
            return await self._elsewhere(request, shard, replica)
        try:
            body = json.loads(await request.read() or b"null")
        except web.HTTPRequestEntityTooLarge:
            return _error(413, body_too_large(self.security.max_body))
        except (ValueError, UnicodeDecodeError) as err:
            return _error(400, f"the request body is not JSON: {err}")
        if not isinstance(body, dict):
            return _error(400, f"the query must be a JSON object (got {type(body).__name__})")
        answering = asyncio.run_coroutine_threadsafe(_answer(replica, body), self.member_loop)
        try:
            async with asyncio.timeout(self.query_timeout):
                status, text = await asyncio.wrap_future(answering)
        except TimeoutError:
            answering.cancel()
            return _error(503, f"shard {shard} did not answer within {self.query_timeout:g}s"
                          f"{_stuck_in(replica)}")
        if status != 200:
            return _error(status, text)
        return web.Response(text=text, content_type="application/json")

    async def _elsewhere(self, request: web.Request, shard: str,
                         replica: Replica | None) -> web.Response:
        """A query of a shard not primary here: forwarded to its primary, unless it was
        forwarded here already or the shard has no primary elsewhere (404)."""
        endpoint = None
        if self.primary_of is not None and FORWARDED not in request.headers:
            endpoint = self.primary_of(shard)
        if endpoint is None:
            if replica is None:
                return _error(404, f"shard {shard} is not run by this member, and has no "
                                   "primary elsewhere right now")
            state = Code.Name(replica.status.code)
            return _error(404, f"shard {shard} is not primary here (its replica is {state})")
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, body_too_large(self.security.max_body))
        return await forward_query(endpoint, shard, body, request.headers.get("Authorization"),
                                   self.security, self.query_timeout)


async def _answer(replica: Replica, body: dict[str, Any]) -> tuple[int, str]:
    """(HTTP status, JSON text or error message) of one query, on the member's loop: the
    answer is serialized there too, since it may be the application's live state."""
    try:
        answer = await replica.query(body)
    except QueryError as err:
        return 400, str(err) or type(err).__name__
    except Exception as err:
        log.warning("query of shard %s failed: %s: %s", replica.id, type(err).__name__, err)
        return 500, f"query failed: {type(err).__name__}: {err}"
    try:
        return 200, json.dumps(answer)
    except (TypeError, ValueError) as err:
        return 500, f"the query's answer is not JSON-serializable: {err}"


def _stuck_in(replica: Replica) -> str:
    """What a 503 adds when the shard is running a hook right now (likely the stuck one)."""
    loop = replica.loop
    if loop is None or loop.hooks.current is None:
        return ""
    hook, _, _, _ = loop.hooks.describe(loop.hooks.current)
    return f" (it is running {hook}: see the member's log for where)"


async def start_site(
    handlers: Handlers, host: str, port: int, sock: socket.socket | None, security: Security
) -> web.AppRunner:
    guard = security.http_middleware(_capability_for, host)
    app = web.Application(client_max_size=security.max_body, middlewares=[guard])
    app.router.add_get("/metrics", handlers.metrics)
    app.router.add_get("/status", handlers.status)
    app.router.add_post("/query/{shard:.+}", handlers.query)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT)
    await runner.setup()
    try:
        ssl_context = security.http_ssl_context()
        site = (web.SockSite(runner, sock, ssl_context=ssl_context) if sock is not None
                else web.TCPSite(runner, host, port, ssl_context=ssl_context))
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
