"""A small HTTP/1.1 server on asyncio streams: what a member's HTTP API needs, no more.

Why not aiohttp, which the broker's gateway uses: importing it costs about 0.13 s of
CPU (its client stack and TLS contexts come along with its server), and a member pays
that on every start and restart, for three routes answering small JSON documents.

What it does: reads a request's head (at most `MAX_HEAD` bytes, `MAX_HEADERS` fields),
hands the handler a `Request` whose body is read on demand (by Content-Length or
chunked, at most `max_body` bytes, answering `Expect: 100-continue`), and writes the
handler's `Response` with a Content-Length. Connections stay open between requests
(HTTP/1.1's default) unless the client or an unread body says otherwise. TLS is
asyncio's. Slow and vanishing clients: a request's head and body must arrive within
`read_timeout`, an idle connection is closed after `idle_timeout`, and a response the
client does not take within `read_timeout` closes its connection. A malformed request
gets 400 (or 431, 501, 505) and its connection closed; a handler's exception a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote

from streamkit.errors import StreamkitError

__all__ = ["BodyTooLarge", "Headers", "HttpServer", "Request", "Response", "json_response"]

log = logging.getLogger(__name__)

MAX_HEAD = 64 << 10  # bytes of a request line and its header fields
MAX_HEADERS = 100
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VERSIONS = ("HTTP/1.1", "HTTP/1.0")


class BodyTooLarge(StreamkitError):
    """A request's body is larger than the server takes (`Request.read`)."""


class BadRequest(StreamkitError):
    """A request the server cannot parse: answered with `status`, its connection closed."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class Headers(dict[str, str]):
    """A request's header fields by lower-case name (repeated fields joined by ", ")."""

    def get(self, name: str, default: Any = None, /) -> Any:
        return super().get(name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return super().__getitem__(name.lower())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and super().__contains__(name.lower())


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: dict[str, str] = field(default_factory=dict)


def json_response(document: Any, status: int = 200) -> Response:
    return Response(status, json.dumps(document).encode(), "application/json")


class Request:
    """One request: its method, decoded path, headers, and a body read on demand."""

    def __init__(self, method: str, target: str, version: str, headers: Headers,
                 reader: asyncio.StreamReader, writer: asyncio.StreamWriter, scheme: str,
                 max_body: int, read_timeout: float) -> None:
        self.method, self.version, self.headers, self.scheme = method, version, headers, scheme
        raw_path, _, self.query_string = target.partition("?")
        self.path = unquote(raw_path)
        self._reader, self._writer = reader, writer
        self._max_body, self._read_timeout = max_body, read_timeout
        self._body: bytes | None = None
        self.chunked, self.length = _framing(headers)
        self.body_pending = self.chunked or self.length > 0

    async def read(self) -> bytes:
        """The body (b"" when there is none); BodyTooLarge past the server's limit."""
        if self._body is not None:
            return self._body
        if self.length > self._max_body:
            raise BodyTooLarge(self.length)
        if self.body_pending and self.headers.get("Expect", "").lower() == "100-continue":
            self._writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        async with asyncio.timeout(self._read_timeout):
            body = await (self._read_chunked() if self.chunked
                          else self._reader.readexactly(self.length))
        self._body, self.body_pending = body, False
        return body

    async def _read_chunked(self) -> bytes:
        parts: list[bytes] = []
        size = 0
        while True:
            line = await self._reader.readuntil(b"\r\n")
            try:
                chunk = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise BadRequest("a malformed chunk size in the request body") from None
            if chunk == 0:
                while await self._reader.readuntil(b"\r\n") != b"\r\n":
                    pass  # trailer fields: none of ours needs them
                return b"".join(parts)
            size += chunk
            if size > self._max_body:
                raise BodyTooLarge(size)
            parts.append(await self._reader.readexactly(chunk))
            if await self._reader.readexactly(2) != b"\r\n":
                raise BadRequest("a chunk of the request body does not end with CRLF")


def _framing(headers: Headers) -> tuple[bool, int]:
    """(chunked, Content-Length) of a request, refusing what could be read two ways."""
    coding = headers.get("Transfer-Encoding")
    length = headers.get("Content-Length")
    if coding is not None:
        if length is not None:
            raise BadRequest("both Transfer-Encoding and Content-Length are set")
        if coding.lower().replace(" ", "") != "chunked":
            raise BadRequest(f"unsupported Transfer-Encoding {coding!r}", 501)
        return True, 0
    if length is None:
        return False, 0
    if not length.isdigit() or len(length) > 18:
        raise BadRequest(f"a malformed Content-Length {length!r}")
    return False, int(length)


def _parse_head(head: bytes) -> tuple[str, str, str, Headers]:
    lines = head.decode("latin-1").split("\r\n")
    try:
        method, target, version = lines[0].split(" ")
    except ValueError:
        raise BadRequest(f"a malformed request line {lines[0][:100]!r}") from None
    if not _TOKEN.fullmatch(method) or not target.startswith("/"):
        raise BadRequest(f"a malformed request line {lines[0][:100]!r}")
    if version not in _VERSIONS:
        raise BadRequest(f"HTTP version {version[:20]!r} is not supported", 505)
    fields = [line for line in lines[1:] if line]
    if len(fields) > MAX_HEADERS:
        raise BadRequest(f"more than {MAX_HEADERS} header fields", 431)
    headers = Headers()
    for line in fields:
        name, colon, value = line.partition(":")
        if not colon or not _TOKEN.fullmatch(name):  # also folded lines, which start blank
            raise BadRequest(f"a malformed header field {line[:100]!r}")
        name, value = name.lower(), value.strip(" \t")
        headers[name] = f"{dict.get(headers, name)}, {value}" if name in headers else value
    return method, target, version, headers


def _keeps_alive(version: str, headers: Headers) -> bool:
    tokens = {t.strip().lower() for t in headers.get("Connection", "").split(",")}
    return "keep-alive" in tokens if version == "HTTP/1.0" else "close" not in tokens


def _encode(response: Response, *, keep_alive: bool, head_only: bool) -> bytes:
    try:
        phrase = HTTPStatus(response.status).phrase
    except ValueError:
        phrase = ""
    lines = [f"HTTP/1.1 {response.status} {phrase}",
             f"Content-Type: {response.content_type}",
             f"Content-Length: {len(response.body)}"]
    lines += [f"{name}: {value}" for name, value in response.headers.items()]
    if not keep_alive:
        lines.append("Connection: close")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if head_only else head + response.body


Handler = Callable[[Request], Awaitable[Response]]


class HttpServer:
    """Serves `handler` on a listening socket until `close`."""

    def __init__(self, handler: Handler, *, max_body: int, ssl_context: ssl.SSLContext | None,
                 read_timeout: float = 60.0, idle_timeout: float = 75.0) -> None:
        self.handler, self.max_body, self.ssl_context = handler, max_body, ssl_context
        self.read_timeout, self.idle_timeout = read_timeout, idle_timeout
        self.scheme = "https" if ssl_context is not None else "http"
        self._server: asyncio.Server | None = None
        # Each connection's task, and whether it awaits a request (else it is answering one).
        self._connections: dict[asyncio.Task[None], bool] = {}
        self._closing = False

    async def start(self, host: str, port: int, sock: socket.socket | None = None) -> None:
        """Listen on `sock` (bound and listening), else on host:port."""
        where: dict[str, Any] = {"sock": sock} if sock is not None else {"host": host,
                                                                          "port": port}
        self._server = await asyncio.start_server(
            self._connection, limit=MAX_HEAD, ssl=self.ssl_context,
            ssl_handshake_timeout=self.read_timeout if self.ssl_context else None, **where)

    async def close(self, grace: float) -> None:
        """Stop taking connections; requests being handled get `grace` seconds to finish,
        then every connection is closed."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for task, awaiting in list(self._connections.items()):
            if awaiting:
                task.cancel()
        if self._connections:
            await asyncio.wait(list(self._connections), timeout=grace)
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = True
        try:
            await self._requests(reader, writer, task)
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError, ssl.SSLError):
            pass  # the client went away, or was too slow: nothing to answer
        finally:
            del self._connections[task]
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        task: asyncio.Task[None]) -> None:
        timeout = self.read_timeout
        while not self._closing:
            self._connections[task] = True
            try:
                async with asyncio.timeout(timeout):
                    head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return  # closed between requests (or within a head: nothing to answer)
            except asyncio.LimitOverrunError:
                await self._answer(writer, Response(431, b"the request head is too large\n"),
                                   keep_alive=False, head_only=False)
                return
            self._connections[task] = False
            timeout = self.idle_timeout
            if not await self._one(head, reader, writer):
                return

    async def _one(self, head: bytes, reader: asyncio.StreamReader,
                   writer: asyncio.StreamWriter) -> bool:
        """Answer one request; whether the connection may carry another."""
        try:
            method, target, version, headers = _parse_head(head)
            request = Request(method, target, version, headers, reader, writer, self.scheme,
                              self.max_body, self.read_timeout)
        except BadRequest as err:
            response = Response(err.status, f"{err}\n".encode())
            await self._answer(writer, response, keep_alive=False, head_only=False)
            return False
        try:
            response = await self.handler(request)
        except BadRequest as err:  # from reading the body
            response, request.body_pending = Response(err.status, f"{err}\n".encode()), True
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            raise
        except Exception:
            log.exception("HTTP %s %s failed", method, request.path)
            response = Response(500, b"internal server error\n")
        # A body left unread would be taken for the next request: close instead.
        keep_alive = not request.body_pending and not self._closing and _keeps_alive(
            version, headers)
        await self._answer(writer, response, keep_alive=keep_alive, head_only=method == "HEAD")
        return keep_alive

    async def _answer(self, writer: asyncio.StreamWriter, response: Response, *,
                      keep_alive: bool, head_only: bool) -> None:
        writer.write(_encode(response, keep_alive=keep_alive, head_only=head_only))
        async with asyncio.timeout(self.read_timeout):
            await writer.drain()
