"""The consumer transaction loop of a primary shard.

Each transaction consumes committed source messages, then commits the
application's state together with a Checkpoint (source offsets, producer
states, and the ACK intents of what it published), then appends those ACKs.
Transactions are pipelined: the next one consumes while the previous one's
commit and ACKs are in flight, and it may not begin its own commit before they
finished. Its length is bounded by the shard's min and max durations:

* it begins with the first committed message;
* it goes on consuming as long as messages are ready, until the max duration;
* when none is ready it waits, instead of committing, while the previous
  transaction is still committing, while the min duration hasn't passed, or
  while a producer's transaction is open in the input (an ACK is probably
  on its way, unless the spec disables waiting for ACKs) — at most until the
  max duration;
* otherwise it commits.

Being asked to stop closes the open transaction too. These rules are one pure
predicate, `must_close`; the loop around it is a few named steps (see
`TransactionLoop`), and it measures and waits by an injectable clock
(`streamkit.app.txn_clock`), so tests drive it deterministically.

ACKs are queued right when the commit starts, with the commit as their
dependency, so in every journal they precede whatever the next transaction
publishes, and they are written only once the checkpoint holding them is
durable. After a crash the next primary queues them again from that
checkpoint (`queue_ack_intents`) without waiting: queued first, they precede
its own publishes in their journals, and its first commit depends on them
(the commit's barrier covers every journal's queue), as Gazette's does.

A poison message -- a source frame that doesn't decode (a BadFrame), or one
whose consume_message raises -- fails the transaction, unless its source's
policy (streamkit.yaml, carried by the shard spec's labels) says to skip it or
dead-letter it. Either way it is passed over within the transaction: the
checkpoint that commits moves the source's offset past it, and a dead letter
is published through the shard's publisher, so it commits (and is read
committed) together with that checkpoint, exactly once. A message that
consume_message raised on is passed over as a whole only if the application
had not yet changed its state for it (see docs/concepts/messages.md).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from streamkit.app.application import Application, batch_hook
from streamkit.app.checkpoints import build_checkpoint
from streamkit.app.metrics import ShardMetrics, shard_metrics
from streamkit.app.poison import PoisonGate, PoisonPolicies, UnskippableFrame, consume_each
from streamkit.app.publishing import ShardPublisher
from streamkit.app.shard import Shard
from streamkit.app.sources import BadFrame, SourceInput
from streamkit.app.txn_clock import MONOTONIC, TxnClock
from streamkit.app.watchdog import HookRecord
from streamkit.client.append_service import AppendService, OpFuture
from streamkit.errors import StreamkitError
from streamkit.message.message import Envelope
from streamkit.protocol import consumer_pb
from streamkit.stores.store import Store

__all__ = [
    "PoisonPolicies",
    "TransactionFailed",
    "TransactionLoop",
    "UnskippableFrame",
    "awaitable_hook",
    "must_close",
    "queue_ack_intents",
    "reappend_ack_intents",
]

log = logging.getLogger(__name__)

_YIELD_EVERY = 256  # messages consumed between yields to the event loop (reads, commits)
# Messages consumed between looks at the clock and at a stop request, at most: runs are
# shorter while the app is slow (`_paced`), so that its transactions still end near
# max_duration, and a stop is seen soon.
_CHECK_EVERY = 16
# At most this many messages go to one call of a batch hook (consume_messages); the clock
# and a stop request are looked at between calls.
_BATCH = 2048
_RUN_SHARE = 8  # a run should take at most 1/_RUN_SHARE of max_duration
_YIELD_AFTER = 0.02  # seconds of consuming after which the loop yields regardless of count


def awaitable_hook(fn: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    """An awaitable form of a hook that may be plain or a coroutine function."""
    if inspect.iscoroutinefunction(fn):
        return fn

    async def call(*args: Any) -> Any:
        return fn(*args)

    return call


def marked_hook(app: Any, hook: str, hooks: HookRecord) -> Callable[..., Awaitable[Any]]:
    """The app's `hook`, awaitable, marked in `hooks` while it runs (for the watchdog)."""
    fn = getattr(app, hook)
    call, is_async = awaitable_hook(fn), inspect.iscoroutinefunction(fn)

    async def marked(*args: Any) -> Any:
        with hooks.call(hook, is_async):
            return await call(*args)

    return marked


def queue_ack_intents(shard: Shard, cp: consumer_pb.Checkpoint,
                      via: AppendService | None = None) -> list[OpFuture]:
    """Queue the restored checkpoint's ACKs again: its transaction may have died before
    writing them. Whatever the shard appends to those journals afterwards follows them.

    `via` (a service shared by the shards of a process) coalesces the ACKs of shards
    recovering at once into one append per journal; the shard's own queue then holds an
    empty append that waits for them (no RPC), so the order and the commit barrier hold.
    """
    if via is None:
        return [shard.appends.append_nowait(j, data) for j, data in cp.ack_intents.items()]
    return [shard.appends.append_nowait(j, b"", (via.append_nowait(j, data),))
            for j, data in cp.ack_intents.items()]


async def reappend_ack_intents(shard: Shard, cp: consumer_pb.Checkpoint) -> None:
    """`queue_ack_intents`, and wait until they are written."""
    for future in queue_ack_intents(shard, cp):
        await future


class TransactionFailed(StreamkitError):
    """A transaction of a shard failed; its cause (`__cause__`) is the original error.

    `phase` says where, so an operator knows whose error it is: "read" (the
    shard's input, including a poison frame it can't pass over), an
    application hook ("begin_txn", "consume_message" or "consume_messages", "finalize_txn",
    "finished_txn"), "commit" (checkpointing and the store's commit) or "ack"
    (appending the transaction's ACKs). `reason` is the message without the shard;
    `message`, where one message raised, names it (its journal and offset).
    """

    def __init__(self, shard: str, number: int, phase: str, error: BaseException,
                 message: str = "") -> None:
        text = f"{type(error).__name__}: {error}" if str(error) else repr(error)
        on = f" on {message}" if message else ""
        self.reason = f"transaction {number} failed at {phase}{on}: {text}"
        super().__init__(f"shard {shard}: {self.reason}")
        self.shard, self.number, self.phase = shard, number, phase


def poison_failed(shard: str, number: int, env: Envelope, error: Exception) -> TransactionFailed:
    """The failure of transaction `number` at a poison message not passed over.

    A frame that doesn't decode fails the read (its error names journal and
    offset); a message the app's consume_message raised on is named here.
    Live shards and backfill tasks fail alike.
    """
    if type(env.message) is BadFrame:
        return TransactionFailed(shard, number, "read", error)
    return TransactionFailed(shard, number, "consume_message", error,
                             f"the message at {env.journal} offset {env.begin}")


def _seen(task: asyncio.Task[None]) -> None:
    """Mark a commit's failure seen. The loop raises it where it next looks; a loop that
    ended first (failed, stopped, fenced) has said why, and asyncio would print this one
    with a traceback as "never retrieved" whenever the task is collected."""
    if not task.cancelled():
        task.exception()


def must_close(
    elapsed: float,
    min_duration: float,
    max_duration: float,
    *,
    stopping: bool,
    ready: bool,
    committing: bool,
    acks_pending: bool,
) -> bool:
    """Whether the open transaction must stop consuming and commit now.

    The module docstring's rules, in one pure place (so they can be tested
    without a loop). `ready`: a message is at hand or buffered; `committing`:
    the previous transaction's commit or ACKs are still in flight;
    `acks_pending`: a producer's transaction is open in the input and the spec
    waits for ACKs. Being asked to stop closes the transaction too.
    """
    if elapsed >= max_duration or stopping:
        return True
    if ready or committing:
        return False
    return elapsed >= min_duration and not acks_pending


class TransactionLoop:
    """Runs consumer transactions of one primary shard until asked to stop or failing.

    One transaction is the steps `_first_message`, `_begin`, then
    `_consume_ready` and `_wait_for_more` until `must_close`, then
    `_await_previous_commit` and `_start_commit`. Durations and waits go by
    `clock` (the real monotonic one unless a test passes a fake).
    """

    def __init__(
        self,
        shard: Shard,
        app: Application,
        store: Store,
        publisher: ShardPublisher,
        source: SourceInput,
        hooks: HookRecord | None = None,
        clock: TxnClock = MONOTONIC,
    ) -> None:
        self.shard, self.app, self.store = shard, app, store
        # Where the hook running now is marked, for the Replica's Watchdog.
        self.hooks = hooks if hooks is not None else HookRecord(shard.id)
        self.publisher, self.source, self.clock = publisher, source, clock
        spec = shard.spec
        self.max_duration = spec.max_txn_duration.ToTimedelta().total_seconds() or 1.0
        self.min_duration = spec.min_txn_duration.ToTimedelta().total_seconds()
        self.wait_for_ack = not spec.disable_wait_for_ack
        self.policies = PoisonPolicies(spec)
        self._async_consume = inspect.iscoroutinefunction(app.consume_message)
        # The batch hook, unless the app has none or a source's policy needs to know which
        # message raised (then consume_message it is, one message at a time).
        batch = None if self.policies.passes_over_consume_errors else batch_hook(app)
        self._batch = batch
        self._async_batch = batch is not None and inspect.iscoroutinefunction(batch)
        self._max_run = _CHECK_EVERY if batch is None else _BATCH
        # The next run's length: consume_message's grows while runs are quick (`_paced`).
        # A batch hook's is not paced: its calls often cost the same whatever their size
        # (a bulk write), so smaller ones would only cost more.
        self._run_limit = 1 if batch is None else _BATCH
        self.hooks.consume_hook = "consume_message" if batch is None else "consume_messages"
        self.hooks.consume_async = self._async_consume if batch is None else self._async_batch
        self._poison = PoisonGate(shard.id, self.policies, publisher)
        self._begin_txn = marked_hook(app, "begin_txn", self.hooks)
        self._finalize = marked_hook(app, "finalize_txn", self.hooks)
        self._finished = marked_hook(app, "finished_txn", self.hooks)
        self._previous: asyncio.Task[None] | None = None
        self.last_commit: float | None = None  # wall time the last transaction was acknowledged
        # Held from a transaction's first message until its commit started: queries take it
        # to see the store between transactions.
        self.lock = asyncio.Lock()
        self._number = 0  # of the transaction begun last (1 is the first since the restore)
        self._open = False  # whether transaction _number is open (begun, commit not started)
        self._phase = "read"  # of the open transaction, or "read" for the next one's input
        self._started = 0.0  # clock time the open transaction began
        self._skipped = 0  # poison messages the open transaction passed over
        self._yielded = 0.0  # clock time of the last yield to the event loop

    async def run(self, stopping: asyncio.Event) -> None:
        """Consume and commit until `stopping` is set, then finish the transaction in progress.

        A failure is raised as TransactionFailed naming the transaction and the
        phase it failed in (its cause is the original error).
        """
        self.hooks.task = asyncio.current_task()
        try:
            while True:
                first = await self._first_message(stopping)
                if first is None:
                    break
                async with self.lock:
                    await self._transaction(first, stopping)
            await self.wait_committed()
        except (asyncio.CancelledError, TransactionFailed):
            raise
        except Exception as error:
            number = self._number if self._open else self._number + 1
            raise TransactionFailed(self.shard.id, number, self._phase, error) from error
        finally:
            previous = self._previous
            if previous is not None and not previous.done():
                await asyncio.wait((previous,))

    @functools.cached_property
    def metrics(self) -> ShardMetrics:
        """The shard's metric children, looked up when its first transaction ends."""
        return shard_metrics(self.shard.id)

    async def wait_committed(self) -> None:
        """Until the last started commit is durable and acknowledged (raises if it failed)."""
        previous = self._previous
        if previous is not None:
            await asyncio.wait((previous,))
        self._check_previous()

    # --- steps ---------------------------------------------------------------------

    async def _first_message(self, stopping: asyncio.Event) -> list[Envelope] | None:
        """Wait for the next transaction's first message(s); None once stopping."""
        source = self.source
        self._phase = "read"
        while True:
            self._check_previous()
            if stopping.is_set():  # input may never run out: don't start another transaction
                return None
            run = source.poll_run(self._run_limit)
            if run:
                return run
            if not source.ready:
                waits: list[Awaitable[Any]] = [source.wait_ready(), stopping.wait()]
                if self._previous is not None:
                    waits.append(self._previous)
                await self.clock.wait(waits)
            else:
                await source.fill()

    async def _transaction(self, run: list[Envelope], stopping: asyncio.Event) -> None:
        """One transaction, from its first message(s) `run` until its commit started."""
        await self._begin()
        source, poll_run = self.source, self.source.poll_run
        min_duration, max_duration = self.min_duration, self.max_duration
        count = 0
        while True:
            if run:
                count, close = await self._consume_ready(run, count, stopping)
                if close:
                    break
            # Nothing at hand: close, or wait for what may change that.
            elapsed = self.clock.now() - self._started
            ready = source.ready
            previous = self._previous
            committing = previous is not None and not previous.done()
            # Looked at only when it may matter: it goes over every producer.
            acks = (
                self.wait_for_ack and not (ready or committing) and source.sequencer.has_pending()
            )
            if must_close(
                elapsed,
                min_duration,
                max_duration,
                stopping=stopping.is_set(),
                ready=ready,
                committing=committing,
                acks_pending=acks,
            ):
                break
            await self._wait_for_more(elapsed, committing, stopping)
            run = poll_run(self._run_limit)
        await self._await_previous_commit()
        self.metrics.consumed.observe(self.clock.now() - self._started)
        self.metrics.messages.inc(count - self._skipped)
        await self._start_commit(count - self._skipped)

    async def _begin(self) -> None:
        """Open the next transaction: its number, start time and the app's begin_txn."""
        self._number += 1
        self._open, self._skipped = True, 0
        self._started = self.clock.now()
        self._phase = "begin_txn"
        await self._begin_txn(self.shard, self.store)
        self.publisher.publisher.clock.update()

    async def _consume_ready(
        self, run: list[Envelope], count: int, stopping: asyncio.Event
    ) -> tuple[int, bool]:
        """Consume `run` and the messages buffered after it, until none is or `must_close`.

        Returns the transaction's message count so far, and whether it must
        close. Runs are at most _CHECK_EVERY messages for consume_message and
        _BATCH for a batch hook, fewer while the app is slow (`_paced`): the clock
        and the stop request are looked at between runs, and nothing else is
        called per message.
        """
        poll_run, now, limit = self.source.poll_run, self.clock.now, self._run_limit
        started, next_yield = self._started, count + _YIELD_EVERY
        min_duration, max_duration = self.min_duration, self.max_duration
        # The pace at which a run of the most messages still fits its share (`_paced`).
        most = self._max_run
        quick = max_duration / (_RUN_SHARE * most) if self._batch is None else math.inf
        self._phase = "read"  # what fails outside the consume hooks is the input (poll)
        while run:
            began = now()
            if self._batch is not None and type(run[0].message) is not BadFrame:
                await self._consume_batch(run)
            else:
                await self._consume_each(run)
            ran = len(run)
            count += ran
            t = now()
            if limit != most or t - began > ran * quick:  # else: stays the most
                limit = self._paced(ran, t - began)
            if count >= next_yield or t - self._yielded > _YIELD_AFTER:
                # Yield by count and by time: a slow application must not starve
                # reads, commits, other shards, or the member's lease keepalive.
                await asyncio.sleep(0)
                self._yielded, next_yield = t, count + _YIELD_EVERY
            # With a message at hand only the max duration and a stop request close.
            if must_close(
                t - started,
                min_duration,
                max_duration,
                stopping=stopping.is_set(),
                ready=True,
                committing=False,
                acks_pending=False,
            ):
                return count, True
            run = poll_run(limit)
        return count, False

    def _paced(self, ran: int, took: float) -> int:
        """The next run's length, from the last one's pace: as many messages as fit in
        1/_RUN_SHARE of max_duration (one, for hooks taking tenths of a second), at most
        twice the last run's limit (it grows back quickly), and at most the most."""
        limit = min(self._max_run, 2 * self._run_limit)
        if took > 0:
            limit = max(1, min(limit, int(ran * self.max_duration / (_RUN_SHARE * took))))
        self._run_limit = limit
        return limit

    async def _consume_each(self, run: list[Envelope]) -> None:
        """consume_message for each envelope of `run`, passing over poison ones by policy."""
        await consume_each(self.app, self.shard, self.store, self.publisher, run,
                           self._async_consume, self._pass_over_or_fail, self.hooks)

    async def _consume_batch(self, run: list[Envelope]) -> None:
        """The batch hook over `run`; if it raises, the transaction fails (nothing is skipped)."""
        hooks = self.hooks
        hooks.current = run[0]  # the watchdog's mark: consuming from this message on
        try:
            if self._async_batch:
                await self._batch(self.shard, self.store, run, self.publisher)
            else:
                self._batch(self.shard, self.store, run, self.publisher)
        except Exception as error:
            raise TransactionFailed(self.shard.id, self._number, "consume_messages", error
                                    ) from error
        finally:
            hooks.current = None

    async def _wait_for_more(
        self, elapsed: float, committing: bool, stopping: asyncio.Event
    ) -> None:
        """Nothing at hand, yet `must_close` said no: wait for what it waits on.

        That is input, the previous commit, the min duration, or an ACK (at
        most until the max duration).
        """
        source, clock = self.source, self.clock
        self._phase = "read"
        if source.ready:
            await source.fill()  # a replay to read, or a reader's error to raise in poll
            return
        previous = self._previous
        if committing and previous is not None:
            waits: list[Awaitable[Any]] = [previous, source.wait_ready()]
            await clock.wait(waits, self._started + self.max_duration)
        elif elapsed < self.min_duration:
            waits = [source.wait_ready(), stopping.wait()]
            await clock.wait(waits, self._started + self.min_duration)
        else:  # an ACK is probably on its way: wait for it, at most until the max duration
            waits = [source.wait_ready(), stopping.wait()]
            await clock.wait(waits, self._started + self.max_duration)
        self._check_previous()

    async def _await_previous_commit(self) -> None:
        """The previous commit must be done before this one starts (one commit in flight)."""
        previous = self._previous
        if previous is not None and not previous.done():
            stalled = self.clock.now()
            await self.clock.wait([previous])
            self.metrics.stalled.observe(self.clock.now() - stalled)
        self._check_previous()

    async def _start_commit(self, count: int) -> None:
        """Finalize, start the store's commit and queue the ACKs behind it; don't wait for it."""
        shard, store, publisher = self.shard, self.store, self.publisher
        self._phase = "finalize_txn"
        await self._finalize(shard, store, publisher)
        self._phase = "commit"
        cp = build_checkpoint(self.source.sequencer, publisher.publisher.build_ack_intents())
        wait_for = shard.appends.pending_except("")
        committing = self.clock.now()
        commit = await store.start_commit(shard.id, cp, wait_for)
        acks = {
            journal: shard.appends.append_nowait(journal, data, (commit,))
            for journal, data in cp.ack_intents.items()
        }
        self._phase = "finished_txn"
        await self._finished(shard, store, commit)
        self._previous = asyncio.create_task(
            self._acknowledged(self._number, commit, acks, cp, committing, count),
            name=f"acknowledge:{shard.id}",
        )
        self._previous.add_done_callback(_seen)
        self._open = False
        self._phase = "read"

    # --- the rest ------------------------------------------------------------------

    def _pass_over_or_fail(self, env: Envelope, error: Exception) -> None:
        """A poison message: pass over it as its source's policy says, or fail naming it."""
        if not self._poison.pass_over(env, error):
            raise poison_failed(self.shard.id, self._number, env, error) from error
        self._skipped += 1

    async def _acknowledged(
        self,
        number: int,
        commit: OpFuture,
        acks: dict[str, OpFuture],
        cp: consumer_pb.Checkpoint,
        committing: float,
        count: int,
    ) -> None:
        """Until transaction `number` is durable and its ACKs appended; then count it done.

        A failure surfaces where the loop next looks (`_check_previous`), maybe
        in a later transaction: it is raised as TransactionFailed naming its own.
        """
        phase = "commit"
        try:
            await commit
            self.metrics.committed.observe(self.clock.now() - committing)
            phase = "ack"
            publish_at = {}
            for journal, ack in acks.items():
                response = await ack
                publish_at[journal] = response.commit.end
        except Exception as error:
            raise TransactionFailed(self.shard.id, number, phase, error) from error
        self.shard.transactions += 1
        self.shard.messages += count
        self.metrics.transactions.inc()
        self.last_commit = time.time()
        self.shard.progress.update(
            {journal: source.read_through for journal, source in cp.sources.items()}, publish_at
        )

    def _check_previous(self) -> None:
        """Raise the previous transaction's commit or ACK error, if it failed."""
        previous = self._previous
        if previous is not None and previous.done():
            self._previous = None
            previous.result()
