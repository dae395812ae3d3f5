"""OpenViews: every task waiting for a store's views to close wakes when they do."""

from __future__ import annotations

import asyncio

from streamkit.stores.store import OpenViews
from tests.waiting import DEADLINE


async def test_every_waiter_wakes_when_the_last_view_closes() -> None:
    views = OpenViews()
    await asyncio.wait_for(views.none(), DEADLINE)  # none open: no wait
    with views.counted():
        with views.counted():
            # A commit and a destroy (say) wait at once.
            waiters = [asyncio.ensure_future(views.none()) for _ in range(3)]
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.01)
        assert not any(w.done() for w in waiters)  # one view is still open
    await asyncio.wait_for(asyncio.gather(*waiters), DEADLINE)
    assert views.count == 0


async def test_a_cancelled_waiter_leaves_the_others_waiting() -> None:
    views = OpenViews()
    with views.counted():
        first, second = (asyncio.ensure_future(views.none()) for _ in range(2))
        await asyncio.sleep(0.01)
        first.cancel()
        await asyncio.sleep(0.01)
        assert not second.done()
    await asyncio.wait_for(second, DEADLINE)
