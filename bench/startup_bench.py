"""How soon `streamkit run` serves: from its command, and again after a SIGKILL.

    python bench/startup_bench.py [--rounds 5] [--history 20000,400000]
                                  [--busy LINES [--busy-after 3.5]] [--store KIND]

* start: `streamkit run` of a fresh copy of examples/wordcount (8 shards, RocksDB) with
  its bundled broker, timed from the command until every shard answers a query
  (`POST /query/shard-NNN` on the member's HTTP API, polled every 10 ms);
* restart: the same app run against a broker process of its own (one that outlives
  the app, as in production) has consumed `--history` lines; it is SIGKILLed, and the
  same command is timed until every shard answers a query again. The wordcount state
  is bounded by the vocabulary (10,000 words), so comparing histories shows whether
  recovery grows with history (it should not: playback starts from the hints, which
  name only the live files' parts of the recovery log).
* busy restart (`--busy LINES`): the same, but killed in the middle of a catch-up:
  LINES lines wait in the broker, and the app is SIGKILLed `--busy-after` seconds
  after it first serves (past its first commit, with a transaction open and its
  store being written), then timed until it serves again. Each round goes on
  where the one before left the app, so LINES must outlast the rounds. Before
  the kill, queries go to the catching-up shards every 0.2 s: their latency is
  printed too (a query sees committed state, so it waits for the commit in flight).

`--store` picks the wordcount's store kind (rocksdb, json or sqlite) for every run.
Commands run with bytecode caching on (as an installed streamkit would), rounds
alternate, and the best and median of each are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.backfill_bench import copy_app, preload  # noqa: E402
from bench.common import machine  # noqa: E402
from bench.wordcount_bench import (  # noqa: E402
    heads,
    lines_file,
    member_urls,
    publish_lines,
    stop_run,
    wait_processed,
)
from streamkit.app.config import load_config  # noqa: E402
from streamkit.app.resolver import Resolver  # noqa: E402
from streamkit.client import BrokerClient  # noqa: E402
from streamkit.keyspace import open_keyspace  # noqa: E402
from tests.brokerproc import BrokerProcess  # noqa: E402

POLL = 0.01


def run_command(app: Path, tmp: Path, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(tmp / "pycache")
    log = open(tmp / f"{app.name}.log", "ab")  # noqa: SIM115 (the process keeps it)
    return subprocess.Popen([sys.executable, "-m", "streamkit.cli.main", "run", str(app),
                             "--no-status", *args], stdout=log, stderr=subprocess.STDOUT,
                            env=env)


def _query(url: str, shard: str, timeout: float) -> None:
    """One wordcount query of `shard`, answered (or an OSError)."""
    request = urllib.request.Request(f"{url}/query/{shard}", data=b'{"word": "the"}',
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        json.loads(response.read())


def _answers(url: str, shard: str) -> bool:
    try:
        _query(url, shard, timeout=2)
    except OSError:
        return False
    return True


async def until_serving(app: Path, proc: subprocess.Popen, started: float,
                        timeout: float = 60) -> float:
    """Seconds from `started` until every shard of `app` answers a query."""
    config = load_config(app)
    shards = [f"shard-{i:03}" for i in range(config.shards)]
    keyspace_file = config.data_dir / "keyspace.db"
    while not keyspace_file.exists():
        await asyncio.sleep(POLL)
    async with open_keyspace(str(keyspace_file)) as keyspace:
        resolver = Resolver(config, keyspace)
        waiting = set(shards)
        while waiting:
            if time.monotonic() - started > timeout or proc.poll() is not None:
                raise RuntimeError(f"{app.name}: not serving {sorted(waiting)}")
            for url in await member_urls(resolver):
                answered = await asyncio.gather(*(asyncio.to_thread(_answers, url, shard)
                                                  for shard in sorted(waiting)))
                waiting -= {s for s, ok in zip(sorted(waiting), answered, strict=True) if ok}
            if waiting:
                await asyncio.sleep(POLL)
    return time.monotonic() - started


async def start_once(tmp: Path, index: int) -> float:
    app = copy_wordcount(tmp, f"start-{index}", "wordcount")
    started = time.monotonic()
    proc = run_command(app, tmp, "--port", str(8480 + 2 * index))
    try:
        return await until_serving(app, proc, started)
    finally:
        stop_run(proc)


async def restart_once(tmp: Path, broker: BrokerProcess, history: int, index: int) -> float:
    app = copy_wordcount(tmp, f"restart-{history}-{index}", f"wc-h{history}-r{index}")
    config = load_config(app)
    proc = run_command(app, tmp, "--broker", broker.address)
    try:
        await until_serving(app, proc, time.monotonic())
        async with BrokerClient(broker.address) as client, open_keyspace(
                str(config.data_dir / "keyspace.db")) as keyspace:
            await publish_lines(client, config, lines_file(history).read_text().splitlines(), 0)
            await wait_processed(Resolver(config, keyspace), await heads(client, config))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        started = time.monotonic()
        proc = run_command(app, tmp, "--broker", broker.address)
        return await until_serving(app, proc, started)
    finally:
        stop_run(proc)


def copy_wordcount(tmp: Path, folder: str, name: str) -> Path:
    """A fresh copy of examples/wordcount, with the store kind of `--store`."""
    app = copy_app(tmp, folder, name)
    config = app / "streamkit.yaml"
    config.write_text(config.read_text().replace("kind: rocksdb", f"kind: {STORE}"))
    return app


STORE = "rocksdb"  # the store kind of every app run (--store)


async def busy_restarts(tmp: Path, broker: BrokerProcess, lines: int, rounds: int,
                        after: float) -> tuple[list[float], list[float]]:
    """Restarts after a SIGKILL `after` seconds into a catch-up of `lines` lines, and the
    latencies of queries made meanwhile."""
    app = copy_wordcount(tmp, "busy", "wc-busy")
    await preload(broker, [app], lines_file(lines).read_text().splitlines())
    config = load_config(app)
    times: list[float] = []
    latencies: list[float] = []
    for index in range(rounds):
        proc = run_command(app, tmp, "--broker", broker.address)
        try:
            await until_serving(app, proc, time.monotonic())
            async with open_keyspace(str(config.data_dir / "keyspace.db")) as keyspace:
                (url,) = await member_urls(Resolver(config, keyspace))
            until = time.monotonic() + after
            while time.monotonic() < until:
                shard = f"shard-{len(latencies) % config.shards:03}"
                latencies.append(await asyncio.to_thread(_query_time, url, shard))
                await asyncio.sleep(0.2)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            started = time.monotonic()
            proc = run_command(app, tmp, "--broker", broker.address)
            times.append(await until_serving(app, proc, started))
        finally:
            stop_run(proc)
        print(f"round {index}: restart in the middle of a catch-up {times[-1]:.3f} s",
              file=sys.stderr, flush=True)
    return times, latencies


def _query_time(url: str, shard: str) -> float:
    """Seconds one query of `shard` took to answer (however long)."""
    started = time.monotonic()
    _query(url, shard, timeout=60)
    return time.monotonic() - started


def _latency_summary(latencies: list[float]) -> dict[str, Any]:
    ordered = sorted(latencies)
    return {"queries": len(ordered), "median_ms": round(1000 * ordered[len(ordered) // 2]),
            "p90_ms": round(1000 * ordered[int(0.9 * len(ordered))]),
            "max_ms": round(1000 * ordered[-1])}


def summary(times: list[float]) -> dict[str, Any]:
    ordered = sorted(times)
    return {"runs": [round(t, 3) for t in times], "best_s": round(ordered[0], 3),
            "median_s": round(ordered[len(ordered) // 2], 3)}


async def bench(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    await start_once(tmp, 99)  # warms the bytecode cache
    starts: list[float] = []
    restarts: dict[int, list[float]] = {h: [] for h in args.history}
    broker = BrokerProcess(tmp / "broker").start()
    try:
        for index in range(args.rounds):
            starts.append(await start_once(tmp, index))
            print(f"round {index}: start {starts[-1]:.3f} s", file=sys.stderr, flush=True)
            for history in args.history:
                restarts[history].append(await restart_once(tmp, broker, history, index))
                print(f"round {index}: restart after {history:,} lines "
                      f"{restarts[history][-1]:.3f} s", file=sys.stderr, flush=True)
        busy, latencies = (
            await busy_restarts(tmp, broker, args.busy, args.rounds, args.busy_after)
            if args.busy else ([], []))
    finally:
        broker.kill()
    return {"start_until_queries": summary(starts),
            **{f"restart_after_{h}_lines": summary(t) for h, t in restarts.items()},
            **({"restart_mid_catch_up": summary(busy),
                "query_during_catch_up": _latency_summary(latencies)} if busy else {}),
            "store": STORE, "load": os.getloadavg()[0], "machine": machine()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--history", default="20000,400000",
                        help="lines consumed before each SIGKILL (comma-separated)")
    parser.add_argument("--busy", type=int, default=0, metavar="LINES",
                        help="also restart after SIGKILLs in the middle of a catch-up of "
                             "LINES lines (0: not)")
    parser.add_argument("--busy-after", type=float, default=3.5, metavar="SECONDS",
                        help="how long after serving the busy app is killed")
    parser.add_argument("--store", default="rocksdb", choices=("rocksdb", "json", "sqlite"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.history = [int(h) for h in args.history.split(",") if h]
    global STORE
    STORE = args.store
    with tempfile.TemporaryDirectory(prefix="streamkit-startup-") as tmp:
        results = asyncio.run(bench(args, Path(tmp)))
    if args.json:
        print(json.dumps(results))
        return
    for name, value in results.items():
        print(f"{name:>30}: {value}")


if __name__ == "__main__":
    main()
