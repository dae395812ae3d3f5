"""SQLiteStore against a real broker: the recorded database recovers exactly, after SIGKILL too.

Run as a module (`python -m tests.test_sqlite_store ADDRESS LOG DIR MODE`),
this file is the writer process of the SIGKILL test.
"""

from __future__ import annotations

import asyncio
import random
import resource
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import apsw
import pytest

from streamkit.client import BrokerClient, OpFuture, RegisterMismatch
from streamkit.recoverylog.recovery import recover
from streamkit.stores.sqlite import IDLE_READERS, JournalMode, SQLiteStore
from streamkit.stores.store import StoreError
from tests.brokerproc import BrokerProcess
from tests.test_json_store import SHARD, checkpoint_of, new_log, run_and_kill_writer, txn_of
from tests.viewing import destroy_while_viewing
from tests.waiting import DEADLINE

MODES: list[JournalMode] = ["DELETE", "WAL"]


def txn_ops(txn: int) -> Iterator[tuple[int, bytes | None]]:
    """Transaction `txn`'s changes, reproducible: (key, row value) upserts, (key, None) deletes.

    Values span several pages, so a torn commit would show.
    """
    rng = random.Random(txn)
    for _ in range(rng.randint(1, 20)):
        key = rng.randrange(200)
        if rng.random() < 0.3:
            yield key, None
        else:
            yield key, txn.to_bytes(4, "big") + rng.randbytes(rng.randrange(10, 6000))


def apply_txn(db: apsw.Connection, txn: int) -> None:
    db.execute("CREATE TABLE IF NOT EXISTS kv(k INTEGER PRIMARY KEY, v BLOB NOT NULL)")
    for key, value in txn_ops(txn):
        if value is None:
            db.execute("DELETE FROM kv WHERE k = ?", (key,))
        else:
            db.execute("INSERT OR REPLACE INTO kv VALUES (?, ?)", (key, value))


def expected_rows(txns: int) -> dict[int, bytes]:
    rows: dict[int, bytes] = {}
    for txn in range(1, txns + 1):
        for key, value in txn_ops(txn):
            if value is None:
                rows.pop(key, None)
            else:
                rows[key] = value
    return rows


def rows_of(db: apsw.Connection) -> dict[int, bytes]:
    """The kv table's content; also asserts the database is intact."""
    assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    has_kv = db.execute("SELECT 1 FROM sqlite_master WHERE name = 'kv'").fetchone()
    return dict(db.execute("SELECT k, v FROM kv").fetchall()) if has_kv else {}


async def committed_primary(client: BrokerClient, log: str, directory: Path) -> SQLiteStore:
    """A store that took over `log` and committed transaction 1."""
    store = SQLiteStore(await recover(client, log, directory))
    await store.restore_checkpoint(SHARD)
    apply_txn(store.db, 1)
    await (await store.start_commit(SHARD, checkpoint_of(1), []))
    return store


async def assert_recovers(client: BrokerClient, log: str, directory: Path, txn: int,
                          rows: dict[int, bytes]) -> None:
    """A fresh instance recovered from `log` holds checkpoint `txn` and exactly `rows`."""
    fs = await recover(client, log, directory)
    store = SQLiteStore(fs)
    assert txn_of(await store.restore_checkpoint(SHARD)) == txn
    assert rows_of(store.db) == rows
    await store.destroy()
    await fs.recorder.close()


@pytest.mark.parametrize("mode", MODES)
async def test_random_workload_recovers_exactly(
    shared_broker: BrokerProcess, tmp_path: Path, mode: JournalMode
) -> None:
    async with BrokerClient(shared_broker.address) as client:
        log = await new_log(client)
        fs = await recover(client, log, tmp_path / "primary")
        store = SQLiteStore(fs, journal_mode=mode)
        assert txn_of(await store.restore_checkpoint(SHARD)) == 0
        for txn in range(1, 51):
            apply_txn(store.db, txn)
            await (await store.start_commit(SHARD, checkpoint_of(txn), []))
        hints = await fs.recorder.build_hints()
        await store.destroy()  # writes nothing (WAL: no checkpoint at close)
        await fs.fsync()
        primary_bytes = (tmp_path / "primary" / "db.sqlite").read_bytes()

    async with BrokerClient(shared_broker.address) as client:  # another process, as it were
        fs = await recover(client, log, tmp_path / "standby")
        assert (tmp_path / "standby" / "db.sqlite").read_bytes() == primary_bytes
        store = SQLiteStore(fs, journal_mode=mode)
        assert txn_of(await store.restore_checkpoint(SHARD)) == 50
        assert rows_of(store.db) == expected_rows(50)
        await store.destroy()
        await fs.recorder.close()

        # Hints taken before the close recover the same content.
        fs = await recover(client, log, tmp_path / "hinted", hints)
        store = SQLiteStore(fs, journal_mode=mode)
        assert txn_of(await store.restore_checkpoint(SHARD)) == 50
        assert rows_of(store.db) == expected_rows(50)
        await store.destroy()
        await fs.recorder.close()


async def test_truncated_database_recovers(shared_broker: BrokerProcess, tmp_path: Path) -> None:
    """A VACUUM shrinks the file (xTruncate): recorded as a re-create with the kept content."""
    async with BrokerClient(shared_broker.address) as client:
        log = await new_log(client)
        fs = await recover(client, log, tmp_path / "primary")
        store = SQLiteStore(fs, journal_mode="DELETE")  # WAL would truncate at a checkpoint
        await store.restore_checkpoint(SHARD)
        for txn in range(1, 11):
            apply_txn(store.db, txn)
            await (await store.start_commit(SHARD, checkpoint_of(txn), []))
        store.db.execute("DELETE FROM kv WHERE k % 2 = 0")
        await (await store.start_commit(SHARD, checkpoint_of(11), []))
        db_file = tmp_path / "primary" / "db.sqlite"
        size = db_file.stat().st_size
        store.db.execute("COMMIT")  # VACUUM runs outside a transaction: step out of the store's
        store.db.execute("VACUUM")
        store.db.execute("BEGIN")
        assert db_file.stat().st_size < size
        await fs.fsync()
        primary_bytes = db_file.read_bytes()
        await store.destroy()

        fs = await recover(client, log, tmp_path / "standby")
        assert (tmp_path / "standby" / "db.sqlite").read_bytes() == primary_bytes
        recovered = SQLiteStore(fs, journal_mode="DELETE")
        assert txn_of(await recovered.restore_checkpoint(SHARD)) == 11
        expected = {k: v for k, v in expected_rows(10).items() if k % 2}
        assert rows_of(recovered.db) == expected
        await recovered.destroy()
        await fs.recorder.close()


async def test_failed_dependency_rolls_back(shared_broker: BrokerProcess, tmp_path: Path) -> None:
    async with BrokerClient(shared_broker.address) as client:
        log = await new_log(client)
        store = await committed_primary(client, log, tmp_path / "primary")
        apply_txn(store.db, 2)
        failed = OpFuture.finished(RuntimeError("append to an output journal failed"))
        with pytest.raises(RuntimeError, match="output journal"):
            await (await store.start_commit(SHARD, checkpoint_of(2), [failed]))
        assert rows_of(store.db) == expected_rows(1)  # and the store goes on working
        apply_txn(store.db, 2)
        await (await store.start_commit(SHARD, checkpoint_of(2), []))
        await store.destroy()
        await assert_recovers(client, log, tmp_path / "standby", 2, expected_rows(2))


async def test_transaction_ended_by_sqlite_fails_the_commit(
    shared_broker: BrokerProcess, tmp_path: Path
) -> None:
    """INSERT OR ROLLBACK ends the store's transaction: later writes must not autocommit."""
    async with BrokerClient(shared_broker.address) as client:
        log = await new_log(client)
        store = await committed_primary(client, log, tmp_path / "primary")
        key = next(k for k, v in txn_ops(1) if v is not None)
        with pytest.raises(apsw.ConstraintError):
            store.db.execute("INSERT OR ROLLBACK INTO kv VALUES (?, x'00')", (key,))
        assert not store.db.in_transaction
        with pytest.raises(apsw.ConstraintError):  # vetoed by the store's commit hook
            store.db.execute("INSERT OR REPLACE INTO kv VALUES (?, x'01')", (key,))
        op = await asyncio.wait_for(store.start_commit(SHARD, checkpoint_of(2), []), DEADLINE)
        with pytest.raises(StoreError, match="ended before its commit"):
            await asyncio.wait_for(op, DEADLINE)
        await store.destroy()
        await assert_recovers(client, log, tmp_path / "standby", 1, expected_rows(1))


async def test_a_commit_sqlite_refuses_names_the_database(
    shared_broker: BrokerProcess, tmp_path: Path
) -> None:
    """The disk fills as SQLite commits (RLIMIT_FSIZE here): the failure names the database
    file (it said only "database or disk is full", of whichever disk)."""
    async with BrokerClient(shared_broker.address) as client:
        log = await new_log(client)
        store = await committed_primary(client, log, tmp_path / "primary")
        store.db.execute("INSERT OR REPLACE INTO kv VALUES (999999, ?)", (b"x" * (4 << 20),))
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        ignored = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, limit[1]))
        try:
            op = await store.start_commit(SHARD, checkpoint_of(2), [])
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)
            signal.signal(signal.SIGXFSZ, ignored)
        with pytest.raises(StoreError) as refused:
            await asyncio.wait_for(op, DEADLINE)
        assert str(refused.value).startswith(
            f"committing {tmp_path / 'primary' / 'db.sqlite'}: "), refused.value
        await store.destroy()


async def test_hand_off_fences_the_previous_instance(
    shared_broker: BrokerProcess, tmp_path: Path
) -> None:
    async with BrokerClient(shared_broker.address) as client:
        log = await new_log(client)
        first = await committed_primary(client, log, tmp_path / "first")

        second = SQLiteStore(await recover(client, log, tmp_path / "second"))
        assert txn_of(await second.restore_checkpoint(SHARD)) == 1
        first.db.execute("DELETE FROM kv")
        with pytest.raises(RegisterMismatch):
            await (await first.start_commit(SHARD, checkpoint_of(2), []))
        await first.destroy()
        apply_txn(second.db, 2)
        await (await second.start_commit(SHARD, checkpoint_of(2), []))
        await second.destroy()
        await second.fs.recorder.close()
        await assert_recovers(client, log, tmp_path / "third", 2, expected_rows(2))


@pytest.mark.parametrize("mode", MODES)
async def test_sigkilled_writer_recovers_a_whole_commit(
    shared_broker: BrokerProcess, tmp_path: Path, mode: JournalMode, rng: random.Random
) -> None:
    async with BrokerClient(shared_broker.address) as client:
        log = await new_log(client)
    last = await asyncio.to_thread(
        run_and_kill_writer, "tests.test_sqlite_store",
        shared_broker.address, log, str(tmp_path / "writer"), mode, rng=rng,
    )
    async with BrokerClient(shared_broker.address) as client:
        fs = await recover(client, log, tmp_path / "standby")
        store = SQLiteStore(fs, journal_mode=mode)
        txn = txn_of(await store.restore_checkpoint(SHARD))
        assert last <= txn <= last + 1
        assert rows_of(store.db) == expected_rows(txn)
        await store.destroy()
        await fs.recorder.close()


async def _writer(address: str, log: str, directory: str, mode: JournalMode) -> None:
    """Commit transactions until killed, printing each once its commit is durable."""
    async with BrokerClient(address) as client:
        store = SQLiteStore(await recover(client, log, Path(directory)), journal_mode=mode)
        txn = txn_of(await store.restore_checkpoint(SHARD))
        while txn < 100_000:
            txn += 1
            apply_txn(store.db, txn)
            await (await store.start_commit(SHARD, checkpoint_of(txn), []))
            print(txn, flush=True)


if __name__ == "__main__":
    address, log, directory, mode = sys.argv[1:]
    assert mode in MODES
    asyncio.run(_writer(address, log, directory, cast(JournalMode, mode)))


async def _rows_in_view(store: SQLiteStore, seen: list[bool] | None = None,
                        durable: OpFuture | None = None) -> dict[int, bytes]:
    async with store.committed_view():  # type: ignore[union-attr]
        if seen is not None and durable is not None:
            seen.append(durable.done())
        return rows_of(store.db)


async def test_a_committed_view_reads_the_last_durable_commit(
        shared_broker: BrokerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """WAL mode: a view reads the last commit in the log through a read-only connection
    of its own, while the transaction loop writes on; a commit on its way to the log
    isn't committed yet, so a view waits for it. DELETE mode has no views."""
    async with BrokerClient(shared_broker.address) as client:
        log = await new_log(client)
        deleting = SQLiteStore(await recover(client, log, tmp_path / "d"), journal_mode="DELETE")
        assert deleting.committed_view() is None
        store = SQLiteStore(await recover(client, log, tmp_path / "wal"))
        await store.restore_checkpoint(SHARD)
        apply_txn(store.db, 1)
        await (await store.start_commit(SHARD, checkpoint_of(1), []))
        apply_txn(store.db, 2)  # the open transaction
        assert await _rows_in_view(store) == expected_rows(1)
        go = asyncio.Event()
        outside = asyncio.ensure_future(_rows_outside(store, go))  # begun outside the view
        view = store.committed_view()
        assert view is not None
        async with view:
            with pytest.raises(apsw.ReadOnlyError):
                store.db.execute("DELETE FROM kv")
            # Another task (the transaction loop's) keeps its transaction meanwhile.
            go.set()
            assert await outside == expected_rows(2)
            assert await _rows_in_view(store) == expected_rows(1)  # nested
            assert await asyncio.ensure_future(_rows_in_view(store)) == expected_rows(1)

        barrier, durable = store.fs.fsync, OpFuture()
        monkeypatch.setattr(store.fs, "fsync", lambda: durable)
        op = await store.start_commit(SHARD, checkpoint_of(2), [])  # committed locally
        seen: list[bool] = []
        reading = asyncio.ensure_future(_rows_in_view(store, seen, op))
        await asyncio.sleep(0.05)
        assert not reading.done()
        durable.resolve(await barrier())
        assert await asyncio.wait_for(reading, DEADLINE) == expected_rows(2)
        assert seen == [True]
        await store.destroy()
        await store.fs.recorder.close()


async def _rows_outside(store: SQLiteStore, go: asyncio.Event) -> dict[int, bytes]:
    await go.wait()
    return dict(store.db.execute("SELECT k, v FROM kv").fetchall())


async def test_destroy_waits_for_an_open_sqlite_view(
        shared_broker: BrokerProcess, tmp_path: Path) -> None:
    async with BrokerClient(shared_broker.address) as client:
        store = SQLiteStore(await recover(client, await new_log(client), tmp_path / "wal"))
        await store.restore_checkpoint(SHARD)
        apply_txn(store.db, 1)
        await (await store.start_commit(SHARD, checkpoint_of(1), []))
        assert await destroy_while_viewing(store, lambda: rows_of(store.db)) == expected_rows(1)
        await store.fs.recorder.close()


async def test_journal_mode_is_checked(shared_broker: BrokerProcess, tmp_path: Path) -> None:
    """Any case of WAL or DELETE is taken (a lowercase "wal" keeps views); another mode,
    which the recording doesn't cover, is refused by name."""
    async with BrokerClient(shared_broker.address) as client:
        fs = await recover(client, await new_log(client), tmp_path / "db")
        with pytest.raises(StoreError, match="journal_mode 'memory'"):
            SQLiteStore(fs, journal_mode=cast(JournalMode, "memory"))
        store = SQLiteStore(fs, journal_mode=cast(JournalMode, "wal"))
        assert store.journal_mode == "WAL" and store.committed_view() is not None
        await store.restore_checkpoint(SHARD)
        assert store.db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        await store.destroy()
        await fs.recorder.close()


class _Doubling(SQLiteStore):
    def prepare(self, connection: apsw.Connection) -> None:
        connection.create_scalar_function("double", lambda x: 2 * x, 1)


async def test_view_connections_are_prepared_and_few(
        shared_broker: BrokerProcess, tmp_path: Path) -> None:
    """A function the store registers in `prepare` works in the transaction and in
    every view; after a burst of concurrent views, only IDLE_READERS stay open."""
    async with BrokerClient(shared_broker.address) as client:
        store = _Doubling(await recover(client, await new_log(client), tmp_path / "db"))
        await store.restore_checkpoint(SHARD)
        apply_txn(store.db, 1)
        assert store.db.execute("SELECT double(21)").fetchone() == (42,)
        await (await store.start_commit(SHARD, checkpoint_of(1), []))
        go = asyncio.Event()

        async def query() -> int:
            async with store.committed_view():  # type: ignore[union-attr]
                await go.wait()
                return store.db.execute("SELECT double(count(*)) FROM kv").fetchone()[0]

        burst = [asyncio.ensure_future(query()) for _ in range(IDLE_READERS + 3)]
        await asyncio.sleep(0.05)
        go.set()
        assert set(await asyncio.gather(*burst)) == {2 * len(expected_rows(1))}
        assert len(store._readers) == IDLE_READERS
        await store.destroy()
        await store.fs.recorder.close()
