"""SQLiteStore: an embedded SQLite database whose file writes are recorded to a recovery log.

SQLite reaches the disk only through its VFS. The store registers a VFS of
its own (an apsw.VFS layered on the default unix VFS) that performs every
operation as usual and then records the ones that change files: opens for
writing, writes, truncates and deletes, of the database and of its journal
or WAL. Playing the log back therefore rebuilds the directory SQLite left
behind, byte for byte, including a hot journal or a WAL with uncommitted
frames if the writer died mid-commit; SQLite resolves those itself when the
recovered database is opened, exactly as after a crash.

Not recorded: temporary files (SQLite opens them without a name) and the
WAL's `-shm` index, which the unix VFS maps into memory and never writes
through xWrite; SQLite rebuilds it from the WAL when it is missing.

xSync does not wait for the log: apsw calls the VFS synchronously on the
event loop's thread, so it cannot block on an append. It needs not: ops
reach the log in the order they were recorded, so any prefix of the log is
a state SQLite's own crash recovery handles, and the commit's durability is
the recorder barrier that `start_commit` returns. Nor does it fsync the
local file: the directory is always rebuilt from the log, never trusted.

Transactions: the store keeps one SQL transaction open on `store.db` at all
times (BEGIN after restore and after every commit). The application issues
its statements on `store.db` without BEGIN/COMMIT of its own (SAVEPOINTs
are fine); `start_commit` adds the checkpoint row to that same transaction
and commits it, so state and checkpoint land together. The checkpoint is
one row of table `streamkit_checkpoint`.

Committed views (WAL mode only): a query's view reads through a read-only
connection of its own, in a read transaction begun when no commit is on its way
to the log, so it sees exactly the last durable commit; WAL lets the writer go
on committing meanwhile (`prepare` sets a view's connection up like the
transaction's). In DELETE mode a reader would block the writer's
commit (and be blocked by it), so queries wait for the open transaction there.

SQLite can end that transaction on its own (INSERT OR ROLLBACK, RAISE(ROLLBACK)
in a trigger, SQLITE_FULL), and an application can COMMIT by mistake; later
statements would then autocommit, reaching the log without a checkpoint. So a
commit hook vetoes (rolls back) every commit the store did not start itself,
and `start_commit` fails, writing nothing, when the transaction is gone.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import AsyncIterator, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Literal, cast, get_args

import apsw

from streamkit.client.append_service import OpFuture
from streamkit.protocol import consumer_pb
from streamkit.recoverylog.recorded_fs import RecordedFS
from streamkit.recoverylog.recorder import Recorder
from streamkit.stores.recorded import RecordedStore
from streamkit.stores.store import OpenViews, StoreError, context_set

__all__ = ["CHECKPOINT_TABLE", "JournalMode", "RecordingVFS", "SQLiteStore"]

CHECKPOINT_TABLE = "streamkit_checkpoint"

JournalMode = Literal["DELETE", "WAL"]
IDLE_READERS = 4  # read-only connections kept open for the next committed views

_vfs_ids = itertools.count(1)

# The store and read-only connection of the current task's committed view, if any.
_VIEW: ContextVar[tuple[SQLiteStore, apsw.Connection] | None] = ContextVar(
    "streamkit_sqlite_view", default=None)


class RecordingVFS(apsw.VFS):
    """The default unix VFS, with changes to files under `root` recorded by `recorder`."""

    def __init__(self, name: str, root: Path, recorder: Recorder) -> None:
        super().__init__(name, base="")
        self.root = root.resolve()
        self.recorder = recorder

    def relative(self, name: str | apsw.URIFilename | None) -> str | None:
        """`name` relative to the recorded root; None for temp files and files outside it."""
        if name is None:
            return None
        filename = name.filename() if isinstance(name, apsw.URIFilename) else name
        try:
            return Path(filename).resolve().relative_to(self.root).as_posix()
        except ValueError:
            return None

    def xOpen(self, name: str | apsw.URIFilename | None, flags: list[int]) -> apsw.VFSFile:
        path = self.relative(name)
        if path is None or not flags[0] & apsw.SQLITE_OPEN_READWRITE:
            return apsw.VFSFile("", name, flags)  # nothing of it is recorded
        return _RecordingFile(self, path, name, flags)

    def xDelete(self, filename: str, syncdir: bool) -> None:
        super().xDelete(filename, False)  # the local directory needs no sync: see above
        path = self.relative(filename)
        if path is not None and self.recorder.fnode_of(path) is not None:
            self.recorder.record_remove(path)


class _RecordingFile(apsw.VFSFile):
    """A file of the base VFS whose writes and truncates are recorded."""

    def __init__(
        self,
        vfs: RecordingVFS,
        path: str,
        name: str | apsw.URIFilename,
        flags: list[int],
    ) -> None:
        super().__init__("", name, flags)
        self.recorder = vfs.recorder
        self.fnode = self.recorder.record_open(path)

    def xWrite(self, data: bytes, offset: int) -> None:
        super().xWrite(data, offset)
        if self.recorder.is_live(self.fnode):
            self.recorder.record_write(self.fnode, data, offset)

    def xTruncate(self, newsize: int) -> None:
        super().xTruncate(newsize)
        if self.recorder.is_live(self.fnode):
            size = self.xFileSize()
            content = self.xRead(size, 0) if size else b""
            self.fnode = self.recorder.record_replace(self.fnode, content)

    def xSync(self, flags: int) -> None:
        """Skipped: durability comes from the recovery log (see the module docstring)."""


class SQLiteStore(RecordedStore):
    """Shard state in an SQLite database (`filename` in `fs`), recorded to the recovery log.

    `store.db` is the apsw Connection, available after `restore_checkpoint`,
    always inside the current consumer transaction. `journal_mode` is WAL
    (default: it records less per commit, and queries read committed views
    beside the open transaction) or DELETE (each commit leaves just the
    database file).

    `start_commit` returns once the transaction's dependencies resolved and
    SQLite committed locally; the returned OpFuture resolves once everything
    SQLite wrote for the commit reached the recovery log.
    """

    def __init__(
        self,
        fs: RecordedFS,
        filename: str = "db.sqlite",
        journal_mode: JournalMode = "WAL",
    ) -> None:
        super().__init__(fs)
        self.filename = filename
        if journal_mode.upper() not in get_args(JournalMode):
            raise StoreError(
                f"SQLiteStore journal_mode {journal_mode!r}: streamkit records only "
                "'WAL' or 'DELETE'"
            )
        self.journal_mode = cast(JournalMode, journal_mode.upper())
        self._vfs_name = f"streamkit-recorded-{os.getpid()}-{next(_vfs_ids)}"
        self._vfs: RecordingVFS | None = None
        self._db: apsw.Connection | None = None
        self._committing = False  # the store's own COMMIT is running: let it through
        self._durable: OpFuture | None = None  # the last commit's way to the log
        self._views = OpenViews()
        self._readers: list[apsw.Connection] = []  # idle read-only connections, for views

    @property
    def db(self) -> apsw.Connection:
        """The connection, inside the current consumer transaction (in a committed view,
        a read-only one, inside a read transaction of the last durable commit)."""
        view = _VIEW.get()
        if view is not None and view[0] is self:
            return view[1]
        if self._db is None:
            raise StoreError("the database is opened by restore_checkpoint")
        return self._db

    def committed_view(self) -> contextlib.AbstractAsyncContextManager[None] | None:
        return self._view() if self.journal_mode == "WAL" else None

    @contextlib.asynccontextmanager
    async def _view(self) -> AsyncIterator[None]:
        view = _VIEW.get()
        if view is not None and view[0] is self:  # nested in this task's view
            yield
            return
        while (durable := self._durable) is not None and not durable.done():
            await durable.wait()  # a commit on its way to the log: not yet committed
        self._check_open()
        if self._db is None:
            raise StoreError("the database is opened by restore_checkpoint")
        if durable is not None and (error := durable.exception()) is not None:
            raise StoreError(f"store failed a commit: {error!r}")
        reader = self._readers.pop() if self._readers else self._open_reader()
        reader.execute("BEGIN")
        reader.execute(f"SELECT count(*) FROM {CHECKPOINT_TABLE}").fetchall()  # snapshot: now
        try:
            with self._views.counted(), context_set(_VIEW, (self, reader)):
                yield
        finally:
            if self._destroyed or len(self._readers) >= IDLE_READERS:
                reader.close()  # outlasted destroy's wait, or a burst of queries ended
            else:
                if reader.in_transaction:
                    reader.execute("ROLLBACK")
                self._readers.append(reader)

    async def restore_checkpoint(self, shard_id: str) -> consumer_pb.Checkpoint:
        self._check_open()
        if self._db is None:
            self._db = self._open()
        db = self._db
        if db.in_transaction:
            db.execute("ROLLBACK")  # a previous assignment's uncommitted work is void
        row = db.execute(f"SELECT checkpoint FROM {CHECKPOINT_TABLE} WHERE id = 0").fetchone()
        checkpoint = consumer_pb.Checkpoint()
        if row is not None:
            checkpoint.ParseFromString(row[0])
        db.execute("BEGIN")
        return checkpoint

    async def start_commit(
        self,
        shard_id: str,
        checkpoint: consumer_pb.Checkpoint,
        wait_for: Sequence[OpFuture],
    ) -> OpFuture:
        self._check_open()
        db = self.db
        data = checkpoint.SerializeToString(deterministic=True)
        error = await self._failed_dependency(wait_for)
        self._check_open()  # destroyed while waiting: the connection is gone
        try:
            if error is not None:
                if db.in_transaction:
                    db.execute("ROLLBACK")  # nothing of the transaction is written
                return OpFuture.finished(error)
            if not db.in_transaction:  # ended under us: its statements are partly lost
                return OpFuture.finished(StoreError(
                    f"shard {shard_id}: the consumer transaction was ended before its commit"
                    " (a ROLLBACK by SQLite or a COMMIT of the application); nothing committed"
                ))
            db.execute(
                f"INSERT OR REPLACE INTO {CHECKPOINT_TABLE}(id, checkpoint) VALUES (0, ?)",
                (data,),
            )
            self._committing = True
            try:
                db.execute("COMMIT")
            finally:
                self._committing = False
        except Exception as failure:  # e.g. the recorder already failed mid-commit
            if db.in_transaction:
                db.execute("ROLLBACK")
            if isinstance(failure, apsw.Error):  # "database or disk is full": which one
                named = StoreError(f"committing {self.fs.local(self.filename)}: "
                                   f"{type(failure).__name__}: {failure}")
                named.__cause__ = failure
                return OpFuture.finished(named)
            return OpFuture.finished(failure)
        finally:
            if not db.in_transaction:
                db.execute("BEGIN")  # the next consumer transaction
        self._durable = self.fs.fsync()
        return self._durable

    async def destroy(self) -> None:
        """Close the database (dropping the open transaction) and unregister the VFS."""
        if self._destroyed:
            return
        self._destroyed = True
        await self._views.drained(f"SQLite store {self.filename}")
        for reader in self._readers:
            reader.close()
        self._readers = []
        db, self._db = self._db, None
        try:
            if db is not None:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                db.close()
        finally:
            if self._vfs is not None:
                self._vfs.unregister()
                self._vfs = None

    def _open(self) -> apsw.Connection:
        """Open the database through a recording VFS and prepare the checkpoint table."""
        self._vfs = RecordingVFS(self._vfs_name, self.fs.root, self.fs.recorder)
        db = apsw.Connection(
            str(self.fs.local(self.filename)),
            flags=apsw.SQLITE_OPEN_READWRITE | apsw.SQLITE_OPEN_CREATE,
            vfs=self._vfs_name,
        )
        # Closing writes nothing (no WAL checkpoint): a released store's directory is
        # disposable, and a deposed primary's recorder would refuse the writes.
        db.config(apsw.SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 1)
        (mode,) = db.execute(f"PRAGMA journal_mode={self.journal_mode}").fetchone()
        if mode.upper() != self.journal_mode:  # SQLite keeps the old mode on failure
            db.close()
            raise StoreError(
                f"{self.filename}: SQLite stays in journal_mode {mode}, "
                f"not {self.journal_mode}"
            )
        db.execute("PRAGMA synchronous=FULL")
        db.execute(
            f"CREATE TABLE IF NOT EXISTS {CHECKPOINT_TABLE}"
            "(id INTEGER PRIMARY KEY CHECK (id = 0), checkpoint BLOB NOT NULL)"
        )
        db.set_commit_hook(self._veto_foreign_commit, id="streamkit-sqlitestore")
        self.prepare(db)
        return db

    def prepare(self, connection: apsw.Connection) -> None:
        """Override to register functions or collations, or to set PRAGMAs, on every
        connection: the transaction's and each committed view's (which are read-only)."""

    def _open_reader(self) -> apsw.Connection:
        """A read-only connection, for committed views: nothing it opens is recorded."""
        reader = apsw.Connection(str(self.fs.local(self.filename)),
                                 flags=apsw.SQLITE_OPEN_READONLY, vfs=self._vfs_name)
        reader.config(apsw.SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 1)  # it can't: read-only
        self.prepare(reader)
        return reader

    def _veto_foreign_commit(self) -> bool:
        """True (turn into a rollback) for any commit but the store's own: see the module doc."""
        return not self._committing
