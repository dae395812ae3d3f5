"""Every exception streamkit defines derives from StreamkitError: one `except` for them all."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import streamkit
from streamkit.errors import StreamkitError

# Modules that import optional heavy dependencies at import time are still walked; these
# are left out because they are generated code or need a running Spark.
_SKIP = ("_pb2", "streamkit.backfill.spark")


def _modules() -> list[str]:
    names = [streamkit.__name__]
    for info in pkgutil.walk_packages(streamkit.__path__, prefix="streamkit."):
        if not any(part in info.name for part in _SKIP):
            names.append(info.name)
    return names


def test_every_public_exception_is_a_streamkit_error() -> None:
    strays = []
    for name in _modules():
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == name
                and not attr.startswith("_")
                and not issubclass(value, StreamkitError)
            ):
                strays.append(f"{name}.{attr}")
    assert not strays, f"exceptions outside the StreamkitError hierarchy: {strays}"
