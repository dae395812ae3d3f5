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

from streamkit.app.config import APP_LABEL, STORE_LABEL
from streamkit.app.replica import STOP_TIMEOUT, Replica, Runtime
from streamkit.app.txn import TransactionFailed, TransactionLoop
from streamkit.protocol import consumer_pb
from streamkit.tasks import leave_behind

__all__ = ["Service"]

log = logging.getLogger(__name__)

Code = consumer_pb.ReplicaStatus.Code

_STOP_MARGIN = 0.5  # seconds beyond a replica's own bounds before it is left behind


class Service:
    """Runs the replicas assigned to this process; see the module docstring."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.replicas: dict[str, Replica] = {}
        self._slots: dict[str, int] = {}
        self.changed = asyncio.Event()  # set when any replica's status changed
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._left_behind: set[asyncio.Task[None]] = set()  # stops stuck on the broker

    async def assign(
        self, specs: Mapping[str, consumer_pb.ShardSpec], slots: Mapping[str, int]
    ) -> None:
        """Make the running replicas match `slots` (shard id -> slot; absent: not here).

        Replicas that must go (not assigned here now, or restarting) stop together, each
        committing what it consumed, before the replicas of `slots` start."""
        dropping = [shard_id for shard_id in self.replicas if shard_id not in slots]
        for shard_id, slot in slots.items():
            replica = self.replicas.get(shard_id)
            if replica is None:
                continue
            if replica.stopping:
                # Abandoned (its member's lease was in doubt, and is answered for again): it
                # serves no more, so a replica of the assignment starts afresh.
                dropping.append(shard_id)
            elif slot != 0 and (_restarts(replica.shard.spec, specs[shard_id])
                                or self._slots.get(shard_id, 0) == 0):
                # A changed spec restarts a standby from scratch; so does a primary
                # demoted to standby (a hand-off): it stops and catches up anew.
                dropping.append(shard_id)
            elif slot == 0 and _restarts(replica.shard.spec, specs[shard_id]):
                # A primary (or a FAILED one) reads by its spec as it started: a change
                # (sources, durations, policies) takes effect once it restarts, committing
                # first. (A standby promoted as its spec changes starts afresh as primary.)
                log.info("shard %s: its spec changed: restarting its primary", shard_id)
                dropping.append(shard_id)
        await asyncio.gather(*(self._drop(shard_id) for shard_id in dropping))
        for shard_id, slot in slots.items():
            spec = specs[shard_id]
            replica = self.replicas.get(shard_id)
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
        """Stop every replica gracefully (primaries commit what they consumed).

        A replica's stop takes up to `timeout` to commit and as long to release.
        One still stopping after that waits on a broker that doesn't answer (even
        its cancelled transaction waits for the commit in flight): it is left
        behind, so that the process can exit (which cancels it, and what it waits
        on, all at once); what it did not commit, the shard's next primary does again.
        """
        replicas = dict(self.replicas)
        drops = {asyncio.create_task(self._drop(shard_id, timeout), name=f"stop:{shard_id}"):
                 shard_id for shard_id in replicas}
        if not drops:
            return
        try:
            done, stuck = await asyncio.wait(drops, timeout=2 * timeout + _STOP_MARGIN)
        except asyncio.CancelledError:
            for task in drops:
                task.cancel()
            raise
        if stuck:
            log.warning("%d shard(s) not stopped within %.1fs (a commit waiting on the "
                        "broker, or on the store's database); left behind, their uncommitted "
                        "transactions abandoned", len(stuck), 2 * timeout + _STOP_MARGIN)
        for task in sorted(stuck, key=drops.__getitem__):
            self._left_behind.add(task)
            leave_behind(f"shard {drops[task]}")
            loop = replicas[drops[task]].loop
            if loop is not None:
                self._left_behind.add(asyncio.create_task(_outcome(drops[task], loop)))
        for task in done:
            task.result()

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


def _restarts(old: consumer_pb.ShardSpec, new: consumer_pb.ShardSpec) -> bool:
    """Whether a replica must restart to follow a spec change: any change but its standby
    count's (the allocator's business) and its labels naming the app and its store (which
    it does not read; a source's policies, also labels, it does)."""
    def running_part(spec: consumer_pb.ShardSpec) -> consumer_pb.ShardSpec:
        part = consumer_pb.ShardSpec()
        part.CopyFrom(spec)
        part.ClearField("hot_standbys")
        kept = [label for label in part.labels.labels if label.name not in _UNREAD_LABELS]
        part.ClearField("labels")
        part.labels.labels.extend(kept)
        return part

    return old != new and running_part(old) != running_part(new)


_UNREAD_LABELS = (APP_LABEL, STORE_LABEL)


async def _outcome(shard_id: str, loop: TransactionLoop) -> None:
    """Await a left-behind primary's commit in flight, so that its failure (the broker
    gone, or the client closed as the process exits) is logged rather than unretrieved:
    the transaction loop, cancelled while waiting for it, no longer looks."""
    try:
        await loop.wait_committed()
    except Exception as error:
        named = isinstance(error, TransactionFailed)  # whose message names the shard already
        log.info("abandoned commit failed: %s", error if named else f"shard {shard_id}: {error}")
