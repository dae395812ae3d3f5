"""Backfills on Spark (local[2]) against real brokers: the same state and output as live.

Each equivalence test builds the same history twice, on two brokers: one app
backfills the first part of it and then processes the rest live, the other
processes all of it live. Their stores must end equal, and their committed
outputs must hold the same updates, none repeated and none missing.
One SparkContext serves the whole module.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from streamkit.app.commit_marks import CheckpointLost
from streamkit.app.config import AppConfig, load_config
from streamkit.app.member import Member, MemberOptions, deploy
from streamkit.app.txn import TransactionFailed
from streamkit.backfill.errors import BackfillError
from streamkit.backfill.plan import BackfillPlan, cover, make_plan
from streamkit.backfill.source import merge_by_time
from streamkit.backfill.task import run_shard
from streamkit.client import (
    BrokerClient,
    append_bytes,
    list_fragments,
    list_journals,
    write_head,
)
from streamkit.client.append_service import AppendService
from streamkit.client.listing import apply_journals
from streamkit.keyspace import open_keyspace
from streamkit.keyspace.keyspace import KeySpace
from streamkit.message.framing import framing_for
from streamkit.message.message import Envelope, set_uuid
from streamkit.message.publisher import Publisher
from streamkit.message.uuid import Flags, build_uuid, clock_at, new_producer_id
from streamkit.protocol import consumer_pb, pb
from streamkit.testing import read_journals
from tests.brokerproc import BrokerProcess
from tests.conftest import unavailable
from tests.e2e import POISONED, totals_of_updates
from tests.test_wordcount import generate_lines
from tests.waiting import eventually

try:
    import pyspark  # noqa: F401
except ImportError:
    unavailable("pyspark is not installed")

ROOT = Path(__file__).resolve().parent.parent
WORDCOUNT = ROOT / "examples" / "wordcount"
Code = consumer_pb.ReplicaStatus.Code
CODECS = [pb.NONE, pb.GZIP, pb.ZSTANDARD, pb.SNAPPY]

LEDGER_YAML = """\
name: ledger
application: app:Ledger
shards: 2
sources:
  - topic: ledger/entries
    partitions: 2
    key: account
outputs:
  - topic: ledger/balances
    partitions: 2
    key: account
store: sqlite
transactions:
  max_duration: 200ms
"""

LEDGER_APP = '''\
"""Balances of accounts; one published update per entry, so outputs compare exactly."""

import streamkit


class Ledger(streamkit.Application):
    def begin_txn(self, shard, store):
        store.db.execute("CREATE TABLE IF NOT EXISTS balances (account TEXT PRIMARY KEY, n INT)")

    def consume_message(self, shard, store, envelope, publisher):
        entry = envelope.message
        row = store.db.execute("SELECT n FROM balances WHERE account = ?",
                               (entry["account"],)).fetchone()
        balance = (row[0] if row else 0) + entry["amount"]
        store.db.execute("INSERT OR REPLACE INTO balances VALUES (?, ?)",
                         (entry["account"], balance))
        publisher.publish("ledger/balances", {"account": entry["account"], "seq": entry["seq"],
                                              "amount": entry["amount"], "balance": balance})

    def finalize_txn(self, shard, store, publisher):
        pass
'''


# --- fixtures and helpers -------------------------------------------------------------


@pytest.fixture(scope="module")
def sc() -> Iterator[Any]:
    from streamkit.backfill.spark import spark_context

    context = spark_context("local[2]")
    try:
        yield context
    finally:
        context.stop()


@pytest.fixture
def brokers(tmp_path: Path) -> Iterator[tuple[BrokerProcess, BrokerProcess]]:
    a = BrokerProcess(tmp_path / "broker-a").start()
    b = BrokerProcess(tmp_path / "broker-b")
    try:
        yield a, b.start()
    finally:  # (a too when b fails to start: it outlived the test run once)
        a.kill()
        b.kill()


def copy_wordcount(folder: Path) -> Path:
    shutil.copytree(WORDCOUNT, folder, ignore=shutil.ignore_patterns(".streamkit", "__pycache__"))
    return folder


def write_ledger(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "streamkit.yaml").write_text(LEDGER_YAML)
    (folder / "app.py").write_text(LEDGER_APP)
    return folder


def app_config(folder: Path) -> AppConfig:
    config = load_config(folder)
    return config.for_application(config.load_application())


class Setup:
    """An app against one broker, with its KeySpace: what a test drives."""

    def __init__(self, app: Path, broker: BrokerProcess, client: BrokerClient,
                 keyspace: KeySpace) -> None:
        self.app, self.broker, self.client, self.keyspace = app, broker, client, keyspace
        self.config = app_config(app)
        self.keyspace_path = str(app / "keyspace.db")

    @classmethod
    async def start(cls, app: Path, broker: BrokerProcess) -> Setup:
        client = BrokerClient(broker.address)
        keyspace = open_keyspace(str(app / "keyspace.db"))
        setup = cls(app, broker, client, keyspace)
        await deploy(setup.config, client, keyspace)
        return setup

    async def close(self) -> None:
        await self.keyspace.close()
        await self.client.close()

    async def heads(self) -> dict[str, int]:
        journals = {s.journal for spec in self.config.shard_specs() for s in spec.sources}
        return {j: await write_head(self.client, j) for j in sorted(journals)}

    async def plan(self, **options: Any) -> BackfillPlan:
        return await make_plan(self.config, self.client, self.config.shard_specs(),
                               broker=self.broker.address, keyspace=self.keyspace_path,
                               fragment_root=self.broker.data_dir / "fragments", **options)

    def member(self, work: str, **options: Any) -> Member:
        return Member(self.config, self.config.load_application(), self.client, self.keyspace,
                      MemberOptions(work_dir=self.app / work, allocate=False, **options))


async def wait_processed(member: Member, heads: dict[str, int], timeout: float = 60) -> None:
    """Until every shard read its sources through `heads` (fails if a shard failed)."""
    deadline = time.monotonic() + timeout
    while True:
        replicas = member.service.replicas
        failed = [f"{r.id}: {r.status.errors}" for r in replicas.values()
                  if r.status.code == Code.FAILED]
        assert not failed, failed
        if replicas and all(r.shard.progress.covers({j: heads[j] for j in r.shard.sources})
                            for r in replicas.values()):
            return
        assert time.monotonic() < deadline, {r.id: r.shard.progress.read_through
                                             for r in replicas.values()}
        await asyncio.sleep(0.05)


def rocksdb_state(member: Member) -> dict[str, dict[bytes, Any]]:
    return {sid: dict(r.store.items()) for sid, r in member.service.replicas.items()}


def sqlite_state(member: Member) -> dict[str, list[tuple[str, int]]]:
    return {sid: sorted(r.store.db.execute("SELECT account, n FROM balances").fetchall())
            for sid, r in member.service.replicas.items()}


async def process_live(setup: Setup, snapshot: Any, work: str = "live") -> tuple[Any, int]:
    """Run the app live until it processed everything published: its state, and how many
    messages it consumed to get there."""
    member = setup.member(work)
    await member.start()
    try:
        await wait_processed(member, await setup.heads())
        consumed = sum(r.shard.messages for r in member.service.replicas.values())
        return snapshot(member), consumed
    finally:
        await member.stop()


async def read_output(setup: Setup, topic: str) -> list[dict[str, Any]]:
    """The topic's read-committed messages, without their UUIDs."""
    messages = await read_journals(setup.client, setup.config.topic_journals(topic))
    return [{k: v for k, v in m.items() if k != "uuid"} for m in messages]


async def publish(setup: Setup, topic: str, messages: list[dict[str, Any]]) -> None:
    mapping = setup.config.mapping_for(topic)
    async with AppendService(setup.client) as service:
        publisher = Publisher(service)
        for message in messages:
            await publisher.publish_committed(mapping, dict(message))


async def small_fragments(setup: Setup, topic: str) -> None:
    """Give the topic's journals 8 KiB fragments, each partition another codec."""
    changes = []
    for i, journal in enumerate(setup.config.topic_journals(topic)):
        (listed,) = await list_journals(setup.client, f"name={journal}")
        spec = listed.spec
        spec.fragment.length = 8 << 10
        spec.fragment.compression_codec = CODECS[i % len(CODECS)]
        changes.append(pb.ApplyRequest.Change(expect_mod_revision=listed.mod_revision,
                                              upsert=spec))
    await apply_journals(setup.client, changes)


async def rolled_fragments_persisted(setup: Setup, topic: str) -> None:
    """Until the broker persisted every fragment it rolled: all but each journal's open
    spool (listed without a backing store) are files a backfill reads directly."""

    async def persisted() -> bool:
        for journal in setup.config.topic_journals(topic):
            listed = await list_fragments(setup.client, journal)
            if sum(not f.spec.backing_store for f in listed.fragments) > 1:
                return False
        return True

    await eventually(persisted, what=f"the rolled fragments of {topic} to be persisted")


async def backfill(sc: Any, plan: BackfillPlan) -> list[dict[str, Any]]:
    from streamkit.backfill.spark import run_on_spark

    return await asyncio.to_thread(run_on_spark, plan, sc=sc)


# --- the plan and the reading order -------------------------------------------------


def _listed(begin: int, end: int, store: str = "", url: str = "") -> Any:
    return pb.FragmentsResponse._Fragment(
        spec=pb.Fragment(journal="j", begin=begin, end=end, backing_store=store),
        signed_url=url)


def test_cover_prefers_direct_reads_and_skips_gaps(tmp_path: Path) -> None:
    listed = [
        _listed(0, 100, "file:///", "file:///j/a.sz"),
        _listed(100, 250, ""),  # a spool...
        _listed(100, 200, "file:///", "file:///j/b.sz"),  # ...of which this much is persisted
        _listed(300, 400, ""),  # after a gap (removed content)
    ]
    segments = cover(listed, 50, 350, tmp_path)
    assert [(s.begin, s.end, s.direct) for s in segments] == [
        (50, 100, True), (100, 200, True), (200, 250, False), (300, 350, False)]
    assert all(not s.direct for s in cover(listed, 0, 400, None))  # no root: via the broker


async def test_journals_are_merged_in_the_order_they_were_written() -> None:
    producer = new_producer_id()

    def batch(journal: str, clocks: list[int]) -> list[Envelope]:
        return [Envelope(journal, c, c + 1, {"uuid": str(build_uuid(producer, c << 4,
                                                                    Flags.OUTSIDE_TXN))})
                for c in clocks]

    async def source(*batches: list[Envelope]) -> AsyncIterator[list[Envelope]]:
        for b in batches:
            yield b

    a = source(batch("a", [1, 2]), batch("a", [7, 8]))
    b = source(batch("b", [3, 4]), batch("b", [5, 6]), batch("b", [9]))
    merged = [[e.begin for e in b] async for b in merge_by_time([a, b])]
    assert merged == [[1, 2], [3, 4], [5, 6], [7, 8], [9]]


# --- scheduling -----------------------------------------------------------------------


def test_largest_shards_start_first() -> None:
    from types import SimpleNamespace

    from streamkit.backfill.plan import largest_first

    def shard(*sizes: int) -> Any:
        return SimpleNamespace(journals=[SimpleNamespace(begin=10, end=10 + n) for n in sizes])

    plan: Any = SimpleNamespace(shards=[shard(5), shard(20), shard(5, 30), shard(1), shard(20)])
    assert largest_first(plan) == [2, 1, 4, 0, 3]


def test_local_workers_fork_from_the_preloaded_daemon(sc: Any) -> None:
    """Spark's daemon handed its place to the one that imported while the JVM started."""
    def parent(_: int) -> bytes:
        return Path(f"/proc/{os.getppid()}/cmdline").read_bytes()

    parents = sc.parallelize(range(2), 2).map(parent).collect()
    assert all(b"--preloaded" in cmdline for cmdline in parents), parents


# --- equivalence ----------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["spark", "processes"])
async def test_wordcount_backfill_then_live_equals_live(
        engine: str, request: pytest.FixtureRequest, brokers: tuple[BrokerProcess, BrokerProcess],
        tmp_path: Path) -> None:
    """On Spark, and in local processes (`--processes`): the same tasks, the same state."""
    lines = [{"id": i, "line": line} for i, line in enumerate(generate_lines(3000, seed=11))]
    first, rest = lines[:2000], lines[2000:]
    a = await Setup.start(copy_wordcount(tmp_path / "a"), brokers[0])
    b = await Setup.start(copy_wordcount(tmp_path / "b"), brokers[1])
    try:
        await small_fragments(a, "wordcount/lines")
        await publish(a, "wordcount/lines", first[:-40])
        await rolled_fragments_persisted(a, "wordcount/lines")
        await publish(a, "wordcount/lines", first[-40:])  # less than a fragment: still spooled
        plan = await a.plan()
        journals = [j for shard in plan.shards for j in shard.journals]
        assert sum(j.bytes_direct for j in journals) > 0  # fragment files, every codec...
        assert sum(j.bytes_via_broker for j in journals) > 0  # ...and the open spools
        if engine == "spark":
            results = await backfill(request.getfixturevalue("sc"), plan)
        else:
            from streamkit.backfill.local import run_locally

            results = await asyncio.to_thread(run_locally, plan, 2)
        assert [r["shard_id"] for r in results] == [s.shard_id for s in plan.shards]
        assert sum(r["messages"] for r in results) == len(first)
        assert {j for r in results for j, o in r["read_through"].items()} == {
            j.journal for j in journals}
        await publish(a, "wordcount/lines", rest)
        backfilled, consumed = await process_live(a, rocksdb_state)
        assert consumed == len(rest)  # live went on where the backfill stopped

        await publish(b, "wordcount/lines", lines)
        live, consumed = await process_live(b, rocksdb_state)
        assert consumed == len(lines)
        assert backfilled == live
        expected = Counter(w for line in lines for w in line["line"].split())
        assert sum((Counter({k.decode(): v for k, v in shard.items()})
                    for shard in live.values()), Counter()) == expected
        # Committed updates: each (shard, word)'s counts only ever grow (nothing repeated),
        # and the last ones add up to the true counts (nothing lost), on both sides.
        assert totals_of_updates(await read_output(a, "wordcount/counts")) == expected
        assert totals_of_updates(await read_output(b, "wordcount/counts")) == expected
    finally:
        await a.close()
        await b.close()


class History:
    """Ledger entries as raw appends, with duplicates, rolled-back and open transactions.

    The same bytes are appended to both setups, so both read one history.
    `committed` is every entry's `seq` a read-committed reader must deliver.
    """

    def __init__(self, config: AppConfig, seed: int = 3) -> None:
        self.rng = random.Random(seed)
        self.framing = framing_for("application/x-ndjson")
        self.mapping = config.mapping_for("ledger/entries")
        self.journals = config.topic_journals("ledger/entries")
        accounts = [f"acct-{i}" for i in range(40)]
        self.accounts = {j: [a for a in accounts if self.mapping({"account": a})[0] == j]
                         for j in self.journals}
        self.clock = clock_at(time.time_ns())
        self.appends: list[tuple[str, bytes]] = []
        self.committed: set[int] = set()
        self.seq = 0
        self.last_ack: dict[tuple[str, bytes], bytes] = {}

    def _frame(self, producer: bytes, flags: int, message: dict[str, Any]) -> bytes:
        self.clock += 1
        message = dict(message)
        set_uuid(message, build_uuid(producer, self.clock, flags))
        out = bytearray()
        self.framing.encode(message, out)
        return bytes(out)

    def _entries(self, journal: str, count: int) -> list[dict[str, Any]]:
        out = []
        for _ in range(count):
            out.append({"account": self.rng.choice(self.accounts[journal]),
                        "amount": self.rng.randint(-5, 20), "seq": self.seq})
            self.seq += 1
        return out

    def singles(self, journal: str, count: int, producer: bytes) -> None:
        entries = self._entries(journal, count)
        frames = [self._frame(producer, Flags.OUTSIDE_TXN, e) for e in entries]
        self.appends.append((journal, b"".join(frames)))
        self.committed.update(e["seq"] for e in entries)

    def transaction(self, journal: str, count: int, producer: bytes, *, ack: bool = True,
                    rollback: bool = False, pieces: int = 1) -> bytes:
        """CONTINUE_TXN entries in `pieces` appends, then (maybe) their ACK; the ACK frame."""
        entries = self._entries(journal, count)
        frames = [self._frame(producer, Flags.CONTINUE_TXN, e) for e in entries]
        step = max(1, len(frames) // pieces)
        for i in range(0, len(frames), step):
            self.appends.append((journal, b"".join(frames[i:i + step])))
        acknowledgement = self._frame(producer, Flags.ACK_TXN, {})
        if rollback:  # the producer restarts from its last checkpoint: re-appends its last ACK
            self.appends.append((journal, self.last_ack[journal, producer]))
        elif ack:
            self.appends.append((journal, acknowledgement))
            self.last_ack[journal, producer] = acknowledgement
            self.committed.update(e["seq"] for e in entries)
        else:
            self.pending = (journal, acknowledgement, [e["seq"] for e in entries])
        return acknowledgement

    def retried(self, count: int = 1) -> None:
        """Append the last `count` appends again, as a producer retrying them would."""
        self.appends.extend(self.appends[-count:])

    def build(self) -> int:
        """The history; returns how many appends the first part (before the cut) has."""
        p_single, p_txn, p_flaky, p_big, p_open = (new_producer_id() for _ in range(5))
        for round_ in range(6):
            for journal in self.journals:
                self.singles(journal, 30, p_single)
                self.retried()  # duplicates of committed messages
                self.transaction(journal, 25, p_txn, pieces=2)
                self.retried(2)  # of a transaction's last messages and its ACK
                self.transaction(journal, 5, p_flaky)
                self.transaction(journal, 20, p_flaky, rollback=True)  # never delivered
                self.transaction(journal, 10, p_flaky)  # commits after the rollback
            if round_ == 1:  # more than the Sequencer's ring holds: its start is re-read
                self.transaction(self.journals[0], 9000, p_big, pieces=5)
        journal = self.journals[1]
        self.transaction(journal, 40, p_open, ack=False)  # open at the cut...
        cut = len(self.appends)
        open_journal, ack, seqs = self.pending
        self.singles(journal, 15, p_single)
        self.appends.append((open_journal, ack))  # ...committed after it
        self.committed.update(seqs)
        for journal in self.journals:
            self.singles(journal, 30, p_single)
            self.transaction(journal, 20, p_txn)
            self.retried()
        return cut


async def append_all(setup: Setup, appends: list[tuple[str, bytes]]) -> None:
    for journal, data in appends:
        await append_bytes(setup.client, journal, data)


async def test_ledger_history_with_duplicates_and_rollbacks_backfills_as_live(
        sc: Any, brokers: tuple[BrokerProcess, BrokerProcess], tmp_path: Path) -> None:
    a = await Setup.start(write_ledger(tmp_path / "a"), brokers[0])
    b = await Setup.start(write_ledger(tmp_path / "b"), brokers[1])
    try:
        history = History(a.config)
        cut = history.build()
        await append_all(a, history.appends[:cut])
        results = await backfill(sc, await a.plan(txn_size=500))
        assert sum(r["transactions"] for r in results) > 2
        await append_all(a, history.appends[cut:])
        backfilled, after = await process_live(a, sqlite_state)

        await append_all(b, history.appends)
        live, consumed = await process_live(b, sqlite_state)
        assert backfilled == live
        assert consumed == len(history.committed)
        assert sum(r["messages"] for r in results) + after == consumed

        outputs = [await read_output(s, "ledger/balances") for s in (a, b)]
        seqs = [e["seq"] for e in outputs[0]]
        assert len(seqs) == len(set(seqs)) and set(seqs) == history.committed
        assert Counter(tuple(sorted(e.items())) for e in outputs[0]) == Counter(
            tuple(sorted(e.items())) for e in outputs[1])
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("store", ["json", "sql"])
async def test_wordcount_backfill_with_other_stores(sc: Any, broker_proc: BrokerProcess,
                                                  tmp_path: Path, store: str) -> None:
    app = copy_wordcount(tmp_path / "app")
    yaml = app / "streamkit.yaml"
    kind = f"sql\n  url: sqlite:///{tmp_path / 'counts.sqlite'}" if store == "sql" else store
    yaml.write_text(yaml.read_text().replace("kind: rocksdb", f"kind: {kind}"))
    lines = [{"id": i, "line": line} for i, line in enumerate(generate_lines(900, seed=2))]
    expected = Counter(w for line in lines for w in line["line"].split())
    setup = await Setup.start(app, broker_proc)
    try:
        await publish(setup, "wordcount/lines", lines[:600])
        results = await backfill(sc, await setup.plan(txn_size=100))
        assert sum(r["messages"] for r in results) == 600
        assert all(r["files"] == (0 if store == "sql" else 1) for r in results)
        await publish(setup, "wordcount/lines", lines[600:])

        async def counts(member: Member) -> Counter[str]:
            found: Counter[str] = Counter()
            for replica in member.service.replicas.values():
                for word in expected:
                    found[word] += await replica.query({"word": word})
            return found

        member = setup.member("live")
        await member.start()
        try:
            await wait_processed(member, await setup.heads())
            assert sum(r.shard.messages for r in member.service.replicas.values()) == 300
            assert await counts(member) == expected
        finally:
            await member.stop()
        assert totals_of_updates(await read_output(setup, "wordcount/counts")) == expected
        if store == "sql":  # its checkpoints lost: a backfill must not count again
            import sqlite3

            with contextlib.closing(sqlite3.connect(tmp_path / "counts.sqlite")) as db, db:
                db.execute("DELETE FROM streamkit_checkpoints")
            with pytest.raises(CheckpointLost, match="shards forget shard-000"):
                await run_shard(await setup.plan(txn_size=100), 0)
    finally:
        await setup.close()


# --- a running primary ----------------------------------------------------------------


async def test_backfill_fences_a_running_primary(sc: Any, broker_proc: BrokerProcess,
                                                tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="streamkit.app.replica")
    setup = await Setup.start(copy_wordcount(tmp_path / "app"), broker_proc)
    lines = [{"id": i, "line": line} for i, line in enumerate(generate_lines(1200, seed=5))]
    try:
        await publish(setup, "wordcount/lines", lines[:800])
        running = setup.member("running")
        await running.start()
        try:
            heads = await setup.heads()
            await wait_processed(running, heads)
            # Backfill only the first half of what the running primaries processed.
            results = await backfill(sc, await setup.plan(ends={j: h // 2
                                                                for j, h in heads.items()}))
            read_through = {j: o for r in results for j, o in r["read_through"].items()}
            assert all(0 < o <= heads[j] // 2 for j, o in read_through.items())
            # The primaries learn at their next commit that they were fenced: they drop
            # their transaction, recover the backfilled state and go on from its offsets,
            # re-reading what they had processed past them.
            await publish(setup, "wordcount/lines", lines[800:])
            await wait_processed(running, await setup.heads())
            expected = Counter(w for line in lines for w in line["line"].split())
            state = rocksdb_state(running)
            assert sum((Counter({k.decode(): v for k, v in shard.items()})
                        for shard in state.values()), Counter()) == expected
        finally:
            await running.stop()
        assert "fenced by another author of its recovery log" in caplog.text
        for journal, offset in read_through.items():
            assert f"{journal}@{offset}" in caplog.text  # "primary, reading <journal>@<offset>"
    finally:
        await setup.close()


async def test_a_running_app_is_backfilled_while_input_keeps_arriving(
        broker_proc: BrokerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Input arrives all along: the running primaries commit, and are fenced, during the
    backfill's hand-overs (each held a second after taking the log over, here, as a loaded
    machine holds it). A fenced primary recovered at once, taking its log back in the middle
    of the hand-over and failing the backfill (REGISTER_MISMATCH); it now waits for the log
    to be quiet. Counts stay exact."""
    from streamkit.backfill import handover

    took_over = handover._take_over

    async def slow_take_over(*args: Any) -> Any:
        fs = await took_over(*args)
        await asyncio.sleep(1.0)
        return fs

    monkeypatch.setattr(handover, "_take_over", slow_take_over)
    app = copy_wordcount(tmp_path / "app")
    config = app / "streamkit.yaml"  # commits every 50 ms: each hand-over meets some
    config.write_text(config.read_text().replace("max_duration: 2s", "max_duration: 50ms"))
    setup = await Setup.start(app, broker_proc)
    lines = [{"id": i, "line": line} for i, line in enumerate(generate_lines(4000, seed=7))]
    done = asyncio.Event()
    fed = lines[:1000]

    async def trickle() -> None:
        while not done.is_set() and len(fed) < len(lines):
            batch = lines[len(fed):len(fed) + 10]
            await publish(setup, "wordcount/lines", batch)
            fed.extend(batch)
            await asyncio.sleep(0.01)

    try:
        await publish(setup, "wordcount/lines", fed)
        running = setup.member("running")
        await running.start()
        try:
            await wait_processed(running, await setup.heads())
            feeding = asyncio.create_task(trickle())
            try:
                plan = await setup.plan()
                for index in range(len(plan.shards)):  # raises if a hand-over failed
                    await run_shard(plan, index, scratch=tmp_path)
            finally:
                done.set()
                await feeding
            await wait_processed(running, await setup.heads())
            state = rocksdb_state(running)
            counted = sum((Counter({k.decode(): v for k, v in shard.items()})
                           for shard in state.values()), Counter())
            assert len(fed) > 1000
            assert counted == Counter(w for line in fed for w in line["line"].split())
        finally:
            await running.stop()
    finally:
        await setup.close()


# --- Spark outside local mode -------------------------------------------------------

CLUSTER_SCRIPT = """\
import pickle, shutil, sys
import streamkit.backfill.spark as spark

plan = pickle.loads(open(sys.argv[1], "rb").read())
zip_app = spark._zip_app


def zip_and_remove(folder):  # the executors must then use the shipped copy
    zipped = zip_app(folder)
    shutil.rmtree(folder)
    return zipped


spark._zip_app = zip_and_remove
sc = spark.spark_context("local-cluster[1,1,1024]")
results = spark.run_on_spark(plan, sc=sc, ship_app=True)
print(sum(r["messages"] for r in results))
spark.stop_context(sc)
"""


async def test_app_folder_is_shipped_to_executors(broker_proc: BrokerProcess,
                                                  tmp_path: Path) -> None:
    """Executors in their own JVMs (local-cluster mode) that don't see the app folder."""
    setup = await Setup.start(copy_wordcount(tmp_path / "app"), broker_proc)
    lines = [{"id": i, "line": line} for i, line in enumerate(generate_lines(300))]
    try:
        await publish(setup, "wordcount/lines", lines)
        plan = await setup.plan()
    finally:
        await setup.close()
    route = setup.config.mapping_for("wordcount/lines")
    read = {j.journal for shard in plan.shards[:2] for j in shard.journals}
    expected = sum(1 for line in lines if route(line)[0] in read)
    shipped = tmp_path / "shipped"
    shutil.copytree(tmp_path / "app", shipped)
    (tmp_path / "plan.pickle").write_bytes(pickle.dumps(
        dataclasses.replace(plan, app_dir=str(shipped), shards=plan.shards[:2])))
    (tmp_path / "cluster.py").write_text(CLUSTER_SCRIPT)
    env = {**os.environ, **SPARK_ENV}
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, str(tmp_path / "cluster.py"),
                         str(tmp_path / "plan.pickle")],
        capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not shipped.exists()
    assert int(done.stdout.split()[-1]) == expected


# --- errors ---------------------------------------------------------------------------


async def test_unreadable_fragment_is_named(sc: Any, broker_proc: BrokerProcess,
                                           tmp_path: Path) -> None:
    setup = await Setup.start(copy_wordcount(tmp_path / "app"), broker_proc)
    try:
        await small_fragments(setup, "wordcount/lines")
        await publish(setup, "wordcount/lines",
                      [{"id": i, "line": line} for i, line in enumerate(generate_lines(1500))])
        await rolled_fragments_persisted(setup, "wordcount/lines")
        plan = await setup.plan()
        journal = next(j for shard in plan.shards for j in shard.journals if j.bytes_direct)
        segment = next(s for s in journal.segments if s.direct)
        fragment = pb.Fragment.FromString(segment.fragment)
        files = list((broker_proc.data_dir / "fragments" / journal.journal).iterdir())
        (path,) = [p for p in files if p.name.startswith(f"{fragment.begin:016x}-")]
        path.write_bytes(b"this is not a fragment")
        with pytest.raises(BackfillError) as raised:
            await backfill(sc, plan)
        message = str(raised.value)
        assert path.name in message and journal.journal in message, message
        assert f"[{segment.begin}, {segment.end})" in message, message
    finally:
        await setup.close()


async def test_plan_errors(broker_proc: BrokerProcess, tmp_path: Path) -> None:
    app = copy_wordcount(tmp_path / "app")
    config = app_config(app)
    async with BrokerClient(broker_proc.address) as client:
        with pytest.raises(BackfillError, match="source journal wordcount/lines/part-000 does "
                                                "not exist"):
            await make_plan(config, client, config.shard_specs(), broker="", keyspace="")
        async with open_keyspace(str(tmp_path / "ks.db")) as keyspace:
            await deploy(config, client, keyspace)
        with pytest.raises(BackfillError, match="past the journal's write head"):
            await make_plan(config, client, config.shard_specs(), broker="", keyspace="",
                            ends={"wordcount/lines/part-001": 10})
        with pytest.raises(BackfillError, match="which no shard reads"):
            await make_plan(config, client, config.shard_specs(), broker="", keyspace="",
                            ends={"elsewhere": 0})


SPARK_ENV = {"SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}


def _cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "streamkit.cli.main", "backfill", *args],
                          capture_output=True, text=True, env={**os.environ, **(env or {})},
                          cwd=cwd, timeout=120)


async def test_cli_plan_and_clear_errors(broker_proc: BrokerProcess, tmp_path: Path) -> None:
    app = copy_wordcount(tmp_path / "app")
    setup = await Setup.start(app, broker_proc)
    try:
        await publish(setup, "wordcount/lines", [{"id": i, "line": "a b c"} for i in range(50)])
        heads = await setup.heads()
    finally:
        await setup.close()
    where = ["--broker", broker_proc.address, "--keyspace", str(app / "keyspace.db"),
             "--fragment-root", str(broker_proc.data_dir / "fragments")]
    shown = await asyncio.to_thread(_cli, "--plan", *where, cwd=app)  # APP defaults to "."
    assert shown.returncode == 0, shown.stderr
    for journal, head in heads.items():
        assert f"{journal}  [0, {head})" in shown.stdout
    assert "8 shards" in shown.stderr
    as_json = await asyncio.to_thread(_cli, str(app), "--plan", "--json", *where,
                                      "--end", "wordcount/lines/part-003=100")
    assert as_json.returncode == 0, as_json.stderr
    (part3,) = [j for shard in json.loads(as_json.stdout)["shards"] for j in shard["journals"]
                if j["journal"] == "wordcount/lines/part-003"]
    assert (part3["begin"], part3["end"]) == (0, 100)
    bad_end = await asyncio.to_thread(_cli, str(app), "--plan", *where, "--end", "oops")
    assert bad_end.returncode == 2 and "expected JOURNAL=OFFSET" in bad_end.stderr
    elsewhere = [*where[:2], "--keyspace", str(tmp_path / "missing.db"), *where[4:]]
    no_keyspace = await asyncio.to_thread(_cli, str(app), "--plan", *elsewhere)
    assert no_keyspace.returncode == 1, no_keyspace.stderr
    assert "missing.db: no such KeySpace file" in no_keyspace.stderr
    assert not (tmp_path / "missing.db").exists()  # named, not made

    missing = await asyncio.to_thread(_cli, str(tmp_path / "nowhere"), "--spark")
    assert missing.returncode == 2 and "streamkit.yaml: no such file" in missing.stderr

    no_java = await asyncio.to_thread(_cli, str(app), "--spark", *where,
                                      env={"JAVA_HOME": str(tmp_path / "no-jdk")})
    assert no_java.returncode == 1, no_java.stderr
    assert "Spark needs Java 17 or 21 and found none" in no_java.stderr
    assert "Traceback" not in no_java.stderr

    no_pyspark = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", "import sys; sys.modules['pyspark'] = None; "
                         "from streamkit.cli.main import main; main()", "backfill", str(app),
                         "--spark", *where], capture_output=True, text=True, timeout=120)
    assert no_pyspark.returncode == 1, no_pyspark.stderr
    assert "PySpark is not installed" in no_pyspark.stderr and "pip install pyspark" in (
        no_pyspark.stderr)

    engine = await asyncio.to_thread(_cli, str(app), *where)
    assert engine.returncode == 2 and "add --spark or --processes N" in engine.stderr
    both = await asyncio.to_thread(_cli, str(app), "--spark", "--processes", "2", *where)
    assert both.returncode == 2 and "choose one" in both.stderr

    # Without Spark: the same tasks in two local processes, every shard handed over.
    local = await asyncio.to_thread(_cli, str(app), "--processes", "2", *where)
    assert local.returncode == 0, local.stderr
    assert "handed over 8 shards" in local.stderr and "2 local processes" in local.stderr
    results = [line.split() for line in local.stdout.splitlines() if line.startswith("shard-")]
    assert sum(int(row[1]) for row in results if row[1].isdigit()) == 50  # each line once


MISCONFIGURED = """

class Misconfigured(WordCount):
    async def finalize_txn(self, shard, store, publisher) -> None:
        if shard.id == "shard-003":
            publisher.publish("nosuchtopic", {"word": "oops"})  # FAILS HERE
        await super().finalize_txn(shard, store, publisher)
"""


async def _counted_app(tmp_path: Path, broker_proc: BrokerProcess) -> Path:
    """The wordcount app, deployed, with 80 lines of history."""
    app = copy_wordcount(tmp_path / "app")
    setup = await Setup.start(app, broker_proc)
    try:
        await publish(setup, "wordcount/lines", [{"id": i, "line": "a b"} for i in range(80)])
    finally:
        await setup.close()
    return app


@pytest.mark.parametrize("engine", [["--processes", "2"], ["--spark"]], ids=["processes",
                                                                             "spark"])
async def test_cli_names_the_hook_the_line_and_the_shards_left(broker_proc: BrokerProcess,
                                                              tmp_path: Path,
                                                              engine: list[str]) -> None:
    """An app's hook failing a backfill is reported as a live shard's failure is (the
    transaction, the hook, the app's file:line; its frames logged, no traceback of
    streamkit's, nor Spark's stacks), and the shards handed over before it, and those not,
    are named. Before, the error named neither the hook nor the line, and the note named no
    shard."""
    app = await _counted_app(tmp_path, broker_proc)
    (app / "app.py").write_text((app / "app.py").read_text() + MISCONFIGURED)
    (app / "streamkit.yaml").write_text((app / "streamkit.yaml").read_text().replace(
        "app:WordCount", "app:Misconfigured"))
    lines = (app / "app.py").read_text().splitlines()
    line = next(number for number, text in enumerate(lines, 1) if "FAILS HERE" in text)
    failed = await asyncio.to_thread(
        _cli, str(app), *engine, "--broker", broker_proc.address, "--keyspace",
        str(app / "keyspace.db"), "--fragment-root", str(broker_proc.data_dir / "fragments"),
        env=SPARK_ENV)
    assert failed.returncode == 1, failed.stderr
    assert "at org.apache" not in failed.stderr and "spark: ERROR" not in failed.stderr, (
        failed.stderr)
    assert ("streamkit: error: shard shard-003: transaction 1 failed at finalize_txn: "
            "ConfigError: ") in failed.stderr, failed.stderr
    assert f"is neither a source nor an output (add it to outputs) (at app.py:{line})" in (
        failed.stderr)
    assert f'app.py", line {line}, in finalize_txn' in failed.stderr, failed.stderr
    assert "Traceback (most recent call last)" not in failed.stderr, failed.stderr
    if engine == ["--spark"]:  # (Spark doesn't tell which tasks finished before)
        assert "shards handed over before this keep their backfilled state" in failed.stderr
        assert failed.stderr.rstrip().endswith("running the same `streamkit backfill` again "
                                               "is safe: it backfills every shard again")
        return
    note = re.search(r"handed over (\d+) of 8 shards: (.*?)(?: \(.*?\))?; not finished: "
                     r"(.*?); running the same `streamkit backfill` again is safe", failed.stderr)
    assert note, failed.stderr
    handed = [] if note[2] == "none" else note[2].split(", ")
    assert len(handed) == int(note[1]) and "shard-003" in note[3].split(", "), failed.stderr
    assert sorted(handed + note[3].split(", ")) == [f"shard-{i:03d}" for i in range(8)]


async def test_a_history_with_a_gap_is_backfilled_only_when_asked(
        broker_proc: BrokerProcess, tmp_path: Path) -> None:
    """Part of a source's history removed (retention, a prune): the backfill refuses, naming
    the journal, unless --skip-missing. It replaced the shards' state with one computed
    without it (a reshard kept 5% of every count), saying so only in the plan's summary."""
    app = await _counted_app(tmp_path, broker_proc)
    assert broker_proc.terminate() == 0  # its spools persisted as fragment files
    fragments = sorted((broker_proc.data_dir / "fragments").rglob("*.sz"))
    assert fragments, list((broker_proc.data_dir / "fragments").rglob("*"))
    fragments[0].unlink()  # the broker, started again, lists the rest
    broker_proc.start()
    journal = fragments[0].parent.relative_to(broker_proc.data_dir / "fragments").as_posix()
    where = ["--broker", broker_proc.address, "--keyspace", str(app / "keyspace.db"),
             "--fragment-root", str(broker_proc.data_dir / "fragments")]
    refused = await asyncio.to_thread(_cli, str(app), "--processes", "2", *where)
    assert refused.returncode == 1, refused.stderr
    assert "part of the history is in no fragment any more" in refused.stderr
    assert journal in refused.stderr and "--skip-missing" in refused.stderr, refused.stderr
    done = await asyncio.to_thread(_cli, str(app), "--processes", "2", "--skip-missing",
                                   *where)
    assert done.returncode == 0, done.stderr
    assert f"and skipped: {journal}" in done.stderr, done.stderr


def _poisoned_app(folder: Path, name: str, policies: str) -> Path:
    app = copy_wordcount(folder)
    source = (app / "app.py").read_text() + "\n" + POISONED
    (app / "app.py").write_text(source.replace("wordcount/", f"{name}/"))
    config = (app / "streamkit.yaml").read_text().replace("wordcount", name)
    config = config.replace("app:WordCount", "app:Poisoned").replace(
        "    key: id\n", f"    key: id\n{policies}", 1)
    (app / "streamkit.yaml").write_text(config)
    return app


async def test_poison_is_passed_over_as_a_live_shard_would(broker_proc: BrokerProcess,
                                                          tmp_path: Path) -> None:
    """The backfill applies the sources' poison policies as the live shards do: a message
    consume_message raises on and a frame that doesn't decode are dead-lettered (under
    `dead-letter`, as docs/concepts/messages.md says); under the default policy the same
    history fails the backfill, naming the transaction, the hook and the message, or the
    read and the frame. Before, the backfill failed on the first and dropped the second
    silently, whatever the policies said."""

    lines = [{"id": i, "line": "poison pill" if i % 50 == 7 else f"w{i % 13} common"}
             for i in range(400)]
    expected = Counter(w for m in lines if "poison" not in m["line"] for w in m["line"].split())
    failures = {"strict": r"failed at consume_message on the message at strict/lines/part-.* "
                          r"ValueError: cannot count line",
                "frames": r"failed at read: FrameError: .*frames/lines/part-003"}
    for name, policies in (("lenient", "    on_consume_error: dead-letter\n"
                                       "    on_undecodable: dead-letter\n"),
                           ("strict", ""), ("frames", "    on_consume_error: skip\n")):
        setup = await Setup.start(_poisoned_app(tmp_path / name, name, policies), broker_proc)
        try:
            await publish(setup, f"{name}/lines", lines)
            async with AppendService(setup.client) as service:  # a frame that isn't JSON
                await (await service.append(f"{name}/lines/part-003", b"{not json\n"))
            plan = await setup.plan()
            if name in failures:
                with pytest.raises(TransactionFailed, match=failures[name]):
                    for index in range(len(plan.shards)):
                        await run_shard(plan, index)
                continue
            for index in range(len(plan.shards)):
                await run_shard(plan, index)
            assert totals_of_updates(await read_output(setup, f"{name}/counts")) == expected
            letters = await read_journals(setup.client, [f"{name}/dead-letters"])
            assert sorted(letter["message"]["id"] for letter in letters if "message" in letter
                          ) == [m["id"] for m in lines if "poison" in m["line"]]
            (frame,) = [letter for letter in letters if letter["cause"] == "undecodable"]
            assert base64.b64decode(frame["raw"]) == b"{not json\n", frame
            assert len(letters) == 1 + sum("poison" in m["line"] for m in lines)
        finally:
            await setup.close()


SLOW = """
class Slow(WordCount):
    async def finalize_txn(self, shard, store, publisher) -> None:
        import asyncio

        await asyncio.sleep(0.05)
        await super().finalize_txn(shard, store, publisher)
"""


async def test_a_running_task_reports_how_far_it_has_read(
        broker_proc: BrokerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A task given a progress folder on its machine writes its shard's bytes read of its
    journals there while it consumes (what `streamkit backfill` shows every 15 s of a long
    run), and removes its report when done; without the folder it writes nothing."""
    from streamkit.backfill import progress

    monkeypatch.setattr(progress, "INTERVAL", 0.05)
    app = copy_wordcount(tmp_path / "slow")
    (app / "app.py").write_text((app / "app.py").read_text() + SLOW)
    config = (app / "streamkit.yaml").read_text().replace("app:WordCount", "app:Slow")
    (app / "streamkit.yaml").write_text(config)
    setup = await Setup.start(app, broker_proc)
    try:
        await publish(setup, "wordcount/lines",
                      [{"id": i, "line": f"w{i % 7} common"} for i in range(2400)])
        folder = tmp_path / "progress"
        folder.mkdir()
        plan = dataclasses.replace(await setup.plan(txn_size=20), progress_dir=str(folder))
        total = sum(j.end - j.begin for j in plan.shards[0].journals)
        task = asyncio.create_task(run_shard(plan, 0))
        seen: list[progress.ShardProgress] = []

        def part_way() -> bool:
            seen.extend(r for r in progress.read_progress(folder) if r.read > 0)
            return bool(seen) or task.done()

        await eventually(part_way, timeout=30, what="a progress report")
        result = await task
        assert seen, "the task ended before it reported"
        assert seen[0].shard == "shard-000" and seen[0].total == total > 0
        assert seen[0].describe().startswith("shard-000 ") and "% of 0." in seen[0].describe()
        assert result.messages > 200  # (its share of the 2,400 lines)
        assert list(folder.iterdir()) == []  # done: its report is gone
    finally:
        await setup.close()


STUCK = """
class Stuck(WordCount):
    stuck = False

    async def finalize_txn(self, shard, store, publisher) -> None:
        import time

        if not Stuck.stuck:  # once: a blocking call that runs past hook_timeout
            Stuck.stuck = True
            time.sleep(1.5)
        await super().finalize_txn(shard, store, publisher)
"""


async def test_a_hook_running_too_long_in_a_task_is_named(
        broker_proc: BrokerProcess, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A backfill task's hook running past `transactions.hook_timeout` is logged naming the
    shard, the hook and where it is, as a live shard's is (a hung hook would otherwise hang
    the backfill without a word)."""

    app = copy_wordcount(tmp_path / "stuck")
    (app / "app.py").write_text((app / "app.py").read_text() + STUCK)
    config = (app / "streamkit.yaml").read_text().replace("app:WordCount", "app:Stuck")
    (app / "streamkit.yaml").write_text(config.replace(
        "transactions:\n", "transactions:\n  hook_timeout: 500ms\n"))
    setup = await Setup.start(app, broker_proc)
    try:
        await publish(setup, "wordcount/lines", [{"id": i, "line": "w"} for i in range(50)])
        plan = await setup.plan()
        with caplog.at_level(logging.WARNING, logger="streamkit.app.watchdog"):
            result = await run_shard(plan, 0)
        assert result.messages > 0
        warned = [r.getMessage() for r in caplog.records if r.name == "streamkit.app.watchdog"]
        assert len(warned) == 1, warned
        assert warned[0].startswith("shard shard-000: finalize_txn has run for "), warned
        assert "time.sleep(1.5)" in warned[0], warned
    finally:
        await setup.close()


def test_tasks_of_a_process_share_its_watchdog() -> None:
    """A pool's process or a Spark worker runs many tasks: one watchdog (a thread and a
    pipe) for them all, with each task's limit, not one left open per task."""
    from streamkit.backfill.task import _watchdog

    first = _watchdog(1.0)
    assert _watchdog(2.5) is first and first.limit == 2.5
