"""HTTP gateway: curl-friendly reads and appends, plus Prometheus /metrics.

* ``GET /<journal>?offset=N&block=true|false`` streams content (206) with the
  headers X-Fragment-Name, X-Fragment-Location, X-Write-Head and Content-Range.
  Without block it ends at the write head; with block it tails. The body is contiguous:
  at offsets no fragment holds (after its first byte) it is cut short, not joined up.
* ``HEAD /<journal>?offset=N`` answers the same headers and no content.
* ``PUT /<journal>`` appends the request body as one append (204) and answers
  X-Commit-Begin, X-Commit-End and X-Commit-SHA1-Sum.

Every request passes the broker's `Security` middleware first: a Host header
that is not one of the server's names is refused (a web page could otherwise
reach a loopback broker through DNS rebinding), so is a browser's write from
another origin, and with auth keys a request needs `Authorization: Bearer`
with READ (GET, HEAD), APPEND (PUT) or LIST (/metrics, which names journals).
A journal the token's selector does not cover is answered as absent (404).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator

from aiohttp import ClientPayloadError, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from streamkit.auth.scope import journal_allowed, require_everything
from streamkit.auth.settings import Security, body_too_large
from streamkit.auth.tokens import Capability
from streamkit.broker import metrics
from streamkit.broker.appends import append, refusal
from streamkit.broker.faults import JournalFault
from streamkit.broker.journals import JournalRegistry
from streamkit.broker.pace import AppendPace
from streamkit.broker.reads import ReadStream
from streamkit.broker.service import (
    BadRequest,
    JournalService,
    check_journal_name,
)
from streamkit.errors import StreamkitError
from streamkit.protocol import pb
from streamkit.protocol.fragments import content_name, digest_of, fragment_url
from streamkit.tasks import cancel_and_wait

log = logging.getLogger(__name__)
_CLIENT_CHECK = 1.0  # seconds between checks that a reader waiting at the head is still there

_STATUS_HTTP = {
    pb.JOURNAL_NOT_FOUND: 404,
    pb.NOT_ALLOWED: 403,
    pb.OFFSET_NOT_YET_AVAILABLE: 416,
    pb.REGISTER_MISMATCH: 409,
    pb.WRONG_APPEND_OFFSET: 409,
}


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, text=message + "\n")


def _status_error(status: int, journal: str) -> web.Response:
    return _error(_STATUS_HTTP.get(status, 500), f"{pb.Status.Name(status)}: {journal}")


def _int_param(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        message = f"query parameter {name}: not an integer: {_shown(raw)}\n"
        raise web.HTTPBadRequest(text=message) from None
    if not -(1 << 63) <= value < 1 << 63:
        raise web.HTTPBadRequest(text=f"query parameter {name}: out of range: {_shown(raw)}\n")
    return value


def _shown(text: str, limit: int = 80) -> str:
    """`text` quoted for an error message: control characters escaped, long text cut."""
    shown = repr(text[:limit])
    return shown + "…" if len(text) > limit else shown


def _bool_param(request: web.Request, name: str) -> bool:
    raw = request.query.get(name, "false").lower()
    if raw not in ("true", "false", "1", "0", ""):
        raise web.HTTPBadRequest(text=f"query parameter {name}: not a boolean: {_shown(raw)}\n")
    return raw in ("true", "1")


_CAPABILITIES = {"GET": Capability.READ, "HEAD": Capability.READ, "PUT": Capability.APPEND}


def _capability_for(request: web.Request) -> Capability | None:
    """What a request needs; None (other methods) leaves the answer to the router (405)."""
    if request.path == "/metrics":
        return Capability.LIST
    return _CAPABILITIES.get(request.method)


class HttpGateway:
    """An aiohttp server over the broker's registry."""

    def __init__(
        self, registry: JournalRegistry, service: JournalService, shutdown_timeout: float = 2.0,
        security: Security | None = None,
    ) -> None:
        self.registry = registry
        self.service = service
        self.shutdown_timeout = shutdown_timeout  # aiohttp's own default waits 60 s
        self.security = security or Security()
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int, sock: socket.socket | None = None) -> None:
        """Serve on host:port, or on `sock` (bound and listening on `host`)."""
        guard = self.security.http_middleware(_capability_for, host)
        app = web.Application(client_max_size=self.security.max_body, middlewares=[guard])
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/{journal:.+}", self.read)  # also serves HEAD
        app.router.add_put("/{journal:.+}", self.append)
        self._runner = web.AppRunner(
            app, access_log=None, shutdown_timeout=self.shutdown_timeout
        )
        await self._runner.setup()
        ssl_context = self.security.http_ssl_context()
        site = (web.SockSite(self._runner, sock, ssl_context=ssl_context) if sock is not None
                else web.TCPSite(self._runner, host, port, ssl_context=ssl_context))
        await site.start()

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()

    async def metrics(self, request: web.Request) -> web.Response:
        require_everything("/metrics")
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _replica(self, request: web.Request):
        journal = request.match_info["journal"]
        try:
            check_journal_name(journal)
        except BadRequest as err:
            raise web.HTTPBadRequest(text=f"{err}\n") from None
        replica = await self.registry.replica(journal)
        if replica is not None and not journal_allowed(journal, replica.spec.labels):
            replica = None  # not covered by the request's token: absent, as over gRPC
        return journal, replica

    async def read(self, request: web.Request) -> web.StreamResponse:
        metrics.READS_OPEN.inc()
        reading = asyncio.ensure_future(self._read(request))
        try:
            # aiohttp leaves a handler running when its client leaves: a read waiting at
            # the head for content would wait for ever. Reads are safe to cancel.
            while not (await asyncio.wait({reading}, timeout=_CLIENT_CHECK))[0]:
                transport = request.transport
                if transport is None or transport.is_closing():
                    await cancel_and_wait(reading, "an HTTP read")
                    log.info("GET %s: the client went away", request.path)
                    return web.Response(status=400)  # (no one reads it)
            return reading.result()
        except JournalFault as fault:
            return _error(fault.http_status, str(fault))
        finally:
            if not reading.done():
                reading.cancel()
            metrics.READS_OPEN.dec()

    async def _read(self, request: web.Request) -> web.StreamResponse:
        journal, replica = await self._replica(request)
        offset = _int_param(request, "offset", 0)
        block = _bool_param(request, "block")
        if replica is None:
            return _status_error(pb.JOURNAL_NOT_FOUND, journal)
        if replica.spec.flags == pb.JournalSpec.O_WRONLY:
            return _status_error(pb.NOT_ALLOWED, journal)
        if offset < -1:
            return _error(400, f"query parameter offset: must be >= -1 (got {offset})")
        read = pb.ReadRequest(
            journal=journal, offset=offset, block=block, metadata_only=request.method == "HEAD"
        )
        responses = ReadStream(replica, read, self.service.header()).responses()
        first = await anext(responses, None)
        if first is None:  # a blocking read ended before anything was there to read
            if replica.deleted:
                return _status_error(pb.JOURNAL_NOT_FOUND, journal)
            return _error(503, f"{journal}: the broker is stopping; read again elsewhere or later")
        if first.status != pb.OK:
            refused = _status_error(first.status, journal)
            if first.write_head:  # an offset not yet written: where the journal ends now
                refused.headers["X-Write-Head"] = str(first.write_head)
            return refused
        contents = _contents(responses, journal, first.offset)
        opening: bytes | None = None
        if first.fragment.backing_store and request.method != "HEAD":
            # A stored fragment may not open (its store down): said with a status while
            # none was sent (a 206 and a cut body told the client nothing).
            opening = await anext(contents, None)
        response = web.StreamResponse(status=206, headers=_read_headers(first))
        await response.prepare(request)
        if request.method == "HEAD":
            return response
        try:
            if opening is not None:
                await response.write(opening)
            async for message in contents:
                await response.write(message)
        except (JournalFault, OffsetJump) as fault:  # the status was sent: cut the body
            log.warning("GET %s ended early: %s", journal, fault)  # short, and say why
            if request.transport is not None:
                request.transport.close()
            return response
        except ConnectionError as error:  # the reader left: an everyday event, not an error
            log.info("GET %s: the client went away (%s)", journal, error)
            return response
        await response.write_eof()
        return response

    async def append(self, request: web.Request) -> web.Response:
        try:
            journal, replica = await self._replica(request)
            status = refusal(replica)
            if status is not None:
                return _status_error(status, journal)
            result = await append(
                replica, pb.AppendRequest(journal=journal),
                _body(request, self.service.pace(), journal, self.security.max_body),
                self.service.header(),
            )
        except BodyTooLarge as error:
            return _error(413, f"{error}; the append to {journal} was rolled back")
        except JournalFault as fault:
            return _error(fault.http_status, str(fault))
        except TimeoutError as err:
            return _error(408, str(err))
        except (ConnectionError, ClientPayloadError) as error:
            # The client went away mid-body: an everyday event, not a server error.
            log.info("PUT %s: the client went away (%s); the append was rolled back",
                     journal, error)
            return _error(400, "the request body ended early; the append was rolled back")
        if result.status != pb.OK:
            return _status_error(result.status, journal)
        commit = result.commit
        return web.Response(
            status=204,
            headers={
                "X-Commit-Begin": str(commit.begin),
                "X-Commit-End": str(commit.end),
                "X-Commit-SHA1-Sum": digest_of(commit.sum).hex(),
            },
        )


class BodyTooLarge(StreamkitError):
    """A PUT body passed the server's --max-body-size."""


async def _body(request: web.Request, pace: AppendPace, journal: str,
                limit: int) -> AsyncIterator[bytes]:
    """The request body in chunks, within the appender's pace (streamkit.broker.pace): a
    slow client must not hold the journal for as long as it likes. A body over `limit`
    fails the append (BodyTooLarge), before a byte of it commits."""
    if (request.content_length or 0) > limit:
        raise BodyTooLarge(body_too_large(limit))
    read = 0
    while True:
        try:
            async with asyncio.timeout(pace.next_timeout()):  # the read only, never the yield
                chunk = await request.content.read(1 << 20)
        except TimeoutError:
            raise pace.timed_out(journal) from None
        if not chunk:
            return
        read += len(chunk)
        if read > limit:
            raise BodyTooLarge(body_too_large(limit))
        pace.got(len(chunk))
        yield chunk


_OPEN_END = (1 << 63) - 1


class OffsetJump(StreamkitError):
    """A GET's read came to offsets no fragment holds (a fragment removed from its store,
    say), after content was sent: the body can't go on past them as if whole."""

    def __init__(self, journal: str, begin: int, end: int) -> None:
        super().__init__(
            f"journal {journal}: offsets {begin}..{end} are in none of its fragments (removed "
            f"from its stores?); the body ends at offset {begin}, the end of the content "
            f"that is there; a GET from offset {begin} goes on at {end}")
        self.begin, self.end = begin, end


async def _contents(responses: AsyncIterator[pb.ReadResponse], journal: str,
                    offset: int) -> AsyncIterator[bytes]:
    """Content bytes of a read from `offset` (where its first response put it), across
    fragments: a non-blocking read ends at the write head (OFFSET_NOT_YET_AVAILABLE), a
    blocking one when the client leaves, as Gazette's gateway streams.

    The body is contiguous content or ends: a later fragment that starts past the end of
    the content so far (offsets no fragment holds) raises OffsetJump, and the body is cut
    there. Gazette's gateway ends its body at such a jump too (only a jump before the
    first byte is served, which the Content-Range header's offset tells), naming it in an
    X-Close-Error trailer; aiohttp can't send trailers, so the body is cut short (the
    chunked encoding is not ended), which HTTP clients report (curl: "transfer closed
    with outstanding read data remaining"), rather than ended as if whole."""
    async for message in responses:
        if message.content:
            offset = message.offset + len(message.content)
            yield message.content
        elif message.status != pb.OK:
            return
        elif message.offset != offset:
            raise OffsetJump(journal, offset, message.offset)


def _read_headers(first: pb.ReadResponse) -> dict[str, str]:
    fragment = first.fragment
    headers = {
        "X-Write-Head": str(first.write_head),
        "X-Fragment-Name": content_name(fragment),
        # Open-ended, as Gazette's gateway says it: the body runs on past this fragment.
        "Content-Range": f"bytes {first.offset}-{_OPEN_END}/{_OPEN_END}",
        "Content-Type": "application/octet-stream",
    }
    if fragment.backing_store:
        headers["X-Fragment-Location"] = fragment_url(fragment.backing_store, fragment)
    return headers
