"""Starting members' APIs: real gRPC and HTTP servers on 127.0.0.1, their ports bound for real.

Members started at once, in this event loop and in other processes, each get
a pair of ports of their own (gRPC, and HTTP on the next), and a member asked
for a port that overlaps a running member's pair fails with OSError instead
of sharing it. Which member answers on a port is told by its Stat answer,
whose header names the member (the shard has no primary: no member runs).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from streamkit.app.config import AppConfig
from streamkit.app.deploy import ensure_shard_specs
from streamkit.app.member import Member, MemberOptions
from streamkit.app.member_apis import MemberAPIs, serve_member_apis
from streamkit.client import BrokerClient
from streamkit.keyspace import open_keyspace
from streamkit.keyspace.keyspace import KeySpace
from streamkit.protocol import consumer_pb
from streamkit.protocol import consumer_pb2_grpc as consumer_grpc
from tests.test_shard_api import WordCount, app_document, app_name

PROGRAM = Path(__file__).resolve().parent / "programs" / "member_apis.py"
IN_PROCESS = 4
PROCESSES = 2  # each takes seconds to import streamkit
TIMEOUT = 30.0


def _member(config: AppConfig, client: BrokerClient, keyspace: KeySpace, work_dir: Path) -> Member:
    options = MemberOptions(work_dir=work_dir, allocate=False, suffix=work_dir.name)
    return Member(config, WordCount, client, keyspace, options)


async def _answering_member(port: int) -> str:
    """The suffix of the member whose Shard API answers on `port`."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        response = await consumer_grpc.ShardStub(channel).Stat(
            consumer_pb.StatRequest(shard="shard-000"), timeout=TIMEOUT
        )
    assert response.status == consumer_pb.NO_SHARD_PRIMARY
    return response.header.process_id.suffix


async def _http_status(port: int) -> Any:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}/status") as answer,
    ):
        assert answer.status == 200
        return await answer.json()


async def _start_process(
    document: dict[str, Any], keyspace: Path, work_dir: Path, broker: str
) -> asyncio.subprocess.Process:
    """A member process, ready to start its APIs on port 0 when it reads a line."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(PROGRAM),
        json.dumps(document),
        str(keyspace),
        str(work_dir),
        broker,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert await _line(proc) == "ready"
    return proc


async def _line(proc: asyncio.subprocess.Process) -> str:
    assert proc.stdout is not None
    return (await asyncio.wait_for(proc.stdout.readline(), TIMEOUT)).decode().strip()


async def _stop_process(proc: asyncio.subprocess.Process) -> int:
    assert proc.stdin is not None
    proc.stdin.close()
    return await asyncio.wait_for(proc.wait(), TIMEOUT)


@pytest.fixture
async def app(shared_broker: Any, tmp_path: Path) -> Any:
    """(document, config, keyspace path, client, keyspace) of an app with one shard spec."""
    document = app_document(app_name(), shards=1)
    config = AppConfig.parse(document, app_dir=tmp_path)
    path = tmp_path / "keyspace.db"
    async with BrokerClient(shared_broker.address) as client, open_keyspace(str(path)) as ks:
        await ensure_shard_specs(ks, config.keyspace_root, config.shard_specs())
        yield document, config, path, client, ks


async def test_members_started_at_once_get_ports_of_their_own(
    app: Any, shared_broker: Any, tmp_path: Path
) -> None:
    document, config, path, client, keyspace = app
    members = [_member(config, client, keyspace, tmp_path / f"m{i}") for i in range(IN_PROCESS)]
    procs: list[asyncio.subprocess.Process] = []
    started: list[MemberAPIs] = []
    try:
        spawned = await asyncio.gather(
            *(
                _start_process(document, path, tmp_path / f"p{i}", shared_broker.address)
                for i in range(PROCESSES)
            ),
            return_exceptions=True,
        )
        procs = [p for p in spawned if isinstance(p, asyncio.subprocess.Process)]
        assert len(procs) == PROCESSES, spawned
        # All at once: the other processes bind while this one does.
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
        results = await asyncio.gather(
            *(serve_member_apis(m) for m in members), return_exceptions=True
        )
        started = [r for r in results if isinstance(r, MemberAPIs)]
        lines = [await _line(proc) for proc in procs]
        assert len(started) == IN_PROCESS, results
        assert all(line.isdigit() for line in lines), lines

        owners = {int(line): f"p{i}" for i, line in enumerate(lines)}
        owners.update({apis.port: f"m{i}" for i, apis in enumerate(started)})
        assert len(owners) == IN_PROCESS + PROCESSES, "two members got the same gRPC port"
        taken = [p for port in owners for p in (port, port + 1)]
        assert len(set(taken)) == len(taken), f"a member's HTTP port is another's: {taken}"
        for member, apis in zip(members, started, strict=True):
            assert apis.http_port == apis.port + 1
            assert member.options.endpoint == f"grpc://127.0.0.1:{apis.port}"
        for port, owner in owners.items():
            assert await _answering_member(port) == owner
            assert await _http_status(port + 1) == []
    finally:
        for apis in started:
            await apis.stop(None)
        codes = [await _stop_process(proc) for proc in procs]
    assert codes == [0] * PROCESSES


async def test_a_port_overlapping_a_running_members_pair_is_refused(
    app: Any, tmp_path: Path
) -> None:
    _, config, _, client, keyspace = app
    running = await serve_member_apis(_member(config, client, keyspace, tmp_path / "first"))
    try:
        port = running.port
        for taken in (port - 1, port, port + 1):  # its HTTP port, both, its gRPC port
            other = _member(config, client, keyspace, tmp_path / f"at{taken}")
            with pytest.raises(OSError, match=r"cannot listen on 127\.0\.0\.1:"):
                await serve_member_apis(other, port=taken)
            assert other.options.endpoint == ""
        # The running member kept both ports and serves on.
        assert await _answering_member(port) == "first"
        assert await _http_status(port + 1) == []
    finally:
        await running.stop(None)


async def test_http_api_started_without_waiting_serves_once_ready_and_stops_while_starting(
    app: Any, tmp_path: Path
) -> None:
    """`wait_http=False` (what `run` and `serve` use, so the member's start overlaps aiohttp's
    import): the HTTP port listens at once and answers once `ready()` returned; stopping a
    member whose HTTP API is still starting stops it too (no thread left serving)."""
    _, config, _, client, keyspace = app
    apis = await serve_member_apis(_member(config, client, keyspace, tmp_path / "lazy"),
                                   wait_http=False)
    try:
        asking = asyncio.create_task(_http_status(apis.http_port))  # waits in the backlog
        await apis.runner.ready()
        assert await asyncio.wait_for(asking, TIMEOUT) == []
    finally:
        await apis.stop(None)
    quick = await serve_member_apis(_member(config, client, keyspace, tmp_path / "quick"),
                                    wait_http=False)
    thread = quick.runner._thread  # type: ignore[attr-defined]
    await quick.runner.cleanup()  # at once, likely before its thread served
    await quick.server.stop(None)
    assert not thread.is_alive(), "stopping should wait for the HTTP API's thread to end"
    with pytest.raises(aiohttp.ClientConnectionError):
        await _http_status(quick.http_port)


async def test_ports_out_of_range_are_refused(app: Any, tmp_path: Path) -> None:
    _, config, _, client, keyspace = app
    member = _member(config, client, keyspace, tmp_path / "m")
    for port in (-1, 65535):
        with pytest.raises(ValueError, match="port must be"):
            await serve_member_apis(member, port=port)


async def test_a_kernel_port_whose_neighbour_is_taken_is_passed_over_quietly(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Port 0: the kernel picks the HTTP port, the gRPC one is the port below. When that is
    taken the pair is given up before gRPC tries it (gRPC's core would print its failure
    on stderr, in the middle of `streamkit run`'s output)."""
    from streamkit.app import member_apis
    from streamkit.auth.settings import Security
    from streamkit.sockets import listen

    taken = []

    def http_above_a_taken_port(host: str, port: int) -> Any:
        while True:
            http = listen(host, port)
            try:
                taken.append(listen(host, http.getsockname()[1] - 1))
                return http
            except OSError:
                http.close()

    monkeypatch.setattr(member_apis, "listen", http_above_a_taken_port)
    try:
        assert await member_apis._bind_pair("127.0.0.1", 0, Security()) is None
        assert "Failed to add port" not in capfd.readouterr().err
    finally:
        for sock in taken:
            sock.close()
