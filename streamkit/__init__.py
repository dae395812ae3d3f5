"""streamkit: stateful, exactly-once stream processing over journals.

The names users import. Lower layers stay importable on their own
(`streamkit.client`, `streamkit.message`, `streamkit.protocol`, ...).

Each name is imported on first use (`lazy_exports`): every streamkit process
imports this package, and most of them (the bundled broker, the CLI's other
commands) need none of these names, whose modules pull in the client, the
message layer and the stores' drivers.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

# Set before grpc is first imported. streamkit's processes fork only to exec (workers,
# the bundled broker, Spark's JVM) or before any channel exists (Spark's Python
# daemon), so gRPC's fork handlers have nothing to protect; left on, they run when
# a fork races gRPC's threads and print warnings (or worse) from the child.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from streamkit.app.application import Application, QueryError  # noqa: F401
    from streamkit.app.publishing import ShardPublisher  # noqa: F401
    from streamkit.app.shard import Shard  # noqa: F401
    from streamkit.message.mapping import (  # noqa: F401
        EmptyPartitions,
        field_key,
        modulo_mapping,
        partitions_from,
        random_mapping,
        rendezvous_mapping,
    )
    from streamkit.message.message import Envelope, Message  # noqa: F401
    from streamkit.message.publisher import AckIntent, Publisher  # noqa: F401
    from streamkit.stores import JSONFileStore, RocksDBStore, SQLiteStore, SQLStore  # noqa: F401

__version__ = "0.1.0"


def lazy_exports(
    package: str, exports: Mapping[str, Iterable[str]]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """A package's module-level `__getattr__` and `__dir__` (PEP 562) serving the names of
    `exports` (module -> names), each imported from its module on first use, so importing a
    package, or any module inside it, costs only what is used."""
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> object:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *where})

    return __getattr__, __dir__


_EXPORTS = {
    "streamkit.app.application": ("Application", "QueryError"),
    "streamkit.app.publishing": ("ShardPublisher",),
    "streamkit.app.shard": ("Shard",),
    "streamkit.message.mapping": ("EmptyPartitions", "field_key", "modulo_mapping",
                                  "partitions_from", "random_mapping", "rendezvous_mapping"),
    "streamkit.message.message": ("Envelope", "Message"),
    "streamkit.message.publisher": ("AckIntent", "Publisher"),
    "streamkit.stores": ("JSONFileStore", "RocksDBStore", "SQLStore", "SQLiteStore"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = [name for names in _EXPORTS.values() for name in names]
