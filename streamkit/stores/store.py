"""The Store interface: where a shard keeps its state and its consumer checkpoint.

Exactly-once processing rests on one rule: the state changes a consumer
transaction made and the Checkpoint that says which messages produced them
become durable together, or not at all. A Store is the thing that makes them
so. How a store represents the transaction itself (a SQL transaction, a write
batch, an in-memory object serialized at commit) is its own business and is
not part of this interface; only the commit and the restore are.

How the consumer runtime drives a store, which implementations may rely on:

* `restore_checkpoint` is called once per shard assignment, before anything
  else. A store backed by an external system installs a *write fence* there,
  so that an older instance of the shard (in another process that still
  believes it is primary) can no longer commit.
* `start_commit` is then called once per consumer transaction, and never while
  the OpFuture of the previous `start_commit` is unresolved: at most one commit
  is in flight. The application does, however, begin the *next* transaction's
  work while a commit is in flight, so a store must keep that work apart from
  the committing transaction (or hold it back until the commit resolved).
* `destroy` is called once, when the shard is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import TypeVar

from streamkit.client.append_service import OpFuture

# OpFuture lives in the client package (appends resolve them); the recovery log
# stores build on the same type, so stores share it rather than wrapping it.
from streamkit.errors import StreamkitError
from streamkit.protocol import consumer_pb
from streamkit.tasks import Countdown

__all__ = ["VIEWING", "VIEW_DRAIN_TIMEOUT", "FencedError", "OpenViews", "Store", "StoreError",
           "context_set", "viewing"]

log = logging.getLogger(__name__)

T = TypeVar("T")

VIEW_DRAIN_TIMEOUT = 10.0  # seconds a store's destroy waits for open committed views (queries)

# The store the current task reads in a committed view, if any. A ContextVar, so the
# transaction loop's task keeps reading its own writes while a query's task views.
VIEWING: ContextVar[Store | None] = ContextVar("streamkit_store_view", default=None)


@contextlib.contextmanager
def context_set(var: ContextVar[T], value: T) -> Iterator[None]:
    """`var` holds `value` for the block (a view's marker, in the current task)."""
    token = var.set(value)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):  # exited in another context
            var.reset(token)


def viewing(store: Store) -> contextlib.AbstractContextManager[None]:
    """Mark the current task as reading `store` in a committed view, for the block."""
    return context_set(VIEWING, store)


class OpenViews(Countdown):
    """A count of a store's open committed views, and a wait for it to reach zero
    (before a commit that must not write under them, or before closing)."""

    async def drained(self, store: object) -> None:
        """Until no view is open, or VIEW_DRAIN_TIMEOUT (new views are refused already)."""
        try:
            await asyncio.wait_for(self.zero(), VIEW_DRAIN_TIMEOUT)
        except TimeoutError:
            log.warning("%s: closed with %d committed views still open", store, self.count)


class StoreError(StreamkitError):
    """A shard's state store could not restore, commit, or was used out of order.

    (A broker's fragment store raises `FragmentStoreError` instead.)"""


class FencedError(StoreError):
    """A newer instance of the shard restored from this store, so this one may not commit.

    The commit was rolled back. The instance that sees this is no longer the
    shard's primary and must stop.
    """


class Store(ABC):
    """Durable, transactional storage of a shard's state together with its Checkpoint."""

    _commit_op: OpFuture | None = None

    checkpoint_home: str | None = None
    """Where the store keeps its checkpoint outside the shard's recovery log (a database,
    named for people), or None. For such a store the runtime records in the KeySpace that
    the shard committed there (`app.commit_marks`): a restore finding nothing is then
    known to have lost its checkpoint, not taken for a new shard's."""

    def _new_commit_op(self, shard_id: str, restored: bool) -> OpFuture:
        """The OpFuture of a new commit, after checking the runtime's contract:
        restore before commit, and one commit at a time."""
        if not restored:
            raise StoreError(f"shard {shard_id}: start_commit before restore_checkpoint")
        if self._commit_op is not None and not self._commit_op.done():
            raise StoreError(f"shard {shard_id}: start_commit while a commit is in flight")
        self._commit_op = OpFuture()
        return self._commit_op

    @abstractmethod
    async def start_commit(
        self,
        shard_id: str,
        checkpoint: consumer_pb.Checkpoint,
        wait_for: Sequence[OpFuture],
    ) -> OpFuture:
        """Begin committing this transaction's state atomically with `checkpoint`.

        Returns an OpFuture of the commit, so the runtime can go on consuming
        while it becomes durable. SQLStore returns at once; recorded stores
        (JSON, SQLite, RocksDB) first wait for `wait_for` and apply the commit
        locally, leaving only the recovery-log append to the future, as
        Gazette's do. The commit itself happens only after every
        future in `wait_for` (the transaction's appends to other journals)
        resolved successfully; if one fails, the commit fails with that error
        and nothing of the transaction is written. An external store also
        fails it with FencedError if another instance restored since this one.
        """

    @abstractmethod
    async def restore_checkpoint(self, shard_id: str) -> consumer_pb.Checkpoint:
        """The last committed Checkpoint; an empty one for a shard never committed.

        Stores with an external database also advance the write fence here,
        which fences off every older instance of the shard.
        """

    def committed_view(self) -> contextlib.AbstractAsyncContextManager[None] | None:
        """A context in which the current task reads the state of the last durable commit,
        without the open (or a committing) transaction's writes; None where the store
        can't keep them apart. Queries read in one, so they need not wait for the open
        transaction to end; without one they wait for it and its commit."""
        return None

    def is_transient(self, error: BaseException) -> bool:
        """Whether `error` (raised by this store, or by the app's statements on it) says the
        store's backing service was briefly out of reach: a dropped connection, a restart.
        The shard then recovers again after a pause rather than failing for good; its
        transaction was not committed (or its outcome is unknown: the restore reads which).
        Stores of local files have no such errors."""
        return False

    @abstractmethod
    async def destroy(self) -> None:
        """Release the store's resources: uncommitted work is dropped, the store is unusable."""
