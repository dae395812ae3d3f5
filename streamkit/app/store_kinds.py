"""The store kinds streamkit.yaml can name, and how a shard's store of each kind is built."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the stores are imported when one is built: commands list the kinds first
    from streamkit.app.shard import Shard
    from streamkit.recoverylog.recorded_fs import RecordedFS
    from streamkit.stores.store import Store

__all__ = ["STORE_KINDS", "build_store", "records_to_log"]

STORE_KINDS = ("rocksdb", "sqlite", "sql", "json")


def records_to_log(kind: str) -> bool:
    """Whether the kind keeps local files recorded to a recovery log (all but SQL)."""
    return kind != "sql"


def build_store(
    kind: str,
    shard: Shard,
    fs: RecordedFS | None,
    *,
    initial_state: Any = None,
    sql_url: str | None = None,
) -> Store:
    """A new store of `kind` for `shard`; `fs` is its recovered directory (None for SQL)."""
    from streamkit.stores.store import StoreError

    if kind == "sql":
        from streamkit.stores.sql import SQLStore

        if not sql_url:
            raise StoreError(f"shard {shard.id}: the sql store needs a database url")
        return SQLStore(sql_url, shard.fqn)
    if fs is None:
        raise StoreError(f"shard {shard.id}: a {kind} store needs a recovery log")
    if kind == "rocksdb":
        from streamkit.stores.rocksdb import RocksDBStore

        # The recovery log is the durable copy; the memtable follows the state's size.
        return RocksDBStore(fs, sync=False, sized_memtable=True)
    if kind == "sqlite":
        from streamkit.stores.sqlite import SQLiteStore

        return SQLiteStore(fs)
    if kind == "json":
        from streamkit.stores.json_file import JSONFileStore

        return JSONFileStore(fs, {} if initial_state is None else initial_state)
    raise StoreError(
        f"shard {shard.id}: unknown store kind {kind!r} (choose one of {', '.join(STORE_KINDS)})"
    )
