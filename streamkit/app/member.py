"""Member: one process's part in running an application.

A member connects to the broker and the KeySpace, runs the shards assigned to
it (a `Service`), and keeps the KeySpace told of their statuses. With an
allocator it joins the app's members, and the leader among them assigns
shards and hot standbys; without one (tests, `streamkit.testing`) it runs
every shard as primary.

`deploy` writes what the app's config implies — journals and shard specs —
and is idempotent, so every `streamkit run` may call it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from streamkit.app.allocator import Allocator
from streamkit.app.application import Application
from streamkit.app.assignment import Assignment, MemberId
from streamkit.app.config import AppConfig
from streamkit.app.deploy import ensure_journals, ensure_shard_specs
from streamkit.app.layout import Layout, check_layout, write_layout
from streamkit.app.replica import STOP_TIMEOUT, Runtime
from streamkit.app.service import Service
from streamkit.app.store_kinds import build_store
from streamkit.app.waits import first_of
from streamkit.client import BrokerClient
from streamkit.keyspace.keyspace import KeySpace
from streamkit.protocol import consumer_pb, pb

__all__ = ["Member", "MemberOptions", "deploy"]

log = logging.getLogger(__name__)


async def deploy(config: AppConfig, client: BrokerClient, keyspace: KeySpace) -> None:
    """Create or update the app's journals and shard specs.

    An app already deployed with another shard count is refused (LayoutError):
    only a resharding backfill changes the count.
    """
    if await check_layout(config, keyspace) is None:
        await write_layout(keyspace, config.keyspace_root, Layout(shards=config.shards))
    journals = await ensure_journals(client, config.journal_specs())
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
    hint_interval: float = 60.0

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
        )
        self.service = Service(self.runtime)
        self.allocator: Allocator | None = None
        self._task: asyncio.Task[None] | None = None

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
            )
            await self.allocator.start()
            self._task = asyncio.create_task(self._follow_assignments(), name="assignments")
        else:
            kvs, _ = await self.keyspace.range(f"{self.config.keyspace_root}/items/")
            specs = {}
            for kv in kvs:
                spec = consumer_pb.ShardSpec.FromString(kv.value)
                if not spec.disable:
                    specs[spec.id] = spec
            await self.service.assign(specs, {shard_id: 0 for shard_id in specs})

    def _is_primary_here(self, shard_id: str) -> bool:
        """Whether the KeySpace (as last seen) assigns this member the shard's primary."""
        allocator = self.allocator
        if allocator is None:
            return False
        primary = allocator.state.primary_of(shard_id)
        return primary is not None and primary.member == allocator.member

    async def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Gracefully: primaries commit what they consumed, then the member leaves.

        `timeout` bounds the commits (see `Service.stop`): shorter when the broker
        is known to be down, so that stopping doesn't wait on it.
        """
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.service.stop(timeout)
        if self.allocator is not None:
            await self.allocator.leave()

    async def kill(self) -> None:
        """Stop without committing or leaving (what a crash looks like to the others)."""
        if self._task is not None:
            self._task.cancel()
        if self.allocator is not None:
            await self.allocator.close()

    async def _follow_assignments(self) -> None:
        """Keep the Service in line with this member's assignments, and report statuses."""
        allocator = self.allocator
        assert allocator is not None
        seen: dict[str, tuple[int, int]] = {}  # shard -> (slot, create revision) last applied
        while True:
            state = allocator.state
            mine = {a.item: a for a in allocator.my_assignments() if a.item in state.items}
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
            for item, a in mine.items():
                replica = self.service.replicas.get(item)
                if replica is not None:
                    replica.shard.assignment = a
            seen = {item: (a.slot, a.create_revision) for item, a in mine.items()}
            await self._report(mine)
            await first_of([allocator.wait_for_change(state.revision), changed.wait()])

    async def _report(self, mine: dict[str, Assignment]) -> None:
        """Write replicas' statuses where the KeySpace has another."""
        allocator = self.allocator
        assert allocator is not None
        for item, assignment in mine.items():
            replica = self.service.replicas.get(item)
            if replica is not None and replica.status != assignment.status:
                await allocator.update_status(assignment, replica.status)
