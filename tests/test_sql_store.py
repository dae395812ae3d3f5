"""SQLStore against a SQLite file and a real PostgreSQL server.

State and checkpoint are always read back through a separate engine, i.e. a
separate connection that sees only what was committed. The crash tests run a
writer in a child process (this file, run as a script) and SIGKILL it.

Run as a script: python tests/test_sql_store.py URL SHARD TABLE MODE [PAUSE_AFTER]
"""

from __future__ import annotations

import asyncio
import random
import re
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa

from streamkit.client.append_service import OpFuture
from streamkit.protocol import consumer_pb, pb
from streamkit.stores import FencedError, SQLStore, StoreError
from streamkit.stores.sql import CHECKPOINTS, VIEW_CONNECTIONS

JOURNAL = "examples/words/part-000"
ROOT = Path(__file__).resolve().parent.parent


# --- helpers shared by the tests and the writer process ----------------------


def app_table(name: str) -> sa.Table:
    """The application's own state: one row per committed transaction number."""
    return sa.Table(name, sa.MetaData(), sa.Column("n", sa.Integer, primary_key=True))


def checkpoint_at(n: int) -> consumer_pb.Checkpoint:
    """A checkpoint recording that transaction `n` read through offset `n`."""
    cp = consumer_pb.Checkpoint()
    source = cp.sources[JOURNAL]
    source.read_through = n
    source.producers.add(id=b"\x01\x02\x03\x04\x05\x06").state.last_ack = n << 4
    cp.ack_intents[f"{JOURNAL}-acks"] = f"ack {n}".encode()
    return cp


def insert_row(conn: sa.Connection, table: sa.Table, n: int) -> None:
    conn.execute(sa.insert(table).values(n=n))


@dataclass
class Committed:
    """What a fresh connection sees of one shard: fence, checkpoint and state rows."""

    fence: int | None
    checkpoint: consumer_pb.Checkpoint | None
    rows: list[int]

    @property
    def read_through(self) -> int:
        return self.checkpoint.sources[JOURNAL].read_through if self.checkpoint else 0


def read_committed(url: str, shard: str, table: sa.Table) -> Committed:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            row = conn.execute(
                sa.select(CHECKPOINTS.c.fence, CHECKPOINTS.c.checkpoint).where(
                    CHECKPOINTS.c.shard_fqn == shard
                )
            ).one_or_none()
            rows = list(conn.execute(sa.select(table.c.n).order_by(table.c.n)).scalars())
    finally:
        engine.dispose()
    if row is None:
        return Committed(None, None, rows)
    checkpoint = consumer_pb.Checkpoint()
    checkpoint.ParseFromString(row.checkpoint)
    return Committed(row.fence, checkpoint, rows)


async def commit_txn(store: SQLStore, table: sa.Table, n: int, *deps: OpFuture) -> OpFuture:
    """One consumer transaction: write row n, then start committing checkpoint n."""
    await store.run(insert_row, table, n)
    return await store.start_commit(store.shard_fqn, checkpoint_at(n), deps)


class ManualOp(OpFuture):
    """A dependency the test resolves by hand, like an append still in flight."""

    __slots__ = ()

    def succeed(self) -> None:
        self.resolve(pb.AppendResponse(status=pb.OK))



# --- fixtures -----------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def shard() -> str:
    return f"test/shard-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def table(db_url: str) -> sa.Table:
    """A fresh application table, unique to this test (the Postgres server is shared)."""
    table = app_table(f"state_{uuid.uuid4().hex[:12]}")
    engine = sa.create_engine(db_url)
    try:
        table.metadata.create_all(engine)
    finally:
        engine.dispose()
    return table


@pytest.fixture
async def new_store(db_url: str, shard: str) -> AsyncIterator[Callable[[], SQLStore]]:
    """Makes store instances of the shard (as separate processes would); destroys them after."""
    stores: list[SQLStore] = []

    def make() -> SQLStore:
        stores.append(SQLStore(db_url, shard))
        return stores[-1]

    yield make
    for store in stores:
        await store.destroy()


# --- tests ----------------------------------------------------------------------


async def test_new_shard_restores_empty_checkpoint_and_fence_1(new_store, db_url, shard, table):
    store = new_store()
    assert await store.restore_checkpoint(shard) == consumer_pb.Checkpoint()
    assert store.fence == 1
    seen = read_committed(db_url, shard, table)
    assert (seen.fence, seen.checkpoint, seen.rows) == (1, consumer_pb.Checkpoint(), [])


async def test_state_and_checkpoint_commit_together(new_store, db_url, shard, table):
    store = new_store()
    await store.restore_checkpoint(shard)
    await store.run(insert_row, table, 1)
    # Written but uncommitted: another connection sees neither row nor checkpoint.
    assert read_committed(db_url, shard, table).rows == []
    op = await store.start_commit(shard, checkpoint_at(1), [])
    assert (await op).status == pb.OK
    seen = read_committed(db_url, shard, table)
    assert (seen.rows, seen.checkpoint) == ([1], checkpoint_at(1))


async def test_restore_returns_last_committed_checkpoint(new_store, db_url, shard, table):
    first = new_store()
    await first.restore_checkpoint(shard)
    for n in (1, 2, 3):
        await (await commit_txn(first, table, n))
    again = new_store()
    assert await again.restore_checkpoint(shard) == checkpoint_at(3)
    assert again.fence == 2
    assert read_committed(db_url, shard, table).rows == [1, 2, 3]


async def test_failed_dependency_fails_commit_and_writes_nothing(new_store, db_url, shard, table):
    store = new_store()
    await store.restore_checkpoint(shard)
    boom = RuntimeError("append failed")
    op = await commit_txn(store, table, 1, OpFuture.finished(), OpFuture.finished(error=boom))
    with pytest.raises(RuntimeError, match="append failed"):
        await op
    seen = read_committed(db_url, shard, table)
    assert (seen.rows, seen.checkpoint) == ([], consumer_pb.Checkpoint())


async def test_commit_waits_for_dependencies(new_store, db_url, shard, table):
    store = new_store()
    await store.restore_checkpoint(shard)
    dep = ManualOp()
    op = await commit_txn(store, table, 1, dep)
    await asyncio.sleep(0.05)  # a negative check: for this long, nothing may commit
    assert not op.done()
    assert read_committed(db_url, shard, table).rows == []
    dep.succeed()
    await op
    assert read_committed(db_url, shard, table).checkpoint == checkpoint_at(1)


async def test_next_transaction_waits_for_the_commit_in_flight(new_store, db_url, shard, table):
    """Pipelining: the next transaction's writes never join the one committing."""
    store = new_store()
    await store.restore_checkpoint(shard)
    dep = ManualOp()
    first = await commit_txn(store, table, 1, dep)
    second_write = asyncio.create_task(store.run(insert_row, table, 2))
    await asyncio.sleep(0.05)  # a negative check: for this long, the write must wait
    assert not second_write.done()
    with pytest.raises(StoreError, match="in flight"):
        store.transaction()
    dep.fail(RuntimeError("upstream append failed"))
    with pytest.raises(RuntimeError):
        await first
    await second_write
    await (await store.start_commit(shard, checkpoint_at(2), []))
    seen = read_committed(db_url, shard, table)
    assert (seen.rows, seen.checkpoint) == ([2], checkpoint_at(2))


async def test_synchronous_transaction(new_store, db_url, shard, table):
    store = new_store()
    await store.restore_checkpoint(shard)
    insert_row(store.transaction(), table, 7)
    await (await store.start_commit(shard, checkpoint_at(7), []))
    assert read_committed(db_url, shard, table).rows == [7]


async def test_newer_instance_fences_older(new_store, db_url, shard, table):
    a, b = new_store(), new_store()
    await a.restore_checkpoint(shard)
    await b.restore_checkpoint(shard)
    assert (a.fence, b.fence) == (1, 2)

    with pytest.raises(FencedError):
        await (await commit_txn(a, table, 1))
    assert read_committed(db_url, shard, table).rows == []  # A's write was rolled back

    await (await commit_txn(b, table, 2))
    with pytest.raises(FencedError):  # and A stays fenced
        await (await commit_txn(a, table, 3))
    seen = read_committed(db_url, shard, table)
    assert (seen.fence, seen.rows, seen.checkpoint) == (2, [2], checkpoint_at(2))


async def test_concurrent_first_restores_get_distinct_fences(new_store, db_url, shard, table):
    """Two instances racing to create a new shard's row: one inserts, the other bumps."""
    stores = [new_store() for _ in range(3)]
    await asyncio.gather(*(store.restore_checkpoint(shard) for store in stores))
    assert sorted(store.fence for store in stores) == [1, 2, 3]
    assert read_committed(db_url, shard, table).fence == 3


async def test_misuse_raises_store_error(new_store, db_url, shard, table):
    store = new_store()
    with pytest.raises(StoreError, match="before restore"):
        await store.start_commit(shard, checkpoint_at(1), [])
    await store.restore_checkpoint(shard)
    await store.run(insert_row, table, 1)
    await store.destroy()  # drops the uncommitted write
    with pytest.raises(StoreError, match="destroyed"):
        await store.restore_checkpoint(shard)
    assert read_committed(db_url, shard, table).rows == []


async def test_destroy_abandons_a_commit_still_waiting_on_dependencies(
    new_store, db_url, shard, table
):
    store = new_store()
    await store.restore_checkpoint(shard)
    op = await commit_txn(store, table, 1, ManualOp())  # never resolves
    await store.destroy()
    assert op.done() and op.exception() is not None
    assert read_committed(db_url, shard, table).rows == []


# --- a URL whose database driver is not installed ----------------------------------

MISSING_DRIVER = (
    "postgresql+pg8000://app:***@db.example/app: SQLAlchemy needs the Python package "
    "'pg8000' for it: pip install pg8000"
)


@pytest.fixture
def without_pg8000(monkeypatch: pytest.MonkeyPatch) -> str:
    """A URL whose driver cannot be imported, whether or not pg8000 is installed here."""
    monkeypatch.setitem(sys.modules, "pg8000", None)  # `import pg8000` now fails
    return "postgresql+pg8000://app:secret@db.example/app"


def test_missing_driver_is_one_line_naming_the_package(without_pg8000: str) -> None:
    with pytest.raises(StoreError) as caught:
        SQLStore(without_pg8000, "test/shard")
    assert str(caught.value) == f"store.url {MISSING_DRIVER}"


def test_an_sqlite_file_in_a_missing_folder_is_named(tmp_path: Path) -> None:
    """SQLite says only "unable to open database file" (a shard failing with it, again and
    again, named neither): the store names the file and the folder that is missing."""
    url = f"sqlite:///{tmp_path}/nodir/x.db"
    with pytest.raises(StoreError) as caught:
        SQLStore(url, "test/shard")
    assert str(caught.value) == (f"store.url {url}: folder {tmp_path}/nodir does not exist "
                                 "(SQLite makes the database file, not its folder)")


def test_missing_driver_fails_loading_the_config(without_pg8000: str) -> None:
    from streamkit.app.config import StoreConfig

    with pytest.raises(ValueError, match=re.escape(MISSING_DRIVER)):
        StoreConfig.model_validate({"kind": "sql", "url": without_pg8000})


# --- crashes: a writer process killed with SIGKILL ------------------------------


async def spawn_writer(
    url: str, shard: str, table: sa.Table, mode: str, pause_after: int = 0
) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, __file__, url, shard, table.name, mode, str(pause_after),
        stdout=asyncio.subprocess.PIPE, cwd=ROOT,
    )


async def next_line(proc: asyncio.subprocess.Process) -> str:
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), timeout=30)).decode().strip()
    assert line, f"writer exited early with {await proc.wait()}"
    return line


async def kill(proc: asyncio.subprocess.Process) -> list[str]:
    """SIGKILL the writer; returns the lines it printed but we had not read yet."""
    proc.send_signal(signal.SIGKILL)
    assert proc.stdout is not None
    rest = (await proc.stdout.read()).decode().split()
    assert await proc.wait() == -signal.SIGKILL
    return rest


def assert_consistent(seen: Committed) -> None:
    """Rows 1..n exist exactly when the checkpoint says transaction n committed."""
    n = seen.read_through
    assert seen.rows == list(range(1, n + 1))
    assert seen.checkpoint == (checkpoint_at(n) if n else consumer_pb.Checkpoint())


async def test_killed_inside_commit_keeps_the_previous_commit(db_url, shard, table):
    """Killed after state and checkpoint were written, before COMMIT reached the database."""
    proc = await spawn_writer(db_url, shard, table, "pause", pause_after=3)
    lines = [await next_line(proc) for _ in range(4)]
    assert lines == ["COMMITTED 1", "COMMITTED 2", "COMMITTED 3", "PAUSED 4"]
    await kill(proc)
    seen = read_committed(db_url, shard, table)
    assert (seen.rows, seen.read_through) == ([1, 2, 3], 3)
    assert_consistent(seen)


async def test_killed_at_random_moments_never_mixes(db_url, shard, table):
    """Kill a busy writer at random moments; each restart continues from what committed."""
    rng = random.Random(7)
    for _ in range(4):
        proc = await spawn_writer(db_url, shard, table, "loop")
        printed = [await next_line(proc)]  # one commit is through: it is busy committing now
        await asyncio.sleep(rng.uniform(0, 0.03))  # the kill moment (what is tested)
        printed += await kill(proc)
        acknowledged = max(int(word) for word in " ".join(printed).split() if word.isdigit())
        seen = read_committed(db_url, shard, table)
        assert_consistent(seen)
        # All acknowledged commits are durable, plus at most the one in flight.
        assert acknowledged <= seen.read_through <= acknowledged + 1
    assert seen.read_through >= 4


# --- the writer process ------------------------------------------------------------


async def _writer(url: str, shard: str, table: sa.Table, mode: str, pause_after: int) -> None:
    """Commit transactions n+1, n+2, ... from the restored checkpoint n, forever.

    Prints "COMMITTED n" after each commit. In "pause" mode, the commit after
    `pause_after` ones stops just before its COMMIT and prints "PAUSED n".
    """
    store = SQLStore(url, shard)
    n = (await store.restore_checkpoint(shard)).sources[JOURNAL].read_through

    def hang_before_commit(_conn: sa.Connection) -> None:
        if mode == "pause" and n > pause_after:
            print(f"PAUSED {n}", flush=True)
            time.sleep(600)

    sa.event.listen(store.engine, "commit", hang_before_commit)
    while True:
        n += 1
        await (await commit_txn(store, table, n))
        print(f"COMMITTED {n}", flush=True)


if __name__ == "__main__":
    url_arg, shard_arg, table_arg, mode_arg, pause_arg = sys.argv[1:6]
    asyncio.run(_writer(url_arg, shard_arg, app_table(table_arg), mode_arg, int(pause_arg)))


# --- committed views --------------------------------------------------------------


@pytest.fixture
def viewable_url(db_url: str) -> str:
    """The database, able to have committed views: PostgreSQL as it is, SQLite in WAL."""
    if db_url.startswith("sqlite"):
        engine = sa.create_engine(db_url)
        with engine.connect() as conn:
            conn.exec_driver_sql("PRAGMA journal_mode=WAL")
        engine.dispose()
    return db_url


def rows_of(conn: sa.Connection, table: sa.Table) -> list[int]:
    return list(conn.execute(sa.select(table.c.n).order_by(table.c.n)).scalars())


async def test_a_committed_view_reads_what_was_committed(new_store, viewable_url, shard, table):
    """A view's `run` and `transaction` read the committed rows only, from a snapshot
    taken as it opens: the writer commits meanwhile (no lock between them), the view
    goes on seeing its snapshot, and it can't write."""
    store = new_store()
    await store.restore_checkpoint(shard)
    await (await commit_txn(store, table, 1))
    await store.run(insert_row, table, 2)  # the open transaction
    go = asyncio.Event()
    outside = asyncio.ensure_future(_read_and_commit(store, table, go))  # begun outside
    view = store.committed_view()
    assert view is not None
    async with view:
        assert await store.run(rows_of, table) == [1]
        assert rows_of(store.transaction(), table) == [1]
        # Another task (the transaction loop's) keeps its transaction, and commits it.
        go.set()
        assert await outside == [1, 2]
        assert await store.run(rows_of, table) == [1]  # the view's snapshot
        async with store.committed_view():  # nested: the same view
            assert rows_of(store.transaction(), table) == [1]
    assert read_committed(viewable_url, shard, table).rows == [1, 2]
    async with store.committed_view():
        assert await store.run(rows_of, table) == [1, 2]
        with pytest.raises(sa.exc.DBAPIError):
            await store.run(insert_row, table, 99)
    await (await commit_txn(store, table, 3))  # the view left the pool's connections writable
    assert read_committed(viewable_url, shard, table).rows == [1, 2, 3]


async def _read_and_commit(store: SQLStore, table: sa.Table, go: asyncio.Event) -> list[int]:
    await go.wait()
    rows = await store.run(rows_of, table)
    await (await store.start_commit(store.shard_fqn, checkpoint_at(2), []))
    return rows


async def test_views_wait_for_a_connection_beyond_view_connections(
        new_store, viewable_url, shard, table):
    """Each view runs on a thread of its own (a slow one holds up no other), and no
    more than VIEW_CONNECTIONS are open at once; the rest wait their turn."""
    from tests.waiting import LIVENESS  # (this file also runs as a script, without `tests`)

    store = new_store()
    await store.restore_checkpoint(shard)
    await (await commit_txn(store, table, 1))
    most = 0

    def slow_read(conn: sa.Connection) -> list[int]:
        time.sleep(0.1)
        return rows_of(conn, table)

    async def query() -> list[int]:
        nonlocal most
        async with store.committed_view():  # type: ignore[union-attr]
            most = max(most, store._views.count)
            return await store.run(slow_read)

    answers = await asyncio.wait_for(
        asyncio.gather(*(query() for _ in range(VIEW_CONNECTIONS + 3))), LIVENESS)
    assert answers == [[1]] * (VIEW_CONNECTIONS + 3)
    assert most == VIEW_CONNECTIONS


async def test_destroy_waits_for_an_open_sql_view(new_store, viewable_url, shard, table):
    from tests.viewing import destroy_while_viewing

    store = new_store()
    await store.restore_checkpoint(shard)
    await (await commit_txn(store, table, 1))
    read = await destroy_while_viewing(store, lambda: rows_of(store.transaction(), table))
    assert read == [1]


async def test_no_view_on_a_given_engine_or_a_shared_connection(tmp_path: Path) -> None:
    """An engine given to the store (the caller's to size, maybe shared with other
    stores' writers) and an in-memory database (one shared connection) have no
    committed view: queries there wait for the transaction."""
    url = f"sqlite:///{tmp_path / 'wal.db'}"
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        conn.exec_driver_sql("PRAGMA journal_mode=WAL")
    for store in (SQLStore(engine, "test/shard"), SQLStore("sqlite://", "test/shard"),
                  SQLStore(url, "test/shard", views=0)):
        await store.restore_checkpoint("test/shard")
        assert store.committed_view() is None
        await store.destroy()
    engine.dispose()


async def test_views_on_a_given_engine_when_asked(viewable_url, shard, table):
    """`views=N` on a given engine: the caller vouches for its pool, which must have room
    for the writer's connection and N views'; then queries read committed views there,
    at most N at once."""
    from sqlalchemy.pool import StaticPool

    from tests.waiting import LIVENESS  # (this file also runs as a script, without `tests`)

    engine = sa.create_engine(viewable_url, pool_size=1, max_overflow=2)
    store = SQLStore(engine, shard, views=2)
    try:
        await store.restore_checkpoint(shard)
        await (await commit_txn(store, table, 1))
        await store.run(insert_row, table, 2)  # the open transaction
        most = 0

        async def query() -> list[int]:
            nonlocal most
            async with store.committed_view():  # type: ignore[union-attr]
                most = max(most, store._views.count)
                rows = await store.run(rows_of, table)
                await asyncio.sleep(0.05)
                return rows

        answers = await asyncio.wait_for(asyncio.gather(*(query() for _ in range(5))), LIVENESS)
        assert answers == [[1]] * 5 and most == 2
        await (await store.start_commit(shard, checkpoint_at(2), []))
        assert read_committed(viewable_url, shard, table).rows == [1, 2]
    finally:
        await store.destroy()
        engine.dispose()
    small = sa.create_engine(viewable_url, pool_size=1, max_overflow=1)
    with pytest.raises(StoreError, match="holds at most 2 connections, and the store needs 3"):
        SQLStore(small, shard, views=2)
    SQLStore(small, shard, views=1)  # room enough (not opened: nothing to destroy)
    small.dispose()
    if viewable_url.startswith("sqlite"):
        shared = sa.create_engine(viewable_url, poolclass=StaticPool)
        with pytest.raises(StoreError, match="StaticPool shares one connection"):
            SQLStore(shared, shard, views=1)
        shared.dispose()
    with pytest.raises(StoreError, match="a count of committed views"):
        SQLStore(viewable_url, shard, views=-1)


async def test_a_query_ending_its_view_transaction_still_cannot_write(
        new_store, viewable_url, shard, table):
    """Read-only holds for the view's connection, not only its first transaction; and
    the connection goes back to the pool writable. A task outliving its view gets a
    StoreError."""
    store = new_store()
    await store.restore_checkpoint(shard)
    await (await commit_txn(store, table, 1))

    def end_and_write(conn: sa.Connection) -> None:
        conn.rollback()
        insert_row(conn, table, 666)
        conn.commit()

    leftover = None
    async with store.committed_view():  # type: ignore[union-attr]
        with pytest.raises(sa.exc.DBAPIError):
            await store.run(end_and_write)
        go = asyncio.Event()

        async def outliving() -> list[int]:
            await go.wait()
            return await store.run(rows_of, table)

        leftover = asyncio.ensure_future(outliving())
    go.set()
    with pytest.raises(StoreError, match="view has ended"):
        await leftover
    with store.engine.connect() as conn:  # the pool's idle connection: the view's
        insert_row(conn, table, 2)
        conn.commit()
    assert read_committed(viewable_url, shard, table).rows == [1, 2]


async def test_a_query_cancelled_in_its_view_gives_everything_back(
        new_store, viewable_url, shard, table):
    """Cancelled while its view opens, reads or closes, even twice: the view's slot
    and count come back once its connection did."""
    store = new_store()
    await store.restore_checkpoint(shard)
    await (await commit_txn(store, table, 1))

    async def query() -> None:
        async with store.committed_view():  # type: ignore[union-attr]
            await store.run(lambda conn: (time.sleep(0.05), rows_of(conn, table)))

    for delay in (0, 0.01, 0.03, 0.06, 0.08):
        task = asyncio.ensure_future(query())
        await asyncio.sleep(delay)
        task.cancel()
        await asyncio.sleep(0.005)
        task.cancel()
        await asyncio.wait([task])
        assert store._views.count == 0 and not store._view_slots.locked()
        assert store.engine.pool.checkedout() == 1  # the writer's only
    async with store.committed_view():  # type: ignore[union-attr]
        assert await store.run(rows_of, table) == [1]


async def test_a_store_of_an_sqlite_url_puts_the_database_in_wal(tmp_path: Path) -> None:
    """Made from a URL, the store switches an SQLite file to WAL, so it has views."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    store = SQLStore(url, "test/shard")
    await store.restore_checkpoint("test/shard")
    assert store.committed_view() is not None
    await store.destroy()
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    engine.dispose()


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_a_connection_dropped_between_transactions_is_replaced(
        new_store, postgres_url, shard) -> None:
    """The database drops the store's connection while the shard is idle (PostgreSQL
    restarted, a backend terminated): the next transaction connects again. It failed on
    the dead connection, failing the shard for good."""
    table = app_table(f"state_{uuid.uuid4().hex[:12]}")
    admin = sa.create_engine(postgres_url)
    try:
        table.metadata.create_all(admin)
        store = new_store()
        await store.restore_checkpoint(shard)
        await (await commit_txn(store, table, 1))
        pid = await store.run(lambda conn: conn.execute(sa.text("SELECT pg_backend_pid()"))
                              .scalar())
        await (await store.start_commit(shard, checkpoint_at(1), []))  # ends that transaction
        with admin.connect() as conn:
            assert conn.execute(sa.text(f"SELECT pg_terminate_backend({int(pid)})")).scalar()
        await (await commit_txn(store, table, 2))
        seen = read_committed(postgres_url, shard, table)
        assert (seen.rows, seen.checkpoint) == ([1, 2], checkpoint_at(2))
    finally:
        admin.dispose()


def _nowhere() -> str:
    """A PostgreSQL URL of a port nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"postgresql://postgres@127.0.0.1:{port}/none"


async def test_a_database_out_of_reach_at_restore_is_one_line(shard) -> None:
    """PostgreSQL down as a shard restores: one line naming the shard and the phase (it
    was SQLAlchemy's error with a 60-line traceback in the log)."""
    store = SQLStore(_nowhere(), shard)
    try:
        with pytest.raises(StoreError) as failed:
            await store.restore_checkpoint(shard)
    finally:
        await store.destroy()
    message = str(failed.value)
    assert message.startswith(f"shard {shard}: restoring its checkpoint from the postgresql "
                              "database none at 127.0.0.1 failed: "), message
    assert "\n" not in message and "refused" in message, message
    assert store.is_transient(failed.value)  # the server may come back


async def test_a_wrong_database_or_user_is_no_outage(postgres_url: str, shard) -> None:
    """A server refusing the URL's database or user says so at once: waiting won't change
    it, so it is not transient (the shard was retried for five minutes as if the server
    were away)."""
    base = postgres_url.rsplit("/", 1)[0]
    for url, said in ((f"{base}/nodb", 'database "nodb" does not exist'),
                      (base.replace("postgres@", "nobody@") + "/streamkit",
                       'role "nobody" does not exist')):
        store = SQLStore(url, shard)
        try:
            with pytest.raises(StoreError) as failed:
                await store.restore_checkpoint(shard)
        finally:
            await store.destroy()
        assert said in str(failed.value) and not store.is_transient(failed.value), failed.value


async def test_a_destroy_given_up_on_does_not_block_the_loop(tmp_path: Path, shard) -> None:
    """An app statement stuck in the database holds the store's thread; a destroy given up
    on (a stop's timeout) returns at once, and the loop runs meanwhile. It joined the
    thread on the event loop, freezing every shard until the statement ended."""
    store = SQLStore(f"sqlite:///{tmp_path / 'stuck.db'}", shard, views=0)
    await store.restore_checkpoint(shard)
    release = threading.Event()
    stuck = asyncio.create_task(store.run(lambda conn: release.wait(10)))
    await asyncio.sleep(0.1)  # not a synchronisation: the statement under way
    stuck.cancel()
    began = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(store.destroy(), 0.3)
        assert time.monotonic() - began < 2.0
    finally:
        release.set()


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
async def test_only_a_database_out_of_reach_is_transient(new_store, postgres_url,
                                                         shard) -> None:
    """A dropped connection or one refused is worth recovering again for; a statement
    timeout or a mistake in the app's SQL is not (it was: any OperationalError)."""
    store = new_store()
    await store.restore_checkpoint(shard)

    def attempt(conn: sa.Connection, statement: str) -> None:
        with conn.begin_nested():  # a savepoint: the transaction goes on after its error
            conn.exec_driver_sql(statement)

    async def raised(statement: str) -> BaseException:
        try:
            await store.run(attempt, statement)
        except Exception as error:
            return error
        raise AssertionError(f"{statement} raised nothing")

    timeout = await raised("SET LOCAL statement_timeout = 10; SELECT pg_sleep(1)")
    assert isinstance(timeout, sa.exc.OperationalError) and not store.is_transient(timeout)
    mistake = await raised("SELECT no_such_column FROM streamkit_checkpoints")
    assert not store.is_transient(mistake)
    pid = await store.run(lambda conn: conn.exec_driver_sql("SELECT pg_backend_pid()").scalar())
    admin = sa.create_engine(postgres_url)
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"SELECT pg_terminate_backend({int(pid)})")
    finally:
        admin.dispose()
    assert store.is_transient(await raised("SELECT 1"))
    away = SQLStore(_nowhere(), shard)
    try:
        with pytest.raises(StoreError) as refused:
            await away.restore_checkpoint(shard)
        assert away.is_transient(refused.value)
    finally:
        await away.destroy()


async def test_a_shared_sqlite_file_locked_by_another_shard_is_transient(tmp_path: Path) -> None:
    """Shards of the SQL store on one SQLite file (the scaffolded app's default) wait on each
    other's writes; one writing past the busy timeout failed the other for good."""
    url = f"sqlite:///{tmp_path / 'shared.db'}?timeout=0.1"
    one, other = SQLStore(url, "test/one"), SQLStore(url, "test/other")
    try:
        await one.restore_checkpoint("one")
        await other.restore_checkpoint("other")
        await one.run(lambda conn: conn.exec_driver_sql(
            "UPDATE streamkit_checkpoints SET fence = fence WHERE shard_fqn = 'test/one'"))
        with pytest.raises(sa.exc.OperationalError) as locked:
            await other.run(lambda conn: conn.exec_driver_sql(
                "UPDATE streamkit_checkpoints SET fence = fence WHERE shard_fqn = 'test/other'"))
        assert "database is locked" in str(locked.value)
        assert other.is_transient(locked.value)
        with pytest.raises(sa.exc.OperationalError) as mistake:
            await other.run(lambda conn: conn.exec_driver_sql("SELECT * FROM no_such_table"))
        assert not other.is_transient(mistake.value)
    finally:
        await one.destroy()
        await other.destroy()


async def test_an_app_ending_the_transaction_itself_is_refused(new_store, shard) -> None:
    """`conn.commit()` inside `store.run` committed the transaction's state without its
    checkpoint: a crash before the next commit counted its messages twice, silently."""
    store = new_store()
    await store.restore_checkpoint(shard)
    for end in ("commit", "rollback"):
        with pytest.raises(StoreError, match="the app's code ended the consumer transaction"):
            await store.run(lambda conn, end=end: getattr(conn, end)())
    await store.run(lambda conn: conn.exec_driver_sql("SELECT 1"))  # in a transaction again


async def test_a_query_given_up_on_has_its_statement_cancelled(
        new_store, viewable_url, shard, table):
    """A view whose query is cancelled mid-statement (it timed out) gives its connection back
    at once, not when the database finishes the statement; and with every view slot busy
    on slow statements, the app still has a connection of the pool for its own use."""
    store = new_store()
    await store.restore_checkpoint(shard)
    await (await commit_txn(store, table, 1))
    slow = ("SELECT pg_sleep(30)" if viewable_url.startswith("postgres") else
            "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
            "SELECT count(*) FROM c")  # SQLite: counts for ever

    async def query() -> None:
        async with store.committed_view():  # type: ignore[union-attr]
            await store.run(lambda conn: conn.exec_driver_sql(slow).all())

    queries = [asyncio.ensure_future(query()) for _ in range(VIEW_CONNECTIONS)]
    await asyncio.sleep(0.5)
    assert store._views.count == VIEW_CONNECTIONS
    with store.engine.connect() as conn:  # the app's own (a table made at start, say)
        assert conn.exec_driver_sql("SELECT 1").scalar() == 1
    started = time.monotonic()
    for task in queries:
        task.cancel()
    await asyncio.wait(queries)
    assert time.monotonic() - started < 5
    assert store._views.count == 0 and store.engine.pool.checkedout() == 1
    async with store.committed_view():  # type: ignore[union-attr]
        assert await store.run(rows_of, table) == [1]


async def test_errors_name_statements_not_the_values_bound(new_store, shard) -> None:
    """A failed statement's error (logged, shown in a shard's status) leaves out the values
    bound to it: a checkpoint's kilobytes of binary, or the app's data."""
    store = new_store()
    await store.restore_checkpoint(shard)

    def insert(conn: sa.Connection) -> None:
        conn.execute(sa.text("INSERT INTO no_such_table VALUES (:v)"), {"v": "secret-value"})

    with pytest.raises(sa.exc.DBAPIError) as failed:
        await store.run(insert)
    assert "no_such_table" in str(failed.value) and "secret-value" not in str(failed.value)


async def test_a_query_cancelled_after_its_connection_broke_is_cancelled(
        new_store, viewable_url, shard, table):
    """Cancelling the statement of a view whose connection was invalidated (dropped by the
    database, say) raises the cancellation, not SQLAlchemy's reconnect error."""
    store = new_store()
    await store.restore_checkpoint(shard)
    await (await commit_txn(store, table, 1))

    async def query() -> None:
        async with store.committed_view():  # type: ignore[union-attr]
            await store.run(lambda conn: conn.invalidate())
            await store.run(lambda conn: time.sleep(1))

    task = asyncio.ensure_future(query())
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert store._views.count == 0
