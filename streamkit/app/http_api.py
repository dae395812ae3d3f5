"""A member's HTTP API: Prometheus metrics, replica status, and application queries.

* ``GET /metrics``: every metric of the process, in Prometheus text format.
* ``GET /status``: a JSON list, one object per replica this process runs:
  id, status, errors, read_through, publish_at, transactions, messages, last_commit,
  write_heads (as the shard's readers last heard them: lag without asking the broker).
* ``POST /query/{shard}`` with a JSON object: the shard's `Application.query`
  answer as JSON. 400 for a body that isn't a JSON object or a QueryError,
  500 for any other failure of the query, 404 when the shard has no primary.

Queries are answered only by the shard's primary, which sees its committed
state. Any member takes a query: one for a shard whose primary runs
elsewhere is forwarded there (`streamkit.app.query_forward`).

The server runs on a thread with an event loop of its own, so that /status
and /metrics answer while user code blocks the member's loop (a stuck hook:
exactly when an operator asks). A query runs user code, so it runs on the
member's loop, for at most `query_timeout` seconds (the watchdog's hook
limit by default); past that the answer is 503, naming the hook the shard is
stuck in, if any.

Every request passes the member's `Security` middleware first: Host headers
that are not the member's own names are refused (DNS rebinding), as are
browsers' cross-origin writes; with auth keys, /status and /metrics need a
LIST token (they name the shards) and a query a READ token covering the shard
(by `id` and labels). /status leaves out shards the token doesn't cover.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import socket
import threading
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from streamkit.app import watchdog
from streamkit.app.application import QueryError
from streamkit.app.query_forward import FORWARDED, PrimaryOf, forward_query
from streamkit.app.replica import Replica
from streamkit.app.service import Service
from streamkit.auth.scope import require_shard, shard_allowed
from streamkit.auth.settings import Security, body_too_large
from streamkit.auth.tokens import Capability
from streamkit.protocol import consumer_pb

__all__ = ["HttpApi", "replica_status", "start_http"]

log = logging.getLogger(__name__)

Code = consumer_pb.ReplicaStatus.Code
_SHUTDOWN_TIMEOUT = 2.0


def replica_status(replica: Replica) -> dict[str, Any]:
    """One replica's state as the /status document shows it."""
    progress = replica.shard.progress
    loop = replica.loop
    return {
        "id": replica.id,
        "status": Code.Name(replica.status.code),
        "errors": list(replica.status.errors),
        "read_through": dict(progress.read_through),
        "publish_at": dict(progress.publish_at),
        "transactions": replica.shard.transactions,
        "messages": replica.shard.messages,
        "last_commit": loop.last_commit if loop is not None else None,
        "write_heads": dict(loop.source.write_heads) if loop is not None else {},
    }


def _capability_for(request: web.Request) -> Capability:
    """READ to query a shard; LIST for /status and /metrics (and anything else)."""
    if request.path.startswith("/query/"):
        return Capability.READ
    return Capability.LIST


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class _Handlers:
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


class HttpApi:
    """The HTTP API of a member's replicas, served from a thread of its own.

    `start()` returns once the server listens; `cleanup()` stops it (the name of
    aiohttp's AppRunner method it stands in for).
    """

    def __init__(self, service: Service, query_timeout: float | None = None,
                 security: Security | None = None, primary_of: PrimaryOf | None = None) -> None:
        self.service = service
        self.security = security or Security()
        self.primary_of = primary_of
        self.query_timeout = watchdog.HOOK_TIMEOUT if query_timeout is None else query_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    async def start(self, host: str, port: int, sock: socket.socket | None) -> None:
        handlers = _Handlers(self.service, asyncio.get_running_loop(), self.query_timeout,
                             self.security, self.primary_of)
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._serve, args=(handlers, host, port, sock, started),
            name="member HTTP API", daemon=True,
        )
        self._thread.start()
        await asyncio.wrap_future(started)

    def _serve(self, handlers: _Handlers, host: str, port: int, sock: socket.socket | None,
               started: concurrent.futures.Future[None]) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            self._runner = loop.run_until_complete(
                _start_site(handlers, host, port, sock, self.security))
        except BaseException as err:
            started.set_exception(err)
            loop.close()
            return
        started.set_result(None)
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def cleanup(self) -> None:
        """Stop serving: in-flight requests get aiohttp's shutdown timeout."""
        loop, runner, thread = self._loop, self._runner, self._thread
        self._runner = self._thread = None
        if loop is None or runner is None or thread is None:
            return
        done = asyncio.run_coroutine_threadsafe(runner.cleanup(), loop)
        try:
            await asyncio.wait_for(asyncio.wrap_future(done), _SHUTDOWN_TIMEOUT + 1)
        except TimeoutError:
            log.warning("the HTTP API did not stop within %gs", _SHUTDOWN_TIMEOUT + 1)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            await asyncio.to_thread(thread.join, _SHUTDOWN_TIMEOUT)


async def start_http(
    service: Service,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    sock: socket.socket | None = None,
    query_timeout: float | None = None,
    security: Security | None = None,
    primary_of: PrimaryOf | None = None,
) -> HttpApi:
    """Serve the HTTP API of `service`'s replicas on `host:port`, or on `sock` (bound and
    listening on `host`: the caller chose the port for real); stop with `await
    api.cleanup()`. `security`: TLS, Host allow-list (names of `host`) and tokens.
    `primary_of` finds where to forward a query of a shard not primary here (None: 404)."""
    api = HttpApi(service, query_timeout, security, primary_of)
    await api.start(host, port, sock)
    return api


async def _start_site(
    handlers: _Handlers, host: str, port: int, sock: socket.socket | None, security: Security
) -> web.AppRunner:
    guard = security.http_middleware(_capability_for, host)
    app = web.Application(client_max_size=security.max_body, middlewares=[guard])
    app.router.add_get("/metrics", handlers.metrics)
    app.router.add_get("/status", handlers.status)
    app.router.add_post("/query/{shard:.+}", handlers.query)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=_SHUTDOWN_TIMEOUT)
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
