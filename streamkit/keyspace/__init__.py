"""Revisioned key/values with watches, leases and transactions (see `KeySpace`)."""

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
    open_keyspace,
)
from streamkit.keyspace.sqlite import SQLiteKeySpace

__all__ = [
    "CompactedError",
    "Compare",
    "Delete",
    "DeletePrefix",
    "Event",
    "KeySpace",
    "KeySpaceError",
    "KeyValue",
    "LeaseNotFoundError",
    "Op",
    "Put",
    "SQLiteKeySpace",
    "TxnResult",
    "open_keyspace",
]
