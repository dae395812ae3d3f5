"""JSONFileStore and SQLiteStore (both journal modes): commit rate with recording, against
the same work unrecorded, and the recovery-log bytes a recorded commit writes.

    python bench/recorded_store_bench.py [--commits 1000] [--json FILE]

Each transaction changes a few small values and commits with a checkpoint,
awaited before the next one (the rate a shard sees when its store is the
bottleneck). "Unrecorded" does the same local work without a recovery log:
SQLite through apsw's default VFS with synchronous=FULL, and the JSON state
file written, fsynced and renamed into place. A fresh broker is started for
the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import apsw

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import create_log, machine, with_broker  # noqa: E402
from bench.rocksdb_store_bench import checkpoint_of  # noqa: E402
from streamkit.client import BrokerClient  # noqa: E402
from streamkit.recoverylog.recovery import recover  # noqa: E402
from streamkit.stores import JSONFileStore, SQLiteStore  # noqa: E402
from streamkit.stores.sqlite import JournalMode  # noqa: E402


def json_unrecorded(directory: Path, commits: int) -> float:
    state: dict[str, int] = {}
    path, temp = directory / "state.json", directory / "state.json.next"
    started = time.perf_counter()
    for n in range(commits):
        state[f"k{n % 100}"] = n
        body = json.dumps({"state": state, "checkpoint": n}).encode()
        with open(temp, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    return commits / (time.perf_counter() - started)


def sqlite_unrecorded(directory: Path, commits: int, journal_mode: JournalMode = "DELETE"
                      ) -> float:
    db = apsw.Connection(str(directory / "db.sqlite"))
    db.execute(f"PRAGMA journal_mode={journal_mode}")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE kv(k TEXT PRIMARY KEY, v INTEGER)")
    db.execute("CREATE TABLE checkpoint(id INTEGER PRIMARY KEY, cp BLOB)")
    started = time.perf_counter()
    for n in range(commits):
        with db:
            db.execute("INSERT OR REPLACE INTO kv VALUES (?, ?)", (f"k{n % 100}", n))
            db.execute("INSERT OR REPLACE INTO checkpoint VALUES (0, ?)",
                       (checkpoint_of(n).SerializeToString(),))
    rate = commits / (time.perf_counter() - started)
    db.close()
    return rate


async def json_recorded(client: BrokerClient, log: str, directory: Path, commits: int) -> float:
    store = JSONFileStore(await recover(client, log, directory), {})
    await store.restore_checkpoint("bench")
    started = time.perf_counter()
    for n in range(commits):
        store.state[f"k{n % 100}"] = n
        await (await store.start_commit("bench", checkpoint_of(n), ()))
    rate = commits / (time.perf_counter() - started)
    await store.destroy()
    await store.fs.recorder.close()
    return rate


async def sqlite_recorded(client: BrokerClient, log: str, directory: Path, commits: int,
                          journal_mode: JournalMode = "DELETE") -> float:
    store = SQLiteStore(await recover(client, log, directory), journal_mode=journal_mode)
    await store.restore_checkpoint("bench")
    store.db.execute("CREATE TABLE kv(k TEXT PRIMARY KEY, v INTEGER)")
    started = time.perf_counter()
    for n in range(commits):
        store.db.execute("INSERT OR REPLACE INTO kv VALUES (?, ?)", (f"k{n % 100}", n))
        await (await store.start_commit("bench", checkpoint_of(n), ()))
    rate = commits / (time.perf_counter() - started)
    log_bytes[f"sqlite_{journal_mode.lower()}"] = store.fs.recorder.write_head
    await store.destroy()
    await store.fs.recorder.close()
    return rate


def sqlite_wal_unrecorded(directory: Path, commits: int) -> float:
    return sqlite_unrecorded(directory, commits, "WAL")


async def sqlite_wal_recorded(client: BrokerClient, log: str, directory: Path, commits: int
                              ) -> float:
    return await sqlite_recorded(client, log, directory, commits, "WAL")


log_bytes: dict[str, int] = {}  # recovery-log bytes a recorded run wrote


async def run(address: str, commits: int, tmp: Path) -> dict[str, float]:
    results: dict[str, float] = {}
    async with BrokerClient(address) as client:
        for name, recorded, unrecorded in (
            ("json", json_recorded, json_unrecorded),
            ("sqlite", sqlite_recorded, sqlite_unrecorded),
            ("sqlite_wal", sqlite_wal_recorded, sqlite_wal_unrecorded),
        ):
            plain = tmp / f"{name}-plain"
            plain.mkdir()
            results[f"{name}_commits_s_unrecorded"] = unrecorded(plain, commits)
            log = f"bench/{name}-log"
            await create_log(client, log)
            rate = await recorded(client, log, tmp / f"{name}-recorded", commits)
            results[f"{name}_commits_s_recorded"] = rate
            base = results[f"{name}_commits_s_unrecorded"]
            results[f"{name}_overhead_pct"] = 100 * (1 - rate / base)
    results |= {f"{name}_log_kib_per_commit": n / 1024 / commits
                for name, n in log_bytes.items()}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=1000)
    parser.add_argument("--json", type=Path, help="also write results here")
    args = parser.parse_args()
    results = with_broker(lambda broker, tmp: run(broker.address, args.commits, tmp))
    for key, value in results.items():
        print(f"{key:32} {value:>10.1f}")
    print(f"{'machine':32} {machine()}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
