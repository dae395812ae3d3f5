"""`streamkit run`'s status lines when its output is not a terminal."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from streamkit.cli.run_status import ShardRow, StatusView


def test_only_a_failed_shard_is_called_failed() -> None:
    """A shard whose store is out of reach is retried (BACKFILL, with its error): named with
    its error, but not as failed, which it isn't (yet)."""
    config: Any = SimpleNamespace(name="app")
    view = StatusView(config, keyspace=None, live=False)  # type: ignore[arg-type]
    rows = [ShardRow("shard-000", "PRIMARY"),
            ShardRow("shard-001", "BACKFILL", errors=["db away (recovering again in 8s)"]),
            ShardRow("shard-002", "FAILED", errors=["boom"])]
    lines = view._summary(rows).splitlines()
    assert lines[0].startswith("streamkit: app: 1 backfill, 1 failed, 1 primary;")
    assert lines[1:] == ["streamkit: shard shard-001: db away (recovering again in 8s)",
                         "streamkit: failed shard shard-002: boom"]
