"""Layout: how many shards an app is deployed with, and the layouts it had before.

Keys are routed to partitions by hashing modulo the partition count, and
shard i holds the state of partition i's keys. Running an app that has state
with another shard count would route keys away from the state that holds
them, so every command that runs shards checks the count it was given
against the deployed one (`check_layout`), and only a resharding backfill
(`streamkit backfill --spark --shards N`) changes it.

The layout is kept in the KeySpace at `<root>/layout` as JSON:

* `shards`: the deployed count;
* `history`: every earlier layout, oldest first, each with the write heads
  its journals had when it was replaced (`ends`). A backfill of a resharded
  app reads each earlier layout's journals up to those heads before the
  next layout's, so a key's messages are consumed in the order they were
  published, whichever partition each went to;
* `resharding`: a resharding backfill started and has not finished; shards
  must not run until it is run again to the end.

Apps deployed before this record existed have none; their count is that of
their shard specs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from streamkit.app.assignment import items_prefix
from streamkit.app.config import AppConfig, ConfigError
from streamkit.keyspace.keyspace import KeySpace
from streamkit.protocol.problems import Problem

__all__ = [
    "Epoch",
    "Layout",
    "LayoutError",
    "check_layout",
    "deployed_config",
    "read_layout",
    "write_layout",
]


class LayoutError(ConfigError):
    """The shard count asked for is not the deployed one (or a reshard is unfinished)."""


@dataclass(frozen=True)
class Epoch:
    """An earlier layout: its shard count, and its journals' write heads when it ended."""

    shards: int
    ends: dict[str, int]


@dataclass
class Layout:
    shards: int
    history: list[Epoch] = field(default_factory=list)
    resharding: bool = False

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "shards": self.shards,
                "history": [{"shards": e.shards, "ends": e.ends} for e in self.history],
                "resharding": self.resharding,
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Layout:
        doc: dict[str, Any] = json.loads(data)
        return cls(
            shards=int(doc["shards"]),
            history=[Epoch(int(e["shards"]), dict(e["ends"])) for e in doc.get("history", [])],
            resharding=bool(doc.get("resharding", False)),
        )


def layout_key(root: str) -> str:
    return f"{root}/layout"


async def read_layout(keyspace: KeySpace, root: str) -> Layout | None:
    """The deployed layout; None when the app was never deployed."""
    kv = await keyspace.get(layout_key(root))
    if kv is not None:
        return Layout.from_json(kv.value)
    kvs, _ = await keyspace.range(items_prefix(root))
    return Layout(shards=len(kvs)) if kvs else None


async def write_layout(keyspace: KeySpace, root: str, layout: Layout) -> None:
    await keyspace.put(layout_key(root), layout.to_json())


def _count_error(config: AppConfig, message: str) -> LayoutError:
    return LayoutError([Problem(message, "shards", source=config.config_file)])


async def check_layout(config: AppConfig, keyspace: KeySpace) -> Layout | None:
    """Refuse to run `config` if its shard count is not the deployed one; the layout."""
    layout = await read_layout(keyspace, config.keyspace_root)
    if layout is None:
        return None
    app = config.app_dir
    if layout.resharding:
        raise _count_error(
            config,
            f"resharding app {config.name} to {layout.shards} shards did not finish: run "
            f"`streamkit backfill {app} --spark --shards {layout.shards}` again to complete it",
        )
    if layout.shards != config.shards:
        raise _count_error(
            config,
            f"app {config.name} is deployed with {layout.shards} shards, not {config.shards}: "
            f"another count would route keys away from the shards holding their state. Run "
            f"with --shards {layout.shards} (or set shards: {layout.shards}); to change the "
            f"count, stop the app and reshard it with `streamkit backfill {app} --spark "
            f"--shards {config.shards}`",
        )
    return layout


async def deployed_config(config: AppConfig, keyspace: KeySpace) -> AppConfig:
    """`config` with the deployed shard count (for commands that talk to running shards)."""
    layout = await read_layout(keyspace, config.keyspace_root)
    if layout is None or layout.shards == config.shards:
        return config
    return config.with_settings(shards=layout.shards).with_store(config.store_kind)
