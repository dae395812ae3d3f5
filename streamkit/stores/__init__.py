"""Stores: durable shard state committed atomically with the consumer checkpoint.

Each store's driver (SQLAlchemy, apsw, rocksdict) is imported only when that
store is first used, so picking one store doesn't load the others.
"""

from __future__ import annotations

import importlib
from typing import Any

from streamkit.stores.store import FencedError, Store, StoreError

_LAZY = {
    "SQLStore": "streamkit.stores.sql",
    "JSONFileStore": "streamkit.stores.json_file",
    "SQLiteStore": "streamkit.stores.sqlite",
    "RocksDBStore": "streamkit.stores.rocksdb",
    "RecordedStore": "streamkit.stores.recorded",
}

__all__ = ["FencedError", "Store", "StoreError", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'streamkit.stores' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
