"""RocksDBStore: transactions, recording by directory diffs, recovery, crashes and fencing.

Also runnable as the crash test's writer process:

    python -m tests.test_rocksdb_store ADDRESS LOG DIRECTORY
"""

from __future__ import annotations

import asyncio
import datetime
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from streamkit.client import BrokerClient, OpFuture, RegisterMismatch
from streamkit.protocol import consumer_pb, pb
from streamkit.recoverylog import CONTENT_TYPE, FSM, Recorder, rpb
from streamkit.recoverylog.recovery import recover
from streamkit.stores.dir_observer import DirObserver
from streamkit.stores.rocksdb import MIN_MEMTABLE, RocksDBStore, default_options
from streamkit.stores.store import StoreError
from tests.brokerproc import BrokerProcess
from tests.helpers_client import create_journal, unique_name
from tests.viewing import destroy_while_viewing
from tests.waiting import DEADLINE

ROOT = Path(__file__).resolve().parent.parent
SOURCE = "input/part-000"
KEYS = 200


def small_files() -> Any:
    """Tiny memtables and SSTs, so a few MiB of writes flush and compact many times."""
    return default_options(write_buffer_size=64 << 10, target_file_size=64 << 10)


def checkpoint_of(n: int) -> consumer_pb.Checkpoint:
    cp = consumer_pb.Checkpoint()
    cp.sources[SOURCE].read_through = n
    return cp


def transaction(n: int) -> dict[str, Any]:
    """Transaction `n`'s mutations (None: delete), the same in every process."""
    rng = random.Random(n)
    txn: dict[str, Any] = {"count": n}
    for _ in range(rng.randint(5, 30)):
        key = f"k{rng.randrange(KEYS):04d}"
        if rng.random() < 0.2:
            txn[key] = None
        elif rng.random() < 0.5:
            txn[key] = {"n": n, "pad": "x" * rng.randrange(1, 500)}
        else:
            txn[key] = rng.randbytes(rng.randrange(500, 4000))  # incompressible bulk
    return txn


def model_after(n: int) -> dict[bytes, Any]:
    state: dict[bytes, Any] = {}
    for i in range(1, n + 1):
        for key, value in transaction(i).items():
            if value is None:
                state.pop(key.encode(), None)
            else:
                state[key.encode()] = value
    return state


def apply(store: RocksDBStore, n: int) -> None:
    with store.write_batch() as batch:
        for key, value in transaction(n).items():
            if value is None:
                batch.delete(key)
            else:
                batch.put(key, value)


async def new_log(client: BrokerClient) -> str:
    log = unique_name("rocksdb-store")
    await create_journal(client, log, length=4 << 20, labels={"content-type": CONTENT_TYPE})
    return log


async def reopen(client: BrokerClient, log: str, directory: Path
                 ) -> tuple[RocksDBStore, consumer_pb.Checkpoint]:
    fs = await recover(client, log, directory)
    store = RocksDBStore(fs, small_files())
    return store, await store.restore_checkpoint("shard")


async def close(store: RocksDBStore) -> None:
    await store.destroy()
    if store.fs is not None:
        await store.fs.recorder.close()


# --- without a log -----------------------------------------------------------


async def test_transactions_reads_and_types(tmp_path: Path) -> None:
    store = RocksDBStore(tmp_path / "db")
    assert await store.restore_checkpoint("shard") == consumer_pb.Checkpoint()
    store.put("a", b"bytes")
    store.put(b"b", {"json": [1, 2]})
    store.put("c", "text")
    store.delete("c")
    assert store.get("a") == b"bytes" and store.get("b") == {"json": [1, 2]}
    assert store.get("c", "gone") == "gone"
    with pytest.raises(KeyError):
        store.put(b"\x00streamkit/checkpoint", b"mine")
    with pytest.raises(RuntimeError), store.write_batch() as batch:
        batch.put("d", 1)
        raise RuntimeError("the group is dropped")
    assert store.get("d") is None

    await (await store.start_commit("shard", checkpoint_of(1), []))
    store.put("a", b"next")  # the next transaction, on top of the committed one
    assert [k for k, _ in store.items()] == [b"a", b"b"]
    assert store.get("a") == b"next"

    failing = OpFuture.finished(RuntimeError("append failed"))
    op = await store.start_commit("shard", checkpoint_of(2), [failing])
    with pytest.raises(RuntimeError, match="append failed"):
        await op
    with pytest.raises(StoreError):
        store.put("x", 1)
    await store.destroy()

    again = RocksDBStore(tmp_path / "db")
    assert await again.restore_checkpoint("shard") == checkpoint_of(1)
    assert dict(again.items()) == {b"a": b"bytes", b"b": {"json": [1, 2]}}
    await again.destroy()


@pytest.mark.parametrize("key", [3, 10**9, 1.5, None, bytearray(b"a"), memoryview(b"a")])
async def test_a_key_must_be_str_or_bytes(tmp_path: Path, key: Any) -> None:
    """`bytes(3)` is three zero bytes (and `bytes(10**9)` a GiB): no such key is stored."""
    store = RocksDBStore(tmp_path / "db")
    await store.restore_checkpoint("shard")
    kind = type(key).__name__
    for call in (lambda: store.put(key, 1), lambda: store.get(key), lambda: store.delete(key),
                 lambda: list(store.items(key))):
        with pytest.raises(TypeError, match=f"must be str or bytes, not {kind}$"):
            call()
    with pytest.raises(TypeError, match=kind), store.write_batch() as batch:
        batch.put(key, 1)
    assert list(store.items()) == []
    await store.destroy()


async def test_nan_and_infinity_are_kept_as_put(tmp_path: Path) -> None:
    """orjson would store them as null; like JSONFileStore, the store keeps them."""
    nan, inf = float("nan"), float("inf")
    values = {"nan": nan, "inf": inf, "nested": {"xs": [1.5, -inf, None], "ok": None},
              "none": {"just": None}}
    store = RocksDBStore(tmp_path / "db")
    await store.restore_checkpoint("shard")
    for key, value in values.items():
        store.put(key, value)
    with store.write_batch() as batch:
        batch.put("batched", [nan])
    await (await store.start_commit("shard", checkpoint_of(1), []))
    await store.destroy()

    again = RocksDBStore(tmp_path / "db")
    await again.restore_checkpoint("shard")
    got = dict(again.items())
    assert repr(got) == repr({k.encode(): v for k, v in
                              sorted({**values, "batched": [nan]}.items())}), got
    assert again.get("nested")["xs"][1] == -inf and again.get("none") == {"just": None}
    with pytest.raises(ValueError, match="key b'when': a value holding NaN"):
        again.put("when", {"at": datetime.date(2024, 1, 1), "x": nan})
    await again.destroy()


async def test_a_committed_view_reads_the_last_durable_commit_only(tmp_path: Path) -> None:
    store = RocksDBStore(tmp_path / "db")
    await store.restore_checkpoint("shard")
    store.put("a", 1)
    store.put("b", 1)
    await (await store.start_commit("shard", checkpoint_of(1), []))
    store.put("a", 2)  # a transaction waiting on its appends
    store.delete("b")
    appended = OpFuture(asyncio.get_running_loop())
    op = await store.start_commit("shard", checkpoint_of(2), [appended])
    store.put("a", 3)  # and the next, open one
    store.put("c", 3)

    async def viewed() -> tuple[Any, ...]:
        async with store.committed_view():
            with pytest.raises(StoreError, match="read-only"):
                store.put("a", 4)
            return store.get("a"), store.get("b"), store.get("c"), dict(store.items())

    assert await viewed() == (1, 1, None, {b"a": 1, b"b": 1})
    # Other tasks (the transaction loop's) keep seeing their transaction meanwhile.
    go = asyncio.Event()

    async def transaction_side() -> Any:
        await go.wait()
        return store.get("a")

    transaction = asyncio.create_task(transaction_side())  # its own context: no view
    async with store.committed_view():
        assert store.get("a") == 1
        go.set()
        assert await transaction == 3
    appended.resolve(OpFuture.finished().result())
    await op
    assert await viewed() == (2, None, None, {b"a": 2})
    await store.destroy()


async def test_a_commit_and_committed_views_wait_for_each_other(tmp_path: Path) -> None:
    """A commit writes only once open views closed; a view opens only once the commit
    writing is durable. So a view never sees a commit half-way."""
    store = RocksDBStore(tmp_path / "db")
    await store.restore_checkpoint("shard")
    store.put("a", 1)
    await (await store.start_commit("shard", checkpoint_of(1), []))
    store.put("a", 2)
    view = store.committed_view()
    await view.__aenter__()
    op = await store.start_commit("shard", checkpoint_of(2), [])
    await asyncio.sleep(0.05)
    assert not op.done() and store.get("a") == 1  # the commit waits for the view
    await view.__aexit__(None, None, None)
    await asyncio.wait_for(op, DEADLINE)

    # A commit whose write is queued on the store's thread: a new view waits for it.
    store.put("a", 3)
    gate = asyncio.Event()
    blocked = asyncio.ensure_future(store._call(_wait_for, gate, asyncio.get_running_loop()))
    op = await store.start_commit("shard", checkpoint_of(3), [])
    await asyncio.sleep(0.05)
    assert store._writing is not None
    reading = asyncio.ensure_future(_read_in_view(store, "a"))
    await asyncio.sleep(0.05)
    assert not reading.done()
    gate.set()
    assert await asyncio.wait_for(reading, DEADLINE) == 3  # after the commit, not before
    await blocked
    await op
    await store.destroy()


class _SlowLog:
    """Stands in for a store's observer and recorder: the barrier waits for `durable`."""

    def __init__(self) -> None:
        self.durable = asyncio.Event()
        self.recorder = self

    def scan(self) -> object:
        return object()

    def record(self, observation: object) -> bool:
        return True

    async def barrier(self) -> pb.AppendResponse:
        await self.durable.wait()
        return pb.AppendResponse(status=pb.OK)


async def test_a_committed_view_waits_until_a_written_commit_is_durable(tmp_path: Path) -> None:
    """Written but not yet in the recovery log is not committed: a view waits for it,
    and a view cancelled while waiting leaves nothing behind."""
    store = RocksDBStore(tmp_path / "db")
    await store.restore_checkpoint("shard")
    store.put("a", 1)
    await (await store.start_commit("shard", checkpoint_of(1), []))
    log = store.observer = _SlowLog()  # type: ignore[assignment]
    store.put("a", 2)
    op = await store.start_commit("shard", checkpoint_of(2), [])
    while store._committing:  # until written (the barrier is what's left)
        await asyncio.sleep(0.01)
    cancelled = asyncio.ensure_future(_read_in_view(store, "a"))
    reading = asyncio.ensure_future(_read_in_view(store, "a"))
    await asyncio.sleep(0.05)
    assert not reading.done()
    cancelled.cancel()
    log.durable.set()
    assert await asyncio.wait_for(reading, DEADLINE) == 2
    await op
    store.observer = None
    store.put("a", 3)
    await asyncio.wait_for(await store.start_commit("shard", checkpoint_of(3), []), DEADLINE)
    assert store._views.count == 0
    async with store.committed_view(), store.committed_view():  # nested: no deadlock
        assert store.get("a") == 3
    await store.destroy()


def _wait_for(gate: asyncio.Event, loop: asyncio.AbstractEventLoop) -> None:
    asyncio.run_coroutine_threadsafe(gate.wait(), loop).result(DEADLINE)


async def _read_in_view(store: RocksDBStore, key: str) -> Any:
    async with store.committed_view():
        return store.get(key)


async def test_a_failed_commit_closes_committed_views(tmp_path: Path) -> None:
    store = RocksDBStore(tmp_path / "db")
    await store.restore_checkpoint("shard")
    op = await store.start_commit("shard", checkpoint_of(1), [OpFuture.finished(OSError("x"))])
    with pytest.raises(OSError):
        await op
    with pytest.raises(StoreError, match="failed a commit"):
        async with store.committed_view():
            pass
    await store.destroy()


async def test_destroy_waits_for_open_committed_views(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A query reading in a view when its shard is released reads on until it ends (up
    to VIEW_DRAIN_TIMEOUT); new views are refused; one left past the timeout gets an
    error naming the destroyed store, not a closed database."""
    store = RocksDBStore(tmp_path / "db")
    await store.restore_checkpoint("shard")
    store.put("a", 1)
    await (await store.start_commit("shard", checkpoint_of(1), []))
    assert await destroy_while_viewing(store, lambda: store.get("a")) == 1

    monkeypatch.setattr("streamkit.stores.store.VIEW_DRAIN_TIMEOUT", 0.05)
    store = RocksDBStore(tmp_path / "db")
    await store.restore_checkpoint("shard")
    go = asyncio.Event()

    async def query() -> None:  # past the timeout: its read fails, the process lives
        async with store.committed_view():
            await go.wait()
            store.get("a")

    querying = asyncio.ensure_future(query())
    await asyncio.sleep(0.01)
    await asyncio.wait_for(store.destroy(), DEADLINE)
    go.set()
    with pytest.raises(StoreError, match="destroyed"):
        await querying


async def test_destroy_before_the_commit_task_ran_fails_its_op(tmp_path: Path) -> None:
    """A commit cancelled before its first step still resolves its OpFuture (as failed)."""
    store = RocksDBStore(tmp_path / "db")
    await store.restore_checkpoint("shard")
    store.put("a", 1)
    op = await store.start_commit("shard", checkpoint_of(1), [])
    await store.destroy()  # the commit task has not been scheduled yet
    with pytest.raises(StoreError, match="destroyed"):
        await asyncio.wait_for(op, DEADLINE)


async def test_restore_drops_uncommitted_mutations(tmp_path: Path) -> None:
    """A second restore_checkpoint starts a fresh transaction: earlier puts are void."""
    store = RocksDBStore(tmp_path / "db")
    await store.restore_checkpoint("shard")
    store.put("kept", 1)
    await (await store.start_commit("shard", checkpoint_of(1), []))
    store.put("dropped", 2)
    assert await store.restore_checkpoint("shard") == checkpoint_of(1)
    assert store.get("dropped") is None
    await (await store.start_commit("shard", checkpoint_of(2), []))
    assert dict(store.items()) == {b"kept": 1}
    await store.destroy()


async def test_observer_orders_and_holds_back_metadata(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MANIFEST/CURRENT and removals wait for a pass in which the MANIFEST held still."""
    recorder = Recorder(None, "log", FSM(rpb.FSMHints(log="log")))  # type: ignore[arg-type]
    observer = DirObserver(tmp_path, recorder)  # never started: ops just queue
    for name, data in (("000001.sst", b"s" * 10), ("MANIFEST-000002", b"m1"),
                       ("CURRENT", b"MANIFEST-000002\n"), ("LOG", b"info")):
        (tmp_path / name).write_bytes(data)

    scan = observer.scan()
    scan.stable = False  # as if a flush edited the MANIFEST meanwhile
    assert not observer.record(scan)
    assert set(recorder.fsm.links) == {"/000001.sst"}
    assert observer.record(observer.scan())
    assert set(recorder.fsm.links) == {"/000001.sst", "/MANIFEST-000002", "/CURRENT"}
    assert len(recorder._queue) == 2  # the metadata went into a batch of its own

    with open(tmp_path / "MANIFEST-000002", "ab") as f:
        f.write(b"m2")
    (tmp_path / "x.dbtmp").write_bytes(b"MANIFEST-000002\n")
    os.replace(tmp_path / "x.dbtmp", tmp_path / "CURRENT")
    (tmp_path / "000001.sst").unlink()
    kinds = {c.name: (c.kind, c.offset, c.data) for c in observer.scan().changes}
    assert kinds == {
        "MANIFEST-000002": ("append", 2, b"m2"),
        "CURRENT": ("replace", 0, b"MANIFEST-000002\n"),
        "000001.sst": ("remove", 0, b""),
    }


# --- recorded ----------------------------------------------------------------


async def test_randomized_workload_recovers_and_fences(
    shared_broker: BrokerProcess, tmp_path: Path
) -> None:
    async with BrokerClient(shared_broker.address) as client:
        log = await new_log(client)
        store, checkpoint = await reopen(client, log, tmp_path / "first")
        assert checkpoint == consumer_pb.Checkpoint()
        pending: OpFuture | None = None
        for n in range(1, 61):
            apply(store, n)  # built while the previous commit is still in flight
            if pending is not None:
                await pending
            pending = await store.start_commit("shard", checkpoint_of(n), [])
            if n % 20 == 0:
                await asyncio.to_thread(store._db.compact_range, None, None)  # type: ignore[union-attr]
        assert pending is not None
        await pending
        names = os.listdir(tmp_path / "first")
        assert sum(name.endswith(".sst") for name in names) > 1
        assert store.observer is not None and store.observer.bytes_recorded > 1 << 20

        second, checkpoint = await reopen(client, log, tmp_path / "second")
        assert checkpoint == checkpoint_of(60)
        assert dict(second.items()) == model_after(60)

        apply(store, 61)  # the first store was fenced by the second recover()
        with pytest.raises(RegisterMismatch):
            await (await store.start_commit("shard", checkpoint_of(61), []))
        await close(store)  # the recorder's failure is sticky; closing it does not raise

        apply(second, 61)
        await (await second.start_commit("shard", checkpoint_of(61), []))
        await close(second)
        third, checkpoint = await reopen(client, log, tmp_path / "third")
        assert checkpoint == checkpoint_of(61)
        assert dict(third.items()) == model_after(61)
        await close(third)


async def test_sigkill_at_random_recovers_a_committed_state(
    shared_broker: BrokerProcess, tmp_path: Path, rng: random.Random
) -> None:
    async with BrokerClient(shared_broker.address) as client:
        log = await new_log(client)
        last = 0
        for round_ in range(3):  # each round recovers what the killed writer left
            writer = subprocess.Popen(
                [sys.executable, "-m", "tests.test_rocksdb_store", shared_broker.address, log,
                 str(tmp_path / f"writer{round_}")],
                cwd=ROOT, stdout=subprocess.PIPE, text=True,
            )
            assert writer.stdout is not None
            kill_after = last + rng.randint(5, 40)
            started = time.monotonic()
            for line in writer.stdout:
                last = int(line)
                if last >= kill_after or time.monotonic() - started > 8:
                    break
            # The kill moment, what is tested: land mid-commit, mid-flush, ...
            await asyncio.sleep(rng.random() * 0.05)
            writer.send_signal(signal.SIGKILL)
            writer.wait()

            store, checkpoint = await reopen(client, log, tmp_path / f"check{round_}")
            n = checkpoint.sources[SOURCE].read_through
            assert n >= last
            assert dict(store.items()) == model_after(n)
            await close(store)
            last = n


async def _writer(address: str, log: str, directory: Path) -> None:
    """Commit transactions forever, printing each number once its commit resolved."""
    async with BrokerClient(address) as client:
        store, checkpoint = await reopen(client, log, directory)
        n = checkpoint.sources[SOURCE].read_through
        while True:
            n += 1
            apply(store, n)
            await (await store.start_commit("shard", checkpoint_of(n), []))
            print(n, flush=True)


if __name__ == "__main__":
    asyncio.run(_writer(sys.argv[1], sys.argv[2], Path(sys.argv[3])))


async def test_a_log_deposed_during_the_first_open_starts_afresh(
    shared_broker: Any, tmp_path: Path
) -> None:
    """The first primary was fenced after its WAL was recorded but before the metadata
    group that makes a database: the next primary opens an empty database, not a
    directory RocksDB calls corrupt."""
    async with BrokerClient(shared_broker.address) as client:
        log = await new_log(client)
        fs = await recover(client, log, tmp_path / "first")
        with fs.open("000004.log", "wb") as wal:
            wal.write(b"a WAL whose database was never recorded")
        await fs.recorder.barrier()
        await fs.recorder.close()
        store, checkpoint = await reopen(client, log, tmp_path / "second")
        assert checkpoint == consumer_pb.Checkpoint()
        apply(store, 1)
        await (await store.start_commit("s", checkpoint_of(1), []))
        await close(store)
        again, checkpoint = await reopen(client, log, tmp_path / "third")
        assert checkpoint == checkpoint_of(1)
        await close(again)


async def test_a_shards_store_has_little_wal_to_replay_whatever_its_history(
    shared_broker: BrokerProcess, tmp_path: Path
) -> None:
    """The store a shard gets replays, at open, only the WAL since its memtable last
    flushed: a memtable sized by the (small) state keeps that bounded while the
    history keeps growing."""
    from types import SimpleNamespace

    from streamkit.app.store_kinds import build_store

    async with BrokerClient(shared_broker.address) as client:
        log = await new_log(client)
        fs = await recover(client, log, tmp_path / "first")
        store = build_store("rocksdb", SimpleNamespace(id="shard"), fs)  # type: ignore[arg-type]
        assert isinstance(store, RocksDBStore)
        await store.restore_checkpoint("shard")
        written = 0
        for n in range(1, 601):
            apply(store, n)
            written += sum(len(v) if isinstance(v, bytes) else 100
                           for v in transaction(n).values() if v is not None)
            await (await store.start_commit("shard", checkpoint_of(n), []))
        wal = sum(f.stat().st_size for f in (tmp_path / "first").glob("*.log"))
        assert written > 32 * MIN_MEMTABLE  # RocksDB's default memtable would hold it all
        assert wal <= 4 * MIN_MEMTABLE
        await close(store)

        second, checkpoint = await reopen(client, log, tmp_path / "second")
        assert checkpoint == checkpoint_of(600)
        assert dict(second.items()) == model_after(600)
        await close(second)


async def _grow(store: RocksDBStore, mib: int, seed: int) -> None:
    """`mib` commits of 1 MiB of distinct, incompressible values each."""
    rng = random.Random(seed)
    for n in range(1, mib + 1):
        with store.write_batch() as batch:
            for k in range(16):
                batch.put(f"{n:03d}/{k:02d}", rng.randbytes(64 << 10))
        await (await store.start_commit("shard", checkpoint_of(n), []))


def _saved_size(directory: Path) -> int:
    """The memtable size in the database's latest OPTIONS file."""
    latest = max(directory.glob("OPTIONS-*"), key=lambda f: int(f.name[8:]))
    return int(re.findall(r"^\s*write_buffer_size=(\d+)$", latest.read_text(),
                          re.MULTILINE)[0])


async def test_a_growing_state_gets_a_larger_memtable(tmp_path: Path) -> None:
    """Large states keep large memtables (less compaction); the size follows the SSTs."""
    store = RocksDBStore(tmp_path / "db", sized_memtable=True)
    await store.restore_checkpoint("shard")
    await _grow(store, 24, seed=7)
    assert _saved_size(tmp_path / "db") >= 8 * MIN_MEMTABLE  # 2 MiB for ~20 MiB of SSTs
    await close(store)


async def test_a_failed_memtable_resize_fails_no_commit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Resizing is tuning: if RocksDB refuses the new size, the commit (already written)
    still succeeds, resizing stops, and the store goes on."""

    class Refusing:
        """The database, refusing option changes."""

        def __init__(self, db: Any) -> None:
            self._db = db

        def set_options(self, options: dict[str, str]) -> None:
            raise RuntimeError(f"refused {options}")

        def __getattr__(self, name: str) -> Any:
            return getattr(self._db, name)

    store = RocksDBStore(tmp_path / "db", sized_memtable=True)
    await store.restore_checkpoint("shard")
    db = store._db
    store._db = Refusing(db)  # type: ignore[assignment]
    await _grow(store, 12, seed=3)  # ~12 MiB of state: a larger memtable is wanted
    assert "resizing to" in caplog.text
    assert store.get("012/15") is not None
    store._db = db
    await close(store)


async def test_a_reopened_store_takes_the_memtable_its_state_calls_for(tmp_path: Path) -> None:
    """RocksDB reopens a database with its saved column-family options, not the ones it
    is given: a store made with RocksDB's 64 MiB memtable (before streamkit sized them)
    gets the small one its state calls for when it opens sized."""
    store = RocksDBStore(tmp_path / "db", default_options(write_buffer_size=64 << 20))
    await store.restore_checkpoint("shard")
    store.put("k", 1)
    await (await store.start_commit("shard", checkpoint_of(1), []))
    await close(store)

    assert _saved_size(tmp_path / "db") == 64 << 20
    reopened = RocksDBStore(tmp_path / "db", sized_memtable=True)
    assert await reopened.restore_checkpoint("shard") == checkpoint_of(1)
    assert _saved_size(tmp_path / "db") == MIN_MEMTABLE
    assert reopened.get("k") == 1
    await close(reopened)
