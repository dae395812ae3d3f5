"""One shard's backfill, as an executor runs it: plain Python, no Spark in sight.

`run_shard_task(plan, index)` is what a Spark task calls (and what tests and
profiling call directly). It rebuilds the shard as the runtime would (the
Application instance, its Shard, its store), then:

* reads the shard's planned journal bytes (`source.JournalReader`) and runs
  every envelope through a Sequencer restored from the store's checkpoint,
  the same class and the same calls the live runtime uses, so duplicates are
  dropped, rolled-back transactions skipped, and a committed transaction
  whose start the ring lost is replayed from the journal;
* feeds the committed messages to the Application's hooks in transactions:
  begin_txn, consume_message, finalize_txn, a commit of the store with a
  Checkpoint built as the runtime builds it, finished_txn. A transaction
  lasts the shard's max_txn_duration, as a live one that always finds input
  ready does (or `plan.txn_size` messages, if set, for repeatable ones);
* publishes what the hooks publish uncommitted, under a producer ID of this
  attempt alone. The ACK intents are only appended once the shard's state
  is handed over, so what a failed attempt published is never acknowledged;
* hands the state over: a recorded store (RocksDB, SQLite, JSON) ran in a
  scratch directory recording nothing, and `handover.hand_over` makes that
  directory the shard's state in its recovery log (fencing a running
  primary); an SQL store committed straight to its database, having fenced
  a running primary when it restored its checkpoint;
* appends the final checkpoint's ACK intents, committing the published
  messages exactly once. `streamkit run` recovers the checkpoint, appends
  the same ACKs again (harmless) and reads on from where the backfill ended.

SQL stores can't be reset by the backfill (their tables are the app's), so
for them it continues from the database's checkpoint rather than from the
start of the history.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from streamkit.app.application import Application, batch_hook
from streamkit.app.checkpoint_ahead import check_read_through
from streamkit.app.checkpoints import build_checkpoint, producer_states, start_offsets
from streamkit.app.commit_marks import check_restored, mark_committed
from streamkit.app.config import AppConfig
from streamkit.app.gc_tuning import tune_for_throughput
from streamkit.app.loader import app_location, app_traceback, forget_app_modules
from streamkit.app.poison import PoisonGate, PoisonPolicies, consume_each
from streamkit.app.publishing import ShardPublisher
from streamkit.app.replica import AppInitFailed
from streamkit.app.shard import Shard
from streamkit.app.sources import BadFrame
from streamkit.app.store_kinds import build_store, records_to_log
from streamkit.app.txn import (
    TransactionFailed,
    marked_hook,
    poison_failed,
    reappend_ack_intents,
)
from streamkit.app.watchdog import HookRecord, Watchdog
from streamkit.backfill.errors import BackfillError
from streamkit.backfill.handover import hand_over
from streamkit.backfill.plan import BackfillPlan, ShardPlan
from streamkit.backfill.progress import reporting
from streamkit.backfill.source import JournalReader, merge_by_time
from streamkit.client import BrokerClient
from streamkit.errors import StreamkitError
from streamkit.keyspace import open_keyspace
from streamkit.keyspace.keyspace import KeySpace
from streamkit.message.message import Envelope
from streamkit.message.publisher import Publisher
from streamkit.message.sequencer import QueueOutcome, Sequencer
from streamkit.protocol import consumer_pb
from streamkit.recoverylog.local import local_fs
from streamkit.stores.store import Store

__all__ = ["ShardResult", "TransactionRunner", "run_shard", "run_shard_task"]

log = logging.getLogger(__name__)

_SINGLE = QueueOutcome.OUTSIDE_COMMIT
_SPAN = QueueOutcome.ACK_COMMIT_RING
_REPLAY = QueueOutcome.ACK_COMMIT_REPLAY
_BATCH = 4096  # messages of a committed run consumed between looks at the clock


@dataclass
class ShardResult:
    """What one shard's backfill did (returned to the driver as a dict)."""

    shard_id: str
    messages: int = 0
    transactions: int = 0
    read_through: dict[str, int] = field(default_factory=dict)
    acknowledged: list[str] = field(default_factory=list)  # journals the final ACKs went to
    bytes_direct: int = 0
    bytes_via_broker: int = 0
    files: int = 0  # handed over to the recovery log
    state_bytes: int = 0
    seconds: float = 0.0
    consume_seconds: float = 0.0
    handover_seconds: float = 0.0
    cpu_seconds: float = 0.0  # of this process (a Spark worker runs one task at a time)


class TransactionRunner:
    """Sequences envelope batches and runs the Application's transactions over them.

    `replay(journal, begin, end)` gives batches of an earlier range again,
    for committed transactions the Sequencer's ring no longer holds. A
    transaction ends after `max_duration` seconds or, if `txn_size` is not
    0, after exactly that many messages. A failure is raised as the live
    runtime's TransactionFailed, naming the transaction and its phase (the
    app's hook that raised, "commit", or "read"): the user's clue to which
    of their hooks to look at.
    """

    def __init__(
        self,
        shard: Shard,
        app: Application,
        store: Store,
        publisher: ShardPublisher,
        sequencer: Sequencer,
        replay: Callable[[str, int, int], AsyncGenerator[list[Envelope], None]],
        *,
        max_duration: float,
        txn_size: int = 0,
        keep: Callable[[Envelope], bool] | None = None,
        hooks: HookRecord | None = None,
    ) -> None:
        self.shard, self.app, self.store = shard, app, store
        # Marks the hook running, for a watchdog that names one running too long.
        self.hooks = hooks if hooks is not None else HookRecord(shard.id)
        self.publisher, self.sequencer = publisher, sequencer
        self.replay = replay
        self._dequeue = sequencer.dequeue_committed if keep is None else _filtered(
            sequencer, keep)
        # A resharded shard checkpoints only the journals it reads live from now on.
        self._sources = None if keep is None else {s.journal for s in shard.spec.sources}
        self.txn_size = txn_size or sys.maxsize
        self.max_duration = math.inf if txn_size else max_duration
        self._deadline = 0.0  # when the open transaction is to end
        self.acks: dict[str, bytes] = {}  # the latest ACK intent of every journal written
        self.messages = 0  # consumed by committed transactions
        self.transactions = 0
        self.checkpoint = consumer_pb.Checkpoint()
        self._in_txn = 0  # messages consumed by the open transaction (0: none is open)
        self._phase = "read"  # a hook's name while it runs, for TransactionFailed
        self._begin = marked_hook(app, "begin_txn", self.hooks)
        self._finalize = marked_hook(app, "finalize_txn", self.hooks)
        self._finished = marked_hook(app, "finished_txn", self.hooks)
        self._async_consume = inspect.iscoroutinefunction(app.consume_message)
        # Poison messages are passed over as the live shard would (app.poison); a source
        # that passes over consume errors needs consume_message, one message at a time.
        policies = PoisonPolicies(shard.spec)
        self._poison = PoisonGate(shard.id, policies, publisher)
        self._batch = None if policies.passes_over_consume_errors else batch_hook(app)
        self.hooks.consume_hook = "consume_message" if self._batch is None else "consume_messages"
        self.hooks.consume_async = inspect.iscoroutinefunction(self._batch or app.consume_message)

    async def run(self, batches: AsyncIterator[list[Envelope]]) -> consumer_pb.Checkpoint:
        """Consume every batch, then commit the last transaction; the final Checkpoint.

        Raises TransactionFailed, or a BackfillError as it is (it says what to fix).
        """
        self.hooks.task = asyncio.current_task()
        try:
            return await self._run(batches)
        except (TransactionFailed, BackfillError):
            raise
        except Exception as error:
            raise TransactionFailed(self.shard.id, self.transactions + 1, self._phase,
                                    error) from error

    async def _run(self, batches: AsyncIterator[list[Envelope]]) -> consumer_pb.Checkpoint:
        """`run`'s loop.

        Runs of messages that commit alone (a committed history: OUTSIDE_TXN
        messages) are sequenced in bulk and consumed as lists; any other
        envelope takes `queue_uncommitted`, and `dequeue_committed` only when
        the outcome says something was committed.
        """
        seq = self.sequencer
        queue, dequeue = seq.queue_uncommitted, self._dequeue
        bulk = seq.commit_run if self._sources is None else None  # not when filtering keys
        size = self.txn_size
        clock = time.monotonic
        async for batch in batches:
            count = self._in_txn  # messages of the open transaction (0: none is open)
            index, length = 0, len(batch)
            while index < length:
                if bulk is not None:
                    end = bulk(batch, index, min(length, index + _BATCH, index + size - count))
                    if end > index:
                        if count == 0:
                            await self._start_txn()
                        await self._consume(batch if end - index == length else batch[index:end])
                        count += end - index
                        index = end
                        if count >= size or clock() >= self._deadline:
                            self._in_txn = count
                            await self.commit()
                            count = 0
                        continue
                env = batch[index]
                index += 1
                outcome = queue(env)
                if outcome is _REPLAY:
                    self._in_txn = count
                    await self._replayed_span()
                    count = self._in_txn
                    continue
                if outcome is not _SINGLE and outcome is not _SPAN:
                    continue  # duplicates, pending and rolled-back messages, bare ACKs
                committed = dequeue()
                if committed is None:
                    continue  # another shard's key
                while committed is not None:
                    if count == 0:
                        await self._start_txn()
                    await self._consume([committed])
                    count += 1
                    committed = dequeue() if outcome is _SPAN else None
                if count >= size or clock() >= self._deadline:
                    self._in_txn = count
                    await self.commit()
                    count = 0
            self._in_txn = count
            await asyncio.sleep(0)  # let the publisher's appends go out
        await self.commit()
        return self.checkpoint

    async def _consume(self, envelopes: list[Envelope]) -> None:
        """The app's batch hook over `envelopes`, or consume_message for each, passing over
        poison messages as their sources' policies say. (A bad frame comes alone: runs in
        bulk hold dict messages only.)"""
        shard, store, publisher = self.shard, self.store, self.publisher
        if self._batch is not None and type(envelopes[0].message) is not BadFrame:
            self._phase = "consume_messages"
            self.hooks.current = envelopes[0]  # the watchdog's mark: consuming from here
            try:
                result = self._batch(shard, store, envelopes, publisher)
                if inspect.isawaitable(result):
                    await result
            finally:
                self.hooks.current = None
        else:
            self._phase = "consume_message"
            await consume_each(self.app, shard, store, publisher, envelopes,
                               self._async_consume, self._pass_over_or_fail, self.hooks)
        self._phase = "read"

    def _pass_over_or_fail(self, env: Envelope, error: Exception) -> None:
        """A poison message: pass over it as its source's policy says, or fail naming it
        (as the live shard does: a frame that doesn't decode fails the read)."""
        if not self._poison.pass_over(env, error):
            raise poison_failed(self.shard.id, self.transactions + 1, env, error) from error

    async def _start_txn(self) -> None:
        self._deadline = time.monotonic() + self.max_duration
        self._phase = "begin_txn"
        await self._begin(self.shard, self.store)
        self._phase = "read"
        self.publisher.publisher.clock.update()

    async def _replayed_span(self) -> None:
        """Dequeue a committed span that starts before the ring: read its start again."""
        seq = self.sequencer
        journal, begin, end = seq.replay_range()
        async with contextlib.aclosing(self.replay(journal, begin, end)) as batches:
            while True:
                env = self._dequeue()
                if env is not None:
                    if self._in_txn == 0:
                        await self._start_txn()
                    await self._consume([env])
                    self._in_txn += 1
                elif seq.awaiting_replay:
                    batch = await anext(batches, None)
                    seq.feed_replay(batch or [], done=batch is None)
                else:
                    break
        if self._in_txn >= self.txn_size or time.monotonic() >= self._deadline:
            await self.commit()

    async def commit(self) -> None:
        """Finalize the open transaction (if any) and commit the store with its Checkpoint.

        Every commit carries the latest ACK intent of each journal published
        to so far, so the last one acknowledges everything the backfill
        published. The store commits only after the publisher's appends are
        durable, as in the live runtime.
        """
        shard, store, publisher = self.shard, self.store, self.publisher
        consumed = self._in_txn
        if consumed:
            self._phase = "finalize_txn"
            await self._finalize(shard, store, publisher)
        self._phase = "commit"
        for intent in publisher.publisher.build_ack_intents():
            self.acks[intent.journal] = intent.content
        cp = build_checkpoint(self.sequencer, ())
        if self._sources is not None:
            for journal in [j for j in cp.sources if j not in self._sources]:
                del cp.sources[journal]
        for journal, content in self.acks.items():
            cp.ack_intents[journal] = content
        commit = await store.start_commit(shard.id, cp, shard.appends.pending_except(""))
        if consumed:
            self._phase = "finished_txn"
            await self._finished(shard, store, commit)
            self._phase = "commit"
        await commit
        self._phase = "read"
        if consumed:
            self.transactions += 1
            self.messages += consumed
        self._in_txn = 0
        self.checkpoint = cp


def _filtered(sequencer: Sequencer, keep: Callable[[Envelope], bool]
              ) -> Callable[[], Envelope | None]:
    """`dequeue_committed`, passing over the envelopes `keep` rejects."""
    dequeue = sequencer.dequeue_committed

    def dequeue_kept() -> Envelope | None:
        env = dequeue()
        while env is not None and not keep(env):
            env = dequeue()
        return env

    return dequeue_kept


def _own_keys(config: AppConfig, shard_plan: ShardPlan, spec: consumer_pb.ShardSpec
              ) -> Callable[[Envelope], bool] | None:
    """Whether a message of a re-keyed journal routes to this shard's partition now."""
    if not shard_plan.rekey:
        return None
    rekey = shard_plan.rekey
    topics = set(rekey.values())
    routes = {topic: config.mapping_for(topic) for topic in topics}
    own = {topic: next(s.journal for s in spec.sources if s.journal.startswith(f"{topic}/part-"))
           for topic in topics}

    partitions = {topic: config.topic_journals(topic) for topic in topics}

    def keep(env: Envelope) -> bool:
        topic = rekey.get(env.journal)
        if topic is None:
            return True
        if type(env.message) is BadFrame:  # no key: one shard has it, by where it was
            return own[topic] == _partition_of_place(env.journal, partitions[topic])
        try:
            journal, _ = routes[topic](env.message)
        except Exception as error:
            raise BackfillError(
                f"journal {env.journal}, offset {env.begin}: cannot route the message by "
                f"its key to a partition of {topic!r}: {type(error).__name__}: {error}"
            ) from None
        return journal == own[topic]

    return keep


def _partition_of_place(journal: str, partitions: list[str]) -> str:
    """The partition (of the new layout) that a keyless frame of `journal` goes to: the one of
    the same index, modulo their count (a name without an index: by its checksum)."""
    suffix = journal.rpartition("-")[2]
    index = int(suffix) if suffix.isdigit() else zlib.crc32(journal.encode())
    return partitions[index % len(partitions)]


def _shard(plan: BackfillPlan, shard_plan: ShardPlan, client: BrokerClient, app_dir: Path,
           work_dir: Path) -> Shard:
    config = plan.app_config(app_dir)
    kind = config.store_kind
    sql_url = config.sql_url() if kind == "sql" else None
    spec = shard_plan.shard_spec()
    return Shard(
        spec,
        client,
        fqn=f"{config.keyspace_root}/items/{spec.id}",
        work_dir=work_dir,
        mappings=config.mapping_for,
        store_factory=lambda shard, fs, state: build_store(
            kind, shard, fs, initial_state=state, sql_url=sql_url
        ),
    )


async def run_shard(
    plan: BackfillPlan,
    index: int,
    *,
    app_dir: Path | None = None,
    scratch: Path | None = None,
) -> ShardResult:
    """Backfill shard `plan.shards[index]` and hand it over (see the module docstring).

    `app_dir` is where the app folder is on this machine (default: the
    plan's); `scratch` where working directories go (default: a temp dir).
    """
    started, cpu = time.monotonic(), time.process_time()
    shard_plan = plan.shards[index]
    app_dir = Path(app_dir or plan.app_dir)
    config = plan.app_config(app_dir)
    app_class = config.load_application(app_dir)
    result = ShardResult(shard_plan.shard_id)
    work = Path(tempfile.mkdtemp(prefix=f"backfill-{shard_plan.shard_id}-", dir=scratch))
    recorded = records_to_log(config.store_kind)
    watchdog = _watchdog(config.transactions.hook_timeout.total_seconds())
    hooks = HookRecord(shard_plan.shard_id)  # (watched once the store is restored)
    try:
        async with BrokerClient(plan.broker, plan.client_security()) as client:
            shard = _shard(plan, shard_plan, client, app_dir, work / "store")
            try:
                app = app_class()
            except Exception as error:
                raise AppInitFailed(app_class, error) from error
            fs = await local_fs(work / "store") if recorded else None
            store = app.new_store(shard, fs)
            try:
                cp = await store.restore_checkpoint(shard.id)
                if store.checkpoint_home is not None:  # an SQL store: was it lost?
                    async with _keyspace(plan) as keyspace:
                        await check_restored(keyspace, config.keyspace_root, shard.id, cp,
                                             store.checkpoint_home)
                await check_read_through(client, shard.id, cp)
                await reappend_ack_intents(shard, cp)  # an SQL store's last ones may be unsent
                hooks = watchdog.watch(shard.id)  # logs a hook running too long, as live
                runner, readers = _runner(plan, shard_plan, shard, app, store, cp, hooks)
                consuming = time.monotonic()
                begins = runner.sequencer.offsets
                async with reporting(plan.progress_dir, shard.id,
                                     sum(j.end - j.begin for j in shard_plan.journals),
                                     lambda: sum(r.bytes_direct + r.bytes_via_broker
                                                 for r in readers),
                                     lambda: runner.messages):
                    final = await runner.run(_by_epoch(readers, begins, shard_plan.epochs))
                result.consume_seconds = time.monotonic() - consuming
                await shard.appends.flush()
                if store.checkpoint_home is not None and runner.transactions:
                    async with _keyspace(plan) as keyspace:
                        await mark_committed(keyspace, config.keyspace_root, shard.id,
                                             store.checkpoint_home)
            finally:
                watchdog.unwatch(hooks)
                await store.destroy()
                if fs is not None:
                    await fs.recorder.close()
            result.messages, result.transactions = runner.messages, runner.transactions
            result.read_through = {j: s.read_through for j, s in final.sources.items()}
            result.bytes_direct = sum(r.bytes_direct for r in readers)
            result.bytes_via_broker = sum(r.bytes_via_broker for r in readers)
            handing = time.monotonic()
            if recorded:
                async with _keyspace(plan) as keyspace:
                    done = await hand_over(client, keyspace, shard.spec, work / "store",
                                           work / "log")
                result.files, result.state_bytes = done.files, done.bytes
            acks = [shard.appends.append_nowait(j, data) for j, data in final.ack_intents.items()]
            for ack in acks:
                await ack
            result.acknowledged = sorted(final.ack_intents)
            await shard.appends.close()
            result.handover_seconds = time.monotonic() - handing
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result.seconds = time.monotonic() - started
    result.cpu_seconds = time.process_time() - cpu
    return result


async def _by_epoch(readers: list[JournalReader], begins: dict[str, int],
                    epochs: list[dict[str, int]]) -> AsyncIterator[list[Envelope]]:
    """The readers' batches, one layout after another (see ShardPlan), each merged by time."""
    offsets = {r.journal: begins.get(r.journal, r.plan.begin) for r in readers}
    for ends in [*epochs, {r.journal: r.plan.end for r in readers}]:
        spans = [(r, offsets[r.journal], ends.get(r.journal, offsets[r.journal]))
                 for r in readers]
        sources = [r.batches(lo, hi) for r, lo, hi in spans if hi > lo]
        async for batch in merge_by_time(sources):
            yield batch
        offsets.update({r.journal: max(lo, hi) for r, lo, hi in spans})


def _runner(plan: BackfillPlan, shard_plan: ShardPlan, shard: Shard, app: Application,
            store: Store, cp: consumer_pb.Checkpoint, hooks: HookRecord
            ) -> tuple[TransactionRunner, list[JournalReader]]:
    """The shard's transaction runner and journal readers, resuming at the checkpoint."""
    spec = shard.spec
    offsets = start_offsets(cp, {j.journal: j.begin for j in shard_plan.journals})
    for journal in shard_plan.journals:
        if offsets[journal.journal] > journal.end:
            log.warning("shard %s: %s is already read through %d, past the plan's end %d",
                        spec.id, journal.journal, offsets[journal.journal], journal.end)
    root = Path(plan.fragment_root) if plan.fragment_root else None
    readers = [JournalReader(j, app.new_message(j.journal), shard.client, root)
               for j in shard_plan.journals]
    by_journal = {r.journal: r for r in readers}

    def replay(journal: str, begin: int, end: int) -> AsyncGenerator[list[Envelope], None]:
        return by_journal[journal].batches(begin, end)

    sequencer = Sequencer(producer_states(cp), spec.ring_buffer_size or 8192, offsets=offsets)
    publisher = ShardPublisher(Publisher(shard.appends), shard.output)
    max_duration = spec.max_txn_duration.ToTimedelta().total_seconds() or 1.0
    keep = _own_keys(plan.app_config(), shard_plan, spec)
    return TransactionRunner(shard, app, store, publisher, sequencer, replay,
                             max_duration=max_duration, txn_size=plan.txn_size,
                             keep=keep, hooks=hooks), readers


_WATCHDOG: list[Watchdog] = []  # the process's one (its thread and pipe are kept)


@contextlib.asynccontextmanager
async def _keyspace(plan: BackfillPlan) -> AsyncIterator[KeySpace]:
    keyspace = open_keyspace(plan.keyspace)
    try:
        yield keyspace
    finally:
        await keyspace.close()


def _watchdog(limit: float) -> Watchdog:
    """The process's watchdog, with `limit`: processes (a pool's, Spark's workers) run many
    tasks in turn, one at a time, and a watchdog each would leave its pipe open."""
    if not _WATCHDOG:
        _WATCHDOG.append(Watchdog(limit))
    _WATCHDOG[0].limit = limit
    return _WATCHDOG[0]


def run_shard_task(plan: BackfillPlan, index: int, app_dir: str | None = None) -> dict[str, Any]:
    """A Spark task's body: backfill one shard; its ShardResult as a dict.

    Problems the user can fix raise BackfillError; anything else is wrapped
    in one that names the shard and, as the live runtime's errors do, the
    last line of the app's code it went through (whose frames are logged).
    """
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tune_for_throughput()
    shard_id = plan.shards[index].shard_id
    folder = Path(app_dir or plan.app_dir)
    forget_app_modules(folder)  # this worker may have run it before
    try:
        result = asyncio.run(run_shard(plan, index, app_dir=Path(app_dir) if app_dir else None))
    except BackfillError as error:
        raise BackfillError(f"shard {shard_id}: {error}") from None
    except Exception as error:
        raise _named(error, shard_id, folder) from None
    return asdict(result)


def _named(error: Exception, shard_id: str, folder: Path) -> BackfillError:
    """`error` as the BackfillError the driver reports: the shard, the transaction and hook
    (for a TransactionFailed), and the app's line it was raised at; the app's frames are
    logged, as a live shard's are (a whole traceback only for what is no one's fault but
    streamkit's: neither the app's code nor one of streamkit's errors)."""
    named = isinstance(error, TransactionFailed | AppInitFailed)
    cause = error.__cause__ if named and error.__cause__ is not None else error
    text = error.reason if named else f"{type(error).__name__}: {error}"
    where, frames = app_location(cause, folder), app_traceback(cause, folder)
    if frames:
        log.error("shard %s: backfill failed: %s%s", shard_id, text, frames)
    elif not isinstance(cause, StreamkitError):
        log.error("shard %s: backfill failed: %s", shard_id, text, exc_info=cause)
    return BackfillError(f"shard {shard_id}: {text}{where}")
