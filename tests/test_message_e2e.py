"""Exactly-once end to end: real producer processes, a real broker, read-committed readers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from streamkit.client import BrokerClient
from streamkit.message.reader import ReadCommitted, ReadUncommitted
from tests import wire
from tests.brokerproc import BrokerProcess

PRODUCER = Path(__file__).parent / "programs" / "txn_producer.py"
ROOT = Path(__file__).resolve().parent.parent


def _start_producer(broker: BrokerProcess, journal: str, count: int, mode: str
                    ) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(PRODUCER), broker.address, journal, str(count), mode],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )


def _wait_for(proc: subprocess.Popen, line: str) -> None:
    assert proc.stdout is not None
    got = proc.stdout.readline().strip()
    assert got == line, f"producer said {got!r}, exit {proc.poll()}"


async def _read(broker: BrokerProcess, journal: str, committed: bool) -> list[dict]:
    async with BrokerClient(broker.address) as client:
        kind = ReadCommitted if committed else ReadUncommitted
        return [env.message async for env in kind(client, journal, dict, block=False)]


async def test_transaction_is_visible_only_once_acknowledged_and_never_if_killed(
    broker_proc: BrokerProcess,
) -> None:
    journal = "e2e/txn"
    labels = {"content-type": "application/x-ndjson"}
    wire.create(wire.stub(broker_proc.address), wire.spec(journal, labels=labels))

    # A producer killed after appending its transaction, before acknowledging it.
    doomed = _start_producer(broker_proc, journal, 50, "hang")
    _wait_for(doomed, "appended")
    assert len(await _read(broker_proc, journal, committed=False)) == 50
    assert await _read(broker_proc, journal, committed=True) == []
    doomed.kill()
    doomed.wait(10)

    # A second producer's transaction becomes visible when its acknowledgement lands.
    survivor = _start_producer(broker_proc, journal, 30, "ack")
    _wait_for(survivor, "appended")
    assert await _read(broker_proc, journal, committed=True) == []
    assert survivor.stdin is not None
    survivor.stdin.write("go\n")
    survivor.stdin.flush()
    _wait_for(survivor, "acked")
    assert survivor.wait(10) == 0

    committed = await _read(broker_proc, journal, committed=True)
    assert [m["i"] for m in committed] == list(range(30))
    assert all(m["txn"] == "ack" for m in committed)
    # The killed producer's messages stay in the journal but are never delivered.
    everything = await _read(broker_proc, journal, committed=False)
    assert sum(m.get("txn") == "hang" for m in everything) == 50
