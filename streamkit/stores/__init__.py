"""Stores: durable shard state committed atomically with the consumer checkpoint."""

from streamkit.stores.sql import SQLStore
from streamkit.stores.store import FencedError, Store, StoreError

__all__ = ["FencedError", "SQLStore", "Store", "StoreError"]
