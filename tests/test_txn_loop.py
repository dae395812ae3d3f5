"""The transaction loop on its own, driven by a fake clock: min and max durations, the
wait for ACKs, and one commit in flight while the next transaction consumes.

The parts are real (Shard, SourceInput with its Sequencer, ShardPublisher, the Store
base class and its one-commit-in-flight check) except the input, whose batches the test
hands over, and the store's commits, which stay in flight until the test resolves them.
Nothing sleeps: time moves only when a test advances the clock, so each assertion about
when a transaction closes is exact.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from streamkit.app.application import Application
from streamkit.app.publishing import ShardPublisher
from streamkit.app.shard import Shard
from streamkit.app.sources import SourceInput
from streamkit.app.txn import _BATCH, _CHECK_EVERY, TransactionFailed, TransactionLoop, must_close
from streamkit.app.waits import first_of
from streamkit.client import BrokerClient
from streamkit.client.append_service import OpFuture
from streamkit.errors import StreamkitError
from streamkit.message.message import Envelope
from streamkit.message.publisher import Publisher
from streamkit.message.sequencer import Sequencer
from streamkit.message.uuid import Flags, build_uuid, new_producer_id
from streamkit.protocol import consumer_pb, pb
from streamkit.stores.store import Store

JOURNAL = "events/part-000"
SHARD = "shard-000"
TICKS = 500  # event-loop turns `until` allows; everything here settles in far fewer


class FakeClock:
    """A TxnClock whose time moves only when the test advances it.

    It also tells the test where the loop waits: `deadline` is the clock time
    the wait in progress lasts until at most (None: no wait, or no limit).
    """

    def __init__(self) -> None:
        self.time = 0.0
        self.waiting = False
        self.deadline: float | None = None
        self._timers: list[tuple[float, asyncio.Future[None]]] = []

    def now(self) -> float:
        return self.time

    async def wait(self, waits: list[Awaitable[Any]], deadline: float | None = None) -> None:
        timer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (deadline if deadline is not None else float("inf"), timer)
        self._timers.append(entry)
        self._fire()
        self.waiting, self.deadline = True, deadline
        try:
            await first_of([*waits, timer])
        finally:
            self.waiting, self.deadline = False, None
            self._timers.remove(entry)
            timer.cancel()

    def advance_to(self, time: float) -> None:
        assert time >= self.time, "a monotonic clock"
        self.time = time
        self._fire()

    def _fire(self) -> None:
        for deadline, timer in self._timers:
            if deadline <= self.time and not timer.done():
                timer.set_result(None)


class Input:
    """A source journal's reader whose batches the test hands over (an EnvelopeReader)."""

    journal = JOURNAL

    def __init__(self) -> None:
        self.batches: asyncio.Queue[list[Envelope] | Exception] = asyncio.Queue()
        self.offset = 0
        self.producer = new_producer_id()
        self.clock = 0

    async def read_batch(self) -> list[Envelope]:
        batch = await self.batches.get()
        if isinstance(batch, Exception):
            raise batch
        return batch

    def close(self) -> None:
        pass

    def envelope(self, n: int, flags: Flags = Flags.OUTSIDE_TXN, producer: bytes = b"") -> Envelope:
        """Message `n`, by the input's own producer unless another is given."""
        self.clock += 1
        uuid = build_uuid(producer or self.producer, self.clock, flags)
        env = Envelope(JOURNAL, self.offset, self.offset + 10, {"uuid": str(uuid), "n": n})
        self.offset += 10
        return env

    def send(self, *envs: Envelope) -> None:
        self.batches.put_nowait(list(envs))

    def committed(self, *ns: int) -> None:
        """Messages committed on their own (as `publish_committed` writes them)."""
        self.send(*(self.envelope(n) for n in ns))


@dataclass
class Commit:
    at: float  # clock time start_commit was called
    txn: int  # the application's transaction number
    messages: list[int]  # what that transaction consumed
    op: OpFuture


class HeldStore(Store):
    """An in-memory store whose commits stay in flight until the test resolves them.

    Store's own check (`_new_commit_op`) fails a commit started while another
    one is in flight, which is the contract the loop must keep.
    """

    def __init__(self, clock: FakeClock, app: Recorder, *, hold: bool) -> None:
        self.clock, self.app, self.hold = clock, app, hold
        self.commits: list[Commit] = []

    async def restore_checkpoint(self, shard_id: str) -> consumer_pb.Checkpoint:
        return consumer_pb.Checkpoint()

    async def start_commit(
        self, shard_id: str, checkpoint: consumer_pb.Checkpoint, wait_for: Sequence[OpFuture]
    ) -> OpFuture:
        op = self._new_commit_op(shard_id, restored=True)
        txn = self.app.txn
        self.commits.append(Commit(self.clock.now(), txn, self.app.consumed[txn], op))
        if not self.hold:
            op.resolve(pb.AppendResponse())
        return op

    def resolve(self, index: int) -> None:
        self.commits[index].op.resolve(pb.AppendResponse())

    async def destroy(self) -> None:
        pass


class Recorder(Application):
    """Records which transaction consumed what, and when each began (by the fake clock)."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.txn = 0
        self.began: dict[int, float] = {}
        self.consumed: dict[int, list[int]] = {}
        self.on_consume: Callable[[int], None] = lambda n: None
        self.on_finalize: Callable[[], None] = lambda: None

    def begin_txn(self, shard: Shard, store: Store) -> None:
        self.txn += 1
        self.began[self.txn] = self.clock.now()
        self.consumed[self.txn] = []

    def consume_message(
        self, shard: Shard, store: Store, envelope: Envelope, publisher: ShardPublisher
    ) -> None:
        self.consumed[self.txn].append(envelope.message["n"])
        self.on_consume(envelope.message["n"])

    def finalize_txn(self, shard: Shard, store: Store, publisher: ShardPublisher) -> None:
        self.on_finalize()


@dataclass
class Harness:
    clock: FakeClock
    input: Input
    app: Recorder
    store: HeldStore
    loop: TransactionLoop
    task: asyncio.Task[None]
    stopping: asyncio.Event
    failed: bool = False  # the test expected the loop to fail, and looked at how


async def failure(h: Harness) -> BaseException:
    """How the loop failed (it must)."""
    await until(h.task.done, "the loop failed")
    h.failed = True
    error = h.task.exception()
    assert error is not None, "the loop ended without an error"
    return error


async def until(condition: Callable[[], bool], what: str) -> None:
    """Turn the event loop until `condition` holds (a bounded number of turns, no time)."""
    for _ in range(TICKS):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"not reached within {TICKS} event-loop turns: {what}")


async def settle() -> None:
    """Let every runnable task run (to show nothing more happens)."""
    for _ in range(TICKS // 10):
        await asyncio.sleep(0)


def _spec(min_txn: float, max_txn: float, wait_for_ack: bool) -> consumer_pb.ShardSpec:
    spec = consumer_pb.ShardSpec(id=SHARD, disable_wait_for_ack=not wait_for_ack)
    spec.min_txn_duration.FromTimedelta(timedelta(seconds=min_txn))
    spec.max_txn_duration.FromTimedelta(timedelta(seconds=max_txn))
    spec.sources.add(journal=JOURNAL)
    return spec


@pytest.fixture
async def run_loop() -> AsyncIterator[Callable[..., Awaitable[Harness]]]:
    """Starts the loop of a shard with the given durations; stops it after the test."""
    started: list[Harness] = []

    async def start(
        *, min_txn: float = 0.0, max_txn: float = 1.0, wait_for_ack: bool = True, hold: bool = True,
        app_class: type[Recorder] | None = None,
    ) -> Harness:
        clock, reader = FakeClock(), Input()
        client = BrokerClient("127.0.0.1:9")  # never dialled: nothing here appends
        shard = Shard(
            _spec(min_txn, max_txn, wait_for_ack),
            client,
            fqn=f"test/{SHARD}",
            work_dir=Path(tempfile.gettempdir()),
            mappings=lambda topic: pytest.fail(f"no outputs here ({topic})"),
            store_factory=lambda *args: pytest.fail("the test makes the store"),
        )
        app = (app_class or Recorder)(clock)
        store = HeldStore(clock, app, hold=hold)
        sequencer = Sequencer([], 64, offsets={JOURNAL: 0})
        source = SourceInput(
            client, sequencer, {JOURNAL: 0}, {JOURNAL: dict}, shard_id=SHARD, readers=[reader]
        )
        publisher = ShardPublisher(Publisher(shard.appends), shard.output)
        loop = TransactionLoop(shard, app, store, publisher, source, clock=clock)
        stopping = asyncio.Event()
        task = asyncio.create_task(loop.run(stopping))
        harness = Harness(clock, reader, app, store, loop, task, stopping)
        started.append(harness)
        await until(lambda: clock.waiting, "the loop waits for its first message")
        return harness

    yield start
    for h in started:
        h.stopping.set()
        h.store.hold = False
        for commit in h.store.commits:
            commit.op.resolve(pb.AppendResponse())
        source = h.loop.source
        try:
            await until(h.task.done, "the loop stopped")
            error = h.task.exception()
            if error is not None and not h.failed:
                raise error
        finally:
            h.task.cancel()
            source.close()


def closed(h: Harness) -> list[tuple[float, list[int]]]:
    """The transactions whose commit started: when, and what they consumed."""
    return [(c.at, c.messages) for c in h.store.commits]


# --- the predicate ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("elapsed", "ready", "committing", "acks_pending", "stopping", "close"),
    [
        (1.0, True, False, False, False, True),  # the max closes, however much is at hand
        (1.0, False, True, True, False, True),  # ... and doesn't wait for a commit or an ACK
        (0.5, True, False, False, True, True),  # a stop request closes
        (0.5, True, False, False, False, False),  # messages at hand: go on
        (0.5, False, True, False, False, False),  # the previous commit in flight: go on
        (0.1, False, False, False, False, False),  # before the min: hold open
        (0.5, False, False, True, False, False),  # an ACK on its way: wait for it
        (0.5, False, False, False, False, True),  # nothing to wait for
        (0.2, False, False, False, False, True),  # the min is inclusive
    ],
)
def test_must_close(
    elapsed: float, ready: bool, committing: bool, acks_pending: bool, stopping: bool, close: bool
) -> None:
    decided = must_close(
        elapsed,
        0.2,
        1.0,
        stopping=stopping,
        ready=ready,
        committing=committing,
        acks_pending=acks_pending,
    )
    assert decided is close


# --- min and max durations --------------------------------------------------------------


async def test_min_duration_holds_the_transaction_open(run_loop: Any) -> None:
    h = await run_loop(min_txn=0.5, max_txn=2.0)
    h.input.committed(1)
    await until(lambda: h.app.consumed == {1: [1]} and h.clock.deadline == 0.5, "wait for min")
    h.clock.advance_to(0.3)
    h.input.committed(2)  # arriving while held open: the same transaction
    await until(lambda: h.app.consumed == {1: [1, 2]} and h.clock.waiting, "consumed 2")
    assert h.clock.deadline == 0.5
    h.clock.advance_to(0.49)
    await settle()
    assert closed(h) == []
    h.clock.advance_to(0.5)
    await until(lambda: len(h.store.commits) == 1, "the commit at the min duration")
    assert closed(h) == [(0.5, [1, 2])]


async def test_without_min_duration_the_transaction_closes_when_input_runs_out(
    run_loop: Any,
) -> None:
    h = await run_loop(min_txn=0.0)
    h.input.committed(1, 2)
    await until(lambda: len(h.store.commits) == 1, "a commit")
    assert closed(h) == [(0.0, [1, 2])]


async def test_max_duration_closes_while_messages_keep_coming(run_loop: Any) -> None:
    h = await run_loop(max_txn=1.0, hold=False)
    step = 1 / 64  # a slow application: each message takes a 64th of the max duration

    def slow(n: int) -> None:
        h.clock.advance_to(h.clock.time + step)

    h.app.on_consume = slow
    h.input.committed(*range(200))
    await until(lambda: sum(map(len, h.app.consumed.values())) == 200, "everything consumed")
    await until(lambda: len(h.store.commits) == 4, "the last commit")
    # The clock is looked at between runs of messages: 1, 2, 4, then 8 (as many as take
    # an eighth of the max duration): the first look at or past it closes (at message 71,
    # then after 64 more), though more messages are at hand.
    assert _CHECK_EVERY == 16
    assert [len(c.messages) for c in h.store.commits] == [71, 64, 64, 1]
    assert [c.at for c in h.store.commits] == [71 * step, 135 * step, 199 * step, 200 * step]
    assert h.app.began == {1: 0.0, 2: 71 * step, 3: 135 * step, 4: 199 * step}


async def test_a_batch_hook_of_a_fixed_cost_keeps_its_batches(run_loop: Any) -> None:
    """A batch hook whose calls take a fixed 0.2 s whatever their size (a bulk write): it
    gets whole batches. Paced as consume_message is, it dropped to one message a call, for
    good (a run of one took as long)."""
    sizes: list[int] = []

    class BulkWriter(Recorder):
        def consume_messages(self, shard: Any, store: Any, envelopes: list[Envelope],
                             publisher: Any) -> None:
            sizes.append(len(envelopes))
            self.consumed[self.txn].extend(env.message["n"] for env in envelopes)
            self.clock.advance_to(self.clock.time + 0.2)

    h = await run_loop(max_txn=1.0, hold=False, app_class=BulkWriter)
    h.input.committed(*range(3000))
    await until(lambda: sum(map(len, h.app.consumed.values())) == 3000, "everything consumed")
    assert sizes == [_BATCH, 3000 - _BATCH], sizes


async def test_a_slow_app_looks_at_the_clock_after_each_message(run_loop: Any) -> None:
    """Hooks taking half the max duration: each transaction closes after two messages. It
    took up to _CHECK_EVERY messages before looking (8 s instead of 1 s), and a stop
    request waited as long."""
    h = await run_loop(max_txn=1.0, hold=False)

    def slow(n: int) -> None:
        h.clock.advance_to(h.clock.time + 0.5)

    h.app.on_consume = slow
    h.input.committed(*range(12))
    await until(lambda: len(h.store.commits) == 6, "the last commit")
    assert [len(c.messages) for c in h.store.commits] == [2] * 6
    assert [c.at for c in h.store.commits] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


# --- waiting for ACKs -------------------------------------------------------------------


def _open_producer_txn(h: Harness) -> tuple[bytes, Envelope]:
    """Message 1 committed, then message 2 of another producer's open transaction."""
    other = new_producer_id()
    pending = h.input.envelope(2, Flags.CONTINUE_TXN, producer=other)
    h.input.send(h.input.envelope(1), pending)
    return other, pending


async def test_waits_for_the_ack_of_an_open_producer_transaction(run_loop: Any) -> None:
    h = await run_loop(max_txn=1.0)
    other, _ = _open_producer_txn(h)
    await until(lambda: h.app.consumed == {1: [1]} and h.clock.deadline == 1.0, "wait for ACK")
    h.clock.advance_to(0.25)
    await settle()
    assert closed(h) == []
    h.input.send(h.input.envelope(0, Flags.ACK_TXN, producer=other))
    await until(lambda: len(h.store.commits) == 1, "the commit once the ACK came")
    assert closed(h) == [(0.25, [1, 2])]


async def test_does_not_wait_for_acks_when_the_spec_says_so(run_loop: Any) -> None:
    h = await run_loop(max_txn=1.0, wait_for_ack=False)
    _open_producer_txn(h)
    await until(lambda: len(h.store.commits) == 1, "a commit")
    assert closed(h) == [(0.0, [1])]


async def test_waits_for_an_ack_at_most_until_the_max_duration(run_loop: Any) -> None:
    h = await run_loop(min_txn=0.1, max_txn=1.0)
    _open_producer_txn(h)
    await until(lambda: h.clock.deadline == 0.1, "wait for the min duration")
    h.clock.advance_to(0.1)
    await until(lambda: h.clock.deadline == 1.0, "then for the ACK")
    h.clock.advance_to(0.99)
    await settle()
    assert closed(h) == []
    h.clock.advance_to(1.0)
    await until(lambda: len(h.store.commits) == 1, "the commit at the max duration")
    assert closed(h) == [(1.0, [1])]


# --- pipelining -------------------------------------------------------------------------


async def test_next_transaction_consumes_while_the_previous_commits(run_loop: Any) -> None:
    h = await run_loop(max_txn=1.0)
    h.input.committed(1)
    await until(lambda: len(h.store.commits) == 1 and h.clock.waiting, "commit 1 in flight")
    h.clock.advance_to(0.1)
    h.input.committed(2)
    await until(lambda: h.app.consumed.get(2) == [2] and h.clock.waiting, "txn 2 consumes")
    assert h.app.began[2] == 0.1
    assert h.clock.deadline == 1.1  # waits for commit 1 or input, at most until its max
    h.clock.advance_to(0.2)
    h.input.committed(3)
    await until(lambda: h.app.consumed[2] == [2, 3] and h.clock.waiting, "txn 2 consumes 3")
    await settle()
    assert len(h.store.commits) == 1  # ... but doesn't commit while commit 1 is in flight
    h.clock.advance_to(0.3)
    h.store.resolve(0)
    await until(lambda: len(h.store.commits) == 2, "commit 2 once commit 1 is done")
    assert closed(h) == [(0.0, [1]), (0.3, [2, 3])]
    assert h.loop.shard.transactions == 1  # acknowledged: commit 1 only


async def test_at_its_max_a_transaction_waits_for_the_previous_commit(run_loop: Any) -> None:
    h = await run_loop(max_txn=1.0)
    h.input.committed(1)
    await until(lambda: len(h.store.commits) == 1 and h.clock.waiting, "commit 1 in flight")
    h.clock.advance_to(0.5)
    h.input.committed(2)
    await until(lambda: h.app.consumed.get(2) == [2] and h.clock.deadline == 1.5, "txn 2 open")
    h.clock.advance_to(1.5)
    await until(lambda: h.clock.waiting and h.clock.deadline is None, "waits for commit 1")
    h.clock.advance_to(2.0)
    h.input.committed(3)  # txn 2 is closed: this one is for txn 3
    await settle()
    assert closed(h) == [(0.0, [1])] and h.app.consumed == {1: [1], 2: [2]}
    h.clock.advance_to(2.5)
    h.store.resolve(0)
    await until(lambda: len(h.store.commits) == 2, "commit 2")
    assert closed(h)[1] == (2.5, [2])
    await until(lambda: h.app.consumed.get(3) == [3], "txn 3 consumes")
    assert h.app.began[3] == 2.5


# --- failures ---------------------------------------------------------------------------


async def test_a_failure_names_the_shard_the_transaction_and_the_phase(run_loop: Any) -> None:
    h = await run_loop(max_txn=1.0, hold=False)  # a failed loop waits for the commit in flight

    def poison(n: int) -> None:
        if n == 3:
            raise ValueError(f"cannot count {n}")

    h.app.on_consume = poison
    h.input.committed(1)
    await until(lambda: len(h.store.commits) == 1, "commit 1")
    h.input.committed(2, 3)
    error = await failure(h)
    assert isinstance(error, TransactionFailed) and isinstance(error, StreamkitError)
    assert (error.shard, error.number, error.phase) == (SHARD, 2, "consume_message")
    phase = f"transaction 2 failed at consume_message on the message at {JOURNAL} offset 20"
    assert str(error) == f"shard {SHARD}: {phase}: ValueError: cannot count 3"
    assert isinstance(error.__cause__, ValueError)


async def test_a_failed_commit_names_its_own_transaction(run_loop: Any) -> None:
    h = await run_loop(max_txn=1.0)
    h.input.committed(1)
    await until(lambda: len(h.store.commits) == 1, "commit 1 in flight")
    h.input.committed(2)
    await until(lambda: h.app.consumed.get(2) == [2] and h.clock.waiting, "txn 2 consumes")
    h.store.commits[0].op.fail(OSError("disk full"))
    error = await failure(h)
    assert isinstance(error, TransactionFailed)
    assert (error.number, error.phase) == (1, "commit")
    assert error.reason == "transaction 1 failed at commit: OSError: disk full"


async def test_a_commit_failing_after_the_loop_failed_prints_no_stray_traceback(
        run_loop: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The loop failed (or was stopped, or fenced) with a commit in flight, which then
    failed too: its error is no one's to report any more. asyncio printed it, with a
    traceback, as "Task exception was never retrieved" whenever the task was collected."""
    import gc

    h = await run_loop(max_txn=1.0)
    h.input.committed(1)
    await until(lambda: len(h.store.commits) == 1, "commit 1 in flight")

    def consume(n: int) -> None:
        if n == 2:
            raise ValueError("no")

    h.app.on_consume = consume
    h.input.committed(2)
    await until(lambda: 2 in h.app.consumed, "transaction 2 consumed")
    h.store.commits[0].op.fail(OSError("fenced"))
    error = await failure(h)
    assert isinstance(error, TransactionFailed) and error.phase == "consume_message"
    h.loop._previous = None  # (the loop object outlives the test's look at the log)
    gc.collect()
    await settle()
    assert "never retrieved" not in caplog.text, caplog.text


async def test_a_failed_finalize_txn_names_its_phase(run_loop: Any) -> None:
    h = await run_loop(max_txn=1.0)

    def finalize() -> None:
        raise RuntimeError("no")

    h.app.on_finalize = finalize
    h.input.committed(1)
    error = await failure(h)
    assert isinstance(error, TransactionFailed)
    assert (error.number, error.phase) == (1, "finalize_txn")
    assert str(error) == f"shard {SHARD}: transaction 1 failed at finalize_txn: RuntimeError: no"


async def test_a_failed_input_names_the_transaction_it_was_read_for(run_loop: Any) -> None:
    h = await run_loop(max_txn=1.0, hold=False)
    h.input.committed(1)
    await until(lambda: len(h.store.commits) == 1, "commit 1")
    h.input.batches.put_nowait(ConnectionError("broker gone"))
    error = await failure(h)
    assert isinstance(error, TransactionFailed)
    assert error.reason == "transaction 2 failed at read: ConnectionError: broker gone"
