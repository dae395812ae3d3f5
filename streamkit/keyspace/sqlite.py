"""The embedded KeySpace: one SQLite file that local processes share.

Each `SQLiteKeySpace` owns one connection, confined to one worker thread.
Running SQLite there (rather than inline on the event loop) means a writer
waiting for another process's write lock blocks only that thread, so the
busy timeout can be generous and callers never see spurious "database is
locked" errors, while the event loop keeps serving. The price is a thread hop
per call (tens of microseconds), small next to gRPC and disk work.

Consistency across processes comes from SQLite itself: WAL mode lets readers
proceed during a write, and every write runs in `BEGIN IMMEDIATE`, which takes
the single write lock before reading anything, so compares and the revision
counter are always evaluated against the latest committed state.

On-disk schema:

* `meta(name, value)`: `revision` (the store head), `compact_revision`
  (history at or below it is gone), `schema` (layout version).
* `kv(key, value, create_revision, mod_revision, version, lease)`: current
  keys; TEXT keys compare bytewise as UTF-8, the order etcd uses.
* `history(revision, seq, kind, key, value, create_revision, version, lease)`:
  one row per changed key per revision, read by watches; trimmed to the last
  `history_revisions` revisions by every write.
* `leases(id, ttl, expires_at)`: live leases; `expires_at` is wall-clock time
  so that all processes agree on it.

Lease expiry is lazy: every operation, in any process, first deletes expired
leases and their keys (one revision, seen by watches like any delete) if
some are due. A process with an open watch polls the store every
`poll_interval`, so that poll is the periodic sweep; when nobody touches the
store, nobody can observe a stale key either. For a second after the head
last moved, it polls every `BUSY_POLL` instead: changes come in chains across
processes (a member joins, the leader assigns, the member takes its shards
over), and each link would otherwise wait for a poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from time import monotonic as _monotonic  # not `time.`: tests fake the wall clock
from typing import Any, TypeVar

from streamkit.keyspace.keyspace import (
    CompactedError,
    Compare,
    Delete,
    DeletePrefix,
    Event,
    KeySpace,
    KeySpaceError,
    KeyValue,
    LeaseNotFoundError,
    Op,
    Put,
    TxnResult,
)

T = TypeVar("T")

_SCHEMA = """
BEGIN IMMEDIATE;
CREATE TABLE IF NOT EXISTS meta (
    name TEXT PRIMARY KEY,
    value INTEGER NOT NULL
) WITHOUT ROWID;
INSERT OR IGNORE INTO meta VALUES ('schema', 1), ('revision', 0), ('compact_revision', 0);
CREATE TABLE IF NOT EXISTS kv (
    key TEXT PRIMARY KEY,
    value BLOB NOT NULL,
    create_revision INTEGER NOT NULL,
    mod_revision INTEGER NOT NULL,
    version INTEGER NOT NULL,
    lease INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS kv_by_lease ON kv (lease) WHERE lease != 0;
CREATE TABLE IF NOT EXISTS history (
    revision INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    kind TEXT NOT NULL CHECK (kind IN ('put', 'delete')),
    key TEXT NOT NULL,
    value BLOB,
    create_revision INTEGER NOT NULL,
    version INTEGER NOT NULL,
    lease INTEGER NOT NULL,
    PRIMARY KEY (revision, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS leases (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ttl REAL NOT NULL,
    expires_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS leases_by_expiry ON leases (expires_at);
COMMIT;
"""

_KV_COLUMNS = "key, value, create_revision, mod_revision, version, lease"

# A watch reads at most this many revisions of history per query.
_WATCH_WINDOW = 1000


def _prefix_end(prefix: str) -> str | None:
    """The least string above every string starting with `prefix` (None: no bound)."""
    for i in reversed(range(len(prefix))):
        nxt = ord(prefix[i]) + 1
        if nxt == 0xD800:  # surrogates can't be stored as UTF-8; skip past them
            nxt = 0xE000
        if nxt <= 0x10FFFF:
            return prefix[:i] + chr(nxt)
    return None


def _prefix_clause(prefix: str) -> tuple[str, tuple[str, ...]]:
    """SQL condition (index-friendly range) selecting keys that start with `prefix`."""
    if not prefix:
        return "1", ()
    end = _prefix_end(prefix)
    if end is None:
        return "key >= ?", (prefix,)
    return "key >= ? AND key < ?", (prefix, end)


class _Revision:
    """The changes of one new revision, made inside an open write transaction.

    The revision counter moves only if something actually changed, as in
    etcd (deleting a missing key is not a write).
    """

    def __init__(self, conn: sqlite3.Connection, head: int, keep: int) -> None:
        self._conn = conn
        self._keep = keep
        self.number = head + 1
        self._changes = 0

    def apply(self, op: Op) -> None:
        match op:
            case Put(key, value, lease):
                self._put(key, value, lease)
            case Delete(key):
                self.delete("key = ?", (key,))
            case DeletePrefix(prefix):
                self.delete(*_prefix_clause(prefix))

    def _put(self, key: str, value: bytes, lease: int) -> None:
        create_revision, version = self._conn.execute(
            "INSERT INTO kv VALUES (?, ?, ?, ?, 1, ?) ON CONFLICT (key) DO UPDATE SET"
            " value = excluded.value, mod_revision = excluded.mod_revision,"
            " version = version + 1, lease = excluded.lease"
            " RETURNING create_revision, version",
            (key, value, self.number, self.number, lease),
        ).fetchone()
        self._record("put", key, value, create_revision, version, lease)

    def delete(self, where: str, params: Sequence[Any]) -> None:
        """Delete the keys matching a condition, recording each."""
        deleted = self._conn.execute(f"DELETE FROM kv WHERE {where} RETURNING key", params)
        for key in sorted(row[0] for row in deleted):
            self._record("delete", key, None, 0, 0, 0)

    def _record(
        self, kind: str, key: str, value: bytes | None, create: int, version: int, lease: int
    ) -> None:
        self._changes += 1
        self._conn.execute(
            "INSERT INTO history VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (self.number, self._changes, kind, key, value, create, version, lease),
        )

    def finish(self) -> int:
        """Publish the revision if anything changed, trim history; return the head."""
        if not self._changes:
            return self.number - 1
        self._conn.execute("UPDATE meta SET value = ? WHERE name = 'revision'", (self.number,))
        floor = self.number - self._keep
        if floor > 0:
            self._conn.execute("DELETE FROM history WHERE revision <= ?", (floor,))
            self._conn.execute(
                "UPDATE meta SET value = ? WHERE name = 'compact_revision' AND value < ?",
                (floor, floor),
            )
        return self.number


def _event(row: tuple[Any, ...]) -> Event:
    revision, kind, key, value, create_revision, version, lease = row
    kv = KeyValue(key, value or b"", create_revision, revision, version, lease)
    return Event(kind, kv, revision)


class _Store:
    """Synchronous access to the file; used only from the KeySpace's worker thread."""

    def __init__(self, path: str, busy_timeout: float, history_revisions: int) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._keep = history_revisions
        self._conn = sqlite3.connect(path, timeout=busy_timeout, isolation_level=None)
        try:
            self._configure()
        except BaseException:
            self._conn.close()
            raise

    def _configure(self) -> None:
        mode = self._conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if mode != "wal":
            raise KeySpaceError(f"SQLite refused WAL mode (got {mode!r}); use a local file")
        # In WAL mode NORMAL loses no commit when a process dies, only on power loss.
        self._conn.execute("PRAGMA synchronous = NORMAL")
        self._conn.executescript(_SCHEMA)

    def close(self) -> None:
        self._conn.close()

    @contextlib.contextmanager
    def _transaction(self, mode: str) -> Iterator[None]:
        self._conn.execute(f"BEGIN {mode}")
        try:
            yield
            self._conn.execute("COMMIT")
        except BaseException:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            raise

    @contextlib.contextmanager
    def _write(self) -> Iterator[int]:
        """Hold the write lock; yields the head after expiring due leases."""
        with self._transaction("IMMEDIATE"):
            yield self._drop_leases(self._head(), "expires_at <= ?", (time.time(),))

    @contextlib.contextmanager
    def _read(self) -> Iterator[int]:
        """A consistent snapshot; yields its head revision."""
        self._expire_due()
        with self._transaction("DEFERRED"):
            yield self._head()

    def _expire_due(self) -> None:
        """Take the write lock to expire leases only when one is actually due."""
        due = self._conn.execute(
            "SELECT 1 FROM leases WHERE expires_at <= ? LIMIT 1", (time.time(),)
        ).fetchone()
        if due:
            with self._write():
                pass

    def _head(self) -> int:
        return self._meta("revision")

    def _meta(self, name: str) -> int:
        row = self._conn.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
        return int(row[0])

    def _get(self, key: str) -> KeyValue | None:
        row = self._conn.execute(f"SELECT {_KV_COLUMNS} FROM kv WHERE key = ?", (key,)).fetchone()
        return KeyValue(*row) if row else None

    def _drop_leases(self, head: int, where: str, params: Sequence[Any]) -> int:
        """Delete matching leases and, in one revision, their keys; returns the head."""
        ids = [
            row[0]
            for row in self._conn.execute(f"DELETE FROM leases WHERE {where} RETURNING id", params)
        ]
        if not ids:
            return head
        revision = _Revision(self._conn, head, self._keep)
        revision.delete(f"lease IN ({', '.join('?' * len(ids))})", ids)
        return revision.finish()

    def head(self) -> int:
        self._expire_due()
        return self._head()

    def get(self, key: str) -> KeyValue | None:
        with self._read():
            return self._get(key)

    def range(self, prefix: str) -> tuple[list[KeyValue], int]:
        where, params = _prefix_clause(prefix)
        with self._read() as head:
            rows = self._conn.execute(
                f"SELECT {_KV_COLUMNS} FROM kv WHERE {where} ORDER BY key", params
            ).fetchall()
        return [KeyValue(*row) for row in rows], head

    def txn(
        self, compares: Sequence[Compare], on_success: Sequence[Op], on_failure: Sequence[Op]
    ) -> TxnResult:
        with self._write() as head:
            succeeded = all(c.holds(self._get(c.key)) for c in compares)
            ops = on_success if succeeded else on_failure
            self._check_leases(ops)
            revision = _Revision(self._conn, head, self._keep)
            for op in ops:
                revision.apply(op)
            return TxnResult(succeeded, revision.finish())

    def _check_leases(self, ops: Sequence[Op]) -> None:
        for lease in {op.lease for op in ops if isinstance(op, Put) and op.lease}:
            if not self._conn.execute("SELECT 1 FROM leases WHERE id = ?", (lease,)).fetchone():
                raise LeaseNotFoundError(f"lease {lease} not found (expired or revoked?)")

    def events(self, prefix: str, after: int) -> tuple[list[Event], int, int]:
        """History under `prefix` after a revision: (events, read up to, head)."""
        where, params = _prefix_clause(prefix)
        with self._read() as head:
            compacted = self._meta("compact_revision")
            if after < compacted:
                raise CompactedError(after, compacted)
            upto = max(after, min(head, after + _WATCH_WINDOW))
            rows = self._conn.execute(
                "SELECT revision, kind, key, value, create_revision, version, lease FROM history"
                f" WHERE revision > ? AND revision <= ? AND {where} ORDER BY revision, seq",
                (after, upto, *params),
            ).fetchall()
        return [_event(row) for row in rows], upto, head

    def grant(self, ttl: float) -> int:
        with self._write():
            cursor = self._conn.execute(
                "INSERT INTO leases (ttl, expires_at) VALUES (?, ?)", (ttl, time.time() + ttl)
            )
            return int(cursor.lastrowid or 0)

    def keepalive(self, lease_id: int) -> bool:
        with self._write():  # expires due leases first, so a lapsed lease is gone
            cursor = self._conn.execute(
                "UPDATE leases SET expires_at = ? + ttl WHERE id = ?", (time.time(), lease_id)
            )
            return cursor.rowcount == 1

    def revoke(self, lease_id: int) -> int:
        with self._write() as head:
            return self._drop_leases(head, "id = ?", (lease_id,))


BUSY_POLL = 0.005  # seconds between polls while the head moved lately
_BUSY_FOR = 1.0  # seconds after the head last moved that polls are BUSY_POLL apart


class SQLiteKeySpace(KeySpace):
    """A KeySpace in one SQLite file, shared by every process that opens it.

    Watches learn of other processes' writes by polling the head revision
    every `poll_interval` seconds; all watches of one instance share that
    poll, and this instance's own writes wake them at once. Each writing
    process trims history to its own `history_revisions`, so processes
    sharing a file should agree on it. Opening is synchronous (it creates
    the file and schema if needed).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        poll_interval: float = 0.05,
        history_revisions: int = 10_000,
        busy_timeout: float = 10.0,
    ) -> None:
        if history_revisions < 1:
            raise ValueError("history_revisions must be at least 1")
        self._path = str(path)
        self._poll_interval = poll_interval
        self._reopen_args = (poll_interval, history_revisions, busy_timeout)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="keyspace")
        try:
            self._store = self._executor.submit(
                _Store, self._path, busy_timeout, history_revisions
            ).result()
        except sqlite3.Error as e:
            self._executor.shutdown()
            raise KeySpaceError(f"cannot open keyspace {self._path}: {e}"
                                f"{_full_disk_hint(self._path)}") from e
        except BaseException:
            self._executor.shutdown()
            raise
        self._closed = False
        self._known_head = 0
        self._head_changed = asyncio.Event()
        self._polled_at = float("-inf")
        self._moved_at = float("-inf")  # monotonic time the known head last moved

    def __repr__(self) -> str:
        return f"SQLiteKeySpace({self._path!r})"

    def reopen(self) -> SQLiteKeySpace:
        poll_interval, history_revisions, busy_timeout = self._reopen_args
        return SQLiteKeySpace(self._path, poll_interval=poll_interval,
                              history_revisions=history_revisions, busy_timeout=busy_timeout)

    def _check_open(self) -> None:
        if self._closed:
            raise KeySpaceError(f"keyspace {self._path} is closed")

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a `_Store` method on the worker thread, as a KeySpaceError if SQLite fails."""
        self._check_open()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        except sqlite3.Error as e:
            raise KeySpaceError(f"keyspace {self._path}: {e}") from e

    def _notify(self) -> None:
        """Wake every watch waiting on `_head_changed`."""
        changed, self._head_changed = self._head_changed, asyncio.Event()
        changed.set()

    def _saw(self, head: int) -> int:
        if head > self._known_head:
            self._known_head = head
            self._moved_at = _monotonic()
            self._notify()
        return head

    async def get(self, key: str) -> KeyValue | None:
        return await self._call(self._store.get, key)

    async def range(self, prefix: str) -> tuple[list[KeyValue], int]:
        kvs, head = await self._call(self._store.range, prefix)
        self._saw(head)
        return kvs, head

    async def revision(self) -> int:
        return self._saw(await self._call(self._store.head))

    async def _txn(
        self, compares: Sequence[Compare], on_success: Sequence[Op], on_failure: Sequence[Op]
    ) -> TxnResult:
        """Note: a caller cancelled while the write runs does not stop it from committing."""
        result = await self._call(self._store.txn, compares, on_success, on_failure)
        self._saw(result.revision)
        return result

    async def watch(self, prefix: str, from_revision: int) -> AsyncIterator[list[Event]]:
        position = from_revision
        while True:
            events, position, head = await self._call(self._store.events, prefix, position)
            self._saw(head)
            if events:
                yield events
            else:
                await self._wait_past(position)

    async def _wait_past(self, revision: int) -> None:
        """Return once this instance knows of a revision after `revision`.

        Whichever waiting watch finds the poll due reads the head for all of
        them; the rest sleep on `_head_changed` until then.
        """
        loop = asyncio.get_running_loop()
        while self._known_head <= revision:
            self._check_open()
            interval = self._poll_interval
            if _monotonic() - self._moved_at < _BUSY_FOR:
                interval = min(interval, BUSY_POLL)
            wait = self._polled_at + interval - loop.time()
            if wait <= 0:
                self._polled_at = loop.time()
                self._saw(await self._call(self._store.head))
                continue
            changed = self._head_changed
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await changed.wait()

    async def grant(self, ttl_seconds: float) -> int:
        if ttl_seconds <= 0:
            raise ValueError("lease TTL must be positive")
        return await self._call(self._store.grant, ttl_seconds)

    async def keepalive(self, lease_id: int) -> bool:
        return await self._call(self._store.keepalive, lease_id)

    async def revoke(self, lease_id: int) -> None:
        self._saw(await self._call(self._store.revoke, lease_id))

    async def close(self) -> None:
        """Close the connection; waiting watches then raise KeySpaceError."""
        if self._closed:
            return
        self._closed = True
        self._notify()
        await asyncio.get_running_loop().run_in_executor(self._executor, self._store.close)
        self._executor.shutdown(wait=False)


def _full_disk_hint(path: str) -> str:
    """SQLite reports a full disk met while making its WAL index as a "disk I/O error":
    name the likelier cause when the file's disk has (almost) no room."""
    try:
        free = shutil.disk_usage(Path(path).parent).free
    except OSError:
        return ""
    return f" (its disk has {free:,} bytes free)" if free < (1 << 20) else ""
