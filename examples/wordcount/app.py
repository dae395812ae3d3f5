"""Wordcount: how many times has each word appeared in the lines published so far?

Lines are partitioned by their `id`, so every shard counts the words of its
own share of the lines. A transaction adds up its words in memory; when it
finalizes, each touched word's count is read from the store, increased, written
back, and published to the `wordcount/counts` topic as that shard's new
running count. State and published updates commit together, exactly once.

The total for a word is the sum over shards: `query` answers a shard's count,
and `combine_answers` sums what every shard answered (`streamkit query`).
Each store kind works; only the state access differs.

`consume_message` is all an app needs; `consume_messages` is the optional
batch form of the same work, which streamkit calls instead when an app has
it (one Python call per list of lines: about twice the lines per second).
"""

from __future__ import annotations

from collections import Counter
from functools import cache
from typing import Any

import streamkit


class WordCount(streamkit.Application):
    concurrent_queries = True  # queries read only the store: no need to wait for a transaction

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()  # this transaction's words

    def consume_message(self, shard, store, envelope, publisher) -> None:
        self.counts.update(envelope.message["line"].split())

    def consume_messages(self, shard, store, envelopes, publisher) -> None:
        self.counts.update(" ".join([e.message["line"] for e in envelopes]).split())

    async def finalize_txn(self, shard, store, publisher) -> None:
        totals = await counts_of(store).add(self.counts)
        for word, total in totals.items():
            publisher.publish("wordcount/counts", {"word": word, "shard": shard.id,
                                                   "count": total})
        self.counts.clear()

    async def query(self, shard, store, request: dict[str, Any]) -> int:
        word = request.get("word")
        if not isinstance(word, str):
            raise streamkit.QueryError('ask {"word": "..."}')
        return await counts_of(store).get(word)

    def combine_answers(self, answers: dict[str, Any]) -> int:
        return sum(answers.values())


class Counts:
    """Per-word counts in a key/value store (RocksDB)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def _get(self, word: str) -> int:
        return self.store.get(word, 0)

    def _put(self, word: str, total: int) -> None:
        self.store.put(word, total)

    async def get(self, word: str) -> int:
        return self._get(word)

    async def add(self, deltas: Counter[str]) -> dict[str, int]:
        """Add `deltas` to the counts; the new totals of the words touched."""
        totals = {}
        for word, n in deltas.items():
            totals[word] = self._get(word) + n
            self._put(word, totals[word])
        return totals


class JSONCounts(Counts):
    """Counts as a JSON document: {word: count}."""

    def _get(self, word: str) -> int:
        return self.store.state.get(word, 0)

    def _put(self, word: str, total: int) -> None:
        self.store.state[word] = total


class SQLiteCounts(Counts):
    """Counts in a table of the shard's SQLite database."""

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        self.created = False  # by this store's transactions (a query's connection can't)

    def _get(self, word: str) -> int:
        import apsw

        try:
            row = self.store.db.execute("SELECT n FROM counts WHERE word = ?", (word,)).fetchone()
        except apsw.SQLError as error:  # no such table: nothing committed yet
            if "no such table" not in str(error):
                raise
            return 0
        return row[0] if row else 0

    def _put(self, word: str, total: int) -> None:
        if not self.created:
            self.store.db.execute(
                "CREATE TABLE IF NOT EXISTS counts (word TEXT PRIMARY KEY, n INT)")
            self.created = True
        self.store.db.execute("INSERT OR REPLACE INTO counts VALUES (?, ?)", (word, total))


class SQLCounts(Counts):
    """Counts in an external database, one table shared by the shards.

    SQL runs on the store's thread (`store.run`), never on the event loop,
    where waiting for another shard's lock would stall every shard.
    """

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        create_table(store.engine)

    async def get(self, word: str) -> int:
        from sqlalchemy import text

        def select(conn: Any) -> int:
            row = conn.execute(text("SELECT n FROM wordcount WHERE shard = :s AND word = :w"),
                               {"s": self.store.shard_fqn, "w": word}).fetchone()
            return row[0] if row else 0

        return await self.store.run(select)

    async def add(self, deltas: Counter[str]) -> dict[str, int]:
        from sqlalchemy.dialects import postgresql, sqlite

        shard, table = self.store.shard_fqn, wordcount_table()
        rows = [{"shard": shard, "word": w, "n": n} for w, n in deltas.items()]

        def upsert(conn: Any) -> dict[str, int]:
            """One multi-row INSERT ... ON CONFLICT per chunk, returning the new totals."""
            insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
            totals: dict[str, int] = {}
            for start in range(0, len(rows), _CHUNK):
                stmt = insert(table).values(rows[start:start + _CHUNK])
                stmt = stmt.on_conflict_do_update(
                    index_elements=["shard", "word"], set_={"n": table.c.n + stmt.excluded.n})
                totals.update(conn.execute(stmt.returning(table.c.word, table.c.n)).all())
            return totals

        return await self.store.run(upsert) if rows else {}


_CHUNK = 2000  # rows per statement: 3 parameters each, well under the drivers' limits


@cache
def wordcount_table() -> Any:
    """The SQL table (sqlalchemy is imported only by apps that use an SQL store)."""
    from sqlalchemy import Column, Integer, MetaData, String, Table

    return Table("wordcount", MetaData(), Column("shard", String, primary_key=True),
                 Column("word", String, primary_key=True), Column("n", Integer))


def create_table(engine: Any) -> None:
    """Create the table once, in a transaction of its own (not a consumer transaction)."""
    from sqlalchemy import text
    from sqlalchemy.exc import IntegrityError

    ddl = text("CREATE TABLE IF NOT EXISTS wordcount (shard TEXT, word TEXT, n INT,"
               " PRIMARY KEY (shard, word))")
    try:
        with engine.begin() as conn:
            conn.execute(ddl)
    except IntegrityError:  # another process created it at the same moment
        pass


_KINDS = {"JSONFileStore": JSONCounts, "SQLiteStore": SQLiteCounts, "SQLStore": SQLCounts}
_opened: dict[int, Counts] = {}


def counts_of(store: Any) -> Counts:
    """The Counts view of a shard's store (made once per store)."""
    counts = _opened.get(id(store))
    if counts is None or counts.store is not store:
        counts = _opened[id(store)] = _KINDS.get(type(store).__name__, Counts)(store)
    return counts
