"""Shared helpers of the client tests: journal creation, unique names, reading until."""

from __future__ import annotations

import re
import urllib.request
import uuid
from pathlib import Path

from google.protobuf.duration_pb2 import Duration

from streamkit.client import BrokerClient, RetryReader, apply_journals
from streamkit.protocol import pb
from tests.waiting import eventually  # noqa: F401 (re-exported to the client tests)


def unique_name(prefix: str = "test") -> str:
    """A journal name no other test uses (tests share a broker)."""
    return f"{prefix}/{uuid.uuid4().hex[:12]}"


async def create_journal(
    client: BrokerClient,
    name: str,
    *,
    length: int = 1 << 20,
    codec: int = pb.SNAPPY,
    stores: tuple[str, ...] = ("file:///",),
    refresh_interval: int = 1,
    labels: dict[str, str] | None = None,
) -> pb.JournalSpec:
    """Create journal `name` (replication 1) and return its spec."""
    spec = pb.JournalSpec(
        name=name,
        replication=1,
        labels=pb.LabelSet(
            labels=[pb.Label(name=k, value=v) for k, v in sorted((labels or {}).items())]
        ),
        fragment=pb.JournalSpec.Fragment(
            length=length,
            compression_codec=codec,
            stores=list(stores),
            refresh_interval=Duration(seconds=refresh_interval),
        ),
    )
    await apply_journals(client, [pb.ApplyRequest.Change(expect_mod_revision=0, upsert=spec)])
    return spec


async def read_range(client: BrokerClient, journal: str, begin: int, end: int) -> bytes:
    """The journal's bytes [begin, end), read through a RetryReader."""
    out = bytearray()
    request = pb.ReadRequest(journal=journal, offset=begin, end_offset=end, block=True)
    async with RetryReader(client, request) as reader:
        async for chunk in reader:
            out += chunk
    return bytes(out)


def fragment_files(data_dir: Path, journal: str) -> list[Path]:
    """Persisted fragment files of `journal` in a broker's default file store."""
    folder = data_dir / "fragments" / journal
    return sorted(p for p in folder.glob("*") if p.is_file()) if folder.exists() else []


def open_reads(http_url: str) -> float:
    """The broker's gauge of Read streams being served (from its /metrics)."""
    with urllib.request.urlopen(f"{http_url}/metrics", timeout=5) as response:
        text = response.read().decode()
    match = re.search(r"^streamkit_broker_reads_open (\S+)$", text, re.MULTILINE)
    assert match, "no reads_open gauge in /metrics"
    return float(match[1])
