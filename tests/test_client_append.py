"""Appender, append_bytes and AppendService against real broker processes."""

from __future__ import annotations

import asyncio
import logging

import pytest

from streamkit.client import (
    Appender,
    AppendService,
    BrokerClient,
    JournalNotFound,
    OpFuture,
    RegisterMismatch,
    WrongAppendOffset,
    append_bytes,
)
from streamkit.protocol.labels import label_set, parse_selector
from tests.brokerproc import BrokerProcess
from tests.helpers_client import create_journal, eventually, read_range, unique_name
from tests.waiting import DEADLINE


@pytest.fixture
async def client(shared_broker: BrokerProcess):
    async with BrokerClient(shared_broker.address) as c:
        yield c


async def _journal(client: BrokerClient) -> str:
    name = unique_name("append")
    await create_journal(client, name)
    return name


async def test_appender_commit_and_abort(client: BrokerClient) -> None:
    journal = await _journal(client)
    async with Appender(client, journal, chunk_size=1024) as appender:
        await appender.write(b"x" * 3000)  # three messages
        await appender.write(b"yz")
    assert appender.response is not None
    assert (appender.response.commit.begin, appender.response.commit.end) == (0, 3002)

    with pytest.raises(RuntimeError, match="changed my mind"):
        async with Appender(client, journal) as appender:
            await appender.write(b"never visible")
            raise RuntimeError("changed my mind")
    response = await append_bytes(client, journal, b"!")
    assert (response.commit.begin, response.commit.end) == (3002, 3003)
    assert await read_range(client, journal, 0, 3003) == b"x" * 3000 + b"yz!"


async def test_appender_preconditions(client: BrokerClient) -> None:
    journal = await _journal(client)
    with pytest.raises(JournalNotFound):
        await append_bytes(client, unique_name("missing"), b"data")

    await append_bytes(client, journal, b"fenced", union_registers=label_set(("author", "a")))
    with pytest.raises(RegisterMismatch):
        await append_bytes(client, journal, b"no", check_registers=parse_selector("author=b"))
    response = await append_bytes(
        client, journal, b"yes", check_registers=parse_selector("author=a")
    )
    assert [(r.name, r.value) for r in response.registers.labels] == [("author", "a")]

    with pytest.raises(WrongAppendOffset):
        await append_bytes(client, journal, b"late", offset=1)
    response = await append_bytes(client, journal, b"exact", offset=response.commit.end)
    assert response.commit.end == len(b"fencedyesexact")


async def test_service_batches_in_order(client: BrokerClient) -> None:
    journal = await _journal(client)
    records = [b"%05d\n" % i for i in range(5000)]
    async with AppendService(client) as service:
        futures = [await service.append(journal, record) for record in records]
        await service.flush()
    distinct = {id(f) for f in futures}
    assert len(distinct) < 50  # co-occurring appends share RPCs
    responses = [await f for f in futures]
    assert responses[-1].commit.end == 6 * len(records)
    assert await read_range(client, journal, 0, 6 * len(records)) == b"".join(records)


async def test_service_dependencies_order_journals(client: BrokerClient) -> None:
    first, second = await _journal(client), await _journal(client)
    async with AppendService(client) as service:
        held = service.start_append(first)
        held.write(b"first")
        later = await service.append(second, b"second", dependencies=[held.future])
        assert service.pending_except(second) == [held.future]
        await asyncio.sleep(0.3)  # a negative check: for this long, `later` must not finish
        assert not later.done()  # waits for `first`, still held by us
        held.release()
        await later
        assert held.future.done()
        assert held.future.result().commit.end == 5


async def test_service_rolls_back_a_failed_writer(client: BrokerClient) -> None:
    journal = await _journal(client)
    async with AppendService(client) as service:
        keep = await service.append(journal, b"kept;")
        append = service.start_append(journal)
        append.write(b"discarded")
        with pytest.raises(ValueError, match="bad record"):
            append.require(ValueError("bad record")).release()
        with service.start_append(journal) as batched:
            batched.write(b"also kept")
        with pytest.raises(KeyError), service.start_append(journal) as failing:
            failing.write(b"discarded too")
            raise KeyError("oops")
        assert batched is append  # one batch: only each caller's writes are undone
        await service.flush()
        assert (await keep).commit.end == len(b"kept;also kept")
    assert await read_range(client, journal, 0, 14) == b"kept;also kept"


async def test_service_failure_propagates(client: BrokerClient) -> None:
    good = await _journal(client)
    missing = unique_name("missing")
    async with AppendService(client) as service:
        doomed = await service.append(missing, b"nowhere")
        dependent = await service.append(good, b"after", dependencies=[doomed])
        with pytest.raises(JournalNotFound):
            await doomed
        with pytest.raises(JournalNotFound):
            await dependent
        assert isinstance(dependent.exception(), JournalNotFound)
        # The failure sticks: nothing later may commit out of order.
        again = await service.append(missing, b"more")
        assert again.done() and isinstance(again.exception(), JournalNotFound)
        barrier = service.pending_except(good)
        assert len(barrier) == 1 and isinstance(barrier[0].exception(), JournalNotFound)
        # A journal without a failed dependency is unaffected.
        other = await _journal(client)
        assert (await (await service.append(other, b"fine"))).commit.end == 4
        assert (await (OpFuture.finished())).status == 0


async def test_service_without_sticky_failures_starts_afresh(client: BrokerClient) -> None:
    # For independent writers sharing a service (recovered ACKs): a journal that failed
    # and was then created takes the next append.
    journal = unique_name("late")
    async with AppendService(client, sticky_failures=False) as service:
        with pytest.raises(JournalNotFound):
            await (await service.append(journal, b"early"))
        await create_journal(client, journal)
        assert (await (await service.append(journal, b"late"))).commit.end == 4
        assert await read_range(client, journal, 0, 4) == b"late"


async def test_service_retries_across_broker_restart(
    broker_proc: BrokerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="streamkit.client.appender")
    async with BrokerClient(broker_proc.address) as client, AppendService(client) as service:
        journal = await _journal(client)
        records = [b"%04d;" % i for i in range(400)]
        for record in records[:200]:
            await service.append(journal, record)
        await service.flush()
        broker_proc.kill()
        futures = [await service.append(journal, record) for record in records[200:]]
        await eventually(  # dispatch fails and retries while the broker is down
            lambda: any(f"retrying append to {journal}" in r.getMessage() for r in caplog.records),
            what="a failed dispatch to be retried",
        )
        assert not futures[-1].done()
        first = next(r for r in caplog.records if "retrying append to" in r.getMessage())
        assert first.levelno == logging.WARNING  # shown by the command line, as appends wait
        await asyncio.to_thread(broker_proc.start)
        await asyncio.wait_for(service.flush(), DEADLINE)
        assert (await futures[-1]).commit.end == 5 * len(records)
        assert await read_range(client, journal, 0, 5 * len(records)) == b"".join(records)


async def test_service_spills_large_content_and_rolls_back_within_it(client: BrokerClient) -> None:
    # Content past the AppendBuffer's 1 MiB moves to a temporary file; a rolled-back writer
    # truncates that file, and the broker gets exactly what was kept.
    async with AppendService(client) as service:
        journal = await _journal(client)
        kept = bytes(range(256)) * 6000  # ~1.5 MiB: spilled
        append = service.start_append(journal)
        append.write(kept)
        append.release()
        assert append._buffer is not None and append._buffer.spilled
        with pytest.raises(ValueError), service.start_append(journal) as again:
            again.write(b"x" * (1 << 20))
            raise ValueError("rolled back")
        future = service.append_nowait(journal, b"tail")
        assert (await future).commit.end == len(kept) + 4
        assert await read_range(client, journal, 0, len(kept) + 4) == kept + b"tail"
