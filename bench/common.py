"""Pieces the benchmark scripts share."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import tempfile
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from google.protobuf.duration_pb2 import Duration

from streamkit.client import BrokerClient, apply_journals
from streamkit.protocol import pb
from streamkit.recoverylog import CONTENT_TYPE
from tests.brokerproc import BrokerProcess

T = TypeVar("T")

MIB = 1 << 20


async def create_log(client: BrokerClient, name: str) -> None:
    """A recovery-log journal: 64 MiB uncompressed fragments in the broker's file store."""
    spec = pb.JournalSpec(
        name=name, replication=1,
        labels=pb.LabelSet(labels=[pb.Label(name="content-type", value=CONTENT_TYPE)]),
        fragment=pb.JournalSpec.Fragment(
            length=64 * MIB, compression_codec=pb.NONE, stores=["file:///"],
            refresh_interval=Duration(seconds=60),
        ),
    )
    await apply_journals(client, [pb.ApplyRequest.Change(expect_mod_revision=0, upsert=spec)])


def machine() -> str:
    """What BENCHMARKS.md records as the machine of a run."""
    return f"{platform.node()} {os.cpu_count()} cores {platform.machine()}"


def with_broker(
    main: Callable[[BrokerProcess, Path], Coroutine[Any, Any, T]],
    extra_args: Callable[[Path], list[str]] = lambda _: [],
    env: dict[str, str] | None = None,
) -> T:
    """Run `main(broker, tmp)` against a fresh broker whose data lives in temp dir `tmp`
    (`extra_args(tmp)`: more `broker serve` options; `env`: more environment)."""
    with tempfile.TemporaryDirectory(prefix="streamkit-bench-") as tmp:
        broker = BrokerProcess(Path(tmp) / "broker", extra_args=extra_args(Path(tmp)),
                               env=env or {}).start()
        try:
            return asyncio.run(main(broker, Path(tmp)))
        finally:
            broker.kill()


def report(results: dict[str, Any], as_json: bool) -> None:
    """Print a benchmark's results: one JSON line, or aligned `name: value` lines."""
    results["machine"] = machine()
    if as_json:
        print(json.dumps(results))
        return
    width = max(len(key) for key in results)
    for key, value in results.items():
        print(f"{key:>{width}}: {value}")
