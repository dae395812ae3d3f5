"""Shard: one partition of an application's work, as the application's hooks see it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamkit.client import BrokerClient
from streamkit.client.append_service import AppendService
from streamkit.errors import StreamkitError
from streamkit.message.mapping import MappingFunc
from streamkit.protocol import consumer_pb
from streamkit.protocol import recoverylog_pb2 as rpb

if TYPE_CHECKING:
    from streamkit.app.assignment import Assignment
    from streamkit.recoverylog.recorded_fs import RecordedFS
    from streamkit.stores.store import Store

__all__ = ["Progress", "Shard", "ShardFailed"]

# (shard, recovered directory or None, initial state of a JSON store) -> the shard's store
StoreFactory = Callable[["Shard", "RecordedFS | None", Any], "Store"]


class ShardFailed(StreamkitError):
    """The shard stopped on an error of its application, input or store."""

    def __init__(self, shard: str, reason: str) -> None:
        super().__init__(f"shard {shard}: {reason}")
        self.shard = shard
        self.reason = reason


@dataclass
class Progress:
    """How far a shard got: sources processed through, and where its ACKs were written.

    Updated after each transaction is committed and acknowledged; `wait_for`
    gives read-your-writes: publish, then wait until the shard read past it.
    """

    read_through: dict[str, int] = field(default_factory=dict)
    publish_at: dict[str, int] = field(default_factory=dict)
    _changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def update(self, read_through: Mapping[str, int], publish_at: Mapping[str, int]) -> None:
        self.read_through.update(read_through)
        self.publish_at.update(publish_at)
        self._changed.set()
        self._changed = asyncio.Event()

    def covers(self, read_through: Mapping[str, int]) -> bool:
        return all(self.read_through.get(j, 0) >= o for j, o in read_through.items())

    async def wait_for(self, read_through: Mapping[str, int]) -> None:
        """Until every journal's processed offset reached the given one."""
        while not self.covers(read_through):
            await self._changed.wait()


class Shard:
    """A shard's identity, spec and clients, handed to every Application hook.

    `appends` is the shard's AppendService: raw appends made through it
    during a transaction commit before the transaction does. `hints` are the
    recovery-log hints the shard recovered from (None without a log).
    `assignment` is this member's Assignment of the shard, as last seen in the
    KeySpace (None without an allocator), for hooks that depend on the slot.
    """

    def __init__(
        self,
        spec: consumer_pb.ShardSpec,
        client: BrokerClient,
        *,
        fqn: str,
        work_dir: Path,
        mappings: Callable[[str], MappingFunc],
        store_factory: StoreFactory,
    ) -> None:
        self.spec = spec
        self.id = spec.id
        self.fqn = fqn
        self.client = client
        self.work_dir = work_dir
        self.appends = AppendService(client)
        self.progress = Progress()
        self.hints: rpb.FSMHints | None = None
        self.assignment: Assignment | None = None
        self.transactions = 0  # committed and acknowledged
        self.messages = 0  # consumed by committed transactions
        self._mappings = mappings
        self._store_factory = store_factory

    @property
    def sources(self) -> list[str]:
        return [source.journal for source in self.spec.sources]

    @property
    def recovery_log(self) -> str:
        """The shard's recovery log, or "" for a store without one (SQLStore)."""
        prefix = self.spec.recovery_log_prefix
        return f"{prefix}/{self.id}" if prefix else ""

    def output(self, topic: str) -> MappingFunc:
        """The MappingFunc of an output topic of streamkit.yaml."""
        return self._mappings(topic)

    def default_store(self, fs: RecordedFS | None, initial_state: Any = None) -> Store:
        """The store streamkit.yaml configures (what `Application.new_store` returns by default)."""
        return self._store_factory(self, fs, initial_state)

    def __repr__(self) -> str:
        return f"Shard({self.id!r})"
