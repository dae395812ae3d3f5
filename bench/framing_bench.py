"""Encode and decode throughput of the framings, for ~100-byte messages.

Run: python bench/framing_bench.py [--count N] [--chunk BYTES]

Decoding is fed in fixed-size chunks (64 KiB by default, about what a journal
read returns), so the numbers include boundary handling and partial-frame
buffering, not just parsing.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from streamkit.message.framing import framing_for
from streamkit.message.message import Message
from streamkit.message.uuid import Flags, build_uuid, new_producer_id


class Sample(Message):
    """A small model whose JSON frame is about 100 bytes."""

    name: str
    value: int
    ok: bool


def _record_class() -> type:
    file = descriptor_pb2.FileDescriptorProto(name="framing_bench.proto", package="bench")
    msg = file.message_type.add(name="Record")
    for number, name in enumerate(("uuid", "payload"), start=1):
        msg.field.add(
            name=name,
            number=number,
            type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
            label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
        )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("bench.Record"))


def _messages(kind: str, count: int) -> tuple[list[Any], type]:
    producer = new_producer_id()
    uuids = [build_uuid(producer, (10**6 + i) << 4, Flags.OUTSIDE_TXN) for i in range(count)]
    if kind == "dict":
        return [
            {"uuid": str(u), "name": f"sensor-{i % 1000:04d}", "value": i, "ok": True}
            for i, u in enumerate(uuids)
        ], dict
    if kind == "model":
        return [
            Sample(uuid=u, name=f"sensor-{i % 1000:04d}", value=i, ok=True)
            for i, u in enumerate(uuids)
        ], Sample
    record = _record_class()
    return [
        record(uuid=str(u), payload=f"sensor-{i % 1000:04d} value={i:08d} ok=yes")
        for i, u in enumerate(uuids)
    ], record


def _rate(count: int, run: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return count / best


def bench(content_type: str, kind: str, count: int, chunk: int) -> tuple[float, float, float]:
    """(bytes per frame, encode msgs/s, decode msgs/s)."""
    framing = framing_for(content_type)
    messages, message_type = _messages(kind, count)
    out = bytearray()

    def encode() -> None:
        out.clear()
        for message in messages:
            framing.encode(message, out)

    encode_rate = _rate(count, encode)
    data = bytes(out)

    def decode() -> None:
        decoder = framing.new_decoder("bench/journal", message_type)
        got = 0
        for offset in range(0, len(data), chunk):
            got += len(decoder.feed(data[offset : offset + chunk], offset))
        assert got == count and not decoder.errors, (got, decoder.errors[:1])

    decode_rate = _rate(count, decode)
    return len(data) / count, encode_rate, decode_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--chunk", type=int, default=64 * 1024)
    args = parser.parse_args()
    cases = [
        ("application/x-ndjson", "dict"),
        ("application/x-ndjson", "model"),
        ("application/x-ndjson", "proto"),
        ("text/csv", "dict"),
        ("text/csv", "model"),
        ("application/x-protobuf-fixed", "proto"),
    ]
    print(f"{args.count} messages, decode chunks of {args.chunk} bytes\n")
    print(f"{'framing':<30} {'message':<7} {'bytes':>6} {'encode msg/s':>13} {'decode msg/s':>13}")
    for content_type, kind in cases:
        size, enc, dec = bench(content_type, kind, args.count, args.chunk)
        print(f"{content_type:<30} {kind:<7} {size:>6.0f} {enc:>13,.0f} {dec:>13,.0f}")


if __name__ == "__main__":
    main()
