"""SQLStore commit rate on this machine: SQLite file and a real PostgreSQL 15.

    python bench/sql_store_bench.py [--commits 2000] [--backends sqlite,postgres] [--json]

Each consumer transaction upserts one small row (key, counter, 64-byte value)
through `SQLStore.run` and then commits it with a checkpoint through
`start_commit`, awaited before the next transaction: the sequential commit
rate a single shard sees when the store is its bottleneck. Both databases keep
their durable defaults (SQLite: rollback journal, synchronous=FULL; PostgreSQL:
fsync and synchronous_commit on), so every commit waits for the disk.

PostgreSQL is started in a temp dir exactly as the test fixture does
(tests/postgres.py); it is skipped, with the reason, if that is not possible.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from streamkit.stores import SQLStore  # noqa: E402
from tests.postgres import PostgresServer, unavailable_reason  # noqa: E402

JOURNAL = "bench/events/part-000"
KEYS = 100  # rows the upserts rotate over
VALUE = b"v" * 64

STATE = sa.Table(
    "bench_state",
    sa.MetaData(),
    sa.Column("key", sa.Integer, primary_key=True),
    sa.Column("counter", sa.BigInteger, nullable=False),
    sa.Column("value", sa.LargeBinary, nullable=False),
)


def _upsert(conn: sa.Connection, key: int, counter: int) -> None:
    """One small row, inserted or overwritten (ON CONFLICT: both dialects have it)."""
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    stmt = dialect.insert(STATE).values(key=key, counter=counter, value=VALUE)
    conn.execute(
        stmt.on_conflict_do_update(
            index_elements=[STATE.c.key], set_={"counter": counter, "value": VALUE}
        )
    )


async def measure(url: str, commits: int) -> dict[str, float]:
    """Sequential transactions against a fresh shard: commits/s and per-commit latency."""
    engine = sa.create_engine(url)
    STATE.metadata.create_all(engine)
    store = SQLStore(engine, f"bench/{uuid.uuid4().hex[:8]}")
    checkpoint = await store.restore_checkpoint(store.shard_fqn)
    latencies: list[float] = []
    try:
        started = time.perf_counter()
        for n in range(1, commits + 1):
            began = time.perf_counter()
            await store.run(_upsert, n % KEYS, n)
            checkpoint.sources[JOURNAL].read_through = n * 100
            await (await store.start_commit(store.shard_fqn, checkpoint, []))
            latencies.append(time.perf_counter() - began)
        elapsed = time.perf_counter() - started
    finally:
        await store.destroy()
        engine.dispose()
    latencies.sort()
    return {
        "commits_per_s": commits / elapsed,
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1e3,
    }


async def run(backends: list[str], commits: int) -> dict[str, Any]:
    results: dict[str, Any] = {"commits": commits, "machine": platform.platform()}
    if "sqlite" in backends:
        with tempfile.TemporaryDirectory(prefix="sqlstore-bench-") as tmp:
            results["sqlite"] = await measure(f"sqlite:///{tmp}/bench.db", commits)
    if "postgres" in backends:
        reason = unavailable_reason()
        if reason is not None:
            results["postgres"] = {"skipped": reason}
        else:
            with PostgresServer() as server:
                results["postgres"] = await measure(server.url, commits)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--commits", type=int, default=2000)
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    results = asyncio.run(run(args.backends.split(","), args.commits))
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{args.commits} sequential commits, one row upsert + checkpoint each")
    print(f"{'backend':10} {'commits/s':>10} {'p50 ms':>8} {'p99 ms':>8}")
    for backend in ("sqlite", "postgres"):
        row = results.get(backend)
        if row is None:
            continue
        if "skipped" in row:
            print(f"{backend:10} skipped: {row['skipped']}")
        else:
            print(
                f"{backend:10} {row['commits_per_s']:>10.0f} "
                f"{row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f}"
            )


if __name__ == "__main__":
    main()
