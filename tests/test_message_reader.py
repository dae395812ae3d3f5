"""ReadUncommitted / ReadCommitted and `journals read --messages/--committed`, on a real broker.

Frames are hand-built ndjson lines with UUIDs of chosen producers, clocks and
flags, appended with append_bytes, so each test controls exactly what a
transaction, a duplicate or a rollback looks like in the journal.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import subprocess
import sys
from collections.abc import AsyncIterator

import orjson
import pytest

from streamkit.client import BrokerClient, append_bytes
from streamkit.message.message import Envelope
from streamkit.message.reader import ReadCommitted, ReadUncommitted
from streamkit.message.uuid import Flags, build_uuid, new_producer_id
from tests.brokerproc import BrokerProcess
from tests.helpers_client import create_journal, eventually, open_reads, unique_name
from tests.waiting import DEADLINE

CONT, ACK, OUT = Flags.CONTINUE_TXN, Flags.ACK_TXN, Flags.OUTSIDE_TXN
NDJSON = {"content-type": "application/x-ndjson"}


@pytest.fixture
async def client(shared_broker: BrokerProcess) -> AsyncIterator[BrokerClient]:
    async with BrokerClient(shared_broker.address) as c:
        yield c


async def new_journal(client: BrokerClient) -> str:
    name = unique_name("messages")
    await create_journal(client, name, labels=NDJSON)
    return name


def frame(producer: bytes, clock: int, flags: int, **fields: object) -> bytes:
    return orjson.dumps({"uuid": str(build_uuid(producer, clock, flags)), **fields}) + b"\n"


async def collect(reader: ReadCommitted | ReadUncommitted) -> list[dict]:
    async with reader:
        return [env.message async for env in reader]


async def take(reader: ReadCommitted, n: int) -> list[str]:
    """The "n" fields of up to `n` next messages; the reader stays usable."""
    out: list[str] = []
    async for env in reader:
        out.append(env.message["n"])
        if len(out) == n:
            break
    return out


def names(messages: list[dict]) -> list[object]:
    return [m.get("n") for m in messages]


async def test_read_uncommitted_sees_every_frame(client: BrokerClient) -> None:
    journal = await new_journal(client)
    A = new_producer_id()
    await append_bytes(client, journal, [frame(A, 1, CONT, n="a1"), frame(A, 2, CONT, n="a2")])
    await append_bytes(client, journal, [frame(A, 1, CONT, n="a1"), frame(A, 3, ACK),
                                         b'{"n": "plain"}\n'])
    envs: list[Envelope] = []
    async with ReadUncommitted(client, journal, block=False) as reader:
        envs = [env async for env in reader]
        assert reader.offset == envs[-1].end
    assert names([e.message for e in envs]) == ["a1", "a2", "a1", None, "plain"]
    # Envelopes tile the journal exactly.
    assert envs[0].begin == 0
    assert all(a.end == b.begin for a, b in itertools.pairwise(envs))


async def stop_consumer(task: asyncio.Task[None]) -> None:
    """Cancel a consumer task; raise what it failed with, if it failed (never lose it)."""
    task.cancel()
    (outcome,) = await asyncio.gather(task, return_exceptions=True)
    if outcome is not None and not isinstance(outcome, asyncio.CancelledError):
        raise AssertionError(f"the consumer task failed: {outcome!r}") from outcome


async def test_read_committed_waits_for_the_ack(client: BrokerClient) -> None:
    journal = await new_journal(client)
    A, B = new_producer_id(), new_producer_id()
    got: asyncio.Queue[dict] = asyncio.Queue()

    async def consume() -> None:
        async with ReadCommitted(client, journal, block=True) as reader:
            async for env in reader:
                got.put_nowait(env.message)

    task = asyncio.create_task(consume())
    try:
        await append_bytes(client, journal, [frame(A, 1, CONT, n="a1"), frame(A, 2, CONT, n="a2"),
                                             frame(B, 1, OUT, n="b1")])
        # B's OUTSIDE_TXN message is committed on its own; A's wait for their ACK.
        assert (await asyncio.wait_for(got.get(), DEADLINE))["n"] == "b1"
        with pytest.raises(TimeoutError):  # a negative check: nothing more, for this long
            await asyncio.wait_for(got.get(), 0.5)
        await append_bytes(client, journal, frame(A, 3, ACK))
        acked = [(await asyncio.wait_for(got.get(), DEADLINE))["n"] for _ in range(2)]
        assert acked == ["a1", "a2"]
        # A rolled-back transaction never shows; the next one does.
        await append_bytes(client, journal, [frame(A, 4, CONT, n="rolled back"),
                                             frame(A, 3, ACK), frame(A, 5, CONT, n="a5"),
                                             frame(A, 4, CONT, n="rolled back"),
                                             frame(A, 6, ACK)])
        assert (await asyncio.wait_for(got.get(), DEADLINE))["n"] == "a5"
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(got.get(), 0.3)
    finally:
        await stop_consumer(task)


async def test_read_committed_replays_evicted_messages_and_restarts(
    client: BrokerClient, caplog: pytest.LogCaptureFixture,
) -> None:
    """A one-message ring makes every interleaved transaction need a replay from the broker;
    restarting from checkpoints in the middle loses and repeats nothing."""
    journal = await new_journal(client)
    producers = [new_producer_id() for _ in range(3)]
    expected: list[str] = []
    clock = 1
    for txn in range(5):
        frames = []
        for i in range(4):
            for p, producer in enumerate(producers):
                frames.append(frame(producer, clock + i, CONT, n=f"{txn}.{p}.{i}"))
                frames.append(frame(producer, clock + i, CONT, n=f"{txn}.{p}.{i}"))  # re-sent
        for p, producer in enumerate(producers):
            frames.append(frame(producer, clock + 4, ACK))
            expected.extend(f"{txn}.{p}.{i}" for i in range(4))
        clock += 5
        await append_bytes(client, journal, frames)

    seen: list[str] = []
    with caplog.at_level(logging.DEBUG, logger="streamkit.message.reader"):
        async with ReadCommitted(client, journal, block=False, buffer=1) as reader:
            seen = [env.message["n"] async for env in reader]
    assert seen == expected
    assert caplog.text.count("replaying") >= 10  # the ring held too little: re-read from the broker

    # Stop after every 7 messages; continue from a checkpoint with a new reader.
    seen, offset, states = [], 0, []
    while True:
        reader = ReadCommitted(client, journal, block=False, buffer=1, offset=offset,
                               states=states)
        async with reader:
            batch = await take(reader, 7)
            offset, states = reader.offset, reader.sequencer.checkpoint()
        if not batch:
            break
        seen.extend(batch)
    assert seen == expected


async def test_read_committed_from_the_write_head(broker_proc: BrokerProcess) -> None:
    """Offset -1 is the write head when the broker takes the read: the test waits for that
    (the broker's gauge of open reads, exact on a broker of its own), then appends."""
    async with BrokerClient(broker_proc.address) as client:
        journal = await new_journal(client)
        A = new_producer_id()
        await append_bytes(client, journal, frame(A, 1, OUT, n="old"))
        got: asyncio.Queue[dict] = asyncio.Queue()

        async def consume(reader: ReadCommitted) -> None:
            async with reader:
                async for env in reader:
                    got.put_nowait(env.message)

        reader = ReadCommitted(client, journal, offset=-1, block=True)
        task = asyncio.create_task(consume(reader))
        try:
            await eventually(lambda: open_reads(broker_proc.http_url) == 1,
                             what="the reader to reach the head")
            await append_bytes(client, journal, [frame(A, 2, CONT, n="new"), frame(A, 3, ACK)])
            assert (await asyncio.wait_for(got.get(), DEADLINE))["n"] == "new"
        finally:
            await stop_consumer(task)
        assert reader.offset > 0


def cli(broker: BrokerProcess, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "streamkit.cli.main", "journals", "read", *args,
         "--broker", broker.address],
        capture_output=True, timeout=60,
    )


async def test_cli_reads_messages(client: BrokerClient, shared_broker: BrokerProcess) -> None:
    journal = await new_journal(client)
    A = new_producer_id()
    await append_bytes(client, journal, [frame(A, 1, CONT, n=1), frame(A, 2, CONT, n=2),
                                         frame(A, 3, ACK), frame(A, 4, CONT, n="pending"),
                                         b"not json\n", frame(A, 1, CONT, n=1)])
    everything = await asyncio.to_thread(cli, shared_broker, journal, "--messages")
    assert everything.returncode == 0, everything.stderr.decode()
    lines = [orjson.loads(line) for line in everything.stdout.splitlines()]
    assert names(lines) == [1, 2, None, "pending", 1]
    assert "bad frame" in everything.stderr.decode()  # the invalid line is reported, skipped

    committed = await asyncio.to_thread(cli, shared_broker, journal, "--committed")
    assert committed.returncode == 0, committed.stderr.decode()
    lines = [orjson.loads(line) for line in committed.stdout.splitlines()]
    assert names(lines) == [1, 2]
    assert all("uuid" in line for line in lines)


async def test_cli_messages_of_a_journal_without_framing(
    client: BrokerClient, shared_broker: BrokerProcess,
) -> None:
    journal = unique_name("messages")
    await create_journal(client, journal)  # no content-type label
    result = await asyncio.to_thread(cli, shared_broker, journal, "--messages")
    assert result.returncode != 0
    assert b"Traceback" not in result.stderr
    assert b"content-type" in result.stderr
