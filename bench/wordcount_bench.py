"""Wordcount end to end: lines/s with exactly-once state, commit latency, recovery.

    python bench/wordcount_bench.py [--lines 1000000] [--store rocksdb] [--workers 1]
                                    [--live 200000] [--recovery] [--json]

The input is the peer benchmark's: `gen_data.py` of ../shared/peers/bytewax-wordcount
(lines of 3-7 words from a 10,000-word vocabulary, seed 42), cached in
$TMPDIR/streamkit-bench. A fresh broker process is started; examples/wordcount
is copied and its journals created; the lines are pre-loaded as committed
messages ({"id": i, "line": ...}, partitioned by id over 8 journals). Then
`streamkit run APP --broker ... --workers N` starts as a real subprocess and
the clock runs until every shard has processed every line (polled from the
members' /status). Reported: lines/s from the run's start (start-up
included), the time to the first committed transaction, the commit phase's
mean and p99 during catch-up (from the members' Prometheus histograms), the
publish-to-processed latency of single lines on the idle app, then with `--live N` the rate at
which N more lines are processed while being published, and with
`--recovery` the time from a SIGKILL of the run to all shards serving again.
`--failover ROUNDS` measures instead how long hot standbys take to serve the
shards of a SIGKILLed member (two `streamkit serve` members, `standbys: 1`,
`--lines` of state).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import bench_security, report, with_broker  # noqa: E402
from streamkit.app.config import load_config  # noqa: E402
from streamkit.app.member import deploy  # noqa: E402
from streamkit.app.member_http import http_url, open_member_url  # noqa: E402
from streamkit.app.resolver import Resolver  # noqa: E402
from streamkit.auth.settings import Security  # noqa: E402
from streamkit.auth.tokens import Capability  # noqa: E402
from streamkit.client import BrokerClient, write_head  # noqa: E402
from streamkit.client.append_service import AppendService  # noqa: E402
from streamkit.keyspace import open_keyspace  # noqa: E402
from streamkit.message.publisher import Publisher  # noqa: E402
from tests.brokerproc import BrokerProcess  # noqa: E402

PEER = ROOT.parent / "shared" / "peers" / "bytewax-wordcount"
TOPIC = "wordcount/lines"


def lines_file(n: int) -> Path:
    """The peer benchmark's data file of `n` lines (generated once, then cached)."""
    cache = Path(tempfile.gettempdir()) / "streamkit-bench"
    cache.mkdir(exist_ok=True)
    path = cache / f"lines-{n}.txt"
    if not path.exists():
        subprocess.run([sys.executable, str(PEER / "gen_data.py"), str(n), "10000",
                        str(path)], check=True)
    return path


async def publish_lines(client: BrokerClient, config: Any, lines: list[str], first: int) -> None:
    mapping = config.mapping_for(TOPIC)
    async with AppendService(client) as service:
        publisher = Publisher(service)
        for i, line in enumerate(lines, first):
            await publisher.publish_committed(mapping, {"id": i, "line": line})


async def heads(client: BrokerClient, config: Any) -> dict[str, int]:
    return {j: await write_head(client, j) for j in config.topic_journals(TOPIC)}


SECURITY = Security()  # --secure: the keys and CA of the run (members want a LIST token)


def _get(url: str) -> bytes:
    with open_member_url(SECURITY, url, cap=Capability.LIST, timeout=5) as response:
        return response.read()


async def member_urls(resolver: Resolver) -> list[str]:
    return [http_url(endpoint) for endpoint in (await resolver.members()).values()]


async def processed(resolver: Resolver) -> dict[str, int]:
    """Journal -> offset read through, over every primary's /status."""
    out: dict[str, int] = {}
    for url in await member_urls(resolver):
        try:
            status = json.loads(await asyncio.to_thread(_get, f"{url}/status"))
        except OSError:
            continue
        for shard in status:
            if shard.get("status") == "FAILED":
                raise RuntimeError(f"shard {shard.get('id')} failed: {shard.get('errors')}")
            if shard.get("status") == "PRIMARY":
                for journal, offset in shard.get("read_through", {}).items():
                    out[journal] = max(out.get(journal, 0), offset)
    return out


async def wait_serving(resolver: Resolver, shards: int, interval: float = 0.02) -> float:
    """Until `shards` shards are PRIMARY (over every member's /status); the time it was."""
    while True:
        count = 0
        for url in await member_urls(resolver):
            with contextlib.suppress(OSError):
                status = json.loads(await asyncio.to_thread(_get, f"{url}/status"))
                count += sum(1 for shard in status if shard.get("status") == "PRIMARY")
        if count >= shards:
            return time.monotonic()
        await asyncio.sleep(interval)


async def wait_processed(resolver: Resolver, wanted: dict[str, int], timeout: float = 900
                         ) -> tuple[float, float]:
    """Wait until every journal is read through `wanted`; (first progress, done) times."""
    start_offsets = await processed(resolver)
    first = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = await processed(resolver)
        if first is None and any(now.get(j, 0) > start_offsets.get(j, 0) for j in wanted):
            first = time.monotonic()
        if all(now.get(j, 0) >= o for j, o in wanted.items()):
            return first or time.monotonic(), time.monotonic()
        await asyncio.sleep(0.1)
    raise TimeoutError(f"not processed within {timeout}s: {now} < {wanted}")


async def commit_latency(resolver: Resolver) -> dict[str, float]:
    """Mean and ~p99 of the committing phase, from the members' histograms."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    pattern = re.compile(r'streamkit_shard_txn_phase_seconds_(bucket|sum|count)\{([^}]*)\} (\S+)')
    for url in await member_urls(resolver):
        text = (await asyncio.to_thread(_get, f"{url}/metrics")).decode()
        for kind, labels, value in pattern.findall(text):
            if 'phase="committing"' not in labels:
                continue
            if kind == "sum":
                total += float(value)
            elif kind == "count":
                count += float(value)
            else:
                le = re.search(r'le="([^"]+)"', labels)
                bound = float("inf") if le is None or le.group(1) == "+Inf" else float(le.group(1))
                buckets[bound] = buckets.get(bound, 0) + float(value)
    p99 = next((b for b, c in sorted(buckets.items()) if count and c >= 0.99 * count), 0.0)
    return {"transactions": count, "mean_ms": 1000 * total / count if count else 0.0,
            "p99_le_ms": 1000 * p99}


async def end_to_end_latency(client: BrokerClient, config: Any, resolver: Resolver,
                             samples: int) -> dict[str, float]:
    """Publish one line at a time; time until its shard's Stat says it is processed.

    Stat answers once a committed (and acknowledged) transaction read the
    line: the latency of exactly-once processing on an idle app.
    """
    import grpc

    from streamkit.protocol import consumer_pb
    from streamkit.protocol.consumer_pb2_grpc import ShardStub

    shard_of = {j: sid for i, sid in enumerate(config.shard_ids())
                for j in config.source_journals(i)}
    primaries = await resolver.primaries()
    times = []
    async with AppendService(client) as service:
        publisher = Publisher(service)
        mapping = config.mapping_for(TOPIC)
        for i in range(samples):
            t = time.monotonic()
            op = await publisher.publish_committed(mapping, {"id": -i, "line": "latency probe"})
            response = await op
            journal = response.commit.journal
            primary = primaries[shard_of[journal]]
            async with grpc.aio.insecure_channel(primary.endpoint.removeprefix("grpc://")) as ch:
                await ShardStub(ch).Stat(consumer_pb.StatRequest(
                    shard=primary.shard, read_through={journal: response.commit.end}))
            times.append(time.monotonic() - t)
            await asyncio.sleep(0.05)
    times.sort()
    return {"p50_ms": round(1000 * times[len(times) // 2], 1),
            "p99_ms": round(1000 * times[min(len(times) - 1, int(len(times) * 0.99))], 1)}


async def failover(broker: BrokerProcess, tmp: Path, lines: list[str], rounds: int,
                   keyspace: str | None = None) -> dict[str, Any]:
    """Two `streamkit serve` members with a hot standby per shard: SIGKILL the member
    holding the most primaries, time until the other serves its shards (PRIMARY, and
    answering Stat and a query), bring it back, repeat. `keyspace`: a KeySpace URL the
    members share (etcd://…; default: the app's SQLite file)."""
    from tests.e2e import AppView, copy_wordcount, eventually, serve_app

    app = copy_wordcount(tmp / "failover", standbys=1)
    extra = ("--keyspace", keyspace) if keyspace else ()
    times: list[float] = []
    members = {}
    async with AppView(app, broker.address, keyspace=keyspace) as view:
        await view.state()
        await deploy(view.config, view.client, view.keyspace)
        await publish_lines(view.client, view.config, lines, 0)
        for name in ("mem-a", "mem-b"):
            members[name] = serve_app(app, broker.address, name, tmp / f"serve-{name}.log",
                                      *extra)
        try:
            for round_ in range(rounds):
                await eventually(view.balanced if round_ else view.standing_by, 120,
                                 "a primary and a standby per shard")
                await view.wait_caught_up(120)
                by_member = await view.primaries_by_member()
                victim = max(by_member, key=lambda m: len(by_member[m]))
                survivor = "mem-b" if victim == "mem-a" else "mem-a"
                killed = time.monotonic()
                members[victim].kill()
                moved = by_member[victim]
                await eventually(functools.partial(view.served_by, moved, survivor), 30,
                                 "the survivor to serve", interval=0.01)
                times.append(time.monotonic() - killed)
                print(f"round {round_}: {len(moved)} shards in {times[-1]:.2f}s",
                      file=sys.stderr)
                members[victim] = serve_app(app, broker.address, victim,
                                            tmp / f"serve-{victim}-{round_}.log", *extra)
        finally:
            for proc in members.values():
                proc.stop()
    times.sort()
    return {"rounds": rounds, "state_lines": len(lines), "min_s": round(times[0], 2),
            "median_s": round(times[len(times) // 2], 2), "max_s": round(times[-1], 2)}


def stop_run(proc: subprocess.Popen) -> None:
    """Ctrl-C, as a user stops `streamkit run`; killed if it takes over a minute."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def start_run(app: Path, broker: BrokerProcess, workers: int, log: Path) -> subprocess.Popen:
    """`streamkit run` against `broker`, with its security settings (if any) as environment."""
    return subprocess.Popen(
        [sys.executable, "-m", "streamkit.cli.main", "run", str(app), "--broker",
         broker.address, "--no-status", "--workers", str(workers)],
        stdout=open(log, "ab"), stderr=subprocess.STDOUT, env={**os.environ, **broker.env})


async def bench(broker: BrokerProcess, tmp: Path, args: argparse.Namespace,
                secure: bool = False) -> dict[str, Any]:
    global SECURITY
    if secure:
        SECURITY = bench_security(tmp)
    app = tmp / "wordcount"
    shutil.copytree(ROOT / "examples" / "wordcount", app,
                    ignore=shutil.ignore_patterns(".streamkit", "__pycache__"))
    store = f"kind: {args.store}"
    if args.store == "sql":  # a real PostgreSQL server (see tests/postgres.py)
        store += f"\n  url: {args.sql_url}"
    text = (app / "streamkit.yaml").read_text().replace("kind: rocksdb", store)
    (app / "streamkit.yaml").write_text(text)
    config = load_config(app)
    all_lines = lines_file(args.lines + args.live).read_text().splitlines()
    results: dict[str, Any] = {"lines": args.lines, "store": args.store,
                               "workers": args.workers}
    async with BrokerClient(broker.address, SECURITY) as client, open_keyspace(
            str(config.data_dir / "keyspace.db")) as keyspace:
        await deploy(config, client, keyspace)
        t = time.monotonic()
        await publish_lines(client, config, all_lines[:args.lines], 0)
        results["preload_s"] = round(time.monotonic() - t, 2)
        wanted = await heads(client, config)
        resolver = Resolver(config, keyspace)
        log = tmp / "run.log"
        started = time.monotonic()
        proc = start_run(app, broker, args.workers, log)
        try:
            first, done = await wait_processed(resolver, wanted)
            results["catch_up_lines_per_s"] = round(args.lines / (done - started))
            results["catch_up_s"] = round(done - started, 2)
            results["first_commit_s"] = round(first - started, 2)
            results["catch_up_commit"] = await commit_latency(resolver)
            if args.latency:
                results["latency"] = await end_to_end_latency(client, config, resolver,
                                                              args.latency)
            if args.live:
                t = time.monotonic()
                await publish_lines(client, config, all_lines[args.lines:], args.lines)
                published = time.monotonic()
                _, done = await wait_processed(resolver, await heads(client, config))
                results["live_lines_per_s"] = round(args.live / (done - t))
                results["live_publish_s"] = round(published - t, 2)
                results["live_lag_after_publish_s"] = round(done - published, 2)
            if args.recovery:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                t = time.monotonic()
                proc = start_run(app, broker, args.workers, log)
                await publish_lines(client, config, ["one more line"], 10**9)
                _, done = await wait_processed(resolver, await heads(client, config))
                results["recovery_s"] = round(done - t, 2)
        finally:
            stop_run(proc)
        if proc.returncode not in (0, -signal.SIGINT):
            print(log.read_text()[-3000:], file=sys.stderr)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--store", default="rocksdb",
                        choices=["rocksdb", "sqlite", "json", "sql"])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--sql-url", default=None,
                        help="database of --store sql (default: a PostgreSQL server started here)")
    parser.add_argument("--live", type=int, default=0, help="lines published while running")
    parser.add_argument("--recovery", action="store_true")
    parser.add_argument("--failover", type=int, default=0, metavar="ROUNDS",
                        help="only measure hot-standby failover, ROUNDS times")
    parser.add_argument("--latency", type=int, default=50,
                        help="single-line publish-to-processed samples (0: skip)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--secure", action="store_true",
                        help="TLS and auth tokens on (broker, members, and this client)")
    args = parser.parse_args()
    if args.failover:
        lines = lines_file(args.lines).read_text().splitlines()
        results = with_broker(lambda broker, tmp: failover(broker, tmp, lines, args.failover))
    elif args.store == "sql" and not args.sql_url:
        from tests.postgres import PostgresServer

        with PostgresServer() as server:
            args.sql_url = server.url
            results = with_broker(lambda broker, tmp: bench(broker, tmp, args))
    else:
        results = with_broker(lambda broker, tmp: bench(broker, tmp, args, args.secure),
                              secure=args.secure)
    results["secure"] = args.secure
    report(results, args.json)


if __name__ == "__main__":
    main()
