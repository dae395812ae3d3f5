"""The live status of `streamkit run`: per shard, who serves it and how far it got.

Assignments come from the KeySpace; progress from each member's HTTP
`/status`; lag is the sources' write heads (as the shard's readers last heard
them from the broker) minus what the shard read through.
On a terminal it is a table redrawn every second; otherwise a summary line
goes to stderr every ten seconds, so logs of long runs stay readable. A
`notice` (the bundled broker being restarted) goes with both: while it lasts,
the shards' numbers are stale.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import click

from streamkit.app.assignment import parse_assignment_key
from streamkit.app.config import AppConfig
from streamkit.app.member_http import http_url, open_member_url
from streamkit.app.resolver import Resolver
from streamkit.auth.settings import Security
from streamkit.auth.tokens import Capability
from streamkit.keyspace.keyspace import KeySpace
from streamkit.protocol import consumer_pb

__all__ = ["ShardRow", "StatusView", "collect"]

Code = consumer_pb.ReplicaStatus.Code


@dataclass
class ShardRow:
    shard: str
    state: str = "UNASSIGNED"
    member: str = ""
    standbys: int = 0
    read_through: int = 0
    lag: int = 0
    messages: int = 0
    rate: float = 0.0
    last_commit: float | None = None
    errors: list[str] = field(default_factory=list)


def _http_status(endpoint: str, security: Security) -> list[dict[str, Any]]:
    """A member's /status (its HTTP port is its gRPC port + 1), with a LIST token when
    `security` has keys."""
    try:
        url = f"{http_url(endpoint)}/status"
        with open_member_url(security, url, cap=Capability.LIST, timeout=2) as r:
            body = json.loads(r.read())
    except (OSError, ValueError):
        return []
    return body if isinstance(body, list) else body.get("shards", [])


async def collect(config: AppConfig, keyspace: KeySpace,
                  security: Security | None = None) -> list[ShardRow]:
    """One snapshot of every shard's status."""
    root = config.keyspace_root
    rows = {shard_id: ShardRow(shard_id) for shard_id in config.shard_ids()}
    resolver = Resolver(config, keyspace)
    for primary in (await resolver.primaries()).values():
        if (row := rows.get(primary.shard)) is not None:
            row.state = Code.Name(primary.status.code)
            row.member = primary.member
            row.errors = list(primary.status.errors)
    assignments, _ = await keyspace.range(f"{root}/assign/")
    for kv in assignments:
        parsed = parse_assignment_key(root, kv.key)
        if parsed is not None and parsed[0] in rows and parsed[2] > 0:
            rows[parsed[0]].standbys += 1
    progress = {}
    for endpoint in set((await resolver.members()).values()):
        for entry in await asyncio.to_thread(_http_status, endpoint, security or Security()):
            progress[entry.get("id")] = entry
    for shard_id in config.shard_ids():
        row = rows[shard_id]
        entry = progress.get(shard_id)
        if entry is None:
            continue
        read_through = entry.get("read_through", {})
        row.read_through = sum(read_through.values())
        row.messages = entry.get("messages", 0)
        row.last_commit = entry.get("last_commit")
        heads = entry.get("write_heads", {})
        row.lag = sum(max(0, head - read_through.get(j, 0)) for j, head in heads.items())
    return list(rows.values())


class StatusView:
    """Redraws (or logs) the shards' status until cancelled."""

    def __init__(self, config: AppConfig, keyspace: KeySpace, live: bool | None = None,
                 notice: Callable[[], str | None] | None = None,
                 security: Security | None = None) -> None:
        self.config, self.keyspace = config, keyspace
        self.security = security or Security()  # to ask the members' /status
        self.notice = notice or (lambda: None)
        self.live = sys.stdout.isatty() if live is None else live
        self._last: dict[str, tuple[float, int]] = {}

    async def run(self) -> None:
        if self.live:
            await self._run_live()
        else:
            while True:
                rows = await self._snapshot()
                click.echo(self._summary(rows), err=True)
                await asyncio.sleep(10)

    async def _snapshot(self) -> list[ShardRow]:
        rows = await collect(self.config, self.keyspace, self.security)
        now = time.monotonic()
        for row in rows:
            before = self._last.get(row.shard)
            if before is not None and now > before[0]:
                row.rate = max(0.0, (row.messages - before[1]) / (now - before[0]))
            self._last[row.shard] = (now, row.messages)
        return rows

    def _summary(self, rows: list[ShardRow]) -> str:
        states: dict[str, int] = {}
        for row in rows:
            states[row.state] = states.get(row.state, 0) + 1
        troubled = [f"{'failed shard' if r.state == 'FAILED' else 'shard'} {r.shard}: "
                    f"{r.errors[0]}" for r in rows if r.errors]  # (or one retried: BACKFILL)
        counts = ", ".join(f"{n} {state.lower()}" for state, n in sorted(states.items()))
        text = (f"streamkit: {self.config.name}: {counts}; "
                f"{sum(r.rate for r in rows):,.0f} msgs/s, lag {sum(r.lag for r in rows):,} B")
        if (notice := self.notice()) is not None:
            text += f"; {notice}"
        return "\n".join([text, *(f"streamkit: {t}" for t in troubled)])

    async def _run_live(self) -> None:
        from rich.live import Live

        with Live(self._table([]), refresh_per_second=2, transient=False) as live:
            while True:
                live.update(self._table(await self._snapshot()))
                await asyncio.sleep(1)

    def _table(self, rows: list[ShardRow]) -> Any:
        from rich.table import Table

        table = Table(title=f"{self.config.name} — Ctrl-C stops after a final commit")
        for column in ("shard", "state", "member", "standbys", "read through", "lag",
                       "msgs/s", "last commit"):
            table.add_column(column, justify="left" if column in ("shard", "state", "member")
                             else "right")
        now = time.time()
        for row in rows:
            age = f"{now - row.last_commit:.1f}s ago" if row.last_commit else "-"
            state = f"[red]{row.state}[/red]" if row.errors else row.state
            table.add_row(row.shard, state, row.member, str(row.standbys),
                          f"{row.read_through:,}", f"{row.lag:,}", f"{row.rate:,.0f}", age)
        for row in rows:
            if row.errors:
                table.caption = f"{row.shard}: {row.errors[0]}"
        if (notice := self.notice()) is not None:
            table.caption = f"[yellow]{notice}[/yellow]"
        return table
