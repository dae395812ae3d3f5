"""The consumer runtime's core against a real broker: transactions, checkpoints, recovery.

These tests build Runtimes by hand (no streamkit.yaml), so they pin the core's
behaviour independent of configuration: exact state after restarts, ACKs,
read-committed output, a raising application.
"""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.duration_pb2 import Duration

from streamkit.app.application import Application, batch_hook
from streamkit.app.replica import Runtime
from streamkit.app.service import Service
from streamkit.app.store_kinds import build_store
from streamkit.client import BrokerClient
from streamkit.client.append_service import AppendService, OpFuture
from streamkit.keyspace import open_keyspace
from streamkit.message.mapping import StaticPartitions, field_key, modulo_mapping
from streamkit.message.publisher import Publisher
from streamkit.message.reader import ReadCommitted
from streamkit.protocol import consumer_pb, pb
from tests.helpers_client import create_journal, eventually, unique_name
from tests.waiting import LIVENESS

NDJSON = {"content-type": "application/x-ndjson"}
RECOVERY = {"content-type": "application/x-gazette-recoverylog"}
Code = consumer_pb.ReplicaStatus.Code


class WordCount(Application):
    """Counts words of {"line": ...} messages; publishes each touched word's count per txn."""

    def __init__(self) -> None:
        self.deltas: dict[str, int] = {}
        self.fail_on: str | None = None

    def consume_message(self, shard: Any, store: Any, envelope: Any, publisher: Any) -> None:
        line = envelope.message["line"]
        if self.fail_on is not None and self.fail_on in line:
            raise ValueError(f"cannot count {self.fail_on!r}")
        for word in line.split():
            self.deltas[word] = self.deltas.get(word, 0) + 1

    def finalize_txn(self, shard: Any, store: Any, publisher: Any) -> None:
        for word, delta in self.deltas.items():
            total = store.get(word, 0) + delta
            store.put(word, total)
            publisher.publish("counts", {"word": word, "count": total, "shard": shard.id})
        self.deltas.clear()

    def query(self, shard: Any, store: Any, request: dict[str, Any]) -> Any:
        return store.get(request["word"], 0)


async def _journals(client: BrokerClient, base: str, shards: int) -> dict[str, Any]:
    inputs = [f"{base}/lines/part-{i:03d}" for i in range(shards)]
    outputs = [f"{base}/counts/part-{i:03d}" for i in range(2)]
    for name in inputs + outputs:
        await create_journal(client, name, labels=NDJSON)
    for i in range(shards):
        await create_journal(client, f"{base}/recovery/shard-{i:03d}", labels=RECOVERY)
    return {"inputs": inputs, "outputs": outputs}


def _specs(base: str, inputs: list[str], max_txn: float = 0.2) -> dict[str, consumer_pb.ShardSpec]:
    specs = {}
    for i, journal in enumerate(inputs):
        spec = consumer_pb.ShardSpec(
            id=f"shard-{i:03d}", recovery_log_prefix=f"{base}/recovery",
            hint_prefix=f"/{base}/hints", hint_backups=2,
        )
        spec.sources.add(journal=journal)
        spec.max_txn_duration.CopyFrom(Duration(nanos=int(max_txn * 1e9)))
        specs[spec.id] = spec
    return specs


def _runtime(app: type[Application], client: BrokerClient, tmp: Path, outputs: list[str],
             kind: str = "rocksdb") -> Runtime:
    partitions = StaticPartitions([pb.ListResponse.Journal(spec=pb.JournalSpec(
        name=name, labels=pb.LabelSet(labels=[pb.Label(name="content-type",
                                                       value=NDJSON["content-type"])])))
        for name in outputs])
    mapping = modulo_mapping(field_key("word"), partitions)
    return Runtime(
        app_factory=app, client=client,
        keyspace=None if os.environ.get("NOHINTS") else open_keyspace(str(tmp / "keyspace.db")),
        work_dir=tmp / "work", mappings=lambda topic: mapping,
        store_factory=lambda shard, fs, state: build_store(kind, shard, fs, initial_state=state),
        keyspace_root="/test", hint_interval=0.5,
    )


async def _publish_lines(client: BrokerClient, inputs: list[str], lines: list[str]) -> None:
    partitions = StaticPartitions([pb.ListResponse.Journal(spec=pb.JournalSpec(
        name=name, labels=pb.LabelSet(labels=[pb.Label(name="content-type",
                                                       value=NDJSON["content-type"])])))
        for name in inputs])
    mapping = modulo_mapping(field_key("line"), partitions)
    async with AppendService(client) as service:
        publisher = Publisher(service)
        for line in lines:
            await publisher.publish_committed(mapping, {"line": line})


async def _read_counts(client: BrokerClient, outputs: list[str]) -> dict[str, int]:
    """Words' counts from the committed updates: the latest of each shard, summed."""
    latest: dict[tuple[str, str], int] = {}
    for journal in outputs:
        reader = ReadCommitted(client, journal, block=False)
        async for env in reader:
            key = (env.message["shard"], env.message["word"])
            assert env.message["count"] > latest.get(key, 0), f"update {key} repeated"
            latest[key] = env.message["count"]
        reader.close()
    totals: dict[str, int] = {}
    for (_, word), count in latest.items():
        totals[word] = totals.get(word, 0) + count
    return totals


def _expected(lines: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in lines:
        for word in line.split():
            counts[word] = counts.get(word, 0) + 1
    return counts


async def _wait_processed(service: Service, client: BrokerClient, inputs: list[str]) -> None:
    from streamkit.client.listing import list_journals  # noqa: F401 - heads via a read
    heads = {}
    for journal in inputs:
        reader = ReadCommitted(client, journal, block=False)
        async for _ in reader:
            pass
        heads[journal] = reader.uncommitted.offset
        reader.close()
    for replica in service.replicas.values():
        wanted = {j: heads[j] for j in replica.shard.sources}
        waiting = asyncio.ensure_future(replica.shard.progress.wait_for(wanted))
        await asyncio.wait([waiting, asyncio.ensure_future(replica.wait())], timeout=30,
                           return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        assert replica.status.code == Code.PRIMARY, replica.status
        assert replica.shard.progress.covers(wanted)


@pytest.mark.parametrize("kind", ["rocksdb", "json", "sqlite", "batch"])
async def test_counts_exact_across_restarts(shared_broker: Any, tmp_path: Path, kind: str) -> None:
    """Also with a batch hook (`consume_messages`), which must get the lines in lists."""
    words = [f"w{i}" for i in range(50)]
    batches = [[" ".join(words[(b * 7 + i * 3 + k) % 50] for k in range(1 + i % 5))
                for i in range(300)] for b in range(3)]
    async with BrokerClient(shared_broker.address) as client:
        base = unique_name("app")
        journals = await _journals(client, base, 2)
        specs = _specs(base, journals["inputs"])
        published: list[str] = []
        app = globals()[APPS[kind]]
        for batch in batches:  # each round: publish, run a fresh service, stop it gracefully
            await _publish_lines(client, journals["inputs"], batch)
            published += batch
            store = "rocksdb" if kind == "batch" else kind
            service = Service(_runtime(app, client, tmp_path, journals["outputs"], store))
            await service.assign(specs, {sid: 0 for sid in specs})
            await _wait_processed(service, client, journals["inputs"])
            await service.stop()
        assert await _read_counts(client, journals["outputs"]) == _expected(published)
    if kind == "batch":
        assert BatchWordCount.largest > 1


class Poisoned(WordCount):
    def __init__(self) -> None:
        super().__init__()
        self.fail_on = "poison"


class JSONWordCount(WordCount):
    """The same counts in a JSON state document."""

    def finalize_txn(self, shard: Any, store: Any, publisher: Any) -> None:
        for word, delta in self.deltas.items():
            total = store.state[word] = store.state.get(word, 0) + delta
            publisher.publish("counts", {"word": word, "count": total, "shard": shard.id})
        self.deltas.clear()


class BatchWordCount(WordCount):
    """The same counts through the batch hook; it remembers the largest list it got."""

    largest = 0

    def consume_messages(self, shard: Any, store: Any, envelopes: Any, publisher: Any) -> None:
        BatchWordCount.largest = max(BatchWordCount.largest, len(envelopes))
        for envelope in envelopes:
            self.consume_message(shard, store, envelope, publisher)


APPS = {"rocksdb": "WordCount", "json": "JSONWordCount", "sqlite": "SQLiteWordCount",
        "batch": "BatchWordCount"}


class SQLiteWordCount(WordCount):
    """The same counts in SQLite."""

    def finalize_txn(self, shard: Any, store: Any, publisher: Any) -> None:
        db = store.db
        db.execute("CREATE TABLE IF NOT EXISTS counts (word TEXT PRIMARY KEY, n INTEGER)")
        for word, delta in self.deltas.items():
            db.execute("INSERT INTO counts VALUES (?, ?) ON CONFLICT(word) DO UPDATE "
                       "SET n = n + excluded.n", (word, delta))
            (total,) = db.execute("SELECT n FROM counts WHERE word = ?", (word,)).fetchone()
            publisher.publish("counts", {"word": word, "count": total, "shard": shard.id})
        self.deltas.clear()


async def test_raising_application_fails_only_its_shard(shared_broker: Any, tmp_path: Path) -> None:
    async with BrokerClient(shared_broker.address) as client:
        base = unique_name("app")
        journals = await _journals(client, base, 2)
        specs = _specs(base, journals["inputs"])
        app = Poisoned
        service = Service(_runtime(app, client, tmp_path, journals["outputs"]))
        await service.assign(specs, {sid: 0 for sid in specs})
        await _publish_lines(client, journals["inputs"][:1], ["poison pill"])
        await _publish_lines(client, journals["inputs"][1:], ["fine words"])
        await eventually(lambda: service.replicas["shard-000"].status.code == Code.FAILED)
        status = service.replicas["shard-000"].status
        assert "cannot count 'poison'" in status.errors[0]
        await _wait_processed_one(service.replicas["shard-001"], client, journals["inputs"][1])
        assert service.replicas["shard-001"].status.code == Code.PRIMARY
        assert await service.replicas["shard-001"].query({"word": "fine"}) == 1
        await service.stop()


class BatchPoisoned(BatchWordCount):
    def consume_messages(self, shard: Any, store: Any, envelopes: Any, publisher: Any) -> None:
        if any("poison" in e.message["line"] for e in envelopes):
            raise ValueError("cannot count a poisoned list")
        super().consume_messages(shard, store, envelopes, publisher)


async def test_a_raising_batch_hook_fails_its_transaction(shared_broker: Any,
                                                          tmp_path: Path) -> None:
    """Nothing of the list is passed over: the shard fails naming the batch hook."""
    async with BrokerClient(shared_broker.address) as client:
        base = unique_name("app")
        journals = await _journals(client, base, 1)
        specs = _specs(base, journals["inputs"])
        service = Service(_runtime(BatchPoisoned, client, tmp_path, journals["outputs"]))
        await service.assign(specs, {sid: 0 for sid in specs})
        await _publish_lines(client, journals["inputs"], ["fine words", "poison pill"])
        await eventually(lambda: service.replicas["shard-000"].status.code == Code.FAILED)
        error = service.replicas["shard-000"].status.errors[0]
        assert "at consume_messages: ValueError: cannot count a poisoned list" in error
        await service.stop()


def test_the_batch_hook_is_used_only_where_it_is_the_latest_word() -> None:
    """A subclass that changes just consume_message must not be bypassed by the batch
    hook it inherited; one that overrides both gets its batch hook."""

    class OnlyEach(BatchWordCount):
        def consume_message(self, *args: Any) -> None:
            super().consume_message(*args)

    class Both(OnlyEach):
        def consume_messages(self, *args: Any) -> None:
            super().consume_messages(*args)

    assert batch_hook(WordCount()) is None
    assert batch_hook(BatchWordCount()).__func__ is BatchWordCount.consume_messages
    assert batch_hook(OnlyEach()) is None
    assert batch_hook(Both()).__func__ is Both.consume_messages


async def _wait_processed_one(replica: Any, client: BrokerClient, journal: str) -> None:
    reader = ReadCommitted(client, journal, block=False)
    async for _ in reader:
        pass
    reader.close()
    await asyncio.wait_for(replica.shard.progress.wait_for({journal: reader.uncommitted.offset}),
                           30)


async def test_a_primary_writes_hints_once_its_log_grew(shared_broker: Any,
                                                         tmp_path: Path) -> None:
    """Long before `hint_interval`, a primary whose recovery log grew by `hint_bytes` writes
    its hints: a recovery then replays from there, not from the start of a catch-up."""
    from dataclasses import replace

    from streamkit.app.hints import primary_key

    async with BrokerClient(shared_broker.address) as client:
        base = unique_name("app")
        journals = await _journals(client, base, 1)
        specs = _specs(base, journals["inputs"])
        runtime = replace(_runtime(WordCount, client, tmp_path, journals["outputs"]),
                          hint_interval=600.0, hint_bytes=1)
        assert runtime.keyspace is not None
        service = Service(runtime)
        await service.assign(specs, {sid: 0 for sid in specs})
        key = primary_key(specs["shard-000"])
        assert await runtime.keyspace.get(key) is None
        await _publish_lines(client, journals["inputs"], ["a b c"] * 20)
        await _wait_processed(service, client, journals["inputs"])
        await eventually(lambda: runtime.keyspace.get(key), 10, "primary hints")
        await service.stop()


async def test_hints_a_log_falls_short_of_fail_the_shard(shared_broker: Any,
                                                         tmp_path: Path) -> None:
    """The KeySpace's hints name more of the recovery log than the broker has (a lost log
    made anew, another broker's): the shard fails naming it. Once every hint had failed,
    it played the log whole, recovered an older state (here: none) and overwrote its
    hints with that."""
    from streamkit.app.hints import primary_key, push_backup_hints, store_primary_hints
    from streamkit.protocol import recoverylog_pb2 as rpb

    async with BrokerClient(shared_broker.address) as client:
        base = unique_name("app")
        journals = await _journals(client, base, 1)
        specs = _specs(base, journals["inputs"])
        runtime = _runtime(WordCount, client, tmp_path, journals["outputs"])
        assert runtime.keyspace is not None
        hints = rpb.FSMHints(log=f"{base}/recovery/shard-000", live_nodes=[rpb.FnodeSegments(
            fnode=1, segments=[rpb.Segment(author=7, first_seq_no=1, first_offset=0,
                                           last_seq_no=3, last_offset=4096)])])
        await store_primary_hints(runtime.keyspace, specs["shard-000"], hints)
        await push_backup_hints(runtime.keyspace, specs["shard-000"], hints)
        service = Service(runtime)
        await service.assign(specs, {sid: 0 for sid in specs})
        replica = service.replicas["shard-000"]
        await eventually(lambda: replica.status.code == Code.FAILED, 20, "a failed shard")
        assert "write head is before hinted" in replica.status.errors[0]
        kv = await runtime.keyspace.get(primary_key(specs["shard-000"]))
        assert kv is not None and b"4096" in kv.value  # the hints are kept
        await service.stop()


async def test_fenced_primary_recovers_again(shared_broker: Any, tmp_path: Path) -> None:
    """Another author takes the recovery log over (as a backfill's hand-over does): the
    primary's next commit fails, it recovers again from the log, and counts stay exact."""
    from streamkit.recoverylog.recovery import recover

    async with BrokerClient(shared_broker.address) as client:
        base = unique_name("app")
        journals = await _journals(client, base, 1)
        specs = _specs(base, journals["inputs"])
        service = Service(_runtime(WordCount, client, tmp_path, journals["outputs"]))
        await service.assign(specs, {sid: 0 for sid in specs})
        first = ["a b c"] * 50
        await _publish_lines(client, journals["inputs"], first)
        await _wait_processed(service, client, journals["inputs"])
        replica = service.replicas["shard-000"]
        first_term_app = replica.app
        fs = await recover(client, f"{base}/recovery/shard-000", tmp_path / "other-author")
        await fs.recorder.close()
        second = ["b c d"] * 30
        await _publish_lines(client, journals["inputs"], second)
        await eventually(lambda: replica.status.code == Code.PRIMARY and bool(replica._fences), 20)
        await _wait_processed(service, client, journals["inputs"])
        assert await replica.query({"word": "b"}) == 80
        # A fence can cut a transaction off mid-way (its words in the app's attributes):
        # the new term starts from a fresh Application, never from that.
        assert replica.app is not first_term_app
        await service.stop()
        assert await _read_counts(client, journals["outputs"]) == _expected(first + second)


async def test_fenced_primary_stopped_while_deciding_does_not_recover(
    shared_broker: Any, tmp_path: Path
) -> None:
    """A fenced primary asks whether it is still primary here (a KeySpace read that takes
    a while); a stop that comes meanwhile wins: no new term starts behind the stop's back
    (it would play back into the directory the shard's next replica here is given)."""
    from streamkit.recoverylog.recovery import recover

    asked, answer = asyncio.Event(), asyncio.Event()

    async def still_primary(shard_id: str) -> bool:
        asked.set()
        await answer.wait()
        return True

    async with BrokerClient(shared_broker.address) as client:
        base = unique_name("app")
        journals = await _journals(client, base, 1)
        specs = _specs(base, journals["inputs"])
        runtime = _runtime(WordCount, client, tmp_path, journals["outputs"])
        runtime.is_primary_here = still_primary
        service = Service(runtime)
        await service.assign(specs, {sid: 0 for sid in specs})
        await _publish_lines(client, journals["inputs"], ["a b"] * 10)
        await _wait_processed(service, client, journals["inputs"])
        replica = service.replicas["shard-000"]
        fs = await recover(client, f"{base}/recovery/shard-000", tmp_path / "other-author")
        await fs.recorder.close()
        await _publish_lines(client, journals["inputs"], ["c d"] * 10)  # its commit is fenced
        await asyncio.wait_for(asked.wait(), LIVENESS)
        stopping = asyncio.create_task(service.stop(timeout=5.0))
        await eventually(lambda: replica.stopping, LIVENESS)  # waiting on the fenced term
        answer.set()
        await asyncio.wait_for(stopping, LIVENESS)
        assert replica.status.code == Code.IDLE
        assert replica._task is not None and replica._task.done()
        assert not replica._fences[1:], "it recovered (and was fenced) again"
        assert replica.store is None and replica.loop is not None  # the term that ended


async def _counting(client: BrokerClient, tmp_path: Path, lines: list[str]
                    ) -> tuple[Service, dict[str, consumer_pb.ShardSpec], dict[str, Any]]:
    """One WordCount shard, primary here, that counted `lines`: its Service, specs and
    journals."""
    base = unique_name("app")
    journals = await _journals(client, base, 1)
    specs = _specs(base, journals["inputs"])
    service = Service(_runtime(WordCount, client, tmp_path, journals["outputs"]))
    await service.assign(specs, {sid: 0 for sid in specs})
    await _publish_lines(client, journals["inputs"], lines)
    await _wait_processed(service, client, journals["inputs"])
    return service, specs, journals


async def test_a_changed_spec_restarts_the_primary(shared_broker: Any, tmp_path: Path) -> None:
    """`shards apply` of a running primary's spec: it restarts (committing first) and reads
    by the new spec. It read on by the old one until some later failover, where a bad
    change (a missing journal) then failed it. A change of the labels naming the app (or
    its store) restarts nothing: no replica reads them."""
    async with BrokerClient(shared_broker.address) as client:
        service, specs, journals = await _counting(client, tmp_path, ["a b"] * 5)
        before = service.replicas["shard-000"]
        labeled = {sid: consumer_pb.ShardSpec() for sid in specs}
        for sid, spec in specs.items():
            labeled[sid].CopyFrom(spec)
            labeled[sid].labels.labels.add(name="app", value="x")
        await service.assign(labeled, {sid: 0 for sid in specs})
        assert service.replicas["shard-000"] is before

        extra = f"{journals['inputs'][0]}-extra"
        await create_journal(client, extra, labels=NDJSON)
        moved = {sid: consumer_pb.ShardSpec() for sid in specs}
        for sid, spec in labeled.items():
            moved[sid].CopyFrom(spec)
            moved[sid].sources.add(journal=extra)
        await service.assign(moved, {sid: 0 for sid in specs})
        after = service.replicas["shard-000"]
        assert after is not before and after.shard.spec == moved["shard-000"]
        await _publish_lines(client, [extra], ["c"] * 3)
        await eventually(lambda: after.status.code == Code.PRIMARY, 20, "primary again")
        await eventually(lambda: after.query({"word": "c"}), 20, "the new source read")
        assert await after.query({"word": "a"}) == 5 and await after.query({"word": "c"}) == 3
        await service.stop()


async def test_stop_with_the_broker_gone_abandons_the_transaction(
    broker_proc: Any, tmp_path: Path
) -> None:
    """A graceful stop can't commit without a broker: it gives up after its timeout
    rather than hanging (nothing uncommitted was acknowledged, so nothing is lost)."""
    async with BrokerClient(broker_proc.address) as client:
        service, _, _ = await _counting(client, tmp_path, ["a b"] * 20)
        broker_proc.kill()
        # A liveness bound: that stop returns at all (how soon is for bench/, not a test).
        async with asyncio.timeout(LIVENESS):
            await service.stop(timeout=1.0)


class _AcksLost(AppendService):
    """Drops appends made with dependencies (a commit's ACKs), as if the process died
    right after each checkpoint became durable."""

    def append_nowait(self, journal: str, data: Any, dependencies: Any = ()) -> Any:
        if dependencies:
            return OpFuture.finished()
        return super().append_nowait(journal, data, dependencies)


async def test_a_new_primary_writes_the_acks_its_predecessor_lost(
        shared_broker: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The recovered checkpoint's ACKs are queued again (not waited for, so the primary
    serves at once): the lost transaction's counts become readable, exactly once."""
    first = [f"a{i % 7} b{i % 5}" for i in range(60)]
    second = [f"c{i % 3}" for i in range(30)]  # other words: only the ACKs show the first
    async with BrokerClient(shared_broker.address) as client:
        base = unique_name("app")
        journals = await _journals(client, base, 1)
        specs = _specs(base, journals["inputs"])
        with monkeypatch.context() as patch:
            patch.setattr("streamkit.app.shard.AppendService", _AcksLost)
            service = Service(_runtime(WordCount, client, tmp_path, journals["outputs"]))
            await service.assign(specs, {sid: 0 for sid in specs})
            await _publish_lines(client, journals["inputs"], first)
            await _wait_processed(service, client, journals["inputs"])
            await service.stop()
        assert await _read_counts(client, journals["outputs"]) == {}, "the ACKs were lost"
        await _publish_lines(client, journals["inputs"], second)
        service = Service(_runtime(WordCount, client, tmp_path, journals["outputs"]))
        await service.assign(specs, {sid: 0 for sid in specs})
        await _wait_processed(service, client, journals["inputs"])
        await service.stop()
        assert await _read_counts(client, journals["outputs"]) == _expected(first + second)


class Gated(Application):
    """Counts words into the store as it consumes; `finalize_txn` waits for `gate`."""

    gate: asyncio.Event | None = None
    concurrent_queries = True

    def consume_message(self, shard: Any, store: Any, envelope: Any, publisher: Any) -> None:
        for word in envelope.message["line"].split():
            _put(store, word, _get(store, word) + 1)

    async def finalize_txn(self, shard: Any, store: Any, publisher: Any) -> None:
        if Gated.gate is not None:
            await Gated.gate.wait()

    def query(self, shard: Any, store: Any, request: dict[str, Any]) -> Any:
        return _get(store, request["word"])


def _get(store: Any, word: str) -> int:
    if hasattr(store, "db"):  # SQLite
        _counts_table(store.db)
        row = store.db.execute("SELECT n FROM counts WHERE word = ?", (word,)).fetchone()
        return row[0] if row else 0
    return store.state.get(word, 0) if hasattr(store, "state") else store.get(word, 0)


def _put(store: Any, word: str, n: int) -> None:
    if hasattr(store, "db"):
        store.db.execute("INSERT OR REPLACE INTO counts VALUES (?, ?)", (word, n))
    elif hasattr(store, "state"):
        store.state[word] = n
    else:
        store.put(word, n)


def _counts_table(db: Any) -> None:
    if not db.execute("SELECT 1 FROM sqlite_master WHERE name = 'counts'").fetchone():
        db.execute("CREATE TABLE counts(word TEXT PRIMARY KEY, n INTEGER)")


class GatedBetween(Gated):
    """Gated, with queries between transactions (the default)."""

    concurrent_queries = False


@pytest.mark.parametrize(("kind", "app"), [("rocksdb", Gated), ("json", Gated), ("sqlite", Gated),
                                           ("rocksdb", GatedBetween)])
async def test_a_query_during_an_open_transaction(shared_broker: Any, tmp_path: Path,
                                                  kind: str, app: type[Gated]) -> None:
    """With `concurrent_queries`, a query answers from the last durable commit at once,
    not from the open transaction; without, it waits for the transaction's commit."""
    async with BrokerClient(shared_broker.address) as client:
        base = unique_name("app")
        journals = await _journals(client, base, 1)
        specs = _specs(base, journals["inputs"])
        service = Service(_runtime(app, client, tmp_path, journals["outputs"], kind))
        try:
            await service.assign(specs, {sid: 0 for sid in specs})
            replica = service.replicas["shard-000"]
            await _publish_lines(client, journals["inputs"], ["a"])
            await _wait_processed(service, client, journals["inputs"])
            assert await replica.query({"word": "a"}) == 1

            Gated.gate = asyncio.Event()
            await _publish_lines(client, journals["inputs"], ["a a"])
            await eventually(lambda: replica.loop is not None
                             and replica.loop._phase == "finalize_txn")
            asking = asyncio.ensure_future(replica.query({"word": "a"}))
            if app.concurrent_queries:
                assert await asyncio.wait_for(asking, LIVENESS) == 1  # not 3: uncommitted
            else:
                await asyncio.sleep(0.3)
                assert not asking.done()
            Gated.gate.set()
            if not app.concurrent_queries:
                assert await asyncio.wait_for(asking, LIVENESS) == 3
            await _wait_processed(service, client, journals["inputs"])
            assert await replica.query({"word": "a"}) == 3
        finally:
            if Gated.gate is not None:
                Gated.gate.set()
            Gated.gate = None
            await service.stop()


class SlowQuery(Gated):
    """Gated, with a query that waits for `query_gate`."""

    query_gate: asyncio.Event | None = None

    async def query(self, shard: Any, store: Any, request: dict[str, Any]) -> Any:
        assert SlowQuery.query_gate is not None
        await SlowQuery.query_gate.wait()
        return _get(store, request["word"])


class NotANumber(Gated):
    def query(self, shard: Any, store: Any, request: dict[str, Any]) -> Any:
        return {"ratio": float("nan")}


async def test_an_answer_that_is_not_json_is_an_error(shared_broker: Any,
                                                      tmp_path: Path) -> None:
    """NaN is no JSON: the member answers a query whose answer holds one with an error
    naming why (it printed `NaN`, which JSON clients can't read), and serves on."""
    from streamkit.app.http_site import _answer

    async with BrokerClient(shared_broker.address) as client:
        base = unique_name("app")
        journals = await _journals(client, base, 1)
        specs = _specs(base, journals["inputs"])
        service = Service(_runtime(NotANumber, client, tmp_path, journals["outputs"], "rocksdb"))
        try:
            await service.assign(specs, {sid: 0 for sid in specs})
            await _publish_lines(client, journals["inputs"], ["a"])
            await _wait_processed(service, client, journals["inputs"])
            status, text = await _answer(service.replicas["shard-000"], {})
            assert status == 500 and "not JSON" in text and "float" in text, (status, text)
        finally:
            await service.stop()


async def test_a_replica_names_the_hook_it_runs(shared_broker: Any, tmp_path: Path) -> None:
    """What a timed-out query's 503 names: a query running in a committed view (beside
    the transaction), else the transaction loop's hook."""
    async with BrokerClient(shared_broker.address) as client:
        base = unique_name("app")
        journals = await _journals(client, base, 1)
        specs = _specs(base, journals["inputs"])
        service = Service(_runtime(SlowQuery, client, tmp_path, journals["outputs"], "rocksdb"))
        Gated.gate, SlowQuery.query_gate = asyncio.Event(), asyncio.Event()
        try:
            await service.assign(specs, {sid: 0 for sid in specs})
            replica = service.replicas["shard-000"]
            await _publish_lines(client, journals["inputs"], ["a"])
            await eventually(lambda: replica.loop is not None
                             and replica.loop._phase == "finalize_txn")
            assert replica.running_hook() == "finalize_txn"
            asking = asyncio.ensure_future(replica.query({"word": "a"}))
            await eventually(lambda: replica.running_hook() == "query")
            SlowQuery.query_gate.set()
            assert await asyncio.wait_for(asking, LIVENESS) == 0  # the open txn's 1 unseen
            assert replica.running_hook() == "finalize_txn"
            Gated.gate.set()
            await _wait_processed(service, client, journals["inputs"])
            assert replica.running_hook() is None
        finally:
            for gate in (Gated.gate, SlowQuery.query_gate):
                if gate is not None:
                    gate.set()
            Gated.gate = SlowQuery.query_gate = None
            await service.stop()


async def test_shards_taking_over_together_start_reading_together(
        shared_broker: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A primary that took over waits (up to TAKE_OVER_HOLD) for the process's other
    shards still taking over, so that none catches up while the others recover; one
    stuck in its take-over holds the rest no longer than that, and a promoted standby
    not at all."""
    async with BrokerClient(shared_broker.address) as client:
        base = unique_name("app")
        journals = await _journals(client, base, 2)
        specs = _specs(base, journals["inputs"])
        await _publish_lines(client, journals["inputs"], [f"w{i}" for i in range(20)])
        runtime = _runtime(WordCount, client, tmp_path, journals["outputs"])
        entered, release = asyncio.Event(), asyncio.Event()
        make_store = runtime.store_factory

        def store_factory(shard: Any, fs: Any, state: Any) -> Any:
            store = make_store(shard, fs, state)
            if shard.id == "shard-001":  # its store opens only once `release` is set
                restore = store.restore_checkpoint

                async def held_restore(shard_id: str) -> Any:
                    entered.set()
                    await release.wait()
                    return await restore(shard_id)

                store.restore_checkpoint = held_restore
            return store

        runtime.store_factory = store_factory
        monkeypatch.setattr("streamkit.app.replica.TAKE_OVER_HOLD", LIVENESS)
        service = Service(runtime)
        try:
            await service.assign(specs, {sid: 0 for sid in specs})
            first = service.replicas["shard-000"]
            await asyncio.wait_for(entered.wait(), LIVENESS)
            await asyncio.sleep(0.3)
            assert first.store is not None and first.loop is None  # held, not reading
            release.set()
            await _wait_processed(service, client, journals["inputs"])
        finally:
            release.set()
            await service.stop()

        # Held past TAKE_OVER_HOLD, shard-001 holds shard-000 back no longer.
        monkeypatch.setattr("streamkit.app.replica.TAKE_OVER_HOLD", 0.2)
        entered.clear()
        release.clear()
        await _publish_lines(client, journals["inputs"][:1], ["late"])
        service = Service(runtime)
        try:
            await service.assign(specs, {sid: 0 for sid in specs})
            await asyncio.wait_for(entered.wait(), LIVENESS)
            first = service.replicas["shard-000"]
            await _wait_processed_one(first, client, journals["inputs"][0])
            assert not release.is_set() and first.status.code == Code.PRIMARY
        finally:
            release.set()
            await service.stop()

        # A standby promoted meanwhile (a failover) serves at once: no hold for it.
        monkeypatch.setattr("streamkit.app.replica.TAKE_OVER_HOLD", LIVENESS)
        entered.clear()
        release.clear()
        service = Service(runtime)
        try:
            await service.assign(specs, {"shard-000": 1, "shard-001": 0})
            first = service.replicas["shard-000"]
            await asyncio.wait_for(entered.wait(), LIVENESS)
            await eventually(lambda: first.status.code == Code.STANDBY)
            await service.assign(specs, {sid: 0 for sid in specs})
            await eventually(lambda: first.status.code == Code.PRIMARY, timeout=LIVENESS / 4)
            assert not release.is_set()
        finally:
            release.set()
            await service.stop()


class SQLCount(Application):
    """Counts words into a PostgreSQL table, in the transaction. A "drop" line, while
    `drops` lasts, has the database drop the store's connection mid-transaction (an
    administrator's pg_terminate_backend, as a restart or failover of the database does)."""

    table = ""
    admin_url = ""
    drops = 0

    def consume_message(self, shard: Any, store: Any, envelope: Any, publisher: Any) -> None:
        import sqlalchemy as sa

        conn = store.transaction()
        line = envelope.message["line"]
        if line == "drop" and SQLCount.drops > 0:
            SQLCount.drops -= 1
            pid = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar()
            admin = sa.create_engine(self.admin_url)
            with admin.connect() as other:
                other.execute(sa.text(f"SELECT pg_terminate_backend({int(pid)})"))
            admin.dispose()
        for word in line.split():
            conn.execute(sa.text(f"INSERT INTO {self.table} VALUES (:w, 1) ON CONFLICT (word) "
                                 f"DO UPDATE SET n = {self.table}.n + 1"), {"w": word})

    def finalize_txn(self, shard: Any, store: Any, publisher: Any) -> None:
        pass


@pytest.fixture
def sql_counting(postgres_url: str, tmp_path: Path) -> Any:
    """An SQLCount table of its own, and the Runtime's factory for SQL stores."""
    import uuid

    import sqlalchemy as sa

    SQLCount.table, SQLCount.admin_url = f"counts_{uuid.uuid4().hex[:10]}", postgres_url
    admin = sa.create_engine(postgres_url)
    with admin.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {SQLCount.table} (word text PRIMARY KEY, n int)"))

    def counts() -> dict[str, int]:
        with admin.connect() as conn:
            return dict(conn.execute(sa.text(f"SELECT word, n FROM {SQLCount.table}")).all())

    def factory(shard: Any, fs: Any, state: Any) -> Any:
        return build_store("sql", shard, fs, sql_url=postgres_url)

    yield factory, counts
    admin.dispose()


async def _sql_service(client: BrokerClient, tmp_path: Path, factory: Any, root: str = "/test"
                       ) -> tuple[Service, list[str]]:
    from dataclasses import replace

    base = unique_name("app")
    journals = await _journals(client, base, 1)
    specs = _specs(base, journals["inputs"])
    for spec in specs.values():
        spec.recovery_log_prefix = ""  # an SQL store recovers from its database
    runtime = replace(_runtime(SQLCount, client, tmp_path, journals["outputs"]),
                      store_factory=factory, keyspace_root=root)
    service = Service(runtime)
    await service.assign(specs, {sid: 0 for sid in specs})
    return service, journals["inputs"]


async def test_a_connection_dropped_mid_transaction_recovers_the_shard(
        shared_broker: Any, tmp_path: Path, sql_counting: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    """PostgreSQL drops a shard's connection inside a transaction: the shard recovers
    again from its checkpoint after a pause, and the counts stay exact. It was FAILED
    until an operator unassigned it."""
    factory, counts = sql_counting
    SQLCount.drops = 1
    async with BrokerClient(shared_broker.address) as client:
        service, inputs = await _sql_service(client, tmp_path, factory)
        lines = ["a b"] * 10 + ["drop"] + ["b c"] * 10
        await _publish_lines(client, inputs, lines)
        await eventually(lambda: counts() == _expected(lines), 30, "exact counts")
        replica = service.replicas["shard-000"]
        assert replica.status.code == Code.PRIMARY, replica.status
        assert SQLCount.drops == 0
        assert "its store seems out of reach for now: recovering again in 1s" in caplog.text
        await service.stop()


async def test_a_lost_sql_checkpoint_fails_the_shard_rather_than_count_again(
        shared_broker: Any, tmp_path: Path, sql_counting: Any, postgres_url: str) -> None:
    """A shard that committed to its database finds no checkpoint row there (its table
    dropped or emptied, another database named): it fails naming the loss. It took itself
    for a new shard and counted its history again on top of the app's table. Once the
    KeySpace's mark is forgotten too, it starts over (counting again: its table kept)."""
    import uuid

    import sqlalchemy as sa

    from streamkit.app.commit_marks import forget_commits, mark_key
    from streamkit.stores.sql import CHECKPOINTS

    factory, counts = sql_counting
    root = f"/lost-{uuid.uuid4().hex[:8]}"
    lines = ["a b", "b c"] * 5
    async with BrokerClient(shared_broker.address) as client:
        service, inputs = await _sql_service(client, tmp_path, factory, root)
        runtime, keyspace = service.runtime, service.runtime.keyspace
        specs = {sid: r.shard.spec for sid, r in service.replicas.items()}
        await _publish_lines(client, inputs, lines)
        await eventually(lambda: counts() == _expected(lines), 30, "exact counts")
        mark = mark_key(root, "shard-000")
        await eventually(lambda: keyspace.get(mark), 10, "the KeySpace's mark of a commit")
        await service.stop()

        admin = sa.create_engine(postgres_url)
        with admin.begin() as conn:
            conn.execute(sa.delete(CHECKPOINTS).where(
                CHECKPOINTS.c.shard_fqn == f"{root}/items/shard-000"))
        again = Service(runtime)
        await again.assign(specs, {sid: 0 for sid in specs})
        replica = again.replicas["shard-000"]
        await eventually(lambda: replica.status.code == Code.FAILED, 20, "a failed shard")
        error = replica.status.errors[0]
        assert "no checkpoint for it in table streamkit_checkpoints in postgresql:" in error
        assert "yet it committed there (first at " in error, error
        assert "streamkit shards forget shard-000" in error
        await asyncio.sleep(0.5)
        assert counts() == _expected(lines)  # nothing counted twice
        await again.stop()

        assert await forget_commits(keyspace, root, ["shard-000", "shard-001"]) == ["shard-000"]
        afresh = Service(runtime)
        await afresh.assign(specs, {sid: 0 for sid in specs})
        await eventually(lambda: counts() == _expected(lines + lines), 30, "counted again")
        await afresh.stop()
        admin.dispose()


async def test_a_checkpoint_past_the_write_head_fails_the_shard(
        shared_broker: Any, tmp_path: Path, sql_counting: Any, postgres_url: str) -> None:
    """The checkpoint read its source further than the journal goes on this broker (an SQL
    app's backfill run at another app's broker, its journals named alike): the shard fails
    saying so. It waited at that offset, skipping every line appended up to it, showing
    no lag."""
    import uuid

    import sqlalchemy as sa

    from streamkit.stores.sql import CHECKPOINTS

    factory, counts = sql_counting
    root = f"/ahead-{uuid.uuid4().hex[:8]}"
    async with BrokerClient(shared_broker.address) as client:
        service, inputs = await _sql_service(client, tmp_path, factory, root)
        specs = {sid: r.shard.spec for sid, r in service.replicas.items()}
        await _publish_lines(client, inputs, ["a b"] * 5)
        await eventually(lambda: counts() == _expected(["a b"] * 5), 30, "exact counts")
        await service.stop()

        admin = sa.create_engine(postgres_url)
        row = CHECKPOINTS.c.shard_fqn == f"{root}/items/shard-000"
        with admin.begin() as conn:
            cp = consumer_pb.Checkpoint.FromString(
                conn.execute(sa.select(CHECKPOINTS.c.checkpoint).where(row)).scalar_one())
            cp.sources[inputs[0]].read_through += 100_000
            conn.execute(sa.update(CHECKPOINTS).where(row).values(
                checkpoint=cp.SerializeToString()))
        admin.dispose()
        again = Service(service.runtime)
        await again.assign(specs, {sid: 0 for sid in specs})
        replica = again.replicas["shard-000"]
        await eventually(lambda: replica.status.code == Code.FAILED, 20, "a failed shard")
        error = replica.status.errors[0]
        assert f"its checkpoint read journal {inputs[0]} through offset" in error, error
        assert "past its write head" in error and "is this the broker it read" in error
        await again.stop()


async def test_a_store_failing_on_and_on_fails_the_shard(
        shared_broker: Any, tmp_path: Path, sql_counting: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Transient errors that go on past STORE_RETRY_FOR fail the shard, saying why."""
    from streamkit.app import replica as replica_module

    monkeypatch.setattr(replica_module, "STORE_RETRY_FOR", 2.5)
    factory, counts = sql_counting
    SQLCount.drops = 100
    async with BrokerClient(shared_broker.address) as client:
        service, inputs = await _sql_service(client, tmp_path, factory)
        await _publish_lines(client, inputs, ["drop"])
        replica = service.replicas["shard-000"]
        await eventually(lambda: replica.status.code == Code.FAILED, 20, "a failed shard")
        assert "transaction 1 failed at consume_message" in replica.status.errors[0]
        assert re.search(r"\(its store's errors went on for \ds\)", replica.status.errors[0])
        assert 100 - SQLCount.drops == 3  # at once, after 1 s and after 2 s
        assert counts() == {}
        await service.stop()


async def test_store_errors_between_commits_start_the_count_anew(
        shared_broker: Any, tmp_path: Path, sql_counting: Any,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Connections dropped now and then, the shard committing in between: each is a first
    error (a pause of 1 s), however long the drops go on. They piled up across terms, and
    failed the shard once the first was STORE_RETRY_FOR old."""
    from streamkit.app import replica as replica_module

    monkeypatch.setattr(replica_module, "STORE_RETRY_FOR", 2.5)
    factory, counts = sql_counting
    async with BrokerClient(shared_broker.address) as client:
        service, inputs = await _sql_service(client, tmp_path, factory)
        lines = ["a"]
        await _publish_lines(client, inputs, ["a"])
        await eventually(lambda: counts() == _expected(lines), 30, "the first commit")
        for _ in range(3):  # about 1.5 s each
            SQLCount.drops = 1
            lines.append("drop")
            await _publish_lines(client, inputs, ["drop"])
            await eventually(lambda: counts() == _expected(lines), 30, "the line counted")
        replica = service.replicas["shard-000"]
        assert replica.status.code == Code.PRIMARY, replica.status
        assert caplog.text.count("recovering again in 1s") == 3, caplog.text
        await service.stop()


async def test_an_abandoned_replica_assigned_again_serves_afresh(
        shared_broker: Any, tmp_path: Path) -> None:
    """A member's lease in doubt, and answered for again an instant later: its follower
    assigns the same slots to replicas that were abandoned meanwhile. They were kept,
    serving nothing for good while the KeySpace showed them PRIMARY."""
    async with BrokerClient(shared_broker.address) as client:
        service, specs, journals = await _counting(client, tmp_path, ["a b"] * 5)
        abandoned = service.replicas["shard-000"]
        abandoned.abandon()
        await service.assign(specs, {sid: 0 for sid in specs})  # the doubt is over
        replica = service.replicas["shard-000"]
        assert replica is not abandoned
        await _publish_lines(client, journals["inputs"], ["b c"] * 5)
        await _wait_processed(service, client, journals["inputs"])
        assert await replica.query({"word": "b"}) == 10
        await service.stop()
