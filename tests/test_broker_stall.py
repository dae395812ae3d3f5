"""A stalled appender is rolled back after --append-timeout and frees the journal."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import grpc
import pytest

from streamkit.protocol import pb
from tests import wire
from tests.brokerproc import BrokerProcess

JOURNAL = "stall/journal"


@pytest.fixture
def broker(tmp_path: Path):
    proc = BrokerProcess(tmp_path / "broker", extra_args=["--append-timeout", "1"]).start()
    wire.create(wire.stub(proc.address), wire.spec(JOURNAL))
    yield proc
    proc.kill()


def test_stalled_http_put_times_out_and_frees_the_journal(broker: BrokerProcess) -> None:
    with socket.create_connection(("127.0.0.1", broker.port + 1), timeout=10) as sock:
        sock.sendall(
            f"PUT /{JOURNAL} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n".encode()
            + b"only part of the body"
        )
        started = time.monotonic()
        reply = sock.recv(200)
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert time.monotonic() - started < 5
    journals = wire.stub(broker.address)
    assert wire.append(journals, JOURNAL, b"next").commit.begin == 0
    assert wire.read(journals, JOURNAL)[0] == b"next"


def test_stalled_grpc_append_is_rolled_back(broker: BrokerProcess) -> None:
    journals = wire.stub(broker.address)
    release = threading.Event()

    def stalls():
        yield pb.AppendRequest(journal=JOURNAL)
        yield pb.AppendRequest(content=b"never committed")
        release.wait(20)  # the appender goes quiet while holding the journal

    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        journals.Append(stalls())
    release.set()
    assert err.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
    assert time.monotonic() - started < 5
    assert wire.append(journals, JOURNAL, b"next").commit.begin == 0
    assert wire.read(journals, JOURNAL)[0] == b"next"
