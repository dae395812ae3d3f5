"""Replica: one shard assigned to this process, as a hot standby or as its primary.

A standby plays the shard's recovery log into its working directory and
keeps tailing it. Becoming primary is then short: a hand-off fences the
previous primary's recorder, playback finishes, the store opens on the
rebuilt files and restores its checkpoint, the checkpoint's ACKs are appended
again, and the transaction loop starts reading the sources where the
checkpoint says. A primary without a standby phase does all of it at once.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import shutil
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamkit.app.application import Application, QueryError
from streamkit.app.assignment import item_key
from streamkit.app.checkpoint_ahead import check_read_through
from streamkit.app.checkpoints import producer_states, start_offsets
from streamkit.app.commit_marks import check_restored, mark_committed
from streamkit.app.hints import load_hints, push_backup_hints, store_primary_hints
from streamkit.app.loader import app_folder, app_location, app_traceback
from streamkit.app.publishing import ShardPublisher
from streamkit.app.shard import Shard, StoreFactory
from streamkit.app.sources import SourceInput
from streamkit.app.txn import TransactionFailed, TransactionLoop, queue_ack_intents
from streamkit.app.waits import first_of
from streamkit.app.watchdog import HookRecord, Watchdog
from streamkit.client import BrokerClient, RegisterMismatch
from streamkit.client.append_service import AppendService
from streamkit.client.reader import read_write_head
from streamkit.errors import StreamkitError
from streamkit.keyspace.keyspace import KeySpace
from streamkit.message.mapping import MappingFunc
from streamkit.message.publisher import Publisher
from streamkit.message.sequencer import Sequencer
from streamkit.protocol import consumer_pb
from streamkit.protocol import recoverylog_pb2 as rpb
from streamkit.recoverylog.fsm import FSMError, RecoveryLogError
from streamkit.recoverylog.recorded_fs import RecordedFS
from streamkit.recoverylog.recovery import Playback
from streamkit.stores.store import FencedError, Store
from streamkit.tasks import Countdown, cancel_and_wait, leave_behind, wait_finished

__all__ = ["AppInitFailed", "Replica", "Runtime"]

log = logging.getLogger(__name__)

Code = consumer_pb.ReplicaStatus.Code

STOP_TIMEOUT = 20.0  # seconds a graceful stop may take before the transaction is abandoned
_MAX_FENCES = 3  # times a primary may be fenced and recover again within the window
# A fenced primary still primary here recovers once its log took no append for LOG_QUIET
# seconds (a backfill's hand-over done), waiting LOG_QUIET_WAIT at most.
LOG_QUIET, LOG_QUIET_WAIT = 2.0, 300.0
_FENCE_WINDOW = 60.0
# A primary whose store's service is briefly out of reach (`Store.is_transient`) recovers
# again after a pause, doubling from 1 s up to STORE_RETRY_PAUSE; it fails for good once
# the errors went on for STORE_RETRY_FOR seconds. A term that committed a transaction
# before its error starts the count anew.
STORE_RETRY_PAUSE, STORE_RETRY_FOR = 30.0, 300.0
# Seconds a primary that took over waits for the others of its process still taking over.
TAKE_OVER_HOLD = 0.2
_HINT_CHECK = 1.0  # seconds between checks of whether a primary is due to write hints


@dataclass
class Runtime:
    """What every replica of a process shares."""

    app_factory: Callable[[], Application]  # one Application instance per shard
    client: BrokerClient
    keyspace: KeySpace | None
    work_dir: Path
    mappings: Callable[[str], MappingFunc]
    store_factory: StoreFactory
    keyspace_root: str
    file_root: Path | None = None
    hint_interval: float = 60.0
    # Recovery-log bytes after which a primary writes hints sooner than hint_interval:
    # a recovery replays the log from the last hints, so this bounds what a burst of
    # writes (a catch-up) leaves to replay.
    hint_bytes: int = 4 << 20
    # Whether this process should (still) be a shard's primary: asked before a fenced
    # primary recovers again. None: always (no allocator, every shard is primary here).
    is_primary_here: Callable[[str], Awaitable[bool]] | None = None
    # Logs application hooks that run too long, and ends a process stuck in one.
    watchdog: Watchdog = field(default_factory=Watchdog)
    extra: dict[str, object] = field(default_factory=dict)
    # The ACKs of recovered checkpoints, for every shard here: shards recovering at once
    # share one append per journal (`queue_ack_intents`). Holds nothing between appends.
    recovered_acks: AppendService = field(init=False)
    # Primaries of this process in take-over (recovery and store open) right now.
    taking_over: Countdown = field(default_factory=Countdown)

    def __post_init__(self) -> None:
        self.recovered_acks = AppendService(self.client, sticky_failures=False)


def is_fenced(error: BaseException) -> bool:
    """Whether `error` says another author took the shard's recovery log or store over."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, RegisterMismatch | FencedError):
            return True
        seen = seen.__cause__
    return False


class AppInitFailed(StreamkitError):
    """Creating the shard's Application instance raised (its `__init__`); the cause is the
    app's error. Fails the shard as any error of its code does, never the member: the
    same class fails the same way wherever its shards move. `reason` names the class."""

    def __init__(self, factory: Callable[[], Application], error: BaseException) -> None:
        name = (f"{factory.__module__}:{factory.__qualname__}" if isinstance(factory, type)
                else getattr(factory, "__qualname__", repr(factory)))
        text = f"{type(error).__name__}: {error}" if str(error) else repr(error)
        self.reason = f"creating the application ({name}) failed: {text}"
        super().__init__(self.reason)


class Replica:
    """One assignment of a shard to this process; see the module docstring."""

    def __init__(self, runtime: Runtime, spec: consumer_pb.ShardSpec) -> None:
        self.runtime = runtime
        self._app: Application | None = None
        # Made here, so that it is there as soon as the replica is; if the app's constructor
        # raises, that is kept and raised as primary, where it fails only this shard.
        self._app_error: AppInitFailed | None = None
        try:
            self._app = self._new_app()
        except AppInitFailed as error:
            self._app_error = error
        self.shard = self._new_shard(spec)
        self._fences: list[float] = []  # monotonic times this replica was fenced
        self._store_errors: list[float] = []  # monotonic times of transient store errors
        self._gave_up_after: float | None = None  # seconds of them before the shard failed
        self.status = consumer_pb.ReplicaStatus(code=Code.IDLE)
        self.changed = asyncio.Event()  # set on every status change
        self.store: Store | None = None
        self.loop: TransactionLoop | None = None
        self._playback: Playback | None = None
        self._fs: RecordedFS | None = None
        self._hooks: HookRecord | None = None  # watched while primary
        self._queries: set[HookRecord] = set()  # of queries in committed views, running now
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    def _new_shard(self, spec: consumer_pb.ShardSpec) -> Shard:
        runtime = self.runtime
        return Shard(spec, runtime.client, fqn=item_key(runtime.keyspace_root, spec.id),
                     work_dir=runtime.work_dir / spec.id, mappings=runtime.mappings,
                     store_factory=runtime.store_factory)

    def _new_app(self) -> Application:
        factory = self.runtime.app_factory
        try:
            return factory()
        except Exception as error:
            raise AppInitFailed(factory, error) from error

    @property
    def app(self) -> Application:
        """This term's Application instance. Raises AppInitFailed if it could not be made."""
        if self._app is None:
            assert self._app_error is not None
            raise self._app_error
        return self._app

    @property
    def id(self) -> str:
        return self.shard.id

    def app_traceback(self, error: BaseException) -> str:
        """The frames of `error`'s traceback in the app's own code, formatted for a log
        line ("" if none): where the user's code raised, without streamkit's frames."""
        return app_traceback(error, self._app_folder())

    def _app_folder(self) -> Path | None:
        factory = self.runtime.app_factory
        cls = type(self._app) if self._app is not None else factory
        return app_folder(cls) if isinstance(cls, type) else None

    # --- transitions --------------------------------------------------------------

    def start_standby(self) -> None:
        """Begin tailing the recovery log (status BACKFILL, then STANDBY)."""
        if self._task is None:
            self._task = asyncio.create_task(
                self._guard(self._standby()), name=f"standby:{self.id}"
            )

    def start_primary(self) -> None:
        """Become primary (from a standby, or from nothing)."""
        previous = self._task
        self._task = asyncio.create_task(
            self._guard(self._primary(previous)), name=f"primary:{self.id}"
        )

    async def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop: a primary finishes its transaction, commits, writes hints; then release.

        If that takes longer than `timeout` (the broker is unreachable, say),
        the transaction in progress is abandoned: it was never acknowledged,
        so the next primary simply does it again.
        """
        self._stopping.set()
        task = self._task
        if task is not None:
            if self.status.code != Code.PRIMARY:
                # A standby, or a primary still taking over: no transaction to commit, so
                # stop now, as a crash there would (it waited out `timeout` when the broker
                # was out of reach and the recovery log could not be read).
                task.cancel()
            done, _ = await asyncio.wait((task,), timeout=timeout)
            if not done:
                log.warning("shard %s: not stopped within %.0fs; abandoning its uncommitted "
                            "transaction", self.id, timeout)
                task.cancel()
            await wait_finished(task, f"shard {self.id}")
        try:
            await asyncio.wait_for(self._release(), timeout)
        except TimeoutError:
            log.warning("shard %s: releasing took over %.0fs; left behind", self.id, timeout)
            leave_behind(f"shard {self.id}")

    def abandon(self) -> None:
        """Stop serving at once and commit nothing more: no more queries, the transaction
        in progress (or the standby's playback) cancelled. A commit already on its way to
        the broker may still land (it is whole, and fenced like any). `stop` then releases
        what the replica holds. For a member whose lease is in doubt: the others may take
        the shard over any moment, and a primary must not serve past that."""
        self._stopping.set()
        if self.status.code != Code.IDLE:
            self._set_status(Code.IDLE)
        if self._task is not None:
            self._task.cancel()

    @property
    def stopping(self) -> bool:
        """Whether `stop` or `abandon` was called."""
        return self._stopping.is_set()

    async def wait(self) -> None:
        """Until the replica's task ended (a stopped or failed shard)."""
        if self._task is not None:
            await wait_finished(self._task, f"shard {self.id}")

    # --- queries ------------------------------------------------------------------

    async def query(self, request: dict[str, object]) -> object:
        """Run the application's query against the store's committed state.

        Answers reflect committed state only. A store with a committed view
        answers from the last durable commit while a transaction is open (for
        apps with `concurrent_queries`); otherwise a query waits until the open
        transaction ends and its commit is durable (and then reads in a view too,
        where the store has one, so that it can't write).
        """
        loop, store = self.loop, self.store
        if self.status.code != Code.PRIMARY or loop is None or store is None:
            raise QueryError(f"shard {self.id} is not serving here")
        view = store.committed_view() if self.app.concurrent_queries else None
        if view is None:
            async with loop.lock:
                await loop.wait_committed()
                # Between transactions the last commit is the store's state, so a view (where
                # the store has one) reads the same, read-only: a query's write would
                # otherwise be committed with the next transaction.
                view = store.committed_view()
                if view is None:
                    return await self._answer(loop.hooks, store, request)
                async with view:
                    return await self._answer(loop.hooks, store, request)
        # Beside the transaction loop's hooks: a record of its own for the watchdog.
        watchdog = self.runtime.watchdog
        hooks = watchdog.watch(self.id)
        self._queries.add(hooks)
        try:
            async with view:
                return await self._answer(hooks, store, request)
        finally:
            self._queries.discard(hooks)
            watchdog.unwatch(hooks)

    def running_hook(self, holding_the_loop: bool = False) -> str | None:
        """The hook this shard runs right now, if any: a query's in a committed view
        first (one beside the transaction that outlasts its timeout is the likely stuck
        one), else the transaction loop's (which also runs the queries that wait for it).
        `holding_the_loop`: only a plain (not async) hook, which blocks every shard of the
        process while it runs."""
        records = [*self._queries, *([self.loop.hooks] if self.loop is not None else [])]
        for record in records:
            if (current := record.current) is not None:
                hook, is_async, _, _ = record.describe(current)
                if not (holding_the_loop and is_async):
                    return hook
        return None

    async def _answer(self, hooks: HookRecord, store: Store, request: dict[str, object]
                      ) -> object:
        with hooks.call("query", asyncio.iscoroutinefunction(self.app.query)):
            answer = self.app.query(self.shard, store, request)
            if inspect.isawaitable(answer):  # (asyncio.iscoroutine: generators too, on 3.11)
                answer = await answer
        return answer

    # --- internals ----------------------------------------------------------------

    def _set_status(self, code: int, error: str | None = None) -> None:
        self.status = consumer_pb.ReplicaStatus(code=code, errors=[error] if error else [])
        self.changed.set()
        self.changed = asyncio.Event()

    async def _guard(self, body: Coroutine[Any, Any, None]) -> None:
        try:
            await body
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            if is_fenced(error):
                if self._stopping.is_set():  # handed over while stopping: nothing is lost
                    log.info("shard %s: fenced while stopping (%s)", self.id, error)
                    self._set_status(Code.IDLE)
                    await self._release()
                else:
                    await self._fenced(error)
                return
            message = f"{type(error).__name__}: {error}" if str(error) else repr(error)
            if isinstance(error, TransactionFailed | AppInitFailed):
                # Names the transaction and phase, or the class; this line names the shard.
                message = error.reason
            if await self._retried(error, message):
                return
            if self._gave_up_after is not None:  # a store out of reach for too long
                message += f" (its store's errors went on for {self._gave_up_after:.0f}s)"
                self._gave_up_after = None
            where = trace = ""
            if isinstance(error, TransactionFailed | AppInitFailed):
                cause = error.__cause__
                if cause is not None:
                    # The app's own code raised: its frames say which line (none: streamkit's
                    # error, which its message explains).
                    where = app_location(cause, self._app_folder())
                    trace = self.app_traceback(cause)
            log.error("shard %s failed: %s%s", self.id, message, trace,
                      exc_info=not isinstance(error, StreamkitError | QueryError | OSError))
            self._set_status(Code.FAILED, message + where)
            await self._release()

    async def _retried(self, error: BaseException, message: str) -> bool:
        """Recover again after a pause, if `error` is the store's transient kind and its
        errors have not gone on for STORE_RETRY_FOR; False to fail the shard instead.

        Exactly-once holds as after a crash: the failed transaction's state was not
        committed (or, failed at commit, its outcome is read back by the restore)."""
        store = self.store
        if store is None or self._stopping.is_set() or not store.is_transient(error):
            return False
        now = time.monotonic()
        if self.loop is not None and self.loop.last_commit is not None:
            self._store_errors.clear()  # this term committed: the store was back meanwhile
        self._store_errors.append(now)
        if now - self._store_errors[0] >= STORE_RETRY_FOR:
            self._gave_up_after = now - self._store_errors[0]
            log.error("shard %s: its store's errors went on for %.0fs; giving up", self.id,
                      self._gave_up_after)
            return False
        pause = min(STORE_RETRY_PAUSE, 2.0 ** (len(self._store_errors) - 1))
        log.warning("shard %s: %s; its store seems out of reach for now: recovering again "
                    "in %.0fs", self.id, message, pause)
        await self._release()
        self._set_status(Code.BACKFILL, f"{message} (recovering again in {pause:.0f}s)")
        await first_of([self._stopping.wait()], pause)
        if await self._still_primary("its store failed"):
            self._new_term()
        return True

    async def _still_primary(self, why: str) -> bool:
        """Whether to begin a new term as primary (after `why`): still meant to be primary
        here, and not stopping. Otherwise the replica idles until the Service drops it."""
        check = self.runtime.is_primary_here
        if check is not None and not await check(self.id):
            log.info("shard %s: %s, and no longer primary here; stepping down", self.id, why)
            self._set_status(Code.IDLE)
            return False
        if self._stopping.is_set():
            # Stopped while the above awaited: `stop` waits for the task it saw, not
            # for one started now, which would play back into the directory the
            # shard's next replica here is given.
            log.info("shard %s: %s, and stopped meanwhile; not recovering", self.id, why)
            self._set_status(Code.IDLE)
            return False
        return True

    def _new_term(self) -> None:
        """Become primary again from what is durable (the log, the store's database)."""
        assignment = self.shard.assignment
        self.shard = self._new_shard(self.shard.spec)
        self.shard.assignment = assignment
        self._task = asyncio.create_task(self._guard(self._primary(None)),
                                         name=f"primary:{self.id}")

    async def _fenced(self, error: BaseException) -> None:
        """Another author took over: a new primary elsewhere, or a backfill's hand-over.

        Nothing this primary committed is lost (the other author played it
        back first); its uncommitted transaction is dropped. If it is still
        meant to be primary here (a backfill), it recovers again from what
        the new author wrote; otherwise it idles until the Service drops it.
        """
        await self._release()
        now = time.monotonic()
        self._fences = [t for t in self._fences if now - t < _FENCE_WINDOW] + [now]
        if not await self._still_primary("fenced"):
            return
        if len(self._fences) > _MAX_FENCES:
            self._set_status(Code.FAILED, f"fenced {len(self._fences)} times within "
                             f"{_FENCE_WINDOW:.0f}s; last: {error}")
            return
        log.warning("shard %s: fenced by another author of its recovery log (%s); "
                    "recovering again once the log is quiet", self.id, error)
        self._set_status(Code.BACKFILL)  # recovering: no longer the primary it was
        await self._log_quiet()
        if self._stopping.is_set():
            self._set_status(Code.IDLE)
            return
        self._new_term()

    async def _log_quiet(self) -> None:
        """Until the recovery log took no append for LOG_QUIET seconds (at most
        LOG_QUIET_WAIT). The author that fenced this primary while it stays primary here is
        a backfill handing its state over: it writes its files in a run of appends, then
        swaps them in. Recovering in the middle would take the log back and fence the
        backfill, failing it (with input arriving, its primary commits, and is fenced, any
        moment)."""
        client, journal = self.shard.client, self.shard.recovery_log
        if not journal:
            return
        clock = time.monotonic
        deadline = clock() + LOG_QUIET_WAIT
        head, since = -1, clock()
        while clock() < deadline and not self._stopping.is_set():
            try:
                now = await read_write_head(client, journal)
            except Exception as error:  # the playback will meet it, and say so
                log.info("shard %s: cannot read its log's head (%s)", self.id, error)
                return
            if now != head:
                head, since = now, clock()
            elif clock() - since >= LOG_QUIET:
                return
            await first_of([self._stopping.wait()], LOG_QUIET / 8)

    async def _hint_candidates(self) -> list[rpb.FSMHints | None]:
        """Hints to recover from, best first: primary, backups; the whole log (None) only
        when there are none. When every hint fails, the log doesn't hold what they say it
        does (shorter than they are: a lost log made anew, another broker's): playing it
        whole would recover some older state, or none, and overwrite the hints with it."""
        shard, keyspace = self.shard, self.runtime.keyspace
        candidates: list[rpb.FSMHints | None] = []
        if keyspace is not None:
            candidates.extend(
                h for h in await load_hints(keyspace, shard.spec) if h.log == shard.recovery_log
            )
        return candidates or [None]

    def _playback_of(self, hints: rpb.FSMHints | None) -> Playback:
        self.shard.hints = hints
        self.shard.work_dir.parent.mkdir(parents=True, exist_ok=True)
        return Playback(self.shard.client, self.shard.recovery_log, self.shard.work_dir, hints)

    async def _take_over(self) -> RecordedFS:
        """Finish playback (a standby's, else a new one) and become the log's author.

        Hints that fail to play back (a log pruned or damaged since) are
        skipped for the next candidate; when none is left, the shard fails.
        """
        candidates = await self._hint_candidates()
        playback = self._playback
        if playback is None or playback.failed() is not None:
            playback = self._playback_of(candidates[0])
        # Those after the hints playing (a standby's may be gone from the KeySpace since).
        # Taken in turn, not looked up again: the primary's and a backup's may be equal.
        rest = (candidates[candidates.index(self.shard.hints) + 1:]
                if self.shard.hints in candidates else [])
        while True:
            self._playback = playback
            try:
                return await playback.take_over()
            except (RecoveryLogError, FSMError) as error:
                if not rest:
                    raise
                log.warning(
                    "shard %s: playback from hints failed (%s); trying older hints", self.id, error
                )
                playback = self._playback_of(rest.pop(0))

    async def _standby(self) -> None:
        if not self.shard.recovery_log:
            self._set_status(Code.STANDBY)  # nothing to tail: a SQL store recovers nothing
            return
        self._set_status(Code.BACKFILL)
        self._playback = self._playback_of((await self._hint_candidates())[0])
        await self._playback.wait_tailing()
        self._set_status(Code.STANDBY)

    async def _primary(self, standby: asyncio.Task[None] | None) -> None:
        shard, runtime = self.shard, self.runtime
        if standby is not None and not standby.done():
            # It is at most waiting for the log's head; playback goes on.
            await cancel_and_wait(standby, f"shard {self.id}'s standby")
        if self.loop is not None:
            # A term as primary ended here (fenced, recovering again): its transaction
            # may have been cut off mid-way, leaving its work in the app's attributes
            # (a dict of counts, say). The new term must not build on that.
            self._app = self._new_app()
            self.loop = None
        app = self.app  # raises AppInitFailed if the app could not be made with the replica
        fs = None
        phases = _Phases()
        with runtime.taking_over.counted():
            if shard.recovery_log:
                self._set_status(Code.BACKFILL)
                fs = self._fs = await self._take_over()
            phases.mark("take-over")
            hooks = self._hooks = runtime.watchdog.watch(shard.id)
            with hooks.call("new_store", False):
                store = self.store = app.new_store(shard, fs)
            cp = await store.restore_checkpoint(shard.id)
            if store.checkpoint_home is not None and runtime.keyspace is not None:
                await check_restored(runtime.keyspace, runtime.keyspace_root, shard.id, cp,
                                     store.checkpoint_home)
            await check_read_through(shard.client, shard.id, cp)
            phases.mark("store")
        if standby is None:
            # Shards taking over together (a process's start or restart) start reading
            # together: one that consumed early would slow the others' recovery on the
            # same event loop and cores, and the process serves once all of them do.
            # (Not a promoted standby: a failover serves at once.)
            await first_of([runtime.taking_over.zero(), self._stopping.wait()], TAKE_OVER_HOLD)
            phases.mark("hold")
        if self._stopping.is_set():  # stopped while taking over: nothing read, nothing to do
            self._set_status(Code.IDLE)
            return
        # Not waited for: the checkpoint's ACKs (the first transaction's publishes queue
        # behind them and its commit depends on them: `queue_ack_intents`), and below,
        # the recovered state's hints (pushed once its ops committed: `_write_hints`).
        queue_ack_intents(shard, cp, runtime.recovered_acks)
        min_offsets = {s.journal: s.min_offset for s in shard.spec.sources}
        offsets = start_offsets(cp, min_offsets)
        shard.progress.update(offsets, {})
        ring = shard.spec.ring_buffer_size or 8192
        # The application may read journals beyond the spec's: resume those where the
        # checkpoint says too (the Sequencer tracks any journal it is fed).
        app_offsets = {j: s.read_through for j, s in cp.sources.items()} | offsets
        readers = app.read_sources(shard, store, dict(app_offsets))
        if readers is not None:
            readers, offsets = list(readers), app_offsets
        sequencer = Sequencer(producer_states(cp), ring, offsets=offsets)
        journals = set(offsets) | {r.journal for r in readers or ()}
        types = {journal: app.new_message(journal) for journal in journals}
        source = SourceInput(
            shard.client, sequencer, offsets, types, file_root=runtime.file_root,
            shard_id=shard.id, readers=readers,
            replay=lambda journal, begin, end: app.replay_range(shard, store, journal, begin, end),
        )
        publisher = ShardPublisher(Publisher(shard.appends), shard.output)
        self.loop = TransactionLoop(shard, app, store, publisher, source, hooks)
        self._set_status(Code.PRIMARY)
        log.info(
            "shard %s: primary, reading %s (%s)",
            shard.id,
            ", ".join(f"{j}@{o}" for j, o in sorted(offsets.items())),
            phases,
        )
        committed = shard.transactions
        hints_task = asyncio.create_task(
            self._write_hints(fs) if fs is not None else self._mark_commit(cp, committed))
        try:
            await self.loop.run(self._stopping)
        finally:
            source.close()
            hints_task.cancel()
        await shard.appends.flush()
        if shard.transactions > committed:
            await self._mark_commit(cp, committed)
        if fs is not None and runtime.keyspace is not None:
            await store_primary_hints(runtime.keyspace, shard.spec, await fs.recorder.build_hints())
        self._set_status(Code.IDLE)

    async def _write_hints(self, fs: RecordedFS | None) -> None:
        """The recovered state's hints as backup 0, once the ops they cover committed;
        then primary hints every `hint_interval`, or once the log grew by `hint_bytes`.

        Backup 0 comes first, so that whatever this primary hints later is not the
        only hint of it. A failure to write hints is logged: the hints already stored
        stay good (the log is kept for them), only longer to play back.
        """
        runtime, keyspace = self.runtime, self.runtime.keyspace
        if fs is None or keyspace is None:
            return
        loop, recorder = asyncio.get_running_loop(), fs.recorder
        try:
            await push_backup_hints(keyspace, self.shard.spec, await recorder.build_hints())
        except Exception as error:
            log.warning("shard %s: writing backup hints failed: %s", self.id, error)
        written_at, hinted_head = loop.time(), recorder.write_head
        while True:
            await asyncio.sleep(min(_HINT_CHECK, runtime.hint_interval))
            if (loop.time() - written_at < runtime.hint_interval
                    and recorder.write_head - hinted_head < runtime.hint_bytes):
                continue
            written_at, hinted_head = loop.time(), recorder.write_head
            try:
                await store_primary_hints(keyspace, self.shard.spec, await recorder.build_hints())
            except Exception as error:
                log.warning("shard %s: writing hints failed: %s", self.id, error)

    async def _mark_commit(self, cp: consumer_pb.Checkpoint, committed: int) -> None:
        """For a store keeping its checkpoint in a database: once it holds one (restored,
        or a transaction of this term acknowledged), mark in the KeySpace that the shard
        committed there (`commit_marks`). A failure is logged and tried again next term."""
        keyspace, store = self.runtime.keyspace, self.store
        if keyspace is None or store is None or store.checkpoint_home is None:
            return
        while not cp.ByteSize() and self.shard.transactions == committed:
            await asyncio.sleep(_HINT_CHECK)
        try:
            await mark_committed(keyspace, self.runtime.keyspace_root, self.id,
                                 store.checkpoint_home)
        except Exception as error:
            log.warning("shard %s: marking its commits in the KeySpace failed: %s", self.id, error)

    async def _release(self) -> None:
        """Close what the replica holds; its working directory is disposable."""
        if self._hooks is not None:
            self.runtime.watchdog.unwatch(self._hooks)
            self._hooks = None
        if self._playback is not None:
            await self._playback.cancel()
            self._playback = None
        if self.store is not None:
            store, self.store = self.store, None
            await self._closing("destroying its store", store.destroy())
        if self._fs is not None:
            fs, self._fs = self._fs, None
            # No flush: what it committed is in the log already (a commit waits for its
            # ops), the rest is a crash's leftovers; and a broker gone would hold it up.
            await self._closing("closing its recorder", fs.recorder.close(flush=False))
        await self._closing("closing its appends", self.shard.appends.close(flush=False))
        shutil.rmtree(self.shard.work_dir, ignore_errors=True)

    async def _closing(self, what: str, step: Awaitable[object]) -> None:
        """Await one step of releasing; a failure is logged, so that the others still run."""
        try:
            await step
        except Exception as error:
            log.warning("shard %s: %s failed: %s: %s", self.id, what, type(error).__name__, error)


class _Phases:
    """How long each step of becoming primary took, for the log line that says it is."""

    def __init__(self) -> None:
        self._began = self._last = time.monotonic()
        self._steps: list[str] = []

    def mark(self, step: str) -> None:
        now = time.monotonic()
        self._steps.append(f"{step} {1000 * (now - self._last):.0f}")
        self._last = now

    def __str__(self) -> str:
        return f"in {1000 * (time.monotonic() - self._began):.0f} ms: {', '.join(self._steps)}"
