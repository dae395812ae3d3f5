"""Journal specs as kept in the KeySpace, and the replicas serving them.

Specs live under ``<root>/items/<journal>`` as serialized JournalSpec protobufs,
the layout Gazette's brokers use in etcd, so one KeySpace can later be shared
with (or migrated to) an etcd-backed deployment. The registry follows the
KeySpace with a watch, so specs applied by any process take effect here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from streamkit.broker.faults import JournalUnavailable, StorageExhausted, storage_fault
from streamkit.broker.replica import Replica, spool_directory
from streamkit.broker.spool import Spool
from streamkit.broker.stores import FragmentStore, FragmentStoreError, open_store
from streamkit.errors import StreamkitError
from streamkit.keyspace import ClusterChangedError, Compare, Delete, Event, KeySpace, Put
from streamkit.protocol import pb
from streamkit.protocol.labels import labels_with_meta
from streamkit.tasks import cancel_and_wait

log = logging.getLogger(__name__)

DEFAULT_ROOT = "/gazette/cluster"
NAME_MAX = 255  # bytes in a file name (a journal name's segment is a folder's name)
RETRY_OPEN = 30.0  # seconds before a journal that failed to open is tried again
RETRY_FULL = 2.0  # seconds before a journal that failed to open on a full disk is tried again
FOLLOW_RETRY_MIN, FOLLOW_RETRY_MAX = 0.5, 5.0  # pauses before following specs again
CATCH_UP_WAIT = 10.0  # longest an Apply waits for the watch to see its change


def _reason(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        where = f" ({error.filename})" if error.filename else ""
        return f"{error.strerror}{where}"
    return str(error) or type(error).__name__


@dataclass
class Entry:
    """A journal spec with the KeySpace revisions it was read at."""

    spec: pb.JournalSpec
    create_revision: int
    mod_revision: int
    _selectable: pb.LabelSet | None = field(default=None, repr=False, compare=False)

    def selectable(self) -> pb.LabelSet:
        """The spec's labels and the journal's meta-labels: what List selectors match.
        Built once (a changed spec gets a new Entry): every List asks for all of them."""
        if self._selectable is None:
            self._selectable = labels_with_meta(self.spec.labels, self.spec.name)
        return self._selectable


class ApplyConflict(StreamkitError):
    """An Apply change's expected revision did not match the KeySpace."""


class JournalRegistry:
    """Specs by name (from the KeySpace) and the replicas opened for them."""

    def __init__(
        self,
        keyspace: KeySpace,
        data_dir: Path,
        file_root: Path,
        on_roll: Callable[[Replica, Spool], None],
        root: str = DEFAULT_ROOT,
    ) -> None:
        self.keyspace = keyspace
        self.data_dir = data_dir
        self.file_root = file_root
        self.prefix = f"{root}/items/"
        self.entries: dict[str, Entry] = {}
        self.revision = 0
        self._start_revision = 0  # journals created after it are new: nothing to recover
        self._replicas: dict[str, Replica] = {}
        self._opening: dict[str, asyncio.Task[Replica]] = {}
        self._on_roll = on_roll
        self._changed = asyncio.Event()
        self._watch_task: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()  # replicas of deleted journals
        # Journals whose replica could not be opened: the spec revision that failed, when,
        # and the fault every request gets until the spec changes or RETRY_OPEN passes.
        self._failed: dict[str, tuple[int, float, JournalUnavailable]] = {}
        # Journals whose open failed on a full disk: when, and the fault requests get until
        # RETRY_FULL passes (each attempt re-reads the journal's spools); and the journals
        # whose full disk was logged (once per outage, not at every attempt).
        self._exhausted: dict[str, tuple[float, StorageExhausted]] = {}
        self._full_logged: set[str] = set()

    async def start(self) -> None:
        """Load every spec and recover its replica, then follow changes."""
        kvs, self.revision = await self.keyspace.range(self.prefix)
        self._start_revision = self.revision
        for kv in kvs:
            self._set(kv.key, kv.value, kv.create_revision, kv.mod_revision)
        for name in list(self.entries):
            with contextlib.suppress(JournalUnavailable):  # logged; the others are served
                await self.replica(name)
        self._watch_task = asyncio.create_task(self._follow())

    async def following(self) -> None:
        """Until following the specs ended for good: raises what ended it (an etcd that was
        wiped or replaced, whose specs the broker would otherwise serve stale for ever)."""
        assert self._watch_task is not None, "start first"
        await asyncio.shield(self._watch_task)

    async def stop(self) -> None:
        if self._watch_task:
            await cancel_and_wait(self._watch_task, "following journal specs")
        await asyncio.gather(*(replica.close() for replica in self._replicas.values()))
        await self.keyspace.close()

    def replicas(self) -> list[Replica]:
        return list(self._replicas.values())

    def changed(self) -> asyncio.Event:
        """Set at the next change of any spec."""
        return self._changed

    async def replica(self, name: str) -> Replica | None:
        """The replica of a journal, opened (and recovered) on first use.

        A journal that can't be opened raises JournalUnavailable, naming the
        cause, and affects nothing else; it is tried again when its spec
        changes, or RETRY_OPEN seconds later. A full disk is no fault of the spec:
        StorageExhausted (RESOURCE_EXHAUSTED), tried again at the first request
        RETRY_FULL seconds later.
        """
        replica = self._replicas.get(name)
        if replica is not None:
            return replica
        entry = self.entries.get(name)
        if entry is None:
            return None
        failed = self._failed.get(name)
        if failed is not None and failed[0] == entry.mod_revision and (
                time.monotonic() - failed[1] < RETRY_OPEN):
            raise failed[2]
        exhausted = self._exhausted.get(name)
        if exhausted is not None and time.monotonic() - exhausted[0] < RETRY_FULL:
            raise exhausted[1]
        task = self._opening.get(name)
        if task is None:
            task = asyncio.create_task(self._open(
                entry.spec, created_since_start=entry.create_revision > self._start_revision))
            self._opening[name] = task
        try:
            replica = await asyncio.shield(task)
        except Exception as error:
            if isinstance(full := storage_fault(name, "opening it", error), StorageExhausted):
                self._exhausted[name] = (time.monotonic(), full)
                if name not in self._full_logged:  # once per outage, not at every attempt
                    self._full_logged.add(name)
                    log.warning("%s (tried again at requests every %gs until it opens)",
                                full, RETRY_FULL)
                raise full from None
            fault = JournalUnavailable(name, f"cannot be served: {_reason(error)}; fix its spec "
                                             "or delete it (streamkit journals apply)")
            if failed is None or failed[0] != entry.mod_revision:
                log.error("%s", fault, exc_info=not isinstance(error, OSError | FragmentStoreError))
            self._failed[name] = (entry.mod_revision, time.monotonic(), fault)
            self._exhausted.pop(name, None)
            raise fault from None
        finally:
            self._opening.pop(name, None)
        self._exhausted.pop(name, None)
        if name in self._full_logged:
            self._full_logged.discard(name)
            log.info("journal %s: opened, now that there is room on the disk", name)
        return replica

    async def _open(self, spec: pb.JournalSpec, *, created_since_start: bool) -> Replica:
        stores = self.stores_of(spec)
        directory = spool_directory(self.data_dir, spec.name)
        replica = await Replica.open(spec, directory, stores, self._on_roll,
                                     new=created_since_start)
        self._replicas[spec.name] = replica
        return replica

    def stores_of(self, spec: pb.JournalSpec) -> list[FragmentStore]:
        return [open_store(url, self.file_root) for url in spec.fragment.stores]

    def check_servable(self, changes: list[pb.ApplyRequest.Change]) -> None:
        """Raise ValueError naming the field if this broker could not serve an upsert.

        Beyond the protocol's rules: each name segment becomes a folder (at most
        NAME_MAX bytes), every store must open here, and replication is 1 (this
        broker keeps one copy; acknowledging appends to a spec asking for more would
        claim a durability it hasn't). Checked at Apply, so a spec that would fail
        when its journal is opened is never stored.
        """
        for index, change in enumerate(changes):
            if not change.HasField("upsert"):
                continue
            spec = change.upsert
            where = f"changes[{index}].upsert"
            if spec.replication > 1:
                raise ValueError(
                    f"{where}.replication: {spec.replication}, but this broker is single-node "
                    "and keeps one copy of a journal: use replication 1 (Gazette's brokers "
                    "replicate)")
            for segment in spec.name.split("/"):
                size = len(segment.encode())
                if size > NAME_MAX:
                    raise ValueError(
                        f"{where}.name: segment {segment[:24]!r}… is {size} bytes; each segment "
                        f"of a journal name names a folder here, at most {NAME_MAX} bytes")
            for i, url in enumerate(spec.fragment.stores):
                try:
                    open_store(url, self.file_root)
                except (FragmentStoreError, ValueError) as error:
                    raise ValueError(f"{where}.fragment.stores[{i}]: {error}") from None

    # --- Apply --------------------------------------------------------------

    async def apply(self, changes: list[pb.ApplyRequest.Change]) -> int:
        """Apply all changes in one KeySpace transaction; raise ApplyConflict if any is stale."""
        compares, ops = [], []
        for change in changes:
            name = change.upsert.name if change.HasField("upsert") else change.delete
            key = self.prefix + name
            if change.expect_mod_revision != -1:
                compares.append(Compare(key, mod_revision=change.expect_mod_revision))
            if change.HasField("upsert"):
                ops.append(Put(key, change.upsert.SerializeToString()))
            else:
                ops.append(Delete(key))
        result = await self.keyspace.txn(compares, ops)
        if not result.succeeded:
            raise ApplyConflict("a change's expect_mod_revision does not match the current spec")
        await self._catch_up(result.revision)
        return result.revision

    async def _catch_up(self, revision: int) -> None:
        """Wait until the watch has seen `revision`, for read-your-writes; at most
        CATCH_UP_WAIT seconds (the change is applied either way: a watch out of reach of
        its KeySpace must not hold the Apply for ever)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CATCH_UP_WAIT):
                while self.revision < revision:
                    await self._changed.wait()
                return
        log.warning("journal specs: the change at revision %d is not seen yet (the watch is "
                    "at %d); it applies once the watch of the KeySpace catches up",
                    revision, self.revision)

    # --- following the KeySpace --------------------------------------------

    async def _follow(self) -> None:
        """Follow spec changes for the broker's life: a watch that fails (the KeySpace out
        of reach) is retried, the specs read afresh, with a pause growing to FOLLOW_RETRY_MAX."""
        delay, failing = FOLLOW_RETRY_MIN, False
        while True:
            try:
                if failing:
                    await self._reload()
                    log.warning("journal specs: following the KeySpace again (at revision %d)",
                                self.revision)
                    delay, failing = FOLLOW_RETRY_MIN, False
                async for events in self.keyspace.watch(self.prefix, self.revision):
                    for event in events:
                        self._apply_event(event)
                        self.revision = max(self.revision, event.revision)
                    self._signal()
            except (asyncio.CancelledError, ClusterChangedError):
                raise
            except Exception as err:
                log.warning("journal spec watch failed; reading the specs again in %.1fs: %s",
                            delay, err)
                failing = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, FOLLOW_RETRY_MAX)

    async def _reload(self) -> None:
        kvs, revision = await self.keyspace.range(self.prefix)
        seen = set()
        for kv in kvs:
            seen.add(self._set(kv.key, kv.value, kv.create_revision, kv.mod_revision))
        seen.discard(None)
        for name in set(self.entries) - seen:
            self._drop(name)
        self.revision = revision
        self._signal()

    def _apply_event(self, event: Event) -> None:
        kv = event.kv
        if event.kind == "delete":
            self._drop(kv.key[len(self.prefix) :])
        else:
            self._set(kv.key, kv.value, kv.create_revision, kv.mod_revision)

    def _set(self, key: str, value: bytes, create_rev: int, mod_rev: int) -> str | None:
        """Take a spec in. Never raises: a bad one (written around Apply's checks)
        affects its journal only, and must not stop the watch."""
        try:
            spec = pb.JournalSpec.FromString(value)
        except Exception as error:
            log.error("ignoring the undecodable journal spec at %s: %s", key, error)
            return None
        self.entries[spec.name] = Entry(spec, create_rev, mod_rev)
        replica = self._replicas.get(spec.name)
        if replica is not None:
            replica.spec = spec
            try:
                replica.stores = self.stores_of(spec)
                replica.unavailable = None
            except Exception as error:  # keep the old stores; refuse appends until fixed
                replica.unavailable = JournalUnavailable(
                    spec.name, f"its spec's fragment stores can't be opened: {_reason(error)}; "
                               "appends are refused until the spec is fixed")
                log.error("%s", replica.unavailable)
            replica.notify()
        return spec.name

    def _drop(self, name: str) -> None:
        self.entries.pop(name, None)
        self._failed.pop(name, None)
        self._exhausted.pop(name, None)
        self._full_logged.discard(name)
        replica = self._replicas.pop(name, None)
        if replica is not None:
            task = asyncio.create_task(replica.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _signal(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()
