"""The Shard API and a member's HTTP API, over real gRPC/HTTP, a real KeySpace and broker.

KeySpace-only RPCs (List, Apply, GetHints, Unassign) run against a ShardAPI
serving no shards, with members and assignments written into the KeySpace as
an allocator writes them. Stat, the HTTP API and the end-to-end cases run
real Members (in this event loop) of a small word-count app on the shared
broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from google.protobuf.duration_pb2 import Duration

from streamkit.app.application import Application, QueryError
from streamkit.app.assignment import MemberId, assignment_key, member_key
from streamkit.app.config import AppConfig
from streamkit.app.deploy import ensure_shard_specs
from streamkit.app.member import Member, MemberOptions, deploy
from streamkit.app.member_apis import serve_member_apis
from streamkit.app.shard_api import ShardAPI
from streamkit.app.shard_ops import get_hints
from streamkit.client import BrokerClient
from streamkit.client.append_service import AppendService
from streamkit.keyspace import open_keyspace
from streamkit.keyspace.keyspace import KeySpace
from streamkit.message.publisher import Publisher
from streamkit.protocol import consumer_pb, pb
from streamkit.protocol import consumer_pb2_grpc as consumer_grpc
from streamkit.protocol import recoverylog_pb2 as rpb
from streamkit.protocol.labels import label_set, parse_selector
from tests.helpers_client import eventually

Code = consumer_pb.ReplicaStatus.Code
TIMEOUT = 30.0


# --- fixtures and helpers shared with test_cli_shards ----------------------------------------


def app_name() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def app_document(name: str, shards: int = 2, **extra: Any) -> dict[str, Any]:
    """A streamkit.yaml document whose journals no other test uses."""
    return {
        "name": name, "application": "app:WordCount", "shards": shards,
        "sources": [{"topic": f"{name}/lines", "partitions": shards, "key": "line"}],
        "outputs": [{"topic": f"{name}/counts", "partitions": 1, "key": "word"}],
        "store": {"kind": "rocksdb"},
        "transactions": {"max_duration": "100ms"},
        **extra,
    }


def app_config(tmp_path: Path, name: str, **extra: Any) -> AppConfig:
    return AppConfig.parse(app_document(name, **extra), app_dir=tmp_path)


class WordCount(Application):
    """Counts the words of {"line": ...}; publishes counts to the app's output topic.

    `gate` (when set) holds consume_message until opened; lines holding "poison"
    fail the shard while `poison` is true.
    """

    gate: asyncio.Event | None = None
    poison = False

    def __init__(self) -> None:
        self.deltas: dict[str, int] = {}

    async def consume_message(self, shard: Any, store: Any, envelope: Any,
                              publisher: Any) -> None:
        if WordCount.gate is not None:
            await WordCount.gate.wait()
        line = envelope.message["line"]
        if WordCount.poison and "poison" in line:
            raise ValueError("poisoned line")
        for word in line.split():
            self.deltas[word] = self.deltas.get(word, 0) + 1

    def finalize_txn(self, shard: Any, store: Any, publisher: Any) -> None:
        topic = shard.spec.sources[0].journal.rsplit("/", 2)[0] + "/counts"
        for word, delta in self.deltas.items():
            total = store.get(word, 0) + delta
            store.put(word, total)
            publisher.publish(topic, {"word": word, "count": total})
        self.deltas.clear()

    def query(self, shard: Any, store: Any, request: dict[str, Any]) -> Any:
        if "crash" in request:
            raise RuntimeError("query crashed")
        if "word" not in request:
            raise QueryError("a query needs a 'word'")
        return {"word": request["word"], "count": store.get(request["word"], 0)}


@pytest.fixture(autouse=True)
def _reset_wordcount() -> Iterator[None]:
    WordCount.gate, WordCount.poison = None, False
    yield
    WordCount.gate, WordCount.poison = None, False


@dataclass
class Running:
    """A member with its gRPC and HTTP APIs up."""

    member: Member
    server: grpc.aio.Server
    runner: Any
    port: int

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port + 1}"

    async def stop(self) -> None:
        await self.member.stop()
        await self.server.stop(0.5)
        await self.runner.cleanup()


@contextlib.asynccontextmanager
async def running_member(config: AppConfig, client: BrokerClient, keyspace_path: Path,
                         suffix: str, *, allocate: bool) -> AsyncIterator[Running]:
    keyspace = open_keyspace(str(keyspace_path))
    options = MemberOptions(work_dir=config.data_dir / "shards" / suffix, allocate=allocate,
                            suffix=suffix, lease_ttl=1.0, hint_interval=60.0)
    member = Member(config, WordCount, client, keyspace, options)
    server, runner, port = await serve_member_apis(member)
    running = Running(member, server, runner, port)
    try:
        await member.start()
        yield running
    finally:
        await running.stop()
        await keyspace.close()


async def publish_lines(client: BrokerClient, config: AppConfig,
                        lines: list[str]) -> dict[str, int]:
    """Publish committed lines to the app's source; the end offset per journal written."""
    ends: dict[str, int] = {}
    mapping = config.mapping_for(config.sources[0].topic)
    async with AppendService(client) as service:
        publisher = Publisher(service)
        futures = [await publisher.publish_committed(mapping, {"line": line}) for line in lines]
        for future in futures:
            response = await future
            ends[response.commit.journal] = max(ends.get(response.commit.journal, 0),
                                                response.commit.end)
    return ends


async def all_primary(member: Member, count: int) -> bool:
    replicas = member.service.replicas
    return len(replicas) == count and all(r.status.code == Code.PRIMARY
                                          for r in replicas.values())


@contextlib.asynccontextmanager
async def shard_stub(endpoint: str) -> AsyncIterator[consumer_grpc.ShardStub]:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        yield consumer_grpc.ShardStub(channel)


@contextlib.asynccontextmanager
async def keyspace_api(tmp_path: Path) -> AsyncIterator[tuple[KeySpace, str,
                                                                consumer_grpc.ShardStub]]:
    """A ShardAPI serving no shards over a fresh KeySpace: (keyspace, root, stub)."""
    keyspace = open_keyspace(str(tmp_path / "keyspace.db"))
    root = f"/gazette/consumers/{app_name()}"
    server = grpc.aio.server()
    consumer_grpc.add_ShardServicer_to_server(
        ShardAPI(keyspace, root, None, "grpc://127.0.0.1:1"), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with shard_stub(f"127.0.0.1:{port}") as stub:
            yield keyspace, root, stub
    finally:
        await server.stop(None)
        await keyspace.close()


def shard_spec(shard: str, **labels: str) -> consumer_pb.ShardSpec:
    spec = consumer_pb.ShardSpec(
        id=shard, recovery_log_prefix="recovery/x", hint_prefix="/hints", hint_backups=1,
        labels=label_set(*sorted(labels.items())), ring_buffer_size=8192,
        read_channel_size=8192,
    )
    spec.sources.add(journal=f"input/{shard}")
    spec.max_txn_duration.CopyFrom(Duration(seconds=1))
    return spec


async def add_member(keyspace: KeySpace, root: str, member: MemberId, endpoint: str) -> None:
    spec = consumer_pb.ConsumerSpec(process_spec=pb.ProcessSpec(
        id=pb.ProcessSpec.ID(zone=member.zone, suffix=member.suffix), endpoint=endpoint))
    await keyspace.put(member_key(root, member), spec.SerializeToString())


async def assign(keyspace: KeySpace, root: str, shard: str, member: MemberId, slot: int,
                 code: int, error: str = "") -> None:
    status = consumer_pb.ReplicaStatus(code=code, errors=[error] if error else [])
    await keyspace.put(assignment_key(root, shard, member, slot), status.SerializeToString())


def upsert(spec: consumer_pb.ShardSpec, revision: int) -> consumer_pb.ApplyRequest.Change:
    return consumer_pb.ApplyRequest.Change(expect_mod_revision=revision, upsert=spec)


# --- List, Apply, GetHints, Unassign over the KeySpace -------------------------------------------


async def test_list_selects_by_labels_and_id_with_routes(tmp_path: Path) -> None:
    async with keyspace_api(tmp_path) as (keyspace, root, stub):
        specs = [shard_spec("shard-a", app="x", tier="hot"), shard_spec("shard-b", app="x"),
                 shard_spec("shard-c", app="y")]
        response = await stub.Apply(consumer_pb.ApplyRequest(
            changes=[upsert(s, 0) for s in specs]))
        assert response.status == consumer_pb.OK
        m1, m2 = MemberId("z1", "mem1"), MemberId("z2", "mem2")
        await add_member(keyspace, root, m1, "grpc://127.0.0.1:7001")
        await add_member(keyspace, root, m2, "grpc://127.0.0.1:7002")
        await assign(keyspace, root, "shard-a", m2, 0, Code.PRIMARY)
        await assign(keyspace, root, "shard-a", m1, 1, Code.STANDBY)
        await assign(keyspace, root, "shard-b", m1, 1, Code.BACKFILL)  # no primary

        async def ids(selector: str) -> list[str]:
            listed = await stub.List(consumer_pb.ListRequest(selector=parse_selector(selector)))
            assert listed.status == consumer_pb.OK
            return [s.spec.id for s in listed.shards]

        assert await ids("") == ["shard-a", "shard-b", "shard-c"]
        assert await ids("app=x") == ["shard-a", "shard-b"]
        assert await ids("app=x, !tier") == ["shard-b"]
        assert await ids("id=shard-c") == ["shard-c"]
        assert await ids("id in (shard-a, shard-c), app=y") == ["shard-c"]
        assert await ids("app=none") == []

        listed = await stub.List(consumer_pb.ListRequest())
        a, b, c = listed.shards
        assert a.spec == specs[0] and a.mod_revision == a.create_revision > 0
        # Members in (zone, suffix) order, as Gazette's routes; `primary` indexes slot 0.
        assert [(m.zone, m.suffix) for m in a.route.members] == [("z1", "mem1"), ("z2", "mem2")]
        assert a.route.primary == 1
        assert list(a.route.endpoints) == ["grpc://127.0.0.1:7001", "grpc://127.0.0.1:7002"]
        assert [s.code for s in a.status] == [Code.STANDBY, Code.PRIMARY]
        assert b.route.primary == -1 and [s.code for s in b.status] == [Code.BACKFILL]
        assert not c.route.members and c.route.primary == -1 and not c.status
        assert listed.header.etcd.revision == await keyspace.revision()

        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.List(consumer_pb.ListRequest(selector=pb.LabelSelector(
                include=pb.LabelSet(labels=[pb.Label(name="x", value="bad value")]))))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "label" in (caught.value.details() or "")


async def test_apply_create_update_delete_with_revision_checks(tmp_path: Path) -> None:
    async with keyspace_api(tmp_path) as (keyspace, root, stub):
        async def apply(*changes: consumer_pb.ApplyRequest.Change) -> int:
            return (await stub.Apply(consumer_pb.ApplyRequest(changes=changes))).status

        async def listed() -> dict[str, consumer_pb.ListResponse.Shard]:
            return {s.spec.id: s for s in (await stub.List(consumer_pb.ListRequest())).shards}

        one, two = shard_spec("shard-1"), shard_spec("shard-2")
        assert await apply(upsert(one, 0)) == consumer_pb.OK
        assert await apply(upsert(one, 0)) == consumer_pb.ETCD_TRANSACTION_FAILED  # exists
        revision = (await listed())["shard-1"].mod_revision

        one.hot_standbys = 1
        # A stale revision fails the whole transaction: shard-2 isn't created either.
        assert await apply(upsert(one, revision + 100), upsert(two, 0)) == \
            consumer_pb.ETCD_TRANSACTION_FAILED
        assert set(await listed()) == {"shard-1"}
        assert await apply(upsert(one, revision), upsert(two, 0)) == consumer_pb.OK
        current = await listed()
        assert current["shard-1"].spec.hot_standbys == 1
        assert current["shard-1"].create_revision == revision
        assert current["shard-1"].mod_revision > revision

        two.disable = True
        assert await apply(upsert(two, -1)) == consumer_pb.OK  # -1: no check
        assert (await listed())["shard-2"].spec.disable

        delete = consumer_pb.ApplyRequest.Change(expect_mod_revision=revision, delete="shard-1")
        assert await apply(delete) == consumer_pb.ETCD_TRANSACTION_FAILED
        delete.expect_mod_revision = (await listed())["shard-1"].mod_revision
        assert await apply(delete) == consumer_pb.OK
        assert set(await listed()) == {"shard-2"}
        assert await keyspace.get(f"{root}/items/shard-1") is None


@pytest.mark.parametrize(("change", "message"), [
    (lambda: upsert(_without_max_txn(shard_spec("shard-1")), 0),
     'shard "shard-1": max_txn_duration'),
    (lambda: upsert(_with_labels(shard_spec("shard-1"), ("id", "x")), 0),
     'shard "shard-1": labels'),
    (lambda: upsert(consumer_pb.ShardSpec(id="a b"), 0), "id"),
    (lambda: consumer_pb.ApplyRequest.Change(delete="shard-1"), "needs its mod revision"),
    (lambda: consumer_pb.ApplyRequest.Change(expect_mod_revision=3), "exactly one of"),
    (lambda: consumer_pb.ApplyRequest.Change(expect_mod_revision=-5, delete="shard-1"),
     "expect_mod_revision must be >= -1"),
    (lambda: consumer_pb.ApplyRequest.Change(
        expect_mod_revision=0, upsert=shard_spec("shard-1"),
        primary_hints=rpb.FSMHints(log="recovery/other")), "primary_hints: log must be"),
])
async def test_apply_rejects_invalid_changes(tmp_path: Path, change: Any, message: str) -> None:
    async with keyspace_api(tmp_path) as (_keyspace, _root, stub):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Apply(consumer_pb.ApplyRequest(changes=[change()]))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (caught.value.details() or "")
        # Nothing was written, and the server goes on serving.
        assert not (await stub.List(consumer_pb.ListRequest())).shards
        with pytest.raises(grpc.aio.AioRpcError) as empty:
            await stub.Apply(consumer_pb.ApplyRequest())
        assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _without_max_txn(spec: consumer_pb.ShardSpec) -> consumer_pb.ShardSpec:
    spec.ClearField("max_txn_duration")
    return spec


def _with_labels(spec: consumer_pb.ShardSpec, *labels: tuple[str, str]) -> consumer_pb.ShardSpec:
    spec.labels.CopyFrom(label_set(*labels))
    return spec


async def test_apply_with_primary_hints_then_get_hints(tmp_path: Path) -> None:
    async with keyspace_api(tmp_path) as (keyspace, _root, stub):
        spec = shard_spec("shard-1")
        hints = rpb.FSMHints(log="recovery/x/shard-1", properties=[
            rpb.Property(path="/IDENTITY", content="abc")])
        response = await stub.Apply(consumer_pb.ApplyRequest(changes=[
            consumer_pb.ApplyRequest.Change(expect_mod_revision=0, upsert=spec,
                                            primary_hints=hints)]))
        assert response.status == consumer_pb.OK
        got = await stub.GetHints(consumer_pb.GetHintsRequest(shard="shard-1"))
        assert got.status == consumer_pb.OK
        assert got.primary_hints.hints == hints
        assert len(got.backup_hints) == 1 and not got.backup_hints[0].HasField("hints")

        missing = await stub.GetHints(consumer_pb.GetHintsRequest(shard="shard-9"))
        assert missing.status == consumer_pb.SHARD_NOT_FOUND
        await keyspace.put("/hints/shard-1.primary", b"{not json")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.GetHints(consumer_pb.GetHintsRequest(shard="shard-1"))
        assert caught.value.code() == grpc.StatusCode.DATA_LOSS
        assert "/hints/shard-1.primary" in (caught.value.details() or "")


async def test_unassign_failed_and_healthy_primaries(tmp_path: Path) -> None:
    async with keyspace_api(tmp_path) as (keyspace, root, stub):
        await stub.Apply(consumer_pb.ApplyRequest(changes=[
            upsert(shard_spec(s), 0) for s in ("shard-a", "shard-b", "shard-c")]))
        m1, m2 = MemberId("z", "mem1"), MemberId("z", "mem2")
        await assign(keyspace, root, "shard-a", m1, 0, Code.FAILED, "boom")
        await assign(keyspace, root, "shard-a", m2, 1, Code.STANDBY)
        await assign(keyspace, root, "shard-b", m2, 0, Code.PRIMARY)
        await assign(keyspace, root, "shard-b", m1, 1, Code.FAILED, "bad standby")
        await assign(keyspace, root, "shard-c", m2, 0, Code.PRIMARY)

        async def unassign(*shards: str, only_failed: bool = False,
                           dry_run: bool = False) -> consumer_pb.UnassignResponse:
            return await stub.Unassign(consumer_pb.UnassignRequest(
                shards=shards, only_failed=only_failed, dry_run=dry_run))

        async def assigned() -> list[str]:
            kvs, _ = await keyspace.range(f"{root}/assign/")
            return [kv.key.removeprefix(f"{root}/assign/") for kv in kvs]

        before = await assigned()
        dry = await unassign("shard-a", "shard-b", "shard-c", only_failed=True, dry_run=True)
        assert (dry.status, list(dry.shards)) == (consumer_pb.OK, ["shard-a", "shard-b"])
        assert await assigned() == before

        done = await unassign("shard-a", "shard-b", "shard-c", only_failed=True)
        assert list(done.shards) == ["shard-a", "shard-b"]
        assert await assigned() == ["shard-a#z#mem2#1", "shard-b#z#mem2#0", "shard-c#z#mem2#0"]

        healthy = await unassign("shard-c")  # a healthy primary goes without only_failed
        assert list(healthy.shards) == ["shard-c"]
        assert "shard-c#z#mem2#0" not in await assigned()
        nothing = await unassign("shard-b", only_failed=True)
        assert nothing.status == consumer_pb.OK and not nothing.shards

        assert (await unassign("shard-x", "shard-a")).status == consumer_pb.SHARD_NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await unassign()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# --- Stat, hints and unassign with real members ---------------------------------------------------


async def test_stat_waits_for_read_through_and_http_api(shared_broker: Any,
                                                        tmp_path: Path) -> None:
    config = app_config(tmp_path, app_name(), shards=2)
    WordCount.gate = asyncio.Event()
    async with BrokerClient(shared_broker.address) as client:
        keyspace = open_keyspace(str(tmp_path / "keyspace.db"))
        await deploy(config, client, keyspace)
        async with running_member(config, client, tmp_path / "keyspace.db", "solo",
                                  allocate=False) as running, shard_stub(running.endpoint) as stub:
            await eventually(lambda: all_primary(running.member, 2), TIMEOUT)
            ends = await publish_lines(client, config, ["a b", "b c", "c d", "d e"])
            shard = next(r for r in running.member.service.replicas.values()
                         if r.shard.sources[0] in ends)
            journal = shard.shard.sources[0]
            request = consumer_pb.StatRequest(shard=shard.id, read_through={
                journal: ends[journal], "not/a/source": 10**9})  # non-sources are ignored
            stat = asyncio.ensure_future(stub.Stat(request, timeout=TIMEOUT))
            # A negative check: the gate holds the shard, so nothing may answer meanwhile.
            await asyncio.sleep(0.5)
            assert not stat.done(), "Stat answered before the shard read through"
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Stat(request, timeout=0.3)
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            WordCount.gate.set()
            response = await stat
            assert response.status == consumer_pb.OK
            assert response.read_through[journal] >= ends[journal]
            assert set(response.publish_at) == {f"{config.name}/counts/part-000"}
            extension = json.loads(response.extension)
            assert extension["status"] == "PRIMARY"
            assert extension["transactions"] >= 1 and extension["messages"] >= 1
            assert extension["last_commit"] > 0
            assert (await stub.Stat(consumer_pb.StatRequest(shard="shard-999"))).status == \
                consumer_pb.SHARD_NOT_FOUND
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await stub.Stat(consumer_pb.StatRequest(shard=shard.id,
                                                        read_through={journal: -2}))
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            await _check_http(running, shard.id)
        await keyspace.close()


async def _check_http(running: Running, shard: str) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{running.http}/status") as answer:
            assert answer.status == 200
            status = {entry["id"]: entry for entry in await answer.json()}
        assert set(status) == {"shard-000", "shard-001"}
        entry = status[shard]
        assert entry["status"] == "PRIMARY" and entry["errors"] == []
        assert entry["transactions"] >= 1 and entry["last_commit"] > 0
        assert entry["read_through"] and entry["publish_at"]

        async def query(target: str, body: bytes) -> tuple[int, Any]:
            async with http.post(f"{running.http}/query/{target}", data=body) as answer:
                return answer.status, await answer.json()

        assert await query(shard, b'{"word": "c"}') == (200, {"word": "c", "count": 2})
        code, error = await query(shard, b"{nope")
        assert code == 400 and "not JSON" in error["error"]
        code, error = await query(shard, b"[1]")
        assert code == 400 and "JSON object" in error["error"]
        code, error = await query(shard, b"[" * 100_000)  # was a 500, a RecursionError logged
        assert code == 400 and "nested too deeply" in error["error"], error
        assert await query(shard, b"{}") == (400, {"error": "a query needs a 'word'"})
        code, error = await query(shard, b'{"crash": 1}')
        assert code == 500 and "RuntimeError: query crashed" in error["error"]
        code, error = await query("shard-404", b"{}")
        assert code == 404 and "shard-404" in error["error"]

        async with http.get(f"{running.http}/metrics") as answer:
            text = await answer.text()
        assert f'streamkit_shard_transactions_total{{shard="{shard}"}}' in text


async def test_stat_is_proxied_to_the_primary_member(shared_broker: Any, tmp_path: Path) -> None:
    config = app_config(tmp_path, app_name(), shards=2)
    path = tmp_path / "keyspace.db"
    async with BrokerClient(shared_broker.address) as client:
        keyspace = open_keyspace(str(path))
        await deploy(config, client, keyspace)
        async with running_member(config, client, path, "mem1", allocate=True) as one, \
                running_member(config, client, path, "mem2", allocate=True) as two:
            members = {"mem1": one, "mem2": two}

            async def settled() -> bool:
                mine = [r for m in members.values() for r in m.member.service.replicas.values()]
                return (len(mine) == 2 and all(r.status.code == Code.PRIMARY for r in mine)
                        and all(m.member.service.replicas for m in members.values()))

            await eventually(settled, TIMEOUT)
            ends = await publish_lines(client, config, [f"w{i}" for i in range(20)])
            for owner, other in (("mem1", two), ("mem2", one)):
                (shard_id,) = members[owner].member.service.replicas
                replica = members[owner].member.service.replicas[shard_id]
                journal = replica.shard.sources[0]
                request = consumer_pb.StatRequest(shard=shard_id,
                                                  read_through={journal: ends.get(journal, 0)})
                async with shard_stub(other.endpoint) as stub:
                    response = await stub.Stat(request, timeout=TIMEOUT)
                    assert response.status == consumer_pb.OK
                    assert response.header.process_id.suffix == owner  # answered by the primary
                    assert response.read_through[journal] >= ends.get(journal, 0)
                    assert json.loads(response.extension)["status"] == "PRIMARY"
                    # A request that was already forwarded isn't forwarded again.
                    request.header.process_id.suffix = "someone"
                    again = await stub.Stat(request, timeout=TIMEOUT)
                    assert again.status == consumer_pb.NOT_SHARD_PRIMARY
                    assert again.header.route.members[0].suffix == owner
        await keyspace.close()


async def test_get_hints_after_primary_wrote_them(shared_broker: Any, tmp_path: Path) -> None:
    config = app_config(tmp_path, app_name(), shards=1)
    path = tmp_path / "keyspace.db"
    async with BrokerClient(shared_broker.address) as client:
        keyspace = open_keyspace(str(path))
        await deploy(config, client, keyspace)
        async with running_member(config, client, path, "solo", allocate=False) as running:
            await eventually(lambda: all_primary(running.member, 1), TIMEOUT)
            await publish_lines(client, config, ["x y z"])
            await eventually(lambda: running.member.service.replicas["shard-000"]
                             .shard.transactions >= 1, TIMEOUT)
            async with shard_stub(running.endpoint) as stub:
                live = await stub.GetHints(consumer_pb.GetHintsRequest(shard="shard-000"))
                # Recovery pushed the hints it recovered with to backup 0.
                assert live.backup_hints[0].hints.log == f"recovery/{config.name}/shard-000"
        # Stopping, the primary wrote its final hints.
        stored = await get_hints(keyspace, config.keyspace_root, "shard-000")
        assert stored.status == consumer_pb.OK
        assert stored.primary_hints.hints.log == f"recovery/{config.name}/shard-000"
        assert stored.primary_hints.hints.live_nodes, "the store's files are hinted"
        assert len(stored.backup_hints) == 2
        await keyspace.close()


async def test_unassign_restarts_a_failed_shard(shared_broker: Any, tmp_path: Path) -> None:
    config = app_config(tmp_path, app_name(), shards=1)
    path = tmp_path / "keyspace.db"
    WordCount.poison = True
    async with BrokerClient(shared_broker.address) as client:
        keyspace = open_keyspace(str(path))
        await deploy(config, client, keyspace)
        async with running_member(config, client, path, "solo", allocate=True) as running, \
                shard_stub(running.endpoint) as stub:
            await eventually(lambda: all_primary(running.member, 1), TIMEOUT)
            ends = await publish_lines(client, config, ["poison pill", "good words"])

            async def listed_status() -> consumer_pb.ReplicaStatus | None:
                shards = (await stub.List(consumer_pb.ListRequest())).shards
                return shards[0].status[0] if shards[0].status else None

            async def failed() -> bool:
                status = await listed_status()
                return status is not None and status.code == Code.FAILED

            await eventually(failed, TIMEOUT)
            assert "poisoned line" in (await listed_status()).errors[0]  # type: ignore[union-attr]
            WordCount.poison = False
            response = await stub.Unassign(consumer_pb.UnassignRequest(shards=["shard-000"],
                                                                        only_failed=True))
            assert list(response.shards) == ["shard-000"]
            # The leader assigns it again (until then there's no primary: a transient
            # NO_SHARD_PRIMARY), and the new primary gets past the bad line.
            request = consumer_pb.StatRequest(shard="shard-000", read_through=ends)
            answers: list[int] = []

            async def answered() -> bool:
                answers.append((await stub.Stat(request, timeout=TIMEOUT)).status)
                return answers[-1] == consumer_pb.OK

            await eventually(answered, TIMEOUT)
            assert set(answers) <= {consumer_pb.OK, consumer_pb.NO_SHARD_PRIMARY}
            assert (await listed_status()).code == Code.PRIMARY  # type: ignore[union-attr]
            replica = running.member.service.replicas["shard-000"]
            assert await replica.query({"word": "good"}) == {"word": "good", "count": 1}
        await keyspace.close()


async def test_serve_member_apis_on_a_given_port_pair(shared_broker: Any, tmp_path: Path) -> None:
    """Ports given: HTTP on the next one; taken ports are an OSError, not a hang."""
    from tests.brokerproc import free_port

    config = app_config(tmp_path, app_name(), shards=1)
    async with BrokerClient(shared_broker.address) as client:
        keyspace = open_keyspace(str(tmp_path / "keyspace.db"))
        await ensure_shard_specs(keyspace, config.keyspace_root, config.shard_specs())
        member = Member(config, WordCount, client, keyspace,
                        MemberOptions(work_dir=tmp_path / "w", allocate=False))
        port = free_port()
        server, runner, bound = await serve_member_apis(member, port=port)
        try:
            assert bound == port and member.options.endpoint == f"grpc://127.0.0.1:{port}"
            async with aiohttp.ClientSession() as http, \
                    http.get(f"http://127.0.0.1:{port + 1}/status") as answer:
                assert await answer.json() == []
            other = Member(config, WordCount, client, keyspace,
                           MemberOptions(work_dir=tmp_path / "v", allocate=False))
            with pytest.raises(OSError):
                await serve_member_apis(other, port=port)
        finally:
            await server.stop(None)
            await runner.cleanup()
            await keyspace.close()
