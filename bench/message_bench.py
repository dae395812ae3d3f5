"""Message-layer throughput: Publisher (and read-committed reads) through a real broker.

    python bench/message_bench.py [--messages 500000] [--journals 4] [--json out.json]

Starts a fresh broker on 127.0.0.1, creates --journals ndjson journals as one
topic, and measures, on this machine:

1. publisher_cpu_msgs_s: validate, map (keyed modulo over a PolledList), UUID,
   frame, with appends discarded: the Publisher's own cost per message;
2. publish_committed_msgs_s: ~100-byte dict messages published committed
   through an AppendService, timed until every OpFuture has resolved;
3. read_committed_msgs_s: ReadCommitted over what (2) wrote, all journals
   one after the other, decoded and sequenced;
4. decode_msgs_s and commit_run_msgs_s: the two steps of (3) a catch-up
   spends most of its framework CPU on, alone, over frames (1) made: the
   ndjson decoder, and the Sequencer's bulk path (`commit_run`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from google.protobuf.duration_pb2 import Duration

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import machine, with_broker  # noqa: E402
from streamkit.client import (  # noqa: E402
    AppendService,
    BrokerClient,
    OpFuture,
    PolledList,
    apply_journals,
)
from streamkit.message.framings.json_lines import JsonLinesDecoder  # noqa: E402
from streamkit.message.mapping import (  # noqa: E402
    MappingFunc,
    field_key,
    modulo_mapping,
    partitions_from,
)
from streamkit.message.publisher import Publisher  # noqa: E402
from streamkit.message.reader import ReadCommitted  # noqa: E402
from streamkit.message.sequencer import Sequencer  # noqa: E402
from streamkit.protocol import pb  # noqa: E402

TOPIC = "bench-messages"
PAYLOAD = "x" * 24  # with key, n and the 36-character UUID: ~100 bytes per framed message


def journal_spec(name: str) -> pb.JournalSpec:
    labels = pb.LabelSet(labels=[pb.Label(name="content-type", value="application/x-ndjson"),
                                 pb.Label(name="topic", value=TOPIC)])
    fragment = pb.JournalSpec.Fragment(length=1 << 30, compression_codec=pb.SNAPPY,
                                       stores=["file:///"], refresh_interval=Duration(seconds=60))
    return pb.JournalSpec(name=name, replication=1, labels=labels, fragment=fragment)


def message(n: int) -> dict[str, Any]:
    return {"key": f"user-{n % 1000}", "n": n, "payload": PAYLOAD}


class _DiscardingService:
    """Stands in for an AppendService: takes each frame and drops it (keeping `keep`)."""

    def __init__(self, keep: int = 0) -> None:
        self.future = OpFuture.finished()
        self.bytes = 0
        self.kept = bytearray()
        self.keep = keep

    async def append(self, journal: str, data: bytes, dependencies: Any = ()) -> OpFuture:
        self.bytes += len(data)
        if len(self.kept) < self.keep:
            self.kept += data
        return self.future


async def bench_publisher_cpu(mapping: MappingFunc, count: int) -> dict[str, float]:
    service = _DiscardingService(keep=16 << 20)
    publisher = Publisher(service)  # type: ignore[arg-type]
    started = time.perf_counter()
    for n in range(count):
        await publisher.publish_committed(mapping, message(n))
    elapsed = time.perf_counter() - started
    return {"publisher_cpu_msgs_s": count / elapsed,
            "framed_message_bytes": service.bytes / count,
            **bench_decode_and_sequence(bytes(service.kept))}


def bench_decode_and_sequence(frames: bytes, rounds: int = 5) -> dict[str, float]:
    """Best of `rounds`: decoding `frames` (ndjson) into envelopes, then committing them."""
    decode = commit = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        envelopes = JsonLinesDecoder("bench", dict).feed(frames, 0)
        decode = min(decode, time.perf_counter() - started)
        sequencer = Sequencer(offsets={"bench": 0})
        started = time.perf_counter()
        index = 0
        while index < len(envelopes):
            index = sequencer.commit_run(envelopes, index, len(envelopes))
        commit = min(commit, time.perf_counter() - started)
    return {"decode_msgs_s": len(envelopes) / decode, "commit_run_msgs_s": len(envelopes) / commit}


async def bench_publish(client: BrokerClient, mapping: MappingFunc, count: int
                        ) -> dict[str, float]:
    """msgs/s until every append committed (futures are shared by the appends of a batch)."""
    async with AppendService(client) as service:
        publisher = Publisher(service)
        futures: set[OpFuture] = set()
        started = time.perf_counter()
        for n in range(count):
            futures.add(await publisher.publish_committed(mapping, message(n)))
        queued = time.perf_counter() - started
        for future in futures:
            await future  # raises if an append failed
        elapsed = time.perf_counter() - started
    return {"publish_committed_msgs_s": count / elapsed,
            "publish_queue_msgs_s": count / queued,
            "append_batches": float(len(futures))}


async def bench_read_committed(client: BrokerClient, journals: list[str], count: int
                               ) -> dict[str, float]:
    total = 0
    started = time.perf_counter()
    for journal in journals:
        async for _ in ReadCommitted(client, journal, message_type=dict, offset=0, block=False):
            total += 1
    elapsed = time.perf_counter() - started
    assert total == count, (total, count)
    return {"read_committed_msgs_s": total / elapsed}


async def run(address: str, args: argparse.Namespace) -> dict[str, float]:
    names = [f"{TOPIC}/part-{i:03d}" for i in range(args.journals)]
    async with BrokerClient(address) as client:
        await apply_journals(client, [pb.ApplyRequest.Change(expect_mod_revision=0,
                                                             upsert=journal_spec(name))
                                      for name in names])
        async with PolledList(client, f"topic={TOPIC}") as polled:
            mapping = modulo_mapping(field_key("key"), partitions_from(polled))
            results = await bench_publisher_cpu(mapping, min(args.messages, 200_000))
            results |= await bench_publish(client, mapping, args.messages)
        results |= await bench_read_committed(client, names, args.messages)
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=500_000)
    parser.add_argument("--journals", type=int, default=4)
    parser.add_argument("--json", type=Path, help="also write results here")
    args = parser.parse_args()
    results: dict[str, Any] = with_broker(lambda broker, _: run(broker.address, args))
    results["messages"] = args.messages
    results["journals"] = args.journals
    results["machine"] = machine()
    for key, value in results.items():
        print(f"{key:32} {value:>14,.1f}" if isinstance(value, float) else f"{key:32} {value}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
