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
import contextlib
import logging
import socket
import threading
from typing import TYPE_CHECKING, Any

from streamkit.app import watchdog
from streamkit.app.replica import Replica
from streamkit.app.service import Service
from streamkit.auth.settings import Security
from streamkit.protocol import consumer_pb

if TYPE_CHECKING:
    from streamkit.app.http_server import HttpServer
    from streamkit.app.query_forward import PrimaryOf

__all__ = ["HttpApi", "replica_status", "start_http"]

log = logging.getLogger(__name__)

Code = consumer_pb.ReplicaStatus.Code
SHUTDOWN_TIMEOUT = 2.0  # seconds in-flight requests get when the API stops


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


class HttpApi:
    """The HTTP API of a member's replicas, served from a thread of its own.

    `start()` starts the thread, which imports the server's side (`http_site`) and
    starts serving, and by default waits until it serves; `ready()` waits (and
    raises what failed). `cleanup()` stops it.
    """

    def __init__(self, service: Service, query_timeout: float | None = None,
                 security: Security | None = None, primary_of: PrimaryOf | None = None) -> None:
        self.service = service
        self.security = security or Security()
        self.primary_of = primary_of
        self.query_timeout = watchdog.HOOK_TIMEOUT if query_timeout is None else query_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: HttpServer | None = None
        self._thread: threading.Thread | None = None
        self._started: concurrent.futures.Future[None] = concurrent.futures.Future()

    async def start(self, host: str, port: int, sock: socket.socket | None, *,
                    wait: bool = True) -> None:
        """Start serving on `sock` (or `host:port`); with `wait` False, return before the
        thread serves: a caller with other start-up work awaits `ready()` after it."""
        self._thread = threading.Thread(
            target=self._serve, args=(asyncio.get_running_loop(), host, port, sock),
            name="member HTTP API", daemon=True,
        )
        self._thread.start()
        if wait:
            await self.ready()

    async def ready(self) -> None:
        """Until the API serves; raises what kept it from serving."""
        await asyncio.wrap_future(self._started)

    def _serve(self, member_loop: asyncio.AbstractEventLoop, host: str, port: int,
               sock: socket.socket | None) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            from streamkit.app.http_site import Handlers, start_site

            handlers = Handlers(self.service, member_loop, self.query_timeout, self.security,
                                self.primary_of)
            self._server = loop.run_until_complete(
                start_site(handlers, host, port, sock, self.security))
        except BaseException as err:
            self._started.set_exception(err)
            loop.close()
            return
        self._started.set_result(None)
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def cleanup(self) -> None:
        """Stop serving: in-flight requests get SHUTDOWN_TIMEOUT seconds to finish."""
        with contextlib.suppress(Exception):  # still starting: let it start, then stop it
            await self.ready()
        loop, server, thread = self._loop, self._server, self._thread
        self._server = self._thread = None
        if loop is None or server is None or thread is None:
            return
        done = asyncio.run_coroutine_threadsafe(server.close(SHUTDOWN_TIMEOUT), loop)
        try:
            await asyncio.wait_for(asyncio.wrap_future(done), SHUTDOWN_TIMEOUT + 1)
        except TimeoutError:
            log.warning("the HTTP API did not stop within %gs", SHUTDOWN_TIMEOUT + 1)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            await asyncio.to_thread(thread.join, SHUTDOWN_TIMEOUT)


async def start_http(
    service: Service,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    sock: socket.socket | None = None,
    query_timeout: float | None = None,
    security: Security | None = None,
    primary_of: PrimaryOf | None = None,
    wait: bool = True,
) -> HttpApi:
    """Serve the HTTP API of `service`'s replicas on `host:port`, or on `sock` (bound and
    listening on `host`: the caller chose the port for real); stop with `await
    api.cleanup()`. `security`: TLS, Host allow-list (names of `host`) and tokens.
    `primary_of` finds where to forward a query of a shard not primary here (None: 404).
    `wait` False: returns while it starts (see `HttpApi.start`)."""
    api = HttpApi(service, query_timeout, security, primary_of)
    await api.start(host, port, sock, wait=wait)
    return api
