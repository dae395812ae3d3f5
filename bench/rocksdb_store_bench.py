"""RocksDBStore: commit rate with and without recording, and recovery time of a large state.

    python bench/rocksdb_store_bench.py [--commits 1000] [--puts 100] [--mib 256] [--json]

Commit rate: each transaction puts `--puts` random ~100-byte values and is
committed with a checkpoint, awaited before the next one (the sequential rate
a shard sees when the store is its bottleneck). Pipelined rate: puts/s when
puts go on while the previous commit is in flight and each commit takes all
puts made since the last (how the consumer runtime drives a store). Measured on a plain local
store (nothing recorded), on a recorded store, and on a recorded store that
does not fsync its WAL (with a recovery log, the log is the durable copy).

Recovery: `--mib` MiB of incompressible values are committed to a recorded
store, then `recover()` plus `restore_checkpoint()` rebuild and open it in a
fresh directory, from the recorder's hints (what a shard's next primary
uses) and from the whole log. Targets: recording costs at most 30% of the
unrecorded commit rate; 1 GiB recovers in under 15 s (extrapolated linearly
unless run with --mib 1024).

A fresh broker is started in a temp dir for the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


from bench.common import MIB, create_log, machine, with_broker  # noqa: E402
from streamkit.client import BrokerClient  # noqa: E402
from streamkit.protocol import consumer_pb  # noqa: E402
from streamkit.recoverylog import rpb  # noqa: E402
from streamkit.recoverylog.recovery import recover  # noqa: E402
from streamkit.stores.rocksdb import RocksDBStore  # noqa: E402

VALUE_SIZE = 100
BULK_VALUE = 64 << 10  # values of the recovery state
BULK_COMMIT = 16 * MIB  # state written per commit while building it


def checkpoint_of(n: int) -> consumer_pb.Checkpoint:
    cp = consumer_pb.Checkpoint()
    cp.sources["bench/input"].read_through = n
    return cp


async def open_store(client: BrokerClient | None, log: str, directory: Path, *, sync: bool = True,
                     hints: rpb.FSMHints | None = None) -> RocksDBStore:
    """A restored store: recorded into `log` when there is a client, else local only."""
    if client is None:
        store = RocksDBStore(directory, sync=sync)
    else:
        store = RocksDBStore(await recover(client, log, directory, hints), sync=sync)
    await store.restore_checkpoint("bench")
    return store


async def close(store: RocksDBStore) -> None:
    await store.destroy()
    if store.fs is not None:
        await store.fs.recorder.close()


async def commit_rate(store: RocksDBStore, commits: int, puts: int) -> float:
    """Sequential commits per second of `commits` transactions of `puts` small puts."""
    payload = os.urandom(VALUE_SIZE * puts)
    started = time.perf_counter()
    for n in range(commits):
        for i in range(puts):
            store.put(b"key-%08d" % ((n * puts + i) % 100_000),
                      payload[i * VALUE_SIZE:(i + 1) * VALUE_SIZE])
        await (await store.start_commit("bench", checkpoint_of(n), []))
    return commits / (time.perf_counter() - started)


async def pipelined_rate(store: RocksDBStore, seconds: float, batch: int = 100) -> float:
    """Puts/s committed when work goes on while the previous commit is in flight.

    This is how the consumer runtime drives a store: the next transaction
    keeps putting while the last one commits, and commits as soon as it is
    done, so transactions grow to cover the commit latency instead of
    waiting it out.
    """
    payload = os.urandom(VALUE_SIZE * batch)
    values = [payload[i * VALUE_SIZE:(i + 1) * VALUE_SIZE] for i in range(batch)]
    puts, n, op = 0, 0, None
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        for i, value in enumerate(values):
            store.put(b"key-%08d" % ((puts + i) % 100_000), value)
        puts += batch
        await asyncio.sleep(0)  # the runtime yields between batches
        if op is None or op.done():
            if op is not None:
                op.result()
            n += 1
            op = await store.start_commit("bench", checkpoint_of(n), [])
    if op is not None:
        await op
    await (await store.start_commit("bench", checkpoint_of(n + 1), []))
    return puts / (time.perf_counter() - started)


async def recovery(client: BrokerClient, tmp: Path, mib: int, repeat: int) -> dict[str, float]:
    """Build a `mib` MiB state, then time rebuilding it with and without hints (best of n)."""
    log = "bench/rocksdb-state"
    await create_log(client, log)
    store = await open_store(client, log, tmp / "state", sync=False)
    started = time.perf_counter()
    written, n = 0, 0
    while written < mib * MIB:
        for _ in range(BULK_COMMIT // BULK_VALUE):
            store.put(b"bulk-%08d" % (written // BULK_VALUE), os.urandom(BULK_VALUE))
            written += BULK_VALUE
        n += 1
        await (await store.start_commit("bench", checkpoint_of(n), []))
    build_s = time.perf_counter() - started
    assert store.fs is not None
    hints = await store.fs.recorder.build_hints()
    log_mib = store.fs.recorder.write_head / MIB
    await close(store)
    results = {"state_mib": written / MIB, "log_mib": log_mib, "build_s": build_s}
    keys = written // BULK_VALUE
    for attempt in range(repeat):  # alternating, so neither case alone gets a warm cache
        for label, h in (("hinted", hints), ("unhinted", None)):
            started = time.perf_counter()
            again = await open_store(client, log, tmp / f"recovered-{label}-{attempt}", hints=h)
            elapsed = time.perf_counter() - started
            assert sum(1 for _ in again.items(b"bulk-")) == keys, "recovered state is incomplete"
            await close(again)
            best = min(elapsed, results.get(f"recover_{label}_s", elapsed))
            results[f"recover_{label}_s"] = best
            results[f"recover_{label}_mib_s"] = results["state_mib"] / best
            results[f"recover_{label}_1gib_s_extrapolated"] = 1024 * best / results["state_mib"]
    return results


async def run(address: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    async with BrokerClient(address) as client:
        results: dict[str, Any] = {}
        cases: list[tuple[str, BrokerClient | None, bool]] = [
            ("unrecorded", None, True),
            ("recorded", client, True),
            ("recorded_nosync", client, False),
        ]
        for label, case_client, sync in cases:
            log = f"bench/rocksdb-{label}"
            if case_client is not None:
                await create_log(client, log)
            store = await open_store(case_client, log, tmp / label, sync=sync)
            results[f"commits_s_{label}"] = await commit_rate(store, args.commits, args.puts)
            results[f"pipelined_puts_s_{label}"] = await pipelined_rate(store, args.seconds)
            await close(store)
        base = results["commits_s_unrecorded"]
        for label in ("recorded", "recorded_nosync"):
            results[f"overhead_pct_{label}"] = 100 * (1 - results[f"commits_s_{label}"] / base)
            results[f"pipelined_overhead_pct_{label}"] = 100 * (
                1 - results[f"pipelined_puts_s_{label}"] / results["pipelined_puts_s_unrecorded"])
        results.update(await recovery(client, tmp, args.mib, args.repeat))
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=1000)
    parser.add_argument("--puts", type=int, default=100, help="~100-byte puts per transaction")
    parser.add_argument("--seconds", type=float, default=5.0,
                        help="duration of the pipelined measurement per case")
    parser.add_argument("--mib", type=int, default=256, help="MiB of state to recover")
    parser.add_argument("--repeat", type=int, default=2, help="recoveries per case (best kept)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    results = with_broker(lambda broker, tmp: run(broker.address, args, tmp))
    results["machine"] = machine()
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for key, value in results.items():
        print(f"{key:40} {value:>10.2f}" if isinstance(value, float) else f"{key:40} {value}")


if __name__ == "__main__":
    main()
