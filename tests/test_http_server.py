"""The member API's small HTTP/1.1 server (streamkit.app.http_server), spoken to over real
sockets: by hand where a request must be malformed or slow, and by urllib and aiohttp's
client (as `streamkit query` and users' tools do)."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import AsyncIterator

import aiohttp
import pytest

from streamkit.app.http_server import BodyTooLarge, HttpServer, Request, Response, json_response

MAX_BODY = 1000


async def _echo(request: Request) -> Response:
    if request.path == "/boom":
        raise RuntimeError("a bug")
    if request.path == "/slow":
        await asyncio.sleep(0.3)
        return Response(body=b"slow done")
    if request.path == "/ignore-body":
        return Response(body=b"ignored")
    try:
        body = await request.read()
    except BodyTooLarge:
        return Response(413, b"too large")
    return json_response({"method": request.method, "path": request.path,
                          "query": request.query_string, "body": body.decode(),
                          "host": request.headers.get("host")})


@pytest.fixture
async def server() -> AsyncIterator[tuple[HttpServer, int]]:
    srv = HttpServer(_echo, max_body=MAX_BODY, ssl_context=None, read_timeout=0.5,
                     idle_timeout=0.5)
    await srv.start("127.0.0.1", 0)
    assert srv._server is not None
    port = srv._server.sockets[0].getsockname()[1]
    yield srv, port
    await srv.close(1.0)


async def _exchange(port: int, raw: bytes, *, read_until_close: bool = True) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    try:
        async with asyncio.timeout(3):
            return await (reader.read() if read_until_close else reader.read(65536))
    finally:
        writer.close()


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


async def test_urllib_and_aiohttp_get_answers_over_one_kept_alive_connection(server) -> None:
    _, port = server
    url = f"http://127.0.0.1:{port}/a%20b/c?x=1"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=3).read())
    assert json.loads(body) == {"method": "GET", "path": "/a b/c", "query": "x=1", "body": "",
                                "host": f"127.0.0.1:{port}"}
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        for i in range(3):
            async with session.post(f"http://127.0.0.1:{port}/q", data=f"body {i}") as answer:
                assert answer.status == 200
                assert (await answer.json())["body"] == f"body {i}"
        # chunked request bodies, as a client streaming its body sends them
        async def parts() -> AsyncIterator[bytes]:
            for part in (b"one ", b"two"):
                yield part
        async with session.post(f"http://127.0.0.1:{port}/q", data=parts()) as answer:
            assert (await answer.json())["body"] == "one two"


async def test_pipelined_requests_are_answered_in_order(server) -> None:
    _, port = server
    raw = (b"POST /1 HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\nabc"
           b"GET /2 HTTP/1.1\r\nHost: h\r\n\r\n"
           b"HEAD /3 HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
    answer = await _exchange(port, raw)
    assert answer.count(b"HTTP/1.1 200 OK") == 3
    first, second = answer.split(b"HTTP/1.1 200 OK")[1:3]
    assert b'"body": "abc"' in first and b'"path": "/2"' in second
    assert answer.rstrip().endswith(b"Connection: close")  # HEAD: headers, no body


async def test_expect_100_continue_is_answered_before_the_body(server) -> None:
    _, port = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /q HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n"
                 b"Expect: 100-continue\r\n\r\n")
    async with asyncio.timeout(3):
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"hi")
        head = await reader.readuntil(b"\r\n\r\n")
    assert _status(head) == 200
    writer.close()


@pytest.mark.parametrize(("raw", "status"), [
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET /x HTTP/2.0\r\n\r\n", 505),
    (b"GET /x HTTP/1.1\r\nbad header\r\n\r\n", 400),
    (b"GET /x HTTP/1.1\r\nX: 1\r\n folded\r\n\r\n", 400),
    (b"POST /x HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
    (b"POST /x HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
    (b"POST /x HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
    (b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    (b"GET /x HTTP/1.1\r\n" + b"".join(b"H%d: v\r\n" % i for i in range(101)) + b"\r\n", 431),
    (b"GET /x HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n", 431),
])
async def test_malformed_requests_get_a_status_and_a_closed_connection(
        server, raw: bytes, status: int) -> None:
    _, port = server
    answer = await _exchange(port, raw)
    assert _status(answer) == status, answer
    assert b"Connection: close" in answer


async def test_bodies_over_the_limit_are_refused_and_close_the_connection(server) -> None:
    _, port = server
    big = b"x" * (MAX_BODY + 1)
    answer = await _exchange(port, b"POST /q HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(big)
                             + big + b"GET /next HTTP/1.1\r\n\r\n")
    assert _status(answer) == 413 and answer.count(b"HTTP/1.1") == 1
    chunked = b"".join(b"100\r\n" + b"y" * 256 + b"\r\n" for _ in range(5)) + b"0\r\n\r\n"
    answer = await _exchange(port, b"POST /q HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                             + chunked)
    assert _status(answer) == 413


async def test_an_unread_body_closes_the_connection_after_the_answer(server) -> None:
    _, port = server
    answer = await _exchange(port, b"POST /ignore-body HTTP/1.1\r\nContent-Length: 5\r\n\r\n"
                             b"hello" b"GET /next HTTP/1.1\r\n\r\n")
    assert answer.count(b"HTTP/1.1 200") == 1 and b"Connection: close" in answer


async def test_a_failing_handler_gets_500_and_the_server_serves_on(server) -> None:
    _, port = server
    assert _status(await _exchange(port, b"GET /boom HTTP/1.1\r\nConnection: close\r\n\r\n")) \
        == 500
    assert _status(await _exchange(port, b"GET /ok HTTP/1.0\r\n\r\n")) == 200


async def test_slow_and_idle_clients_are_disconnected(server) -> None:
    _, port = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /x HTTP/1.1\r\n")  # and never the rest of the head
    async with asyncio.timeout(3):
        assert await reader.read() == b""  # closed after read_timeout, without an answer
    writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /q HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc")  # a body cut short
    async with asyncio.timeout(3):
        assert await reader.read() == b""
    writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)  # idle: closed too
    async with asyncio.timeout(3):
        assert await reader.read() == b""
    writer.close()


async def test_close_lets_requests_in_flight_finish_and_drops_idle_connections() -> None:
    srv = HttpServer(_echo, max_body=MAX_BODY, ssl_context=None)
    await srv.start("127.0.0.1", 0)
    assert srv._server is not None
    port = srv._server.sockets[0].getsockname()[1]
    idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
    slow = asyncio.create_task(_exchange(port, b"GET /slow HTTP/1.1\r\n\r\n"))
    await asyncio.sleep(0.1)
    async with asyncio.timeout(3):
        await srv.close(2.0)
        assert await idle_reader.read() == b""
        answer = await slow
    assert _status(answer) == 200 and answer.endswith(b"slow done")
    assert b"Connection: close" in answer
    idle_writer.close()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)
