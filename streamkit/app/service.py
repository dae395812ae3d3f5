"""Service: the replicas one process runs, kept in line with its assignments.

Whoever decides the assignments (the allocator through the KeySpace, or a
static "every shard is primary here" for tests and single-process runs)
calls `assign` with the shard specs and this process's slot of each: 0 for
primary, 1+ for a hot standby. The Service starts, promotes and stops
replicas to match.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from streamkit.app.replica import STOP_TIMEOUT, Replica, Runtime
from streamkit.protocol import consumer_pb

__all__ = ["Service"]

log = logging.getLogger(__name__)

Code = consumer_pb.ReplicaStatus.Code


class Service:
    """Runs the replicas assigned to this process; see the module docstring."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.replicas: dict[str, Replica] = {}
        self._slots: dict[str, int] = {}
        self.changed = asyncio.Event()  # set when any replica's status changed
        self._watchers: dict[str, asyncio.Task[None]] = {}

    async def assign(
        self, specs: Mapping[str, consumer_pb.ShardSpec], slots: Mapping[str, int]
    ) -> None:
        """Make the running replicas match `slots` (shard id -> slot; absent: not here)."""
        for shard_id in list(self.replicas):
            if shard_id not in slots:
                await self._drop(shard_id)
        for shard_id, slot in slots.items():
            spec = specs[shard_id]
            replica = self.replicas.get(shard_id)
            if replica is not None and slot != 0 and (
                replica.shard.spec != spec or self._slots.get(shard_id, 0) == 0
            ):
                # A changed spec restarts a standby from scratch; so does a primary
                # demoted to standby (a hand-off): it stops and catches up anew.
                await self._drop(shard_id)
                replica = None
            if replica is None:
                replica = self.replicas[shard_id] = Replica(self.runtime, spec)
                self._watchers[shard_id] = asyncio.create_task(self._watch(replica))
                if slot == 0:
                    replica.start_primary()
                else:
                    replica.start_standby()
            elif slot == 0 and self._slots.get(shard_id, 0) != 0:
                log.info("shard %s: promoted from standby to primary", shard_id)
                replica.start_primary()
            self._slots[shard_id] = slot

    async def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop every replica gracefully (primaries commit what they consumed)."""
        await asyncio.gather(*(self._drop(shard_id, timeout) for shard_id in list(self.replicas)))

    def statuses(self) -> dict[str, consumer_pb.ReplicaStatus]:
        return {shard_id: replica.status for shard_id, replica in self.replicas.items()}

    async def _drop(self, shard_id: str, timeout: float = STOP_TIMEOUT) -> None:
        replica = self.replicas.pop(shard_id)
        self._slots.pop(shard_id, None)
        await replica.stop(timeout)
        watcher = self._watchers.pop(shard_id, None)
        if watcher is not None:
            watcher.cancel()

    async def _watch(self, replica: Replica) -> None:
        """Relay a replica's status changes to `changed`."""
        while True:
            event = replica.changed
            await event.wait()
            self.changed.set()
            self.changed = asyncio.Event()
