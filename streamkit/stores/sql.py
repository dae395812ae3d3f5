"""SQLStore: shard state in an external SQL database, with fenced checkpoints.

Each consumer transaction is one database transaction. The application
issues its reads and writes through it (`run`, or `transaction` for plain
synchronous code), and `start_commit` adds the checkpoint row to that same
database transaction and commits it, so state and checkpoint land together.

Checkpoints live in one table, created if missing:

    streamkit_checkpoints(shard_fqn TEXT PRIMARY KEY, fence BIGINT NOT NULL,
                          checkpoint BYTEA/BLOB NOT NULL)

`restore_checkpoint` increments the shard's fence in a transaction of its own
and remembers the value. Every commit updates the checkpoint only where the
fence still has that value; if another instance restored in the meantime the
update matches no row, the whole transaction is rolled back and the commit
fails with FencedError. The row lock the update takes also orders a commit
against a concurrent restore: whichever commits second sees the first.

A committed view (a query beside the open transaction) is a read transaction
on a connection of its own from the store's pool, used on a thread of its own,
and begun (its snapshot taken) as the view opens: the database shows it only
what was committed, and a commit is durable once the database committed it,
so the view needs no waiting on the store's commits. On PostgreSQL the view's
session is REPEATABLE READ, READ ONLY (reset when the connection goes back to the
pool). On SQLite it needs the database in WAL mode (in the default
rollback-journal mode a reader would block the writer's commit) and runs with
`PRAGMA query_only`; pysqlite begins no transaction for reads, so the view
issues its own BEGIN. A query must not end the view's transaction: it would read
on outside the view's snapshot.

A store that makes its own engine (from a URL) has views: it sizes the pool
for them (the writer's connection, one idle for views, up to VIEW_CONNECTIONS
while views are open; at most that many are open at once, more wait their turn;
and one more for the app's own use of `store.engine`; a view whose query is given
up on has its statement cancelled, so it doesn't hold its connection on),
and puts an SQLite database in WAL mode (it stays so). An engine given to the
store is the caller's to size and may be shared by stores whose writers views
must not starve, so it has views only when the caller opts in with `views=N`
(its pool must have room for N connections beside the writer's; an SQLite
database must already be in WAL). Elsewhere queries wait for the transaction:
on databases other than PostgreSQL and SQLite, SQLite outside WAL, an
in-memory database (each thread's connection has a database of its own), and
with `views=0`.

SQLAlchemy is synchronous, so all database work runs on one worker thread per
store, through its one connection. One thread (rather than the default pool
of `asyncio.to_thread`) keeps the connection's use strictly in submission
order and on a single thread, which some drivers require.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shlex
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError, NoSuchModuleError

from streamkit.client.append_service import OpFuture
from streamkit.errors import causes
from streamkit.protocol import consumer_pb, pb
from streamkit.stores.store import FencedError, OpenViews, Store, StoreError, context_set
from streamkit.tasks import finish, on_thread, wait_finished

__all__ = ["CHECKPOINTS", "SQLStore", "driver_problem"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_metadata = sa.MetaData()

CHECKPOINTS = sa.Table(
    "streamkit_checkpoints",
    _metadata,
    sa.Column("shard_fqn", sa.Text, primary_key=True),
    sa.Column("fence", sa.BigInteger, nullable=False),
    sa.Column("checkpoint", sa.LargeBinary, nullable=False),
)
"""The checkpoint table; portable DDL, created by the first restore if missing."""

VIEW_CONNECTIONS = 4  # committed views of one store open at once (each a connection)

_RESTORE_ATTEMPTS = 5  # a racing first restore of a new shard can lose its INSERT

# Drivers whose pip package is not named like the module SQLAlchemy imports.
_DRIVER_PACKAGES = {
    "psycopg": "psycopg[binary]",
    "psycopg2": "psycopg2-binary",
    "MySQLdb": "mysqlclient",
    "mysql": "mysql-connector-python",
}


def driver_problem(url: str | sa.URL) -> str | None:
    """Why `url`'s database driver cannot be loaded here, in one line; None if it can.

    SQLAlchemy only raises a bare ModuleNotFoundError from inside create_engine,
    which names neither the URL that wanted the module nor the package to install.
    """
    parsed = sa.make_url(url)
    shown = parsed.render_as_string(hide_password=True)
    try:
        parsed.get_dialect().import_dbapi()
    except NoSuchModuleError:
        return f"{shown}: SQLAlchemy has no database dialect {parsed.drivername!r}"
    except ImportError as error:
        missing = error.name if isinstance(error, ModuleNotFoundError) else None
        if not missing:  # installed, but broken (a missing system library, say)
            return f"{shown}: its database driver failed to import: {error}"
        package = _DRIVER_PACKAGES.get(missing.partition(".")[0], missing)
        return (f"{shown}: SQLAlchemy needs the Python package {package!r} for it: "
                f"pip install {shlex.quote(package)}")
    return None


def _create_engine(url: str, views: int) -> sa.Engine:
    """An engine for `url`, failing with one line that says what to install if need be.

    Its pool keeps two connections (the writer's, and one for the next committed view or
    the app's own use of `store.engine`, a table made at start) and opens up to `views`
    more while views need them: views never take the app's last one.
    """
    if (problem := driver_problem(url)) is not None:
        raise StoreError(f"store.url {problem}")
    if (problem := _sqlite_folder_problem(url)) is not None:
        raise StoreError(f"store.url {problem}")
    try:
        # pool_pre_ping: a view's pooled connection that the database dropped (restarted)
        # is replaced at checkout, not found dead by a query.
        # hide_parameters: an error names the statement, not the values bound to it (a
        # checkpoint's kilobytes of binary; the app's data, which logs need not hold).
        return sa.create_engine(url, pool_size=2, max_overflow=views, pool_pre_ping=True,
                                hide_parameters=True)
    except TypeError:  # a pool without sizes (an in-memory SQLite database's, one per thread)
        return sa.create_engine(url, hide_parameters=True)


def sqlite_file(url: sa.URL) -> str | None:
    """The file an SQLite URL names: "" for none, ":memory:" for an in-memory database
    (also as a `file:` URI, with `?uri=true`, or `mode=memory`); None if not SQLite."""
    if url.get_backend_name() != "sqlite":
        return None
    name = url.database or ""
    if url.query.get("uri") == "true" and name.startswith("file:"):
        name = name.removeprefix("file:")
        if url.query.get("mode") == "memory":
            return ":memory:"
    return ":memory:" if name.startswith(":memory:") else name


def _sqlite_folder_problem(url: str) -> str | None:
    """Why SQLite can't make `url`'s file (its folder is missing), in words naming both;
    SQLite itself says only "unable to open database file"."""
    parsed = sa.make_url(url)
    if (name := sqlite_file(parsed)) in (None, "", ":memory:"):
        return None
    folder = Path(name).absolute().parent
    if folder.is_dir():
        return None
    return (f"{parsed.render_as_string(hide_password=True)}: folder {folder} does not exist "
            f"(SQLite makes the database file, not its folder)")


def _check_pool(engine: sa.Engine, views: int) -> None:
    """Refuse `views` on a given engine whose pool can't give each view a connection of
    its own beside the writer's: views would share the writer's, or wait for the pool's
    timeout and fail."""
    if not views:
        return
    pool = engine.pool
    if isinstance(pool, sa.pool.StaticPool | sa.pool.SingletonThreadPool
                  | sa.pool.AssertionPool):
        raise StoreError(f"views={views}: the engine's {type(pool).__name__} shares one "
                         "connection, and each view needs its own (use a QueuePool or NullPool)")
    overflow = getattr(pool, "_max_overflow", -1)  # a QueuePool's; -1: no limit
    if isinstance(pool, sa.pool.QueuePool) and 0 <= overflow < views + 1 - pool.size():
        raise StoreError(f"views={views}: the engine's pool holds at most "
                         f"{pool.size() + overflow} connections, and the store needs "
                         f"{views + 1} (its writer's and one per view): raise its pool_size "
                         "or max_overflow, or lower views")


class _View:
    """A committed view's read transaction: its connection, and the thread it runs on."""

    def __init__(self, store: SQLStore) -> None:
        self.store = store
        self.conn: sa.Connection | None = None
        self._raw: Any = None  # the driver's connection under `conn`, to cancel a statement
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlstore-view")

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await on_thread(self._thread, fn, *args)
        except asyncio.CancelledError:  # the query was given up on (it timed out, say)
            self.interrupt()
            raise

    def interrupt(self) -> None:
        """Cancel the statement the view's thread runs now, if any: given up on, it would
        hold the view's connection and slot until the database finished it (a slow query
        asked a few times over would hold them all). Thread-safe in both drivers."""
        raw = self._raw  # (taken at open: `conn.connection` may reconnect, or raise)
        cancel = getattr(raw, "cancel", None) or getattr(raw, "interrupt", None)  # pg, sqlite
        if self.conn is not None and cancel is not None:
            with contextlib.suppress(Exception):
                cancel()

    def open(self) -> None:
        """Take a connection and begin the read transaction, its snapshot taken now."""
        conn = self.store.engine.connect()
        try:
            if conn.dialect.name == "postgresql":
                # For the session: a query that ends the view's transaction reads on
                # in another, read-only too (though no longer in the view's snapshot).
                conn.exec_driver_sql("SET SESSION CHARACTERISTICS AS TRANSACTION"
                                     " ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                conn.commit()
            else:  # SQLite in WAL mode
                conn.exec_driver_sql("PRAGMA query_only = ON")
                if not conn.connection.driver_connection.in_transaction:  # type: ignore[union-attr]
                    conn.exec_driver_sql("BEGIN")  # pysqlite begins none for reads
            conn.execute(sa.select(sa.func.count()).select_from(CHECKPOINTS)).one()
        except BaseException:
            conn.invalidate()  # whatever state it is in, it goes back to no one
            conn.close()
            raise
        self._raw = conn.connection.driver_connection
        self.conn = conn

    def close(self) -> None:
        """Roll back (a query's view commits nothing) and give the connection back."""
        conn, self.conn = self.conn, None
        if conn is None:
            return
        try:
            conn.rollback()
            # Pooled: writable again, as the database's defaults have it.
            if conn.dialect.name == "postgresql":
                conn.exec_driver_sql("RESET default_transaction_isolation")
                conn.exec_driver_sql("RESET default_transaction_read_only")
            else:
                conn.exec_driver_sql("PRAGMA query_only = OFF")
            conn.commit()
        except Exception as error:  # not reusable: discard it
            log.info("%s: closing a committed view failed: %s", self.store.shard_fqn, error)
            conn.invalidate()
        finally:
            conn.close()

    def connection(self) -> sa.Connection:
        if self.conn is None:  # a task started in the view, outliving it
            raise StoreError(f"shard {self.store.shard_fqn}: the committed view has ended")
        return self.conn

    async def end(self) -> None:
        try:
            await self.call(self.close)
        finally:
            self._thread.shutdown(wait=False)


_VIEW: ContextVar[_View | None] = ContextVar("streamkit_sql_view", default=None)


class SQLStore(Store):
    """A Store in an external SQL database (SQLite file, PostgreSQL, ...) via SQLAlchemy.

    `engine` is an Engine, which the store borrows and does not dispose, or a
    URL, from which it makes (and later disposes) an engine of its own.
    `shard_fqn` keys the shard's checkpoint row; make it unique across every
    consumer application sharing the database. `views`: how many committed
    views (queries beside the open transaction) may be open at once, each on
    a connection of its own; default VIEW_CONNECTIONS for a URL, 0 for a given
    engine (whose pool the caller sizes: see the module doc).
    """

    def __init__(self, engine: sa.Engine | str, shard_fqn: str, *,
                 views: int | None = None) -> None:
        self._owns_engine = isinstance(engine, str)
        if views is None:
            views = VIEW_CONNECTIONS if self._owns_engine else 0
        if views < 0:
            raise StoreError(f"views={views}: a count of committed views, 0 or more")
        if self._owns_engine:
            self._engine = _create_engine(str(engine), views)
        else:
            assert isinstance(engine, sa.Engine)
            _check_pool(engine, views)
            self._engine = engine
        self._view_count = views
        self.shard_fqn = shard_fqn
        self.checkpoint_home = (f"table {CHECKPOINTS.name} in "
                                f"{self._engine.url.render_as_string(hide_password=True)}")
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlstore")
        self._conn: sa.Connection | None = None
        self._fence: int | None = None
        self._commit_task: asyncio.Task[None] | None = None
        self._waiting_on_dependencies = False
        self._destroyed = False
        self._table_ready = False
        self._viewable = False  # whether committed views work here (known after a restore)
        self._views = OpenViews()
        self._view_slots = asyncio.Semaphore(max(views, 1))

    @property
    def engine(self) -> sa.Engine:
        return self._engine

    @property
    def fence(self) -> int | None:
        """The fence installed by the last restore_checkpoint; None before one."""
        return self._fence

    # --- the application's side --------------------------------------------

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(connection, *args)` in the current consumer transaction, off the event loop.

        Waits first for a commit in flight, so that the next transaction's
        statements can never slip into the one being committed. In a committed view,
        `fn` gets the view's connection instead, on the view's thread.
        """
        if (view := self._view()) is not None:  # reads on while destroy waits for it
            conn = view.connection()
            return await view.call(fn, conn, *args)
        self._check_open()
        if self._commit_op is not None:
            await self._commit_op.wait()
        return await self._call(self._in_transaction, fn, *args)

    def transaction(self) -> sa.Connection:
        """The connection, inside the current consumer transaction, for synchronous SQL.

        Statements issued on it block the calling thread (the event loop, from
        a plain hook) for as long as the database takes; prefer `run`. It may
        not be used while a commit is in flight (that raises StoreError), nor
        concurrently with `run`. In a committed view it is the view's connection.
        """
        if (view := self._view()) is not None:
            return view.connection()
        self._check_open()
        if self._commit_op is not None and not self._commit_op.done():
            raise StoreError("a commit is in flight: await store.run(...) instead")
        return self._begun()

    # --- Store --------------------------------------------------------------

    def committed_view(self) -> contextlib.AbstractAsyncContextManager[None] | None:
        return self._open_view() if self._viewable else None

    @contextlib.asynccontextmanager
    async def _open_view(self) -> AsyncIterator[None]:
        if self._view() is not None:  # nested in this task's view
            yield
            return
        async with self._view_slots:
            self._check_open()
            view = _View(self)
            with self._views.counted():
                try:
                    await view.call(view.open)
                    with context_set(_VIEW, view):
                        yield
                finally:
                    await finish(view.end())  # then the slot and count (twice cancelled too)

    async def restore_checkpoint(self, shard_id: str) -> consumer_pb.Checkpoint:
        self._check_open()
        if self._commit_op is not None:
            await self._commit_op.wait()
        try:
            fence, data = await self._call(self._restore_sync)
        except sa.exc.DBAPIError as error:  # the database out of reach, say: one line
            url = self._engine.url
            where = (f" {url.database}" if url.database else "") + (
                f" at {url.host}" if url.host else "")
            raise StoreError(f"shard {self.shard_fqn}: restoring its checkpoint from the "
                             f"{self._engine.dialect.name} database{where} failed: "
                             f"{' '.join(str(error.orig or error).split())}") from error
        self._fence = fence
        checkpoint = consumer_pb.Checkpoint()
        checkpoint.ParseFromString(data)
        return checkpoint

    async def start_commit(
        self,
        shard_id: str,
        checkpoint: consumer_pb.Checkpoint,
        wait_for: Sequence[OpFuture],
    ) -> OpFuture:
        self._check_open()
        data = checkpoint.SerializeToString(deterministic=True)
        op = self._new_commit_op(shard_id, restored=self._fence is not None)
        self._waiting_on_dependencies = True  # until _commit has seen them all resolve
        self._commit_task = asyncio.create_task(
            self._commit(op, data, self._fence, list(wait_for)),
            name=f"sqlstore-commit:{shard_id}",
        )
        return op

    async def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        op, task = self._commit_op, self._commit_task
        if task is not None and not task.done():
            # Still waiting on dependencies: nothing was sent, so abandon it.
            # Already in the database: let it finish rather than guess its outcome.
            if self._waiting_on_dependencies:
                task.cancel()
            await wait_finished(task, f"the commit of shard {self.shard_fqn}'s store")
        if op is not None and not op.done():  # cancelled before it even started
            op.fail(StoreError(f"store of shard {self.shard_fqn} destroyed before the commit"))
        await self._views.drained(f"store of shard {self.shard_fqn}")
        try:
            await self._call(self._close_sync)
        finally:
            # Not waiting for the thread: it is idle once closed, and when this was given up
            # on instead (a statement stuck in the database holding it), a wait here would
            # block the event loop, and every shard on it, until the database answers.
            self._executor.shutdown(wait=False)
            if self._owns_engine:
                self._engine.dispose()

    def is_transient(self, error: BaseException) -> bool:
        """A connection the database dropped or refused (PostgreSQL restarting, a backend
        terminated, a failover), a deadlock or a serialization failure: an error SQLAlchemy
        marks `connection_invalidated`, or whose server code says so (`_transient_code`).
        An app's mistake (an unknown column, a statement timeout) is not."""
        for seen in causes(error):
            if isinstance(seen, sa.exc.DBAPIError):
                if seen.connection_invalidated:
                    return True
                if self._engine.dialect.name == "sqlite":
                    # Its errors are the file's or the app's, never a server's going away;
                    # but shards sharing the file wait on each other's writes, and one
                    # writing longer than the busy timeout is no mistake.
                    return "database is locked" in str(seen.orig)
                return _transient_code(seen)
            if isinstance(seen, sa.exc.PendingRollbackError):  # the app went on after one
                return self._conn is not None and self._conn.invalidated
        return False

    # --- internals ----------------------------------------------------------

    def _view(self) -> _View | None:
        view = _VIEW.get()
        return view if view is not None and view.store is self else None

    def _check_open(self) -> None:
        if self._destroyed:
            raise StoreError(f"store of shard {self.shard_fqn} was destroyed")

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the store's worker thread."""
        return await on_thread(self._executor, fn, *args)

    def _connection(self) -> sa.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = self._engine.connect()
        return self._conn

    def _begun(self) -> sa.Connection:
        """The connection, in the current consumer transaction (begun if need be)."""
        conn = self._connection()
        if not conn.in_transaction():
            conn = self._alive(conn)
            conn.begin()
        return conn

    def _alive(self, conn: sa.Connection) -> sa.Connection:
        """`conn`, or a new connection if the database dropped it since the last
        transaction (restarted while the shard was idle: its next transaction failed,
        and the shard with it). A ping per consumer transaction; safe, as nothing of the
        transaction is on the connection yet, and the fence is checked at commit."""
        try:
            if not conn.invalidated and conn.dialect.do_ping(conn.connection.dbapi_connection):
                return conn
        except Exception as error:  # the ping's failure: the connection is gone
            log.info("%s: its database connection was dropped (%s); connecting again",
                     self.shard_fqn, error)
        conn.invalidate()
        conn.close()
        self._conn = self._engine.connect()
        return self._conn

    def _in_transaction(self, fn: Callable[..., T], *args: Any) -> T:
        conn = self._begun()
        transaction = conn.get_transaction()
        result = fn(conn, *args)
        if conn.get_transaction() is not transaction:
            # Committed without its checkpoint: a crash before the next commit would have
            # the transaction's messages counted again. Said at once, not at that crash.
            raise StoreError(
                f"shard {self.shard_fqn}: the app's code ended the consumer transaction "
                "(a commit or rollback on the store's connection): the store commits it, "
                "with the checkpoint, when the transaction ends")
        return result

    def _rollback(self) -> None:
        if self._conn is not None and self._conn.in_transaction():
            self._conn.rollback()

    def _restore_sync(self) -> tuple[int, bytes]:
        """Bump the fence (inserting the row of a new shard) and read the checkpoint, committed."""
        conn = self._connection()
        self._rollback()  # whatever a previous assignment left uncommitted is void
        if not self._table_ready:
            if self._owns_engine and conn.dialect.name == "sqlite":
                _use_wal(conn, self.shard_fqn)
            _create_table(conn)
            self._table_ready = True
        row_is = CHECKPOINTS.c.shard_fqn == self.shard_fqn
        for _ in range(_RESTORE_ATTEMPTS):
            try:
                with conn.begin():
                    bumped = conn.execute(
                        sa.update(CHECKPOINTS).where(row_is).values(fence=CHECKPOINTS.c.fence + 1)
                    )
                    if bumped.rowcount == 0:
                        conn.execute(
                            sa.insert(CHECKPOINTS).values(
                                shard_fqn=self.shard_fqn, fence=1, checkpoint=b""
                            )
                        )
                    fence, data = conn.execute(
                        sa.select(CHECKPOINTS.c.fence, CHECKPOINTS.c.checkpoint).where(row_is)
                    ).one()
                    self._viewable = self._view_count > 0 and _has_views(conn)
                if self._view_count and not self._viewable and not self._owns_engine:
                    log.warning("%s: views=%d, but %s can't have committed views (SQLite "
                                "needs WAL mode): queries wait for the transaction",
                                self.shard_fqn, self._view_count, conn.dialect.name)
                return int(fence), bytes(data)
            except IntegrityError:
                continue  # another instance inserted the row first: bump it instead
        raise StoreError(f"shard {self.shard_fqn}: could not install a fence")

    def _commit_sync(self, data: bytes, fence: int) -> None:
        """Write the checkpoint where the fence is still ours, and commit everything together."""
        try:
            conn = self._begun()
            written = conn.execute(
                sa.update(CHECKPOINTS)
                .where(CHECKPOINTS.c.shard_fqn == self.shard_fqn, CHECKPOINTS.c.fence == fence)
                .values(checkpoint=data)
            )
            if written.rowcount != 1:
                raise FencedError(
                    f"shard {self.shard_fqn}: fence {fence} is stale, a newer instance restored"
                )
            conn.commit()
        except BaseException:
            self._rollback()
            raise

    def _close_sync(self) -> None:
        if self._conn is not None:
            try:
                self._rollback()
            except Exception as error:  # closing anyway: the database rolls back what's open
                log.info("%s: rolling back before closing failed: %s", self.shard_fqn, error)
            self._conn.close()
            self._conn = None

    async def _commit(
        self, op: OpFuture, data: bytes, fence: int, wait_for: list[OpFuture]
    ) -> None:
        """Wait for the dependencies in order, then commit; resolve `op` with the outcome."""
        try:
            for dependency in wait_for:
                await dependency.wait()
                if (error := dependency.exception()) is not None:
                    raise error
            self._waiting_on_dependencies = False
            await self._call(self._commit_sync, data, fence)
        except BaseException as error:
            if self._waiting_on_dependencies:  # nothing was sent: drop the transaction
                self._waiting_on_dependencies = False
                try:
                    await asyncio.shield(self._call(self._rollback))
                except Exception as rollback_error:  # the transaction fails either way
                    log.info("%s: rolling back a transaction never sent failed: %s",
                             self.shard_fqn, rollback_error)
            op.fail(error)
            if isinstance(error, asyncio.CancelledError):
                raise
        else:
            op.resolve(pb.AppendResponse(status=pb.OK))


# SQLSTATEs of errors that pass: connection exceptions (class 08), serialization failure,
# deadlock, the server shutting down or starting, too many connections.
_TRANSIENT_STATES = frozenset({"40001", "40P01", "57P01", "57P02", "57P03", "53300"})
# MySQL's: can't connect, server gone away, lost connection, too many connections,
# lock wait timeout, deadlock.
_TRANSIENT_MYSQL = frozenset({2002, 2003, 2006, 2013, 1040, 1205, 1213})


def _transient_code(error: sa.exc.DBAPIError) -> bool:
    """Whether the driver's error says the server went away or asked for a retry. An
    OperationalError without a server code is the connection's own failure (refused,
    reset, timed out); any other code is the statement's."""
    orig = error.orig
    state = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    args = getattr(orig, "args", ())
    if not state and args and isinstance(args[0], dict):  # pg8000: the server's fields
        state = args[0].get("C")
    if isinstance(state, str) and state:
        return state.startswith("08") or state in _TRANSIENT_STATES
    if args and isinstance(args[0], int):  # MySQL drivers: (code, message)
        return args[0] in _TRANSIENT_MYSQL
    if _REFUSED.search(str(orig)):
        return False  # the server answered: the URL is wrong, not the server away
    return isinstance(error, sa.exc.OperationalError)


# What PostgreSQL refuses a connection for that waiting won't change (psycopg2 gives such
# errors no SQLSTATE): a wrong password, user or database, an address pg_hba.conf refuses.
_REFUSED = re.compile(r'password authentication failed|(role|database) "[^"]*" does not exist'
                     r"|no pg_hba\.conf entry|password is required")


def _create_table(conn: sa.Connection) -> None:
    """Create the checkpoint table if missing, tolerating another process creating it too."""
    try:
        with conn.begin():
            CHECKPOINTS.create(conn, checkfirst=True)
    except sa.exc.DBAPIError:
        with conn.begin():
            if not sa.inspect(conn).has_table(CHECKPOINTS.name):
                raise


def _use_wal(conn: sa.Connection, shard_fqn: str) -> None:
    """Put an SQLite database in WAL mode (it stays so): views need it, and shards
    sharing the file no longer block each other's reads. Best effort: a database
    that can't switch (another connection mid-transaction) stays as it is."""
    try:
        conn.exec_driver_sql("PRAGMA journal_mode=WAL")
        conn.commit()
    except sa.exc.DBAPIError as error:
        conn.rollback()
        log.info("%s: SQLite database left in its journal mode: %s", shard_fqn, error)



def _has_views(conn: sa.Connection) -> bool:
    """Whether committed views can read beside this connection's transactions, on an
    engine the store made (see the module doc). An in-memory SQLite database reports
    journal_mode "memory"."""
    if conn.dialect.name == "postgresql":
        return True
    if conn.dialect.name == "sqlite":
        mode = conn.exec_driver_sql("PRAGMA journal_mode").scalar()
        return str(mode).lower() == "wal"
    return False
