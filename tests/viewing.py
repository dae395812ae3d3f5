"""A store destroyed while a query reads in one of its committed views (shared by the
store tests)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from streamkit.stores.store import StoreError
from tests.waiting import DEADLINE

T = TypeVar("T")


async def destroy_while_viewing(store: Any, read: Callable[[], T]) -> T:
    """Destroy `store` while a query is in a committed view; returns what `read` gave.

    Checks the query reads on until it ends (destroy waits for it), and that a view
    asked for meanwhile is refused with an error naming the destroyed store.
    """
    go = asyncio.Event()

    async def query() -> T:
        async with store.committed_view():
            await go.wait()
            return read()

    querying = asyncio.ensure_future(query())
    await asyncio.sleep(0.01)
    destroying = asyncio.ensure_future(store.destroy())
    await asyncio.sleep(0.05)
    assert not destroying.done()
    with pytest.raises(StoreError, match="destroyed"):
        async with store.committed_view():
            pass
    go.set()
    await asyncio.wait_for(destroying, DEADLINE)
    return await querying
