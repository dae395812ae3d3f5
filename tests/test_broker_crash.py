"""Durability: SIGKILL at awkward moments loses nothing acknowledged; SIGTERM persists spools."""

from __future__ import annotations

import contextlib
import http.client
import threading
import time
from pathlib import Path

import grpc

from streamkit.protocol import pb
from tests import wire
from tests.brokerproc import BrokerProcess
from tests.helpers_client import open_reads
from tests.waiting import DEADLINE, LIVENESS, Worker

JOURNAL = "crash/records"


def _record(i: int) -> bytes:
    # Varying sizes so appends straddle fragment boundaries at odd offsets.
    return (f"{i:08d}|".encode() * (1 + i % 97)) + b"\n"


class Writer(Worker):
    """Appends records one by one, remembering exactly which were acknowledged; `join`
    raises what went wrong in it (an append refused, rather than cut off by the kill)."""

    def __init__(self, address: str, start_at: int) -> None:
        super().__init__(self._append_until_cut_off, name=f"writer from record {start_at}")
        self.journals = wire.stub(address)
        self.next = start_at
        self.acked: list[tuple[int, int, bytes]] = []
        self.in_flight: bytes | None = None

    def _append_until_cut_off(self) -> None:
        while True:
            record = _record(self.next)
            self.in_flight = record
            try:
                response = wire.append(self.journals, JOURNAL, record)
            except grpc.RpcError:
                return  # the broker died under us; this record is unacknowledged
            assert response.status == pb.OK
            self.acked.append((response.commit.begin, response.commit.end, record))
            self.in_flight = None
            self.next += 1


def _check_after_restart(journals, acked: list[tuple[int, int, bytes]],
                         in_flight: bytes | None) -> bytes:
    content = wire.read(journals, JOURNAL)[0]
    for begin, end, record in acked:
        assert content[begin:end] == record, f"acknowledged append at {begin} lost or damaged"
    tail = content[acked[-1][1] if acked else 0 :]
    assert tail in (b"", in_flight), "an unacknowledged append is partially present"
    return content


def test_sigkill_during_appends_and_persists_loses_nothing_acknowledged(tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path / "broker").start()
    try:
        journals = wire.stub(broker.address)
        wire.create(journals, wire.spec(JOURNAL, length=8192, codec=pb.GZIP))
        acked: list[tuple[int, int, bytes]] = []
        next_record = 0
        for delay in (0.4, 0.9, 0.15):
            writer = Writer(broker.address, next_record)
            writer.start()
            wire.wait_until(lambda w=writer: w.acked, what="the writer's first acknowledged append")
            time.sleep(delay)  # the kill moment (what is tested), not synchronisation
            broker.kill()  # mid-append and, with 8 KiB fragments, mid-persist
            writer.join()
            acked.extend(writer.acked)
            assert writer.acked, "the writer made no progress before the kill"
            broker.start()
            journals = wire.stub(broker.address)
            content = _check_after_restart(journals, acked, writer.in_flight)
            # Appends continue at the right offset with no manual step.
            resumed = wire.append(journals, JOURNAL, b"resume\n")
            assert resumed.commit.begin == len(content)
            acked.append((resumed.commit.begin, resumed.commit.end, b"resume\n"))
            next_record = writer.next + 1
    finally:
        broker.kill()


def test_sigkill_mid_stream_rolls_the_partial_append_back(tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path / "broker").start()
    try:
        journals = wire.stub(broker.address)
        wire.create(journals, wire.spec(JOURNAL))
        assert wire.append(journals, JOURNAL, b"committed\n").status == pb.OK
        sent_half, test_over = threading.Event(), threading.Event()

        def half_an_append():
            yield pb.AppendRequest(journal=JOURNAL)
            yield pb.AppendRequest(content=b"x" * 300_000)
            sent_half.set()
            test_over.wait(LIVENESS)  # never finishes: the broker dies first

        failed = []
        streamer = Worker(
            lambda: failed.append(_expect_rpc_error(journals, half_an_append())),
            name="half an append",
        )
        streamer.start()
        assert sent_half.wait(DEADLINE)
        spools = broker.data_dir / "journals" / JOURNAL / "@spool"
        wire.wait_until(
            lambda: sum(p.stat().st_size for p in spools.glob("*.spool"))
            >= len(b"committed\n") + 300_000,
            what="the broker to write the chunk into its spool",
        )
        broker.kill()
        streamer.join()
        assert failed == [True], "the append should fail with the broker"
        broker.start()
        journals = wire.stub(broker.address)
        assert wire.read(journals, JOURNAL)[0] == b"committed\n"
        assert wire.append(journals, JOURNAL, b"next\n").commit.begin == len(b"committed\n")
    finally:
        test_over.set()
        broker.kill()


def _tail_http(broker: BrokerProcess, sent: threading.Event) -> None:
    """A blocking HTTP read from the write head: no header comes before new content, so
    `sent` marks the request as sent (the broker has it, in its socket at least)."""
    connection = http.client.HTTPConnection("127.0.0.1", broker.port + 1, timeout=LIVENESS)
    try:
        connection.request("GET", f"/{JOURNAL}?offset=-1&block=true")
        sent.set()
        # The broker stopping ends the read, cleanly or by cutting the connection.
        with contextlib.suppress(OSError, http.client.HTTPException):
            connection.getresponse().read()
    finally:
        connection.close()


def _expect_rpc_error(journals, requests) -> bool:
    try:
        journals.Append(requests)
    except grpc.RpcError:
        return True
    return False


def test_sigterm_stops_and_persists_spools(tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path / "broker").start()
    journals = wire.stub(broker.address)
    wire.create(journals, wire.spec(JOURNAL, length=1 << 20, codec=pb.ZSTANDARD))
    payload = b"".join(_record(i) for i in range(500))
    wire.append(journals, JOURNAL, payload)
    # Tailing readers, over gRPC and HTTP, must not hold the shutdown open.
    tail = journals.Read(pb.ReadRequest(journal=JOURNAL, offset=-1, block=True))
    sent = threading.Event()
    http_tail = Worker(_tail_http, broker, sent, name="HTTP tail")
    http_tail.start()
    wire.wait_until(
        lambda: sent.is_set() and open_reads(broker.http_url) >= 1,
        what="the gRPC tail to be served and the HTTP tail's request sent",
    )
    # A liveness bound: the tails must not hold the shutdown open. How quickly the broker
    # stops is a measurement, for bench/.
    assert broker.terminate(timeout=LIVENESS) == 0, broker.log()
    tail.cancel()
    http_tail.join()
    stored = list((tmp_path / "broker" / "fragments" / JOURNAL).glob("*.zst"))
    assert len(stored) == 1 and stored[0].name.startswith(f"{0:016x}-{len(payload):016x}-")
    broker.start()
    try:
        journals = wire.stub(broker.address)
        content, metadata = wire.read(journals, JOURNAL)
        assert content == payload
        assert metadata[0].fragment.backing_store == "file:///"
        assert wire.append(journals, JOURNAL, b"more").commit.begin == len(payload)
    finally:
        broker.kill()
