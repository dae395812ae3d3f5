"""Which gRPC status a Shard API failure gets, over real members, KeySpace and broker.

Only a request the checks reject is INVALID_ARGUMENT. A ValueError from
anywhere else — here the application's `read_through` hook — is the server's
failure: INTERNAL, logged with its traceback, and the member serves on. A
member forwarding Stat to the shard's primary passes the primary's status on.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from streamkit.app.config import AppConfig
from streamkit.app.member import Member, MemberOptions, deploy
from streamkit.app.member_apis import MemberAPIs, serve_member_apis
from streamkit.app.shard_ops import BadRequest, CorruptHints
from streamkit.client import BrokerClient
from streamkit.errors import StreamkitError
from streamkit.keyspace import open_keyspace
from streamkit.protocol import consumer_pb
from tests.helpers_client import eventually
from tests.test_shard_api import (
    TIMEOUT,
    WordCount,
    all_primary,
    app_config,
    app_name,
    shard_stub,
)

BROKEN = "broken/alias"  # a journal name the application's read_through fails on


class BrokenAliases(WordCount):
    """read_through raises ValueError for BROKEN: a bug of the application, not the client's."""

    def read_through(self, shard: Any, store: Any, offsets: dict[str, int]) -> dict[str, int]:
        if BROKEN in offsets:
            raise ValueError(f"no source journal is aliased {BROKEN!r}")
        return offsets


@contextlib.asynccontextmanager
async def member_with_apis(
    config: AppConfig, client: BrokerClient, keyspace_path: Path, suffix: str, *, allocate: bool
) -> AsyncIterator[tuple[Member, MemberAPIs]]:
    keyspace = open_keyspace(str(keyspace_path))
    options = MemberOptions(
        work_dir=config.data_dir / "shards" / suffix,
        allocate=allocate,
        suffix=suffix,
        lease_ttl=1.0,
        hint_interval=60.0,
    )
    member = Member(config, BrokenAliases, client, keyspace, options)
    apis = await serve_member_apis(member)
    try:
        await member.start()
        yield member, apis
    finally:
        await member.stop()
        await apis.stop(0.5)
        await keyspace.close()


def test_request_errors_are_streamkit_errors() -> None:
    assert issubclass(BadRequest, StreamkitError) and issubclass(BadRequest, ValueError)
    assert issubclass(CorruptHints, StreamkitError) and not issubclass(CorruptHints, ValueError)


async def test_a_value_error_of_the_app_is_internal_not_invalid_argument(
    shared_broker: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = app_config(tmp_path, app_name(), shards=1)
    path = tmp_path / "keyspace.db"
    async with BrokerClient(shared_broker.address) as client:
        async with open_keyspace(str(path)) as keyspace:
            await deploy(config, client, keyspace)
        async with (
            member_with_apis(config, client, path, "solo", allocate=False) as (member, apis),
            shard_stub(f"127.0.0.1:{apis.port}") as stub,
        ):
            await eventually(lambda: all_primary(member, 1), TIMEOUT)
            caplog.set_level(logging.ERROR, logger="streamkit.app.shard_api")
            broken = consumer_pb.StatRequest(shard="shard-000", read_through={BROKEN: 1})
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Stat(broken, timeout=TIMEOUT)
            assert caught.value.code() == grpc.StatusCode.INTERNAL
            assert "ValueError: no source journal is aliased" in (caught.value.details() or "")
            logged = [r for r in caplog.records if r.name == "streamkit.app.shard_api"]
            assert logged and logged[0].exc_info is not None, "the failure was not logged"
            assert "Stat of shard-000" in logged[0].getMessage()

            # A malformed request is still the client's mistake...
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await stub.Stat(consumer_pb.StatRequest(shard="shard-000", read_through={"x": -1}))
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # ...and the member serves on.
            fine = await stub.Stat(consumer_pb.StatRequest(shard="shard-000"), timeout=TIMEOUT)
            assert fine.status == consumer_pb.OK


async def test_a_forwarded_stat_passes_the_primarys_failure_on(
    shared_broker: Any, tmp_path: Path
) -> None:
    config = app_config(tmp_path, app_name(), shards=2)
    path = tmp_path / "keyspace.db"
    async with BrokerClient(shared_broker.address) as client:
        async with open_keyspace(str(path)) as keyspace:
            await deploy(config, client, keyspace)
        async with (
            member_with_apis(config, client, path, "mem1", allocate=True) as one,
            member_with_apis(config, client, path, "mem2", allocate=True) as two,
        ):
            members = [one, two]

            async def settled() -> bool:
                return all([await all_primary(m, 1) for m, _ in members])

            await eventually(settled, TIMEOUT)
            for (owner, _), (_, other) in ((one, two), (two, one)):
                (shard,) = owner.service.replicas
                async with shard_stub(f"127.0.0.1:{other.port}") as stub:
                    for _ in range(2):  # the second goes over the member's cached channel
                        answer = await stub.Stat(
                            consumer_pb.StatRequest(shard=shard), timeout=TIMEOUT
                        )
                        assert answer.status == consumer_pb.OK
                        assert answer.header.process_id.suffix == owner.options.suffix
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await stub.Stat(
                            consumer_pb.StatRequest(shard=shard, read_through={BROKEN: 1}),
                            timeout=TIMEOUT,
                        )
                    assert caught.value.code() == grpc.StatusCode.INTERNAL
                    details = caught.value.details() or ""
                    assert f"forwarding Stat of {shard} to its primary" in details
                    assert "ValueError" in details
