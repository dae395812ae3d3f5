"""A member's HTTP API: Prometheus metrics, replica status, and application queries.

* ``GET /metrics``: every metric of the process, in Prometheus text format.
* ``GET /status``: a JSON list, one object per replica this process runs:
  id, status, errors, read_through, publish_at, transactions, messages, last_commit,
  write_heads (as the shard's readers last heard them: lag without asking the broker).
* ``POST /query/{shard}`` with a JSON object: the shard's `Application.query`
  answer as JSON. 404 when the shard isn't primary here, 400 for a body that
  isn't a JSON object or a QueryError, 500 for any other failure of the query.

Queries are answered only by the shard's primary, which sees its committed
state; a client finds the primary with `streamkit shards list` (or the
Shard API's List route).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from streamkit.app.application import QueryError
from streamkit.app.replica import Replica
from streamkit.app.service import Service
from streamkit.protocol import consumer_pb

__all__ = ["replica_status", "start_http"]

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


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class _Handlers:
    def __init__(self, service: Service) -> None:
        self.service = service

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def status(self, request: web.Request) -> web.Response:
        replicas = sorted(self.service.replicas.values(), key=lambda r: r.id)
        return web.json_response([replica_status(r) for r in replicas])

    async def query(self, request: web.Request) -> web.Response:
        shard = request.match_info["shard"]
        replica = self.service.replicas.get(shard)
        if replica is None:
            return _error(404, f"shard {shard} is not run by this member")
        if replica.status.code != Code.PRIMARY:
            state = Code.Name(replica.status.code)
            return _error(404, f"shard {shard} is not primary here (its replica is {state})")
        try:
            body = json.loads(await request.read() or b"null")
        except (ValueError, UnicodeDecodeError) as err:
            return _error(400, f"the request body is not JSON: {err}")
        if not isinstance(body, dict):
            return _error(400, f"the query must be a JSON object (got {type(body).__name__})")
        try:
            answer = await replica.query(body)
        except QueryError as err:
            return _error(400, str(err) or type(err).__name__)
        except Exception as err:
            log.warning("query of shard %s failed: %s: %s", shard, type(err).__name__, err)
            return _error(500, f"query failed: {type(err).__name__}: {err}")
        try:
            text = json.dumps(answer)
        except (TypeError, ValueError) as err:
            return _error(500, f"the query's answer is not JSON-serializable: {err}")
        return web.Response(text=text, content_type="application/json")


async def start_http(service: Service, host: str, port: int) -> web.AppRunner:
    """Serve the HTTP API of `service`'s replicas; stop with `await runner.cleanup()`."""
    handlers = _Handlers(service)
    app = web.Application(client_max_size=16 << 20)
    app.router.add_get("/metrics", handlers.metrics)
    app.router.add_get("/status", handlers.status)
    app.router.add_post("/query/{shard:.+}", handlers.query)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=_SHUTDOWN_TIMEOUT)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
