"""Where a client finds its broker when a command names none.

A module of its own, free of gRPC, so that commands can declare their options
(`--broker`, read from these variables) before importing the client.
"""

from __future__ import annotations

__all__ = ["BROKER_ENV", "DEFAULT_ADDRESS"]

DEFAULT_ADDRESS = "127.0.0.1:8080"
# Where a broker address is taken from when none is given: ours, then gazctl's.
BROKER_ENV = ("STREAMKIT_BROKER", "BROKER_ADDRESS")
