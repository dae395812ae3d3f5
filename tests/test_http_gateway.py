"""The HTTP gateway: curl-style reads and appends, errors, and /metrics."""

from __future__ import annotations

import hashlib
import socket
import time
import urllib.error
import urllib.request

import pytest

from streamkit.protocol import pb
from streamkit.protocol.fragments import content_path
from tests import wire
from tests.brokerproc import BrokerProcess


def _http(method: str, url: str, body: bytes | None = None):
    request = urllib.request.Request(url, data=body, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


@pytest.fixture(scope="module")
def journal(shared_broker) -> str:
    name = "http/gateway"
    wire.create(wire.stub(shared_broker.address), wire.spec(name))
    return name


def test_put_then_get(shared_broker, journal) -> None:
    url = f"{shared_broker.http_url}/{journal}"
    status, headers, _ = _http("PUT", url, b"first line\n")
    assert status == 204
    assert (headers["X-Commit-Begin"], headers["X-Commit-End"]) == ("0", "11")
    assert headers["X-Commit-SHA1-Sum"] == hashlib.sha1(b"first line\n").hexdigest()
    _http("PUT", url, b"second\n")
    status, headers, body = _http("GET", url + "?offset=0")
    assert status == 206
    assert body == b"first line\nsecond\n"
    assert headers["X-Write-Head"] == "18"
    assert headers["Content-Range"] == "bytes 0-9223372036854775807/9223372036854775807"
    assert headers["X-Fragment-Name"].startswith("0000000000000000-")
    status, headers, body = _http("HEAD", url + "?offset=11")
    assert status == 206 and body == b"" and headers["X-Write-Head"] == "18"


def test_get_streams_across_fragments_to_the_write_head(shared_broker) -> None:
    """Without ?block, a GET reads every fragment through the write head (each append below
    rolls a fragment of its own), as Gazette's gateway does; from the middle, too."""
    name = "http/fragmented"
    wire.create(wire.stub(shared_broker.address), wire.spec(name, length=1024))
    url = f"{shared_broker.http_url}/{name}"
    lines = [f"{i:03d} ".encode() + b"x" * 1200 + b"\n" for i in range(6)]
    for line in lines:
        assert _http("PUT", url, line)[0] == 204
    status, headers, body = _http("GET", url + "?offset=0")
    assert status == 206 and body == b"".join(lines)
    begin, end, _sum = headers["X-Fragment-Name"].split("-")  # the first fragment's name
    assert int(begin, 16) == 0 and int(end, 16) == len(lines[0])
    middle = len(lines[0]) * 3 + 7
    assert _http("GET", f"{url}?offset={middle}")[2] == b"".join(lines)[middle:]


def test_errors_map_to_http_statuses(shared_broker, journal) -> None:
    base = shared_broker.http_url
    assert _http("GET", f"{base}/http/missing")[0] == 404
    assert _http("PUT", f"{base}/http/missing", b"x")[0] == 404
    status, headers, _ = _http("GET", f"{base}/{journal}?offset=999999")
    assert status == 416 and int(headers["X-Write-Head"]) > 0  # where to read up to
    status, _, body = _http("GET", f"{base}/{journal}?offset=abc")
    assert status == 400 and b"offset" in body
    assert _http("GET", f"{base}/bad//name")[0] == 400
    # Garbage on the socket gets a 400 and the gateway keeps serving.
    with socket.create_connection(("127.0.0.1", shared_broker.port + 1), timeout=5) as sock:
        sock.sendall(b"\x00\x01garbage\r\n\r\n")
        assert sock.recv(100).split(b" ")[1] == b"400"  # HTTP/1.0 for a garbled request
    assert _http("GET", f"{base}/{journal}?offset=0")[0] == 206


def _metrics(shared_broker) -> str:
    status, _headers, body = _http("GET", f"{shared_broker.http_url}/metrics")
    assert status == 200
    return body.decode()


def _appends_counted(text: str, journal: str) -> float:
    line = next((ln for ln in text.splitlines()
                 if ln.startswith("streamkit_broker_appends_total") and journal in ln), None)
    return float(line.split()[-1]) if line else 0.0


def test_a_blocking_get_whose_journal_goes_away_is_a_404(shared_broker) -> None:
    """A GET waiting at the write head, and its journal deleted: a 404 naming it. It was a
    500, with an aiohttp traceback in the broker's log."""
    import threading

    name = "http/deleted-under-a-read"
    journals = wire.stub(shared_broker.address)
    wire.create(journals, wire.spec(name))
    answer: list = []
    url = f"{shared_broker.http_url}/{name}?offset=-1&block=true"
    reading = threading.Thread(target=lambda: answer.append(_http("GET", url)))
    reading.start()
    time.sleep(0.5)  # (waiting at the head, or not yet: either way no 500)
    wire.delete(journals, name)
    reading.join(10)
    assert answer and answer[0][0] == 404, answer
    assert b"JOURNAL_NOT_FOUND: " + name.encode() in answer[0][2]
    assert "StopAsyncIteration" not in shared_broker.log()


def test_metrics_count_appends(shared_broker, journal) -> None:
    before = _appends_counted(_metrics(shared_broker), journal)
    wire.append(wire.stub(shared_broker.address), journal, b"counted\n")
    wire.append(wire.stub(shared_broker.address), journal, b"twice\n")
    text = _metrics(shared_broker)
    assert _appends_counted(text, journal) == before + 2
    assert "streamkit_broker_reads_open" in text


async def test_the_gateway_starts_on_the_first_connection_and_stops_unstarted(tmp_path) -> None:
    """The broker listens on its HTTP port from the start but imports aiohttp only once a
    client connects (a broker started beside its consumers keeps that CPU for them); a
    broker stopped before anyone asked closes the port all the same."""
    import asyncio

    from streamkit.broker.server import Broker, BrokerConfig
    from tests.brokerproc import free_port

    for ask in (True, False):
        port = free_port()
        broker = Broker(BrokerConfig(data_dir=tmp_path / f"broker-{ask}", port=port))
        await broker.start()
        try:
            assert broker.gateway is None
            if ask:
                status, _, _ = await asyncio.to_thread(
                    _http, "GET", f"http://127.0.0.1:{port + 1}/metrics")
                assert status == 200 and broker.gateway is not None
        finally:
            await broker.stop()
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port + 1), 1):
            pass


def test_a_reader_leaving_is_no_error_and_a_fragment_that_wont_open_is_a_503(tmp_path) -> None:
    """A GET whose client leaves mid-body was logged as an ERROR with a traceback, each
    time; a GET whose first fragment can't be opened answered 206 and cut the body."""
    broker = BrokerProcess(tmp_path / "broker").start()
    try:
        name = "http/leaving"
        journals = wire.stub(broker.address)
        wire.create(journals, wire.spec(name, length=1 << 20, codec=pb.NONE))
        for n in range(6):
            assert wire.append(journals, name, bytes([97 + n]) * (1 << 20)).status == pb.OK
        host, port = broker.http_url.removeprefix("http://").split(":")
        for _ in range(3):
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                request = f"GET /{name}?offset=0 HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n"
                sock.sendall(request.encode())
                assert sock.recv(1000).startswith(b"HTTP/1.1 206")
        wire.wait_until(lambda: "the client went away" in broker.log())
        # HTTP reads count among the reads open while served (they never did), and no more.
        def reads_open() -> bytes:
            return _http("GET", f"{broker.http_url}/metrics")[2].split(
                b"\nstreamkit_broker_reads_open ")[1].split(b"\n")[0]

        wire.wait_until(lambda: reads_open() == b"0.0")  # the readers that left: ended
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(f"GET /{name}?offset=-1&block=true HTTP/1.1\r\n"
                         f"Host: {host}:{port}\r\n\r\n".encode())
            wire.wait_until(lambda: reads_open() == b"1.0")
        wire.wait_until(lambda: reads_open() == b"0.0")

        persisted = wire.wait_until(lambda: [f for f in wire.fragments(journals, name)
                                             if f.backing_store])
        (broker.data_dir / "fragments" / content_path(persisted[0])).unlink()
        status, _, body = _http("GET", f"{broker.http_url}/{name}?offset=0")
        assert status == 503 and f"journal {name}: reading fragment".encode() in body, body
        assert "Error handling request" not in broker.log() and "Traceback" not in broker.log()
    finally:
        broker.kill()
