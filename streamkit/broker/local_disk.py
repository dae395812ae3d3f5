"""The broker's own disk work runs on threads of its own.

Store calls (an S3 request, say) run in threads too. Sharing one pool, a store
that hangs held every thread, and every append of every journal waited behind
them (each commit syncs its spool in a thread). So spool commits, spool
recovery and compressing spools for persisting run here; stores use theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from streamkit.tasks import on_thread

__all__ = ["on_disk"]

T = TypeVar("T")

_THREADS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="broker-disk")


async def on_disk(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in one of the broker's disk threads."""
    return await on_thread(_THREADS, fn, *args)
