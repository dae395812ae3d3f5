"""StatClient and Stat routing, over real Shard API servers and a real KeySpace.

The servers run no shards (a ShardAPI without a Service), so what they answer
tells who answered: a member that is the shard's primary per the KeySpace but
runs no replica says NOT_SHARD_PRIMARY with its own id in the header.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from streamkit.app.assignment import MemberId
from streamkit.app.shard_api import ShardAPI
from streamkit.app.shard_ops import apply_shards, read_state
from streamkit.app.stat_client import Primary, StatClient, find_primary, forwarded
from streamkit.keyspace import open_keyspace
from streamkit.keyspace.keyspace import KeySpace
from streamkit.protocol import consumer_pb
from streamkit.protocol import consumer_pb2_grpc as consumer_grpc
from tests.test_shard_api import add_member, app_name, assign, shard_spec, shard_stub, upsert

Code = consumer_pb.ReplicaStatus.Code
TIMEOUT = 10.0
A, B = MemberId("z", "mem-a"), MemberId("z", "mem-b")


@contextlib.asynccontextmanager
async def shard_api(keyspace: KeySpace, root: str, member: MemberId) -> AsyncIterator[str]:
    """A member's Shard API serving no shards, announced in the KeySpace; its endpoint."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    port = server.add_insecure_port("127.0.0.1:0")
    endpoint = f"grpc://127.0.0.1:{port}"
    api = ShardAPI(keyspace, root, None, endpoint, member)
    consumer_grpc.add_ShardServicer_to_server(api, server)
    await server.start()
    await add_member(keyspace, root, member, endpoint)
    try:
        yield endpoint
    finally:
        await server.stop(None)
        await api.close()


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[tuple[KeySpace, str]]:
    """A KeySpace holding one shard spec, shard-1: (keyspace, root)."""
    root = f"/gazette/consumers/{app_name()}"
    async with open_keyspace(str(tmp_path / "keyspace.db")) as keyspace:
        response = await apply_shards(keyspace, root, [upsert(shard_spec("shard-1"), 0)])
        assert response.status == consumer_pb.OK
        yield keyspace, root


async def test_find_primary_and_forwarded(app: tuple[KeySpace, str]) -> None:
    keyspace, root = app
    await add_member(keyspace, root, A, "grpc://127.0.0.1:7001")
    await assign(keyspace, root, "shard-1", A, 1, Code.STANDBY)
    assert find_primary(await read_state(keyspace, root), "shard-1") is None  # no primary
    assert find_primary(await read_state(keyspace, root), "shard-9") is None  # no shard

    await assign(keyspace, root, "shard-1", B, 0, Code.PRIMARY)  # B never announced itself
    assert find_primary(await read_state(keyspace, root), "shard-1") is None
    await add_member(keyspace, root, B, "grpc://127.0.0.1:7002")
    state = await read_state(keyspace, root)
    assert find_primary(state, "shard-1") == Primary(B, "grpc://127.0.0.1:7002")

    request = consumer_pb.StatRequest(shard="shard-1", read_through={"j": 5})
    marked = forwarded(request, state, B)
    assert not request.HasField("header"), "the caller's request is left as it was"
    assert marked.read_through == {"j": 5} and marked.HasField("header")
    assert marked.header.process_id.suffix == "mem-b"
    assert marked.header.etcd.revision == state.revision
    assert [m.suffix for m in marked.header.route.members] == ["mem-a", "mem-b"]


async def test_one_channel_per_member_and_dead_ones_dropped(app: tuple[KeySpace, str]) -> None:
    keyspace, root = app
    request = consumer_pb.StatRequest(shard="shard-1")
    async with StatClient() as stats:
        async with shard_api(keyspace, root, A) as endpoint, shard_api(keyspace, root, B) as other:
            for target, suffix in ((endpoint, "mem-a"), (other, "mem-b"), (endpoint, "mem-a"),
                                   (other, "mem-b")):
                answer = await stats.stat(target, request, timeout=TIMEOUT)
                assert answer.status == consumer_pb.NO_SHARD_PRIMARY
                assert answer.header.process_id.suffix == suffix
            assert sorted(stats.endpoints) == sorted(
                e.removeprefix("grpc://") for e in (endpoint, other)
            )
        with pytest.raises(grpc.aio.AioRpcError) as caught:  # both servers are gone
            await stats.stat(endpoint, request, timeout=TIMEOUT)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert stats.endpoints == [other.removeprefix("grpc://")]
    assert stats.endpoints == []


async def test_a_member_forwards_stat_to_the_primary_once(app: tuple[KeySpace, str]) -> None:
    keyspace, root = app
    async with shard_api(keyspace, root, A) as endpoint, shard_api(keyspace, root, B) as primary:
        await assign(keyspace, root, "shard-1", B, 0, Code.PRIMARY)
        async with shard_stub(endpoint.removeprefix("grpc://")) as stub:
            request = consumer_pb.StatRequest(shard="shard-1")
            for _ in range(2):
                answer = await stub.Stat(request, timeout=TIMEOUT)
                # B answered (as primary without a replica), and didn't send it back to A.
                assert answer.status == consumer_pb.NOT_SHARD_PRIMARY
                assert answer.header.process_id.suffix == "mem-b"
            state = await read_state(keyspace, root)
            again = await stub.Stat(forwarded(request, state, B), timeout=TIMEOUT)
            assert again.status == consumer_pb.NOT_SHARD_PRIMARY  # A doesn't forward it on
            assert again.header.process_id.suffix == "mem-a"
    # B stays announced as the primary, but its server is gone.
    async with (
        shard_api(keyspace, root, A) as endpoint,
        shard_stub(endpoint.removeprefix("grpc://")) as stub,
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Stat(consumer_pb.StatRequest(shard="shard-1"), timeout=TIMEOUT)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"forwarding Stat of shard-1 to its primary {B} at {primary}" in (
        caught.value.details() or ""
    )
