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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from streamkit.broker.replica import Replica, spool_directory
from streamkit.broker.spool import Spool
from streamkit.broker.stores import FragmentStore, open_store
from streamkit.keyspace import Compare, Delete, Event, KeySpace, Put
from streamkit.protocol import pb

log = logging.getLogger(__name__)

DEFAULT_ROOT = "/gazette/cluster"


@dataclass
class Entry:
    """A journal spec with the KeySpace revisions it was read at."""

    spec: pb.JournalSpec
    create_revision: int
    mod_revision: int


class ApplyConflict(Exception):
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
        self._replicas: dict[str, Replica] = {}
        self._opening: dict[str, asyncio.Task[Replica]] = {}
        self._on_roll = on_roll
        self._changed = asyncio.Event()
        self._watch_task: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()  # replicas of deleted journals

    async def start(self) -> None:
        """Load every spec and recover its replica, then follow changes."""
        kvs, self.revision = await self.keyspace.range(self.prefix)
        for kv in kvs:
            self._set(kv.key, kv.value, kv.create_revision, kv.mod_revision)
        for name in list(self.entries):
            await self.replica(name)
        self._watch_task = asyncio.create_task(self._follow())

    async def stop(self) -> None:
        if self._watch_task:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
        await asyncio.gather(*(replica.close() for replica in self._replicas.values()))
        await self.keyspace.close()

    def replicas(self) -> list[Replica]:
        return list(self._replicas.values())

    def changed(self) -> asyncio.Event:
        """Set at the next change of any spec."""
        return self._changed

    async def replica(self, name: str) -> Replica | None:
        """The replica of a journal, opened (and recovered) on first use."""
        replica = self._replicas.get(name)
        if replica is not None:
            return replica
        entry = self.entries.get(name)
        if entry is None:
            return None
        task = self._opening.get(name)
        if task is None:
            task = asyncio.create_task(self._open(entry.spec))
            self._opening[name] = task
        try:
            return await asyncio.shield(task)
        finally:
            self._opening.pop(name, None)

    async def _open(self, spec: pb.JournalSpec) -> Replica:
        stores = self.stores_of(spec)
        directory = spool_directory(self.data_dir, spec.name)
        replica = await Replica.open(spec, directory, stores, self._on_roll)
        self._replicas[spec.name] = replica
        return replica

    def stores_of(self, spec: pb.JournalSpec) -> list[FragmentStore]:
        return [open_store(url, self.file_root) for url in spec.fragment.stores]

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
        """Wait (briefly) until the watch has seen `revision`, for read-your-writes."""
        for _ in range(200):
            if self.revision >= revision:
                return
            await self._changed.wait()

    # --- following the KeySpace --------------------------------------------

    async def _follow(self) -> None:
        while True:
            try:
                async for events in self.keyspace.watch(self.prefix, self.revision):
                    for event in events:
                        self._apply_event(event)
                        self.revision = max(self.revision, event.revision)
                    self._signal()
            except asyncio.CancelledError:
                raise
            except Exception as err:
                log.warning("journal spec watch failed, reloading: %s", err)
                await asyncio.sleep(0.5)
                await self._reload()

    async def _reload(self) -> None:
        kvs, revision = await self.keyspace.range(self.prefix)
        seen = set()
        for kv in kvs:
            seen.add(self._set(kv.key, kv.value, kv.create_revision, kv.mod_revision))
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

    def _set(self, key: str, value: bytes, create_rev: int, mod_rev: int) -> str:
        spec = pb.JournalSpec.FromString(value)
        self.entries[spec.name] = Entry(spec, create_rev, mod_rev)
        replica = self._replicas.get(spec.name)
        if replica is not None:
            replica.spec = spec
            replica.stores = self.stores_of(spec)
            replica.notify()
        return spec.name

    def _drop(self, name: str) -> None:
        self.entries.pop(name, None)
        replica = self._replicas.pop(name, None)
        if replica is not None:
            task = asyncio.create_task(replica.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _signal(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()
