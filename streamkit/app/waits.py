"""Waiting for the first of several things, the way the runtime's loops do."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

__all__ = ["first_of"]


async def first_of(waits: list[Awaitable[Any]], timeout: float | None = None) -> None:
    """Until the first of `waits` finishes (or `timeout`).

    Coroutines are wrapped in tasks here and cancelled afterwards; tasks the
    caller passed in (the previous commit) are left running.
    """
    futures = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(futures, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait, future in zip(waits, futures, strict=True):
            if future is not wait and not future.done():
                future.cancel()
