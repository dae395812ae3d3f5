"""Revisioned key/values with watches, leases and transactions (see `KeySpace`)."""

from typing import TYPE_CHECKING, Any

from streamkit.keyspace.keyspace import (
    ClusterChangedError,
    CompactedError,
    Compare,
    Delete,
    DeletePrefix,
    Event,
    KeySpace,
    KeySpaceError,
    KeySpaceURLError,
    KeyValue,
    LeaseNotFoundError,
    Op,
    Put,
    TxnResult,
    open_keyspace,
    sqlite_path,
)
from streamkit.keyspace.sqlite import SQLiteKeySpace

if TYPE_CHECKING:
    from streamkit.keyspace.etcd import EtcdKeySpace


def __getattr__(name: str) -> Any:
    """`EtcdKeySpace` on first use, so that SQLite users never load gRPC and aetcd."""
    if name == "EtcdKeySpace":
        from streamkit.keyspace.etcd import EtcdKeySpace

        return EtcdKeySpace
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ClusterChangedError",
    "CompactedError",
    "Compare",
    "Delete",
    "DeletePrefix",
    "EtcdKeySpace",
    "Event",
    "KeySpace",
    "KeySpaceError",
    "KeySpaceURLError",
    "KeyValue",
    "LeaseNotFoundError",
    "Op",
    "Put",
    "SQLiteKeySpace",
    "TxnResult",
    "open_keyspace",
    "sqlite_path",
]
