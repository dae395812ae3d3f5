"""Pieces the benchmark scripts share."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import platform
import tempfile
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from google.protobuf.duration_pb2 import Duration

from streamkit.auth import ClientTls, parse_keys
from streamkit.auth.settings import Security
from streamkit.client import BrokerClient, apply_journals
from streamkit.protocol import pb
from streamkit.recoverylog import CONTENT_TYPE
from tests.brokerproc import BrokerProcess
from tests.bytecode import compile_bytecode

# The processes a benchmark starts import streamkit from bytecode, as an installed
# streamkit does (see tests/bytecode.py).
compile_bytecode()

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
    main: Callable[[BrokerProcess, Path], Coroutine[Any, Any, T]], *, secure: bool = False
) -> T:
    """Run `main(broker, tmp)` against a fresh broker whose data lives in temp dir `tmp`
    (with `secure`, serving TLS and requiring tokens: see `secure_files`)."""
    with tempfile.TemporaryDirectory(prefix="streamkit-bench-") as tmp:
        env = secure_files(Path(tmp)) if secure else {}
        broker = BrokerProcess(Path(tmp) / "broker", env=env).start()
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


# --- --secure: TLS and auth tokens on ---------------------------------------------------------

BENCH_KEYS = base64.b64encode(b"streamkit broker benchmark key!!").decode()


def secure_files(tmp: Path) -> dict[str, str]:
    """Make a CA and a certificate for 127.0.0.1 in `tmp`; the environment that turns TLS
    and tokens on for `broker serve`, `run` and `serve` (and is what they pass on)."""
    from tests.test_auth_tls import make_pki  # the test extra's `cryptography`

    (tmp / "pki").mkdir(exist_ok=True)
    pki = make_pki(tmp / "pki")
    return {"AUTH_KEYS": BENCH_KEYS, "STREAMKIT_TLS_CERT": str(pki.server_cert),
            "STREAMKIT_TLS_KEY": str(pki.server_key), "STREAMKIT_TLS_CA": str(pki.ca)}


def bench_security(tmp: Path) -> Security:
    """The client side of `secure_files(tmp)`: the keys, and the CA to trust."""
    return Security(keys=parse_keys(BENCH_KEYS), client_tls=ClientTls(ca=tmp / "pki" / "ca.pem"))
