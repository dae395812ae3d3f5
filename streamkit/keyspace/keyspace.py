"""The `KeySpace` interface: an etcd-shaped, revisioned key/value store.

Everything streamkit keeps about its cluster (journal and shard specs, members,
assignments, hints) lives under keys of one `KeySpace`. The interface follows
etcd's data model closely so that the embedded SQLite backend and the etcd
backend are interchangeable:

* one global `revision` counter, bumped once by every transaction that changes
  at least one key; all keys changed by that transaction share it as their
  `mod_revision`;
* transactions are "if all compares hold, apply these ops, else those ops";
* watches replay the change history after a given revision, so the pattern
  "`range(prefix)`, then `watch(prefix, revision)`" misses nothing;
* leases expire keys whose owner stopped sending keepalives.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, Self

from streamkit.errors import StreamkitError


class KeySpaceError(StreamkitError):
    """Base class of every error a `KeySpace` raises."""


class KeySpaceURLError(KeySpaceError, ValueError):
    """A KeySpace URL in none of the accepted forms (bad input, not a KeySpace failing)."""


class CompactedError(KeySpaceError):
    """A watch asked for history that compaction already dropped.

    The watcher should re-read its prefix with `range` and watch again from
    the revision that `range` returns.
    """

    def __init__(self, requested: int, compact_revision: int) -> None:
        super().__init__(
            f"revision {requested} is compacted: history starts after {compact_revision}"
        )
        self.requested = requested
        self.compact_revision = compact_revision


class ClusterChangedError(KeySpaceError):
    """The store behind the URL is no longer the one this client was using.

    Its data was wiped, restored from an older backup, or another cluster now
    answers at the address: revisions already seen mean nothing there, so a
    watch cannot resume and a view built so far is stale. Every later call on
    the client raises it again; the process must start over from a fresh read
    (exit, for a supervisor to restart it).
    """


class LeaseNotFoundError(KeySpaceError):
    """A put named a lease that was never granted, was revoked, or expired."""


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as stored at some revision (field meanings as in etcd)."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True, slots=True)
class Event:
    """One change seen by a watch.

    For a delete, `kv` carries only the key, and `mod_revision` equal to the
    deleting revision (as etcd reports it); its other fields are zero.
    """

    kind: Literal["put", "delete"]
    kv: KeyValue
    revision: int


@dataclass(frozen=True, slots=True)
class Compare:
    """An equality test on one key, part of a transaction's guard.

    Give exactly one target. A missing key has mod_revision, create_revision
    and version 0, so `Compare(key, mod_revision=0)` means "key must not
    exist"; a value compare never holds for a missing key (as in etcd).
    """

    key: str
    mod_revision: int | None = None
    create_revision: int | None = None
    value: bytes | None = None
    version: int | None = None

    def __post_init__(self) -> None:
        targets = (self.mod_revision, self.create_revision, self.value, self.version)
        if sum(t is not None for t in targets) != 1:
            raise ValueError(
                "Compare needs exactly one of mod_revision, create_revision, value, version"
            )

    def holds(self, kv: KeyValue | None) -> bool:
        """Evaluate against the key's current state (None if it doesn't exist)."""
        if self.value is not None:
            return kv is not None and kv.value == self.value
        if self.mod_revision is not None:
            return (kv.mod_revision if kv else 0) == self.mod_revision
        if self.create_revision is not None:
            return (kv.create_revision if kv else 0) == self.create_revision
        return (kv.version if kv else 0) == self.version


@dataclass(frozen=True, slots=True)
class Put:
    """Set `key` to `value`, attached to `lease` (0: no lease)."""

    key: str
    value: bytes
    lease: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.value, bytes):
            raise TypeError(f"Put value must be bytes, not {type(self.value).__name__}")


@dataclass(frozen=True, slots=True)
class Delete:
    """Delete `key` if it exists."""

    key: str


@dataclass(frozen=True, slots=True)
class DeletePrefix:
    """Delete every key starting with `prefix` ("" deletes everything)."""

    prefix: str


Op = Put | Delete | DeletePrefix


@dataclass(frozen=True, slots=True)
class TxnResult:
    """Which branch a transaction took, and the store revision after it.

    `revision` is the new revision if the branch changed anything, else the
    revision the transaction was evaluated at.
    """

    succeeded: bool
    revision: int


def check_ops(ops: Sequence[Op]) -> None:
    """Reject op lists whose outcome would depend on their order.

    etcd refuses a transaction that puts one key twice, or puts a key that
    the same transaction also deletes; doing the same here keeps the two
    backends interchangeable.
    """
    puts = [op.key for op in ops if isinstance(op, Put)]
    if len(puts) != len(set(puts)):
        raise KeySpaceError("a transaction may put each key at most once")
    for op in ops:
        if isinstance(op, Delete) and op.key in puts:
            raise KeySpaceError(f"a transaction may not both put and delete {op.key!r}")
        if isinstance(op, DeletePrefix) and any(k.startswith(op.prefix) for k in puts):
            raise KeySpaceError(f"a transaction may not put under deleted prefix {op.prefix!r}")


class KeySpace(abc.ABC):
    """Revisioned keys with compare-and-swap transactions, watches and leases.

    Implementations are used from one asyncio event loop. `close` releases
    the backend; `async with` closes on exit.
    """

    @abc.abstractmethod
    async def get(self, key: str) -> KeyValue | None:
        """The key's current state, or None if it doesn't exist."""

    @abc.abstractmethod
    async def range(self, prefix: str) -> tuple[list[KeyValue], int]:
        """All keys starting with `prefix`, sorted, and the revision read at."""

    @abc.abstractmethod
    async def revision(self) -> int:
        """The store's current revision."""

    async def txn(
        self,
        compares: Sequence[Compare],
        on_success: Sequence[Op],
        on_failure: Sequence[Op] = (),
    ) -> TxnResult:
        """Atomically: if every compare holds apply `on_success`, else `on_failure`."""
        check_ops(on_success)
        check_ops(on_failure)
        return await self._txn(compares, on_success, on_failure)

    @abc.abstractmethod
    async def _txn(
        self, compares: Sequence[Compare], on_success: Sequence[Op], on_failure: Sequence[Op]
    ) -> TxnResult:
        """Backend part of `txn`; the ops are already checked."""

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Unconditionally set a key; returns the new revision."""
        return (await self.txn((), (Put(key, value, lease),))).revision

    async def delete(self, key: str) -> int:
        """Delete a key if present; returns the revision after the delete."""
        return (await self.txn((), (Delete(key),))).revision

    @abc.abstractmethod
    def watch(self, prefix: str, from_revision: int) -> AsyncIterator[list[Event]]:
        """Batches of changes under `prefix` with revision > `from_revision`.

        Batches arrive in revision order and never split one revision. Raises
        `CompactedError` if that history is gone, at the start or later if
        the watcher falls behind compaction (read the prefix again and watch
        from there), and `ClusterChangedError` if the store was replaced.
        """

    @abc.abstractmethod
    async def grant(self, ttl_seconds: float) -> int:
        """Create a lease that expires `ttl_seconds` from now; returns its id.

        A backend may round the TTL up to its granularity (etcd: whole seconds,
        and at least its minimum TTL), never down.
        """

    @abc.abstractmethod
    async def keepalive(self, lease_id: int) -> bool:
        """Push the lease's expiry back by its TTL; False if it's expired or unknown."""

    @abc.abstractmethod
    async def revoke(self, lease_id: int) -> None:
        """End the lease now, deleting its keys; unknown leases are ignored."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the backend. Later calls, and waiting watches, raise KeySpaceError."""

    @abc.abstractmethod
    def reopen(self) -> KeySpace:
        """A new, independent client of the same KeySpace, with the same options.

        A client belongs to the event loop that first uses it; another thread
        with a loop of its own (the member's lease keeper) needs its own client.
        """

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


def sqlite_path(url: str) -> str | None:
    """The file an embedded-KeySpace URL or path names; None for an etcd URL (which the etcd
    backend checks). Raises KeySpaceURLError for any other URL, and for a mistyped one
    ("etcd:/x", "etcd//h:1/x", "sqlite:x.db"), which must not become a file of that name."""
    if url.startswith(("etcd:", "etcd//")):
        return None
    if url.startswith("sqlite:"):
        if not url.startswith("sqlite:///"):
            raise KeySpaceURLError(f"{url}: expected sqlite:///absolute/path.db")
        return url.removeprefix("sqlite://")
    if "://" in url:
        raise KeySpaceURLError(
            f"{url}: unknown keyspace URL scheme (expected a file path, "
            "sqlite:///absolute/path.db or etcd://host:port/prefix)"
        )
    return url


def open_keyspace(url: str, **options: float) -> KeySpace:
    """Open the KeySpace a URL names.

    `sqlite:///abs/path.db` or a plain file path open the embedded backend
    (`options` go to `SQLiteKeySpace`). `etcd://host:port[,host:port...]/prefix`
    opens the etcd backend (`options` go to `EtcdKeySpace`), keeping every key
    under `prefix` (which may be empty) so that several apps can share one etcd.
    """
    path = sqlite_path(url)
    if path is None:
        from streamkit.keyspace.etcd import EtcdKeySpace

        return EtcdKeySpace.from_url(url, **options)
    from streamkit.keyspace.sqlite import SQLiteKeySpace

    return SQLiteKeySpace(path, **options)
