"""A stalled appender is rolled back after --append-timeout and frees the journal."""

from __future__ import annotations

import re
import socket
import threading
import time
from pathlib import Path

import grpc
import pytest

from streamkit.protocol import pb
from tests import wire
from tests.brokerproc import BrokerProcess
from tests.waiting import LIVENESS

JOURNAL = "stall/journal"


@pytest.fixture
def broker(tmp_path: Path):
    proc = BrokerProcess(tmp_path / "broker", extra_args=["--append-timeout", "1"]).start()
    wire.create(wire.stub(proc.address), wire.spec(JOURNAL))
    yield proc
    proc.kill()


def _http_reply(sock: socket.socket) -> bytes:
    """One whole HTTP response: the headers, then Content-Length bytes of body."""
    reply = b""
    while b"\r\n\r\n" not in reply or len(reply.partition(b"\r\n\r\n")[2]) < _length(reply):
        chunk = sock.recv(4096)
        if not chunk:
            break  # the broker closed the connection: what it sent is the reply
        reply += chunk
    return reply


def _length(reply: bytes) -> int:
    found = re.search(rb"(?im)^content-length:\s*(\d+)", reply.partition(b"\r\n\r\n")[0])
    return int(found[1]) if found else 0


def test_stalled_http_put_times_out_and_frees_the_journal(broker: BrokerProcess) -> None:
    # That the 1 s --append-timeout applied shows in the reply, not on a clock; the socket's
    # timeout is a liveness bound only (the broker does not wait for the client for ever).
    with socket.create_connection(("127.0.0.1", broker.port + 1), timeout=LIVENESS) as sock:
        sock.sendall(
            f"PUT /{JOURNAL} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n".encode()
            + b"only part of the body"
        )
        reply = _http_reply(sock)
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert f"append to {JOURNAL} stalled for 1s; rolled back".encode() in reply, reply
    journals = wire.stub(broker.address)
    assert wire.append(journals, JOURNAL, b"next").commit.begin == 0
    assert wire.read(journals, JOURNAL)[0] == b"next"


def test_stalled_grpc_append_is_rolled_back(broker: BrokerProcess) -> None:
    journals = wire.stub(broker.address)
    release = threading.Event()

    def stalls():
        yield pb.AppendRequest(journal=JOURNAL)
        yield pb.AppendRequest(content=b"never committed")
        # The appender goes quiet while holding the journal; were the broker to wait for it,
        # the append would commit after this liveness bound, and the test fail.
        release.wait(LIVENESS)

    with pytest.raises(grpc.RpcError) as err:
        journals.Append(stalls())
    release.set()
    assert err.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
    if err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # the 1 s --append-timeout
        assert "stalled for 1s; rolled back" in err.value.details(), err.value.details()
    assert wire.append(journals, JOURNAL, b"next").commit.begin == 0
    assert wire.read(journals, JOURNAL)[0] == b"next"


def test_a_stopping_broker_ends_reads_at_a_chunk_and_answers_waiting_appends_unavailable(
        tmp_path: Path) -> None:
    """SIGTERM's graceful stop gives in-flight calls gRPC's grace, then cancels them:
    clients see CANCELLED, which they take as final (members failed their shards on it). A
    read streaming a fragment now ends at its next chunk, an ordinary end the reader goes on
    from, and appends still waiting for their content or for the journal are rolled back
    UNAVAILABLE, which clients retry."""
    proc = BrokerProcess(tmp_path / "broker", extra_args=["--min-append-rate", "0"]).start()
    try:
        journals = wire.stub(proc.address)
        wire.create(journals, wire.spec(JOURNAL, length=64 << 20, codec=pb.NONE))
        wire.append(journals, JOURNAL, *[bytes(1 << 20)] * 16)
        release = threading.Event()
        outcomes: dict[str, object] = {}

        def slow_read() -> None:  # ~3 s for the whole fragment: the stop comes mid-stream
            got = 0
            try:
                for response in journals.Read(pb.ReadRequest(journal=JOURNAL, block=True)):
                    got += len(response.content)
                    time.sleep(0.1)
                outcomes["read"] = got
            except grpc.RpcError as err:
                outcomes["read"] = err

        def stalls():
            yield pb.AppendRequest(journal=JOURNAL)
            yield pb.AppendRequest(content=b"never committed")
            release.wait(LIVENESS)

        def call(name: str, requests) -> None:
            try:
                outcomes[name] = wire.stub(proc.address).Append(requests)
            except grpc.RpcError as err:
                outcomes[name] = err

        threads = [threading.Thread(target=slow_read),
                   threading.Thread(target=call, args=("stalled", stalls()))]
        for thread in threads:
            thread.start()
        time.sleep(0.5)  # the stalled append holds the journal; the next one waits for it
        queued = pb.AppendRequest(journal=JOURNAL)
        threads.append(threading.Thread(
            target=call, args=("queued", wire.append_requests(queued, [b"queued"]))))
        threads[-1].start()
        time.sleep(0.3)
        assert proc.terminate() == 0
        release.set()
        for thread in threads:
            thread.join(LIVENESS)
        assert isinstance(outcomes["read"], int) and 0 < outcomes["read"] < 16 << 20, outcomes
        for name in ("stalled", "queued"):
            err = outcomes[name]
            assert isinstance(err, grpc.RpcError), (name, err)
            assert err.code() == grpc.StatusCode.UNAVAILABLE, (name, err)
            assert "the broker is stopping (retry it)" in err.details(), (name, err)
        proc.start()
        content, _ = wire.read(wire.stub(proc.address), JOURNAL)
        assert content == bytes(16 << 20)  # neither rolled-back append left a byte
    finally:
        release.set()
        proc.kill()
