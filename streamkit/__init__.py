"""streamkit: stateful, exactly-once stream processing over journals.

The names users import. Lower layers stay importable on their own
(`streamkit.client`, `streamkit.message`, `streamkit.protocol`, ...).
"""

import os

# Set before grpc is first imported. streamkit's processes fork only to exec (workers,
# the bundled broker, Spark's JVM) or before any channel exists (Spark's Python
# daemon), so gRPC's fork handlers have nothing to protect; left on, they run when
# a fork races gRPC's threads and print warnings (or worse) from the child.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from streamkit.app.application import Application, QueryError
from streamkit.app.publishing import ShardPublisher
from streamkit.app.shard import Shard
from streamkit.message.mapping import (
    EmptyPartitions,
    field_key,
    modulo_mapping,
    partitions_from,
    random_mapping,
    rendezvous_mapping,
)
from streamkit.message.message import Envelope, Message
from streamkit.message.publisher import AckIntent, Publisher

__version__ = "0.1.0"

_STORES = ("JSONFileStore", "RocksDBStore", "SQLStore", "SQLiteStore")


def __getattr__(name: str) -> object:
    """The stores, imported on first use (their drivers are heavy)."""
    if name in _STORES:
        import streamkit.stores

        return getattr(streamkit.stores, name)
    raise AttributeError(f"module 'streamkit' has no attribute {name!r}")

__all__ = [
    "AckIntent",
    "Application",
    "QueryError",
    "Shard",
    "ShardPublisher",
    "EmptyPartitions",
    "Envelope",
    "Message",
    "Publisher",
    "field_key",
    "modulo_mapping",
    "partitions_from",
    "random_mapping",
    "rendezvous_mapping",
    *_STORES,
]
