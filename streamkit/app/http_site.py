"""The server side of a member's HTTP API (see `http_api`): its routes and handlers, on
`http_server`, behind the member's `Security` checks (`http_guards`).

Imported on the HTTP API's own thread when it starts, so that its imports overlap the
member's start instead of preceding it; the Prometheus client's wait for a scrape.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Iterable
from typing import Any

from streamkit.app.application import QueryError
from streamkit.app.http_api import replica_status
from streamkit.app.http_server import BodyTooLarge, HttpServer, Request, Response, json_response
from streamkit.app.metrics import ensure_registered
from streamkit.app.query_forward import FORWARDED, PrimaryOf, forward_query
from streamkit.app.replica import Replica
from streamkit.app.service import Service
from streamkit.auth.http_guards import Refusal, guarded
from streamkit.auth.scope import require_everything, require_shard, shard_allowed
from streamkit.auth.settings import Security, body_too_large
from streamkit.auth.tokens import Capability
from streamkit.protocol import consumer_pb

__all__ = ["Handlers", "start_site"]

log = logging.getLogger(__name__)

Code = consumer_pb.ReplicaStatus.Code


_QUERY = "/query/"


def _capability_for(request: Request) -> Capability:
    """READ to query a shard; LIST for /status and /metrics (and anything else)."""
    if request.path.startswith(_QUERY):
        return Capability.READ
    return Capability.LIST


def _error(status: int, message: str) -> Response:
    return json_response({"error": message}, status)


def _refused(refusal: Refusal) -> Response:
    return Response(refusal.status, f"{refusal.message}\n".encode(), headers=refusal.headers())


class Handlers:
    def __init__(self, service: Service, member_loop: asyncio.AbstractEventLoop,
                 query_timeout: float, security: Security,
                 primary_of: PrimaryOf | None) -> None:
        self.service = service
        self.member_loop = member_loop
        self.query_timeout = query_timeout
        self.security = security
        self.primary_of = primary_of

    async def route(self, request: Request) -> Response:
        """The route's answer: GET (or HEAD) /metrics and /status, POST /query/SHARD."""
        path, method = request.path, request.method
        if path.startswith(_QUERY) and len(path) > len(_QUERY):
            if method == "POST":
                return await self.query(request, path[len(_QUERY):])
            allowed = "POST"
        elif path in ("/metrics", "/status"):
            if method in ("GET", "HEAD"):
                return await (self.metrics() if path == "/metrics" else self.status())
            allowed = "GET, HEAD"
        else:
            return Response(404, b"404: Not Found")
        return Response(405, b"405: Method Not Allowed", headers={"Allow": allowed})

    async def metrics(self) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        require_everything("/metrics")
        ensure_registered()
        return Response(body=generate_latest(), content_type=CONTENT_TYPE_LATEST)

    async def status(self) -> Response:
        replicas = sorted((r for r in self.service.replicas.values()
                           if shard_allowed(r.id, r.shard.spec.labels)), key=lambda r: r.id)
        return json_response([replica_status(r) for r in replicas])

    async def query(self, request: Request, shard: str) -> Response:
        replica = self.service.replicas.get(shard)
        require_shard(shard, replica.shard.spec.labels if replica is not None else None)
        if replica is None or replica.status.code != Code.PRIMARY:
            return await self._elsewhere(request, shard, replica)
        try:
            body = json.loads(await request.read() or b"null")
        except BodyTooLarge:
            return _error(413, body_too_large(self.security.max_body))
        except (ValueError, UnicodeDecodeError) as err:
            return _error(400, f"the request body is not JSON: {err}")
        except RecursionError:  # "[[[[..." a hundred thousand deep
            return _error(400, "the request body is JSON nested too deeply")
        if not isinstance(body, dict):
            return _error(400, f"the query must be a JSON object (got {type(body).__name__})")
        answering = asyncio.run_coroutine_threadsafe(_answer(replica, body), self.member_loop)
        try:
            async with asyncio.timeout(self.query_timeout):
                status, text = await asyncio.wrap_future(answering)
        except TimeoutError:
            answering.cancel()
            return _error(503, f"shard {shard} did not answer within {self.query_timeout:g}s"
                          f"{_stuck_in(replica, list(self.service.replicas.values()))}")
        if status != 200:
            return _error(status, text)
        return Response(body=text.encode(), content_type="application/json")

    async def _elsewhere(self, request: Request, shard: str,
                         replica: Replica | None) -> Response:
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
        except BodyTooLarge:
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
    except asyncio.CancelledError as err:
        task = asyncio.current_task()
        if task is not None and task.cancelling():  # ours (timed out): not the app's doing
            raise
        return _query_failed(replica, err)
    except BaseException as err:  # SystemExit, KeyboardInterrupt too: the member serves on
        return _query_failed(replica, err)
    try:  # NaN and infinities aren't JSON: clients would choke on them
        return 200, json.dumps(answer, allow_nan=False)
    except (TypeError, ValueError) as err:
        return 500, f"the query's answer is not JSON-serializable: {err}"
    except RecursionError:
        return 500, "the query's answer is not JSON-serializable: it is nested too deeply"


def _query_failed(replica: Replica, err: BaseException) -> tuple[int, str]:
    # With the app's frames (if it raised in its own code): the answer names only the error.
    log.warning("query of shard %s failed: %s: %s%s", replica.id, type(err).__name__, err,
                replica.app_traceback(err))
    return 500, f"query failed: {type(err).__name__}: {err}"


def _stuck_in(replica: Replica, replicas: Iterable[Replica]) -> str:
    """What a 503 adds when the shard is running a hook right now (likely the stuck one),
    or else another shard of the member runs a plain hook, which holds every shard's loop."""
    hook = replica.running_hook()
    if hook is not None:
        return f" (it is running {hook}: see the member's log for where)"
    for other in replicas:
        if other is not replica and (hook := other.running_hook(holding_the_loop=True)):
            return (f" (shard {other.id} of the same member is running {hook}, which holds "
                    "every shard of the member: see the member's log for where)")
    return ""


async def start_site(
    handlers: Handlers, host: str, port: int, sock: socket.socket | None, security: Security
) -> HttpServer:
    """Serve `handlers` on `sock` (or host:port), every request checked by `security`'s
    Host, origin and token rules first."""
    check = security.http_guard(_capability_for, host)

    async def handle(request: Request) -> Response:
        return await guarded(check, request, handlers.route, _refused)

    server = HttpServer(handle, max_body=security.max_body,
                        ssl_context=security.http_ssl_context())
    await server.start(host, port, sock)
    return server
