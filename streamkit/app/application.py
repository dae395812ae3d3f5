"""Application: the user's stream-processing logic, as hooks the runtime calls.

A user subclasses `Application` and implements `consume_message` (and usually
`finalize_txn`). The runtime calls the hooks from the shard's task, one
consumer transaction at a time:

    begin_txn → consume_message (N times) → finalize_txn → (commit) → finished_txn

Each shard gets an Application instance of its own, so attributes (say, a
dict of counts accumulated during a transaction) are per shard; and each term
as primary gets a new one, so a transaction cut off mid-way (the shard
fenced by a new author of its recovery log, and recovering again) leaves
nothing behind in the attributes the next term builds on.

For speed, an application may also implement `consume_messages`, which gets
a list of committed messages at once (up to a few thousand, all of one
transaction). When a class overrides it, the runtime calls it instead of
`consume_message` (see its docstring for what changes).

Hooks may be plain methods or coroutines (`async def`). Plain methods are
cheaper per call and right for most work; a coroutine suits hooks that await
I/O, such as `SQLStore.run`.

State goes in the shard's store (`new_store`, by default the store
`streamkit.yaml` names) and is committed together with the checkpoint.
Messages published through the hook's `publisher` are uncommitted until the
transaction commits, so readers see them exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from streamkit.errors import StreamkitError

if TYPE_CHECKING:
    from streamkit.app.producer import EnvelopeReader
    from streamkit.app.publishing import ShardPublisher
    from streamkit.app.shard import Shard
    from streamkit.client.append_service import OpFuture
    from streamkit.message.message import Envelope
    from streamkit.recoverylog.recorded_fs import RecordedFS
    from streamkit.stores.store import Store

__all__ = ["Application", "QueryError"]


class QueryError(StreamkitError):
    """A query the application can't answer (bad request, unknown key...): told to the caller."""


class Application:
    """Base class of streamkit applications; see the module docstring for the hook order."""

    #: The store kind when streamkit.yaml names none: "rocksdb", "sqlite", "sql" or "json".
    store: ClassVar[str | None] = None
    #: The type source messages decode to: dict, a streamkit.Message subclass or a protobuf.
    message_type: ClassVar[type] = dict

    def new_store(self, shard: Shard, fs: RecordedFS | None) -> Store:
        """The shard's store, opened on `fs` (the directory rebuilt from its recovery log).

        `fs` is None for stores without a recovery log (SQL). The default
        builds the store kind configured in streamkit.yaml.
        """
        return shard.default_store(fs, initial_state=self.initial_state())

    def initial_state(self) -> Any:
        """The state a JSON store starts from (a JSON-able value or a pydantic model)."""
        return {}

    def new_message(self, journal: str) -> type:
        """The message type of a source journal (default: `message_type`)."""
        return self.message_type

    def read_sources(
        self, shard: Shard, store: Store, offsets: dict[str, int]
    ) -> Sequence[EnvelopeReader] | None:
        """Readers of the uncommitted envelopes the shard consumes, starting at `offsets`.

        Lets an application choose its inputs (Gazette's StartReadingMessages).
        `offsets` maps journals to where the checkpoint (or the spec's minimum)
        says to resume. None: the runtime reads the spec's sources itself.
        """
        return None

    def replay_range(
        self, shard: Shard, store: Store, journal: str, begin: int, end: int
    ) -> EnvelopeReader | None:
        """A reader of [begin, end) of `journal`, which the sequencer needs re-read.

        Pairs with `read_sources` for inputs the runtime can't re-read itself.
        None: the runtime reads the range from the broker.
        """
        return None

    def read_through(
        self, shard: Shard, store: Store, offsets: dict[str, int]
    ) -> dict[str, int]:
        """The shard's source offsets that a Stat request's `offsets` correspond to.

        For applications whose inputs are derived from other journals, so a
        client can wait on the journals it wrote (Gazette's ReadThrough).
        """
        return offsets

    def begin_txn(self, shard: Shard, store: Store) -> Any:
        """Called before the first message of each transaction."""

    def consume_message(
        self, shard: Shard, store: Store, envelope: Envelope, publisher: ShardPublisher
    ) -> Any:
        """Apply one committed source message to the store; publish what follows from it."""
        raise NotImplementedError(f"{type(self).__name__} must implement consume_message")

    def consume_messages(
        self, shard: Shard, store: Store, envelopes: list[Envelope], publisher: ShardPublisher
    ) -> Any:
        """Optional, for speed: apply several committed source messages at once, in order.

        Overriding it makes the runtime hand over committed messages in lists
        (one Python call per list instead of per message), within the same
        transactions and with the same exactly-once outcome. If it raises, the
        transaction fails as a whole: the runtime can't tell which message
        was at fault, so sources whose `on_consume_error` is skip or
        dead-letter get `consume_message`, one message at a time, instead.
        Frames that don't decode never reach it (their policy applies as usual).
        The runtime calls it only where a class overrides it (and no subclass
        overrides just `consume_message`).
        """
        raise NotImplementedError(f"{type(self).__name__} has no consume_messages")

    def finalize_txn(self, shard: Shard, store: Store, publisher: ShardPublisher) -> Any:
        """Called once a transaction has consumed its last message, before it commits.

        Write state accumulated in memory and publish derived messages here.
        """

    def finished_txn(self, shard: Shard, store: Store, commit: OpFuture) -> Any:
        """Called when the transaction's commit started; `commit` resolves when it is durable."""

    # True: `query` may run while a transaction is open, reading the store's committed
    # view where it has one (RocksDB, JSON, SQLite in WAL mode), so it need not
    # wait for the transaction to end.
    # It must then read only the store (not attributes a transaction changes), and
    # can't write. False (the default): queries run between transactions.
    concurrent_queries = False

    def query(self, shard: Shard, store: Store, request: dict[str, Any]) -> Any:
        """Answer a read-only query (JSON in, JSON out) from the shard's committed state.

        It sees a consistent state: the last durable commit. It runs between
        transactions, or, with `concurrent_queries` and a store that has a
        committed view (RocksDB, JSON, SQLite in WAL mode, SQL on PostgreSQL or
        on SQLite in WAL mode), while a transaction
        is open, its reads
        skipping that transaction's writes. Raise QueryError for requests it
        can't answer.
        """
        raise QueryError(f"{type(self).__name__} answers no queries")

    def combine_answers(self, answers: dict[str, Any]) -> Any:
        """One answer from every shard's answer to the same query (shard id -> answer).

        Used when a query goes to all shards rather than to the one owning a
        key; the default returns the answers as they are.
        """
        return answers


def batch_hook(app: Application) -> Any:
    """The app's `consume_messages` if its class overrides the default; else None.

    Not when a subclass overrode only `consume_message`: its change must not be
    bypassed by the batch hook it inherited.
    """
    batch_class = _defining(type(app), "consume_messages")
    if batch_class is Application:
        return None
    each_class = _defining(type(app), "consume_message")
    if each_class is not batch_class and issubclass(each_class, batch_class):
        return None
    return app.consume_messages


def _defining(cls: type, name: str) -> type:
    """The class of `cls`'s MRO whose body defines attribute `name`."""
    return next(k for k in cls.__mro__ if name in vars(k))
