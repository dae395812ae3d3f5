"""RocksDBStore: shard state in an embedded RocksDB, recorded to a recovery log.

The database lives in the RecordedFS's root, a directory rebuilt from the
shard's recovery log by `recover()`. rocksdict cannot hook RocksDB's file
operations, so each commit writes to the database and then records how the
directory changed (see `dir_observer`); the commit's OpFuture resolves once
those recorded operations committed to the log, which is what makes the
transaction durable. The local disk never needs to be: it is rebuilt.

A consumer transaction's mutations collect in memory (reads see them) and go
to the database in one WriteBatch together with the checkpoint, under a
reserved key, so state and checkpoint land in the same atomic write. The next
transaction's mutations start a fresh collection while a commit is in flight.

Keys are bytes or str (str is stored UTF-8 encoded); values are bytes or any
JSON value, stored with a one-byte tag so `get` returns the type `put` got.
Keys starting with `RESERVED_PREFIX` belong to the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import orjson
import rocksdict

from streamkit.client.append_service import OpFuture
from streamkit.message.framings.json_lines import has_non_finite
from streamkit.protocol import consumer_pb, pb
from streamkit.recoverylog.recorded_fs import RecordedFS
from streamkit.stores.dir_observer import DirObserver, Observation
from streamkit.stores.store import VIEWING, OpenViews, Store, StoreError, viewing
from streamkit.tasks import on_thread, wait_finished

__all__ = [
    "CHECKPOINT_KEY",
    "RESERVED_PREFIX",
    "RocksDBStore",
    "WriteBatch",
    "default_options",
    "memtable_for",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

# The store whose committed view the current task reads in (`committed_view`), if any.
Key = bytes | str

RESERVED_PREFIX = b"\x00streamkit/"
CHECKPOINT_KEY = RESERVED_PREFIX + b"checkpoint"

# Value tags: bytes, JSON (orjson's), JSON with NaN/Infinity constants (Python json's).
_BYTES, _JSON, _NON_FINITE_JSON = b"b", b"j", b"n"
MAX_MANIFEST_SIZE = 128 << 10  # small MANIFESTs roll often, so recovery reads little of them
_MAX_PASSES = 200  # observation passes before a commit gives up on a still directory
# Memtable sizes a store picks for itself (see `memtable_for`); the largest is RocksDB's default.
MIN_MEMTABLE, MAX_MEMTABLE = 256 << 10, 64 << 20


def default_options(
    *, write_buffer_size: int | None = None, target_file_size: int | None = None
) -> rocksdict.Options:
    """Options in raw mode (what the store needs), optionally with smaller files for tests."""
    options = rocksdict.Options(raw_mode=True)
    options.create_if_missing(True)
    if write_buffer_size is not None:
        options.set_write_buffer_size(write_buffer_size)
    if target_file_size is not None:
        options.set_target_file_size_base(target_file_size)
        options.set_max_bytes_for_level_base(4 * target_file_size)
    return options


def memtable_for(state_bytes: int) -> int:
    """The memtable size for a database whose SST files hold `state_bytes`.

    A store opened after a crash replays the WAL written since its memtable
    last flushed, at ~30 ms per MiB of memtable here. RocksDB's fixed 64 MiB
    would make a small state's restart cost grow with its recent history (to
    seconds); an eighth of the state keeps the replay in proportion to what
    playback already costs, while a large state keeps large memtables (and
    little compaction). Powers of two, so the size changes rarely.
    """
    size = min(MAX_MEMTABLE, max(MIN_MEMTABLE, state_bytes // 8))
    return 1 << (size.bit_length() - 1)


def _raw(key: Key, what: str = "key") -> bytes:
    """`key` as bytes; only str and bytes are keys (`bytes(3)` would be b"\\0\\0\\0")."""
    if isinstance(key, bytes):
        return key
    if isinstance(key, str):
        return key.encode()
    raise TypeError(f"a RocksDBStore {what} must be str or bytes, not {type(key).__name__}")


def _key(key: Key) -> bytes:
    raw = _raw(key)
    if raw.startswith(RESERVED_PREFIX):
        raise KeyError(f"key {raw!r} is in the store's reserved range")
    return raw


def _encode(key: bytes, value: Any) -> bytes:
    """`value` tagged. orjson writes NaN and ±Infinity as null; a value holding one is
    written by Python's json instead (as JSONFileStore does), so `get` returns it as put.
    Only a body containing `null` is searched, so ordinary values pay no Python scan."""
    if isinstance(value, bytes | bytearray | memoryview):
        return _BYTES + bytes(value)
    body = orjson.dumps(value)
    if body.find(b"null") != -1 and has_non_finite(value):
        try:
            return _NON_FINITE_JSON + json.dumps(value, separators=(",", ":")).encode()
        except (TypeError, ValueError) as error:
            raise ValueError(f"key {key!r}: a value holding NaN or ±Infinity must be plain "
                             f"JSON (dicts, lists, str, numbers, bools, None): {error}"
                             ) from error
    return _JSON + body


def _decode(raw: bytes) -> Any:
    tag, body = raw[:1], raw[1:]
    if tag == _BYTES:
        return body
    if tag == _JSON:
        return orjson.loads(body)
    if tag == _NON_FINITE_JSON:
        return json.loads(body)
    raise StoreError(f"value with unknown tag {tag!r}: not written by RocksDBStore")


def _saved_memtable(directory: Path) -> int | None:
    """The memtable size in a database's latest OPTIONS file: RocksDB reopens with the
    column family's saved options, not the ones it is given."""
    numbered = [(int(f.name[8:]), f) for f in directory.glob("OPTIONS-*") if f.name[8:].isdigit()]
    if not numbered:
        return None
    found = re.search(r"^\s*write_buffer_size=(\d+)\s*$", max(numbered)[1].read_text(),
                      re.MULTILINE)
    return int(found.group(1)) if found else None


class WriteBatch:
    """Mutations applied to the transaction together, or (if the block raises) not at all."""

    def __init__(self) -> None:
        self.mutations: dict[bytes, bytes | None] = {}

    def put(self, key: Key, value: Any) -> None:
        raw = _key(key)
        self.mutations[raw] = _encode(raw, value)

    def delete(self, key: Key) -> None:
        self.mutations[_key(key)] = None


def _nothing() -> None:
    pass


class RocksDBStore(Store):
    """A Store in an embedded RocksDB, recorded to the recovery log of `fs`.

    `fs` may also be a plain directory: then nothing is recorded, and
    durability is the local disk's (for development and benchmarks).
    `options` must be rocksdict Options in raw mode (see `default_options`);
    the store turns off WAL recycling (a recycled WAL is rewritten in place)
    and caps the MANIFEST. `sync` fsyncs the WAL on every commit; with a
    recovery log the log is what is durable, so it may be turned off there.

    The RecordedFS (and its recorder) stay the caller's to close.
    """

    def __init__(
        self,
        fs: RecordedFS | str | os.PathLike[str],
        options: rocksdict.Options | None = None,
        *,
        sync: bool = True,
        sized_memtable: bool = False,
    ) -> None:
        self.fs = fs if isinstance(fs, RecordedFS) else None
        self.path = fs.root if isinstance(fs, RecordedFS) else Path(fs)
        self._options = options or default_options()
        self._options.set_recycle_log_file_num(0)
        self._options.set_max_manifest_file_size(MAX_MANIFEST_SIZE)
        self._write_options = rocksdict.WriteOptions()
        self._write_options.sync = sync  # a property in rocksdict, not a setter
        self._memtable = 0 if sized_memtable else None  # the size in use; None: the options'
        self.observer = DirObserver(self.path, self.fs.recorder) if self.fs else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rocksdbstore")
        self._thread_started = False
        self._db: rocksdict.Rdict | None = None
        self._pending: dict[bytes, bytes | None] = {}
        self._committing: dict[bytes, bytes | None] = {}
        self._commit_task: asyncio.Task[None] | None = None
        self._failed: BaseException | None = None
        self._waiting_on_dependencies = False
        self._destroyed = False
        # Committed views: queries reading the database while no commit writes to it.
        self._views = OpenViews()
        self._writing: asyncio.Future[None] | None = None  # a commit's write, until durable

    # --- the application's side --------------------------------------------

    def get(self, key: Key, default: Any = None) -> Any:
        """The value of `key` as this transaction sees it (its own writes included), or
        in a committed view as the last durable commit left it."""
        raw = _key(key)
        if VIEWING.get() is not self:
            for overlay in (self._pending, self._committing):
                if raw in overlay:
                    value = overlay[raw]
                    return default if value is None else _decode(value)
        stored = self._open_db().get(raw)
        return default if stored is None else _decode(stored)

    def put(self, key: Key, value: Any) -> None:
        """Set `key` to `value` (bytes, or anything JSON-serializable) in this transaction."""
        self._check_writable()
        raw = _key(key)
        self._pending[raw] = _encode(raw, value)

    def delete(self, key: Key) -> None:
        self._check_writable()
        self._pending[_key(key)] = None

    @contextlib.contextmanager
    def write_batch(self) -> Iterator[WriteBatch]:
        """A group of mutations that joins the transaction only if the block completes."""
        self._check_writable()
        batch = WriteBatch()
        yield batch
        self._pending.update(batch.mutations)

    def items(self, prefix: Key = b"") -> Iterator[tuple[bytes, Any]]:
        """(key, value) pairs under `prefix` in key order, as this transaction sees them."""
        start = _raw(prefix, "prefix")
        overlay = {} if VIEWING.get() is self else {**self._committing, **self._pending}
        changed = sorted(k for k in overlay if k.startswith(start))
        stored = self._stored_items(start)
        nxt = next(stored, None)
        for key in changed:
            while nxt is not None and nxt[0] < key:
                yield nxt[0], _decode(nxt[1])
                nxt = next(stored, None)
            if nxt is not None and nxt[0] == key:
                nxt = next(stored, None)
            if overlay[key] is not None:
                yield key, _decode(overlay[key])
        while nxt is not None:
            yield nxt[0], _decode(nxt[1])
            nxt = next(stored, None)

    # --- Store --------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def committed_view(self) -> AsyncIterator[None]:  # type: ignore[override]
        """Within it, this task's reads skip the open and the committing transactions'
        writes: the database then holds exactly the last durable commit, since a view
        waits for a commit that is writing and a commit waits for the views open."""
        if VIEWING.get() is self:  # nested in this task's view: already counted
            yield
            return
        while self._writing is not None:
            await asyncio.wait((self._writing,))
        self._open_db()  # raises if a commit failed: what it wrote may not be durable
        with self._views.counted(), viewing(self):
            yield

    async def restore_checkpoint(self, shard_id: str) -> consumer_pb.Checkpoint:
        """Open the database (rebuilt by playback) and read the checkpoint committed last.

        Opening changes the directory (a new MANIFEST, WAL and OPTIONS), which
        is recorded before this returns, so a failed fence shows up here.
        """
        self._check_usable()
        self._pending = {}  # a previous assignment's uncommitted mutations are void
        if self._db is None:
            if self.observer is not None:
                self._discard_half_created()
                self.observer.adopt()
            if self._memtable is not None:
                self._options.set_write_buffer_size(MIN_MEMTABLE)  # a new database's (no state)
                self._memtable = _saved_memtable(self.path) or MIN_MEMTABLE  # a reopened one's
            self._db = await self._call(rocksdict.Rdict, str(self.path), self._options)
            await self._call(self._check_raw_mode)
            await self._call(self._fit_memtable, False)  # before the open is recorded
            if self.observer is not None:
                await self._record()
                await self.observer.recorder.barrier()
        checkpoint = consumer_pb.Checkpoint()
        data = self._db.get(CHECKPOINT_KEY)
        if data:
            checkpoint.ParseFromString(data)
        return checkpoint

    async def start_commit(
        self,
        shard_id: str,
        checkpoint: consumer_pb.Checkpoint,
        wait_for: Sequence[OpFuture],
    ) -> OpFuture:
        self._check_usable()
        op = self._new_commit_op(shard_id, restored=self._db is not None)
        self._waiting_on_dependencies = True
        self._committing, self._pending = self._pending, {}
        data = checkpoint.SerializeToString(deterministic=True)
        self._commit_task = asyncio.create_task(
            self._commit(op, data, list(wait_for)), name=f"rocksdbstore-commit:{shard_id}"
        )
        return op

    async def destroy(self) -> None:
        """Finish (or abandon, if still waiting on dependencies) the commit in flight; close."""
        if self._destroyed:
            return
        self._destroyed = True
        task = self._commit_task
        if task is not None and not task.done():
            if self._waiting_on_dependencies:  # nothing written yet: drop the transaction
                task.cancel()
            await wait_finished(task, f"the commit of the store at {self.path}")
        op = self._commit_op
        if op is not None and not op.done():  # cancelled before its body ever ran
            op.fail(StoreError(f"store at {self.path} destroyed before the commit started"))
        await self._views.drained(f"store at {self.path}")
        try:
            if self._db is not None:
                await self._call(self._db.close)
        finally:
            self._db = None
            self._executor.shutdown(wait=True)

    # --- internals ----------------------------------------------------------

    def _discard_half_created(self) -> None:
        """Empty a rebuilt directory that holds RocksDB files but no CURRENT.

        A primary deposed while recording its database's very first open can
        leave such a log: data files are recorded before the metadata group
        that makes them a database. Nothing in it was ever committed (commits
        start only after that group is durable), and RocksDB refuses to open
        it, so it starts afresh; the removals are recorded by `adopt`.
        """
        if (self.path / "CURRENT").exists():
            return
        for entry in self.path.iterdir():
            if entry.is_file() and entry.name != "rocksdict-config.json":
                entry.unlink()

    def _check_writable(self) -> None:
        self._check_usable()
        if VIEWING.get() is self:
            raise StoreError("a committed view is read-only (queries can't write)")

    def _check_usable(self) -> None:
        if self._destroyed:
            raise StoreError(f"store at {self.path} was destroyed")
        if self._failed is not None:
            raise StoreError(f"store at {self.path} failed a commit: {self._failed!r}")

    def _open_db(self) -> rocksdict.Rdict:
        if VIEWING.get() is not self:  # an open view reads on: nothing writes under it
            self._check_usable()
        if self._db is None:
            raise StoreError(f"store at {self.path} was destroyed" if self._destroyed
                             else "the store is not open: call restore_checkpoint first")
        return self._db

    def _stored_items(self, start: bytes) -> Iterator[tuple[bytes, bytes]]:
        for key, value in self._open_db().items(from_key=start):
            if not key.startswith(start):
                return
            if not key.startswith(RESERVED_PREFIX):
                yield key, value

    def _check_raw_mode(self) -> None:
        config = self.path / "rocksdict-config.json"
        if config.exists() and not json.loads(config.read_text()).get("raw_mode"):
            raise StoreError(f"{self.path}: RocksDBStore needs Options(raw_mode=True)")

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the store's worker thread (RocksDB calls block)."""
        if not self._thread_started:
            # The executor starts its thread on the first call, and Thread.start waits until
            # the thread runs: milliseconds while other threads hold the GIL (eight shards
            # opening their stores at once), which the event loop would spend blocked.
            self._thread_started = True
            await asyncio.to_thread(self._executor.submit, _nothing)
        return await on_thread(self._executor, fn, *args)

    def _write_sync(self, mutations: dict[bytes, bytes | None], checkpoint: bytes) -> None:
        """The transaction and its checkpoint, in one atomic write."""
        assert self._db is not None
        batch = rocksdict.WriteBatch(raw_mode=True)
        for key, value in mutations.items():
            if value is None:
                batch.delete(key)
            else:
                batch.put(key, value)
        batch.put(CHECKPOINT_KEY, checkpoint)
        self._db.write(batch, self._write_options)

    def _write_and_scan(self, mutations: dict[bytes, bytes | None], checkpoint: bytes
                        ) -> Observation | None:
        """Write, then make the first observation pass: one trip to the worker thread."""
        self._write_sync(mutations, checkpoint)
        self._fit_memtable()
        return None if self.observer is None else self.observer.scan()

    def _fit_memtable(self, grow_only: bool = True) -> None:
        """Size the memtable by the state (`memtable_for`): at open either way, at commits
        only up (a shrinking state keeps its memtable until the next open). RocksDB saves
        the size in a new OPTIONS file; a refusal stops the resizing, never the commit or
        open it follows (tuning, not state)."""
        if self._memtable is None or self._db is None:
            return
        wanted = memtable_for(self._db.property_int_value("rocksdb.total-sst-files-size") or 0)
        if wanted == self._memtable or (grow_only and wanted < self._memtable):
            return
        try:
            self._db.set_options({"write_buffer_size": str(wanted)})
        except Exception as error:
            log.warning("store at %s: memtable left at %d bytes (resizing to %d failed: %s)",
                        self.path, self._memtable, wanted, error)
            self._memtable = None
        else:
            self._memtable = wanted

    async def _record(self, first: Observation | None = None) -> None:
        """Record the directory's changes since the last commit point, up to a stable pass."""
        observer = self.observer
        assert observer is not None
        for attempt in range(_MAX_PASSES):
            if observer.record(first or await self._call(observer.scan)):
                return
            first = None
            await asyncio.sleep(min(0.001 * attempt, 0.05))  # let the background work settle
        raise StoreError(f"{self.path}: MANIFEST kept changing over {_MAX_PASSES} passes")

    async def _write_durably(self, checkpoint: bytes) -> pb.AppendResponse:
        """Write the committing transaction and record it, with committed views kept out
        (new ones wait; open ones finish first) until it is durable."""
        writing = self._writing = asyncio.get_running_loop().create_future()
        try:
            await self._views.zero()
            first = await self._call(self._write_and_scan, self._committing, checkpoint)
            self._committing = {}
            if self.observer is None:
                return pb.AppendResponse(status=pb.OK)
            await self._record(first)
            return await self.observer.recorder.barrier()
        finally:
            self._writing = None
            writing.set_result(None)

    async def _commit(self, op: OpFuture, checkpoint: bytes, wait_for: list[OpFuture]
                      ) -> None:
        """Wait for the dependencies, write, record; resolve `op` once the log has it all."""
        try:
            for dependency in wait_for:
                await dependency.wait()
                if (error := dependency.exception()) is not None:
                    raise error
            self._waiting_on_dependencies = False
            response = await self._write_durably(checkpoint)
        except BaseException as error:
            self._waiting_on_dependencies = False
            # The state the next transaction builds on is lost or unrecorded: the store is done.
            self._failed = error
            op.fail(error)
            if isinstance(error, asyncio.CancelledError):
                raise
        else:
            op.resolve(response)
