"""Broker and client throughput on this machine.

    python bench/broker_bench.py [--mib 512] [--records 1000000] [--json out.json] [--secure]

Starts a fresh broker process on 127.0.0.1 (its own temp data dir), then measures
with streamkit's own asyncio client, in this order:

1. MB/s of 1 MiB appends (Appender), one journal, one append at a time;
   and with 4 journals appended concurrently;
2. records/s of 100-byte records through AppendService (batched into few RPCs);
3. MB/s of reads from a spooled fragment (Reader through the broker);
4. MB/s of reads from persisted SNAPPY fragments, through the broker and
   directly from the file store (do_not_proxy + FragmentReader);
5. p50/p99 latency of 100-byte appends, one at a time, on an otherwise idle broker;
6. µs per fragment-index lookup at the head of a journal of 10,000 fragments (in
   this process: every blocked read looks its offset up again after each append).

With --secure the broker serves TLS (a CA and certificate made for the run) and
requires tokens (AUTH_KEYS), and the client signs its calls: the cost of security.

Before measuring, it writes --warmup MiB to a scratch journal: on a fresh VM the
first touch of page-cache memory is several times slower than steady state
(see BENCHMARKS.md), and a long-running broker lives in the steady state.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import timeit
from pathlib import Path

from google.protobuf.duration_pb2 import Duration

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import bench_security, machine, with_broker  # noqa: E402
from streamkit.auth.settings import Security  # noqa: E402
from streamkit.broker.index import FragmentIndex  # noqa: E402
from streamkit.client import (  # noqa: E402
    Appender,
    AppendService,
    BrokerClient,
    RetryReader,
    apply_journals,
    list_fragments,
)
from streamkit.protocol import pb  # noqa: E402

MIB = 1 << 20


def journal_spec(name: str, length: int, codec: int) -> pb.JournalSpec:
    fragment = pb.JournalSpec.Fragment(
        length=length, compression_codec=codec, stores=["file:///"],
        refresh_interval=Duration(seconds=60),
    )
    return pb.JournalSpec(name=name, replication=1, fragment=fragment)


async def create(client: BrokerClient, *specs: pb.JournalSpec) -> None:
    changes = [pb.ApplyRequest.Change(expect_mod_revision=0, upsert=s) for s in specs]
    await apply_journals(client, changes)


async def append_mib(client: BrokerClient, journal: str, count: int, block: bytes) -> None:
    for _ in range(count):
        async with Appender(client, journal) as appender:
            await appender.write(block)


async def bench_big_appends(client: BrokerClient, mib: int) -> dict[str, float]:
    block = os.urandom(MIB)
    await create(client, journal_spec("bench/big", 1 << 34, pb.NONE),
                 *(journal_spec(f"bench/big-{i}", 1 << 34, pb.NONE) for i in range(4)))
    started = time.perf_counter()
    await append_mib(client, "bench/big", mib, block)
    one = mib / (time.perf_counter() - started)
    started = time.perf_counter()
    await asyncio.gather(*(append_mib(client, f"bench/big-{i}", mib // 4, block)
                           for i in range(4)))
    four = (mib // 4 * 4) / (time.perf_counter() - started)
    return {"append_1mib_mb_s": one * MIB / 1e6, "append_1mib_4_journals_mb_s": four * MIB / 1e6}


async def bench_records(client: BrokerClient, records: int) -> dict[str, float]:
    await create(client, journal_spec("bench/records", 1 << 30, pb.SNAPPY))
    record = b"r" * 99 + b"\n"
    service = AppendService(client)
    started = time.perf_counter()
    last = None
    for _ in range(records):
        last = await service.append("bench/records", record)
    await service.flush()
    elapsed = time.perf_counter() - started
    assert last is not None and last.result().commit.end == records * len(record)
    await service.close()
    return {"append_service_records_s": records / elapsed}


async def read_all(client: BrokerClient, journal: str, end: int, *, direct_root: Path | None = None
                   ) -> float:
    """MB/s of reading [0, end); with `direct_root`, persisted fragments are read from files."""
    request = pb.ReadRequest(journal=journal, offset=0, end_offset=end, block=True,
                             do_not_proxy=direct_root is not None)
    reader = RetryReader(client, request, file_root=direct_root)
    total = 0
    started = time.perf_counter()
    async for chunk in reader:
        total += len(chunk)
    elapsed = time.perf_counter() - started
    assert total == end, (total, end)
    return end / elapsed / 1e6


async def bench_reads(client: BrokerClient, mib: int, file_root: Path) -> dict[str, float]:
    spooled = await read_all(client, "bench/big", mib * MIB)
    fragment = min(64 * MIB, max(MIB, mib * MIB // 8))  # several fragments even in small runs
    await create(client, journal_spec("bench/persisted", fragment, pb.SNAPPY))
    block = os.urandom(MIB // 2) + bytes(MIB // 2)
    await append_mib(client, "bench/persisted", mib, block)
    async with Appender(client, "bench/persisted") as appender:
        await appender.write(b"roll")
    persisted_end = await wait_persisted(client, "bench/persisted", mib * MIB - fragment)
    proxied = await read_all(client, "bench/persisted", persisted_end)
    direct = await read_all(client, "bench/persisted", persisted_end, direct_root=file_root)
    return {"read_spool_mb_s": spooled, "read_persisted_via_broker_mb_s": proxied,
            "read_persisted_direct_mb_s": direct}


async def wait_persisted(client: BrokerClient, journal: str, at_least: int) -> int:
    """Wait until persisted fragments cover [0, at_least) and more than nothing;
    returns their end."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        listing = await list_fragments(client, journal)
        covered = 0
        for f in listing.fragments:
            if f.spec.backing_store and f.spec.begin == covered:
                covered = f.spec.end
        if covered >= at_least and covered > 0:
            return covered
        await asyncio.sleep(0.5)
    raise TimeoutError("fragments were not persisted in time")


async def bench_latency(client: BrokerClient, count: int = 2000) -> dict[str, float]:
    await create(client, journal_spec("bench/latency", 1 << 30, pb.SNAPPY))
    latencies = []
    for _ in range(count):
        started = time.perf_counter()
        async with Appender(client, "bench/latency") as appender:
            await appender.write(b"x" * 100)
        latencies.append((time.perf_counter() - started) * 1000)
    latencies.sort()
    return {"small_append_p50_ms": statistics.median(latencies),
            "small_append_p99_ms": latencies[int(len(latencies) * 0.99)]}


async def warm_up(client: BrokerClient, mib: int) -> None:
    await create(client, journal_spec("bench/warmup", 64 * MIB, pb.NONE))
    await append_mib(client, "bench/warmup", mib, os.urandom(MIB))


def bench_index_lookup(fragments: int = 10_000) -> dict[str, float]:
    index = FragmentIndex()
    for i in range(fragments):
        index.add(pb.Fragment(journal="j", begin=i * MIB, end=(i + 1) * MIB, backing_store="s"))
    head = fragments * MIB + 100
    index.add(pb.Fragment(journal="j", begin=fragments * MIB, end=head))  # the open spool
    seconds = min(timeit.repeat(lambda: index.query(head), number=1000, repeat=5)) / 1000
    return {"index_lookup_us_10000_fragments": seconds * 1e6}


async def run(address: str, args: argparse.Namespace, file_root: Path,
              security: Security | None) -> dict[str, float]:
    async with BrokerClient(address, security) as client:
        await warm_up(client, args.warmup)
        results: dict[str, float] = bench_index_lookup()
        results |= await bench_latency(client)
        results |= await bench_big_appends(client, args.mib)
        results |= await bench_records(client, args.records)
        results |= await bench_reads(client, args.mib, file_root)
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="MiB per big-append/read test")
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--warmup", type=int, default=1024, help="MiB written before measuring")
    parser.add_argument("--json", type=Path, help="also write results here")
    parser.add_argument("--secure", action="store_true", help="TLS and auth tokens on")
    args = parser.parse_args()
    results = with_broker(
        lambda broker, tmp: run(broker.address, args, broker.data_dir / "fragments",
                                bench_security(tmp) if args.secure else None),
        secure=args.secure,
    )
    results["secure"] = args.secure
    results["machine"] = machine()
    for key, value in results.items():
        print(f"{key:36} {value:>12.1f}" if isinstance(value, float) else f"{key:36} {value}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
