"""Member: one process's part in running an application.

A member connects to the broker and the KeySpace, runs the shards assigned to
it (a `Service`), and keeps the KeySpace told of their statuses. With an
allocator it joins the app's members, and the leader among them assigns
shards and hot standbys; without one (tests, `streamkit.testing`) it runs
every shard as primary.

`deploy` writes what the app's config implies — journals and shard specs —
and is idempotent, so every `streamkit run` may call it.

While its lease is in doubt (keepalives unanswered for most of its TTL: the
KeySpace is out of reach, or slow), a member serves no shards: it abandons
its replicas at once, before the lease can lapse and the others take the
shards over, and takes its assignments up again once a keepalive is answered
(see `streamkit.app.allocator`).

A member is crash-only about its own loops. The assignment follower (which
keeps the Service in line with the KeySpace and reports statuses) is never
restarted: a crash means the member's view of what it runs can't be trusted.
The allocator's loops are restarted or given up on by their own policy (see
`streamkit.app.allocator`). A loop given up on stops the member at once:
it stops the follower, gives its primaries `FAILED_STOP_TIMEOUT` to commit,
and revokes its lease, so that its shards move to other members;
`wait_failed` returns the failure, and `streamkit run` / `serve` exit 1
naming the loop. KeySpace errors while reporting statuses are expected and
retried, not crashes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from streamkit.app.allocator import Allocator, LeaseLost
from streamkit.app.application import Application
from streamkit.app.assignment import Assignment, MemberId
from streamkit.app.config import AppConfig
from streamkit.app.deploy import (
    RecoveryLogMissing,
    deployment_id,
    ensure_journals,
    ensure_shard_specs,
    forget_lost_logs,
    lost_logs,
    recorded_logs,
)
from streamkit.app.layout import Layout, check_layout, write_layout
from streamkit.app.peer_watch import PeerWatch
from streamkit.app.replica import STOP_TIMEOUT, Runtime
from streamkit.app.service import Service
from streamkit.app.store_kinds import build_store
from streamkit.app.supervise import LoopFailure, Restart, supervised
from streamkit.app.waits import first_of
from streamkit.app.watchdog import Watchdog
from streamkit.client import BrokerClient
from streamkit.keyspace.keyspace import KeySpace, KeySpaceError
from streamkit.protocol import consumer_pb, pb
from streamkit.tasks import cancel_and_wait

__all__ = ["FAILED_STOP_TIMEOUT", "Member", "MemberOptions", "deploy"]

log = logging.getLogger(__name__)

# Seconds a member stopping because a loop failed gives its primaries to commit: its
# lease may be gone already, and what they don't commit, their next primaries do again.
FAILED_STOP_TIMEOUT = 5.0
# Seconds before statuses that couldn't be written (a KeySpace error) are tried again.
_REPORT_RETRY = 0.5


async def deploy(config: AppConfig, client: BrokerClient, keyspace: KeySpace,
                 adopt: bool = False) -> None:
    """Create or update the app's journals and shard specs.

    An app already deployed with another shard count is refused (LayoutError):
    only a resharding backfill changes the count. So is one whose recovery logs
    another KeySpace's deployment made, or that this KeySpace never deployed and
    whose logs carry no deployment (DeploymentConflict), unless `adopt`.
    """
    deployed_before = await check_layout(config, keyspace) is not None
    deployment = await deployment_id(keyspace, config.keyspace_root)
    recorded = await recorded_logs(keyspace, config.shard_specs()) if deployed_before else {}
    if lost := await lost_logs(client, recorded):
        short = {log: head for log, head in lost.items() if head is not None}
        if not adopt or short:
            raise RecoveryLogMissing(short if adopt else lost, recorded, client.address,
                                     adopt)
        await forget_lost_logs(keyspace, config.shard_specs(), lost)
        log.warning("app %s: recovery log %s%s lost, made anew: its shard starts from an "
                    "empty state (its hints deleted)", config.name, min(lost),
                    f" (and {len(lost) - 1} more)" if len(lost) > 1 else "")
    journals = await ensure_journals(client, config.journal_specs(deployment), adopt,
                                     adopt_unlabeled=deployed_before)  # (refused: no layout)
    if not deployed_before:
        await write_layout(keyspace, config.keyspace_root, Layout(shards=config.shards))
    shards = await ensure_shard_specs(keyspace, config.keyspace_root, config.shard_specs())
    if journals or shards:
        log.info(
            "app %s: %d journal(s) and %d shard spec(s) created or updated",
            config.name,
            journals,
            shards,
        )


@dataclass
class MemberOptions:
    """How a member runs: where its shards' files go, and how it joins the others."""

    work_dir: Path
    allocate: bool = True
    zone: str = "local"
    suffix: str = ""
    endpoint: str = ""  # where this member's Shard API listens (grpc://host:port)
    file_root: Path | None = None  # the broker's file store, read directly when local
    lease_ttl: float = 1.0
    expect_members: int = 1  # members started together: the first assignment waits for them
    hint_interval: float = 60.0
    # Seconds a hook may run before the watchdog logs it (None: streamkit.yaml's
    # transactions.hook_timeout); a query over HTTP gets as long.
    hook_timeout: float | None = None

    def member_id(self) -> MemberId:
        return MemberId(self.zone, self.suffix or f"{socket.gethostname()}-{os.getpid()}")


class Member:
    """Runs its share of an application's shards; see the module docstring."""

    def __init__(
        self,
        config: AppConfig,
        app_class: type[Application],
        client: BrokerClient,
        keyspace: KeySpace,
        options: MemberOptions,
    ) -> None:
        self.config = config
        self.app_class = app_class
        self.client = client
        self.keyspace = keyspace
        self.options = options
        kind, sql_url = config.store_kind, config.sql_url() if config.store_kind == "sql" else None
        self.runtime = Runtime(
            app_factory=app_class,
            client=client,
            keyspace=keyspace,
            work_dir=options.work_dir,
            mappings=config.mapping_for,
            store_factory=lambda shard, fs, state: build_store(
                kind, shard, fs, initial_state=state, sql_url=sql_url
            ),
            keyspace_root=config.keyspace_root,
            file_root=options.file_root,
            hint_interval=options.hint_interval,
            is_primary_here=self._is_primary_here if options.allocate else None,
            watchdog=Watchdog(
                config.transactions.hook_timeout.total_seconds()
                if options.hook_timeout is None
                else options.hook_timeout
            ),
        )
        self.service = Service(self.runtime)
        self.allocator: Allocator | None = None
        self.failure: LoopFailure | None = None  # the loop whose failure stopped this member
        self._failed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._peer_watch: asyncio.Task[None] | None = None
        self._stopping: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.options.allocate:
            member = self.options.member_id()
            spec = consumer_pb.ConsumerSpec(
                process_spec=pb.ProcessSpec(
                    id=pb.ProcessSpec.ID(zone=member.zone, suffix=member.suffix),
                    endpoint=self.options.endpoint,
                )
            )
            self.allocator = Allocator(
                self.keyspace,
                self.config.keyspace_root,
                member,
                spec,
                lease_ttl=self.options.lease_ttl,
                on_failure=self._fail,
                on_doubt=self._stop_serving,
                expect_members=self.options.expect_members,
            )
            await self.allocator.start()
            self._task = supervised(
                "assignment-follower",
                self._follow_assignments,
                owner=f"member {member}",
                on_give_up=self._fail,
            )
            allocator = self.allocator
            watch = PeerWatch(self.keyspace, member, lambda: allocator.state,
                              allocator.wait_for_change)
            self._peer_watch = supervised(  # restartable: it only ever speeds failover up
                "peer-watch", watch.run, owner=f"member {member}", on_give_up=self._fail,
                restart=Restart(),
            )
        else:
            kvs, _ = await self.keyspace.range(f"{self.config.keyspace_root}/items/")
            specs = {}
            for kv in kvs:
                spec = consumer_pb.ShardSpec.FromString(kv.value)
                if not spec.disable:
                    specs[spec.id] = spec
            await self.service.assign(specs, {shard_id: 0 for shard_id in specs})

    def _stop_serving(self) -> None:
        """The lease is in doubt: it may lapse any moment, and the others take these shards
        over. Stop serving them now, committing nothing more (what a primary consumed but
        did not commit, its next primary does again); the follower then drops them, and
        takes the assignments up again once the lease is answered for."""
        replicas = [r for r in self.service.replicas.values() if not r.stopping]
        if replicas:
            log.warning("member %s: stops serving %d shard(s) while its lease is in doubt",
                        self.options.member_id(), len(replicas))
        for replica in replicas:
            replica.abandon()

    async def _is_primary_here(self, shard_id: str) -> bool:
        """Whether the KeySpace, read now, assigns this member (under its own lease) the
        shard's primary. Read afresh: a fence often beats the watch's news of the move
        that caused it, and taking the shard back on that stale view would fence the
        rightful primary in turn."""
        allocator = self.allocator
        if allocator is None or allocator.lease_in_doubt:
            return False
        try:
            state = await allocator.fresh_state()
        except KeySpaceError as error:
            log.warning("member %s: cannot read the KeySpace (%s); deciding about %s on "
                        "the watch's view", allocator.member, error, shard_id)
            state = allocator.state
        primary = state.primary_of(shard_id)
        return (primary is not None and primary.member == allocator.member
                and primary.lease == allocator.lease)

    async def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Gracefully: primaries commit what they consumed, then the member leaves.

        `timeout` bounds the commits (see `Service.stop`): shorter when the broker
        is known to be down, so that stopping doesn't wait on it. Once stopping
        (or stopped, after a failed loop), this waits for that stop. A caller
        cancelled meanwhile leaves the stop to go on without it.
        """
        if self._stopping is None:
            self._stopping = asyncio.create_task(self._stop(timeout), name="member stop")
        await asyncio.shield(self._stopping)

    async def _stop(self, timeout: float) -> None:
        if self._peer_watch is not None:
            await cancel_and_wait(self._peer_watch, "the peer watch")
        if self._task is not None:
            await cancel_and_wait(self._task, "the assignment follower")
        try:
            await self.service.stop(timeout)
        finally:
            if self.allocator is not None:
                if self.failure is not None and isinstance(self.failure.error, LeaseLost):
                    await self.allocator.close()  # the lease lapsed: nothing to revoke
                else:
                    await self.allocator.leave()

    async def wait_failed(self) -> LoopFailure:
        """Until a loop of this member failed for good (it then stops by itself)."""
        await self._failed.wait()
        assert self.failure is not None
        return self.failure

    def _fail(self, failure: LoopFailure) -> None:
        """A loop was given up on: stop this member loudly, so that its shards move."""
        if self.failure is not None:
            return
        self.failure = failure
        self._failed.set()
        if self._stopping is None:
            log.error(
                "member %s stops: %s; its shards move to other members",
                self.options.member_id(),
                failure,
            )
            self._stopping = asyncio.create_task(self._stop_failed(), name="member stop")

    async def _stop_failed(self) -> None:
        try:
            await self._stop(FAILED_STOP_TIMEOUT)
        except KeySpaceError as error:  # out of reach too: the lease lapses by itself
            log.warning("member %s: could not leave the KeySpace (%s); its lease lapses by "
                        "itself", self.options.member_id(), error)
        except Exception:  # the loop's failure is what gets reported; this is its aftermath
            log.exception(
                "member %s: stopping after its failure failed as well", self.options.member_id()
            )

    async def kill(self) -> None:
        """Stop without committing or leaving (what a crash looks like to the others)."""
        for task in (self._task, self._peer_watch):
            if task is not None:
                task.cancel()
        if self.allocator is not None:
            await self.allocator.close()

    async def _follow_assignments(self) -> None:
        """Keep the Service in line with this member's assignments, and report statuses."""
        allocator = self.allocator
        assert allocator is not None
        seen: dict[str, tuple[int, int]] = {}  # shard -> (slot, create revision) last applied
        retry: float | None = None  # seconds until statuses not written are tried again
        while True:
            state = allocator.state
            doubt_changes = allocator.doubt_changes()
            in_doubt = allocator.lease_in_doubt
            # Assignments under another lease than the member's are gone with that lease
            # (expired; the watch may not show it yet): serve none of them.
            mine = {
                a.item: a
                for a in allocator.my_assignments()
                if a.item in state.items and a.lease == allocator.lease and not in_doubt
            }
            changed = self.service.changed
            slots = {item: a.slot for item, a in mine.items()}
            # An assignment deleted and made again (`streamkit shards unassign` of a FAILED
            # shard) may come and go between two looks: the same slot under a new key
            # revision still means a fresh replica.
            renewed = {
                item
                for item, a in mine.items()
                if seen.get(item, (a.slot, a.create_revision)) != (a.slot, a.create_revision)
                and seen[item][0] == a.slot
            }
            if renewed:
                await self.service.assign(
                    state.items, {i: s for i, s in slots.items() if i not in renewed}
                )
            await self.service.assign(state.items, slots)
            if allocator.lease_in_doubt:  # since this look: what started must not serve
                self._stop_serving()
            for item, a in mine.items():
                replica = self.service.replicas.get(item)
                if replica is not None:
                    replica.shard.assignment = a
            seen = {item: (a.slot, a.create_revision) for item, a in mine.items()}
            try:
                await self._report(mine)
                retry = None
            except KeySpaceError as e:
                log.warning("member %s: cannot report statuses (%s); retrying", allocator.member, e)
                retry = _REPORT_RETRY
            await first_of(
                [
                    allocator.wait_for_change(state.revision),
                    changed.wait(),
                    doubt_changes.wait(),
                ],
                retry,
            )

    async def _report(self, mine: dict[str, Assignment]) -> None:
        """Write replicas' statuses where the KeySpace has another."""
        allocator = self.allocator
        assert allocator is not None
        for item, assignment in mine.items():
            replica = self.service.replicas.get(item)
            if replica is not None and replica.status != assignment.status:
                await allocator.update_status(assignment, replica.status)
