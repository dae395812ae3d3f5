"""Waiting for a task to finish without mistaking its outcome for the caller's.

`with suppress(BaseException): await task` after `task.cancel()` also swallows
the cancellation of the *caller*, which then runs on as if nobody had asked
it to stop, and it hides whatever error the task ended with. The helpers here
wait with `asyncio.wait`, which never raises the task's outcome: a
CancelledError out of it is always the caller's own and propagates, while the
task's own cancellation is expected and absorbed, and any other error it
ended with is logged (WARNING) as dropped, never raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Executor
from typing import Any, TypeVar

from streamkit.errors import StreamkitError

__all__ = ["Countdown", "cancel_and_wait", "finish", "leave_behind", "left_behind", "on_thread",
           "wait_finished"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_LEFT_BEHIND: list[str] = []


async def wait_finished(task: asyncio.Future[T], what: str) -> T | None:
    """Until `task` finished; its result, or None if it was cancelled or failed.

    A failure is logged at WARNING as `what` having been dropped (a failure
    that matters should be raised or reported where it happens). If the caller
    is cancelled meanwhile, CancelledError propagates and `task` is left to
    finish on its own; a caller already being cancelled (cleaning up in a
    `finally`) waits as usual. Unlike checking `current_task().cancelling()`
    after `await task`, this cannot mistake the two cancellations for each
    other, nor cancel the task because the caller was.
    """
    if not task.done():
        await asyncio.wait((task,))
    if task.cancelled():
        return None
    error = task.exception()
    if error is not None:
        # A StreamkitError says what and where; a traceback is for the unexpected.
        log.warning("dropped the error of %s: %s", what, _describe(error),
                    exc_info=None if isinstance(error, StreamkitError) else error)
        return None
    return task.result()


async def cancel_and_wait(task: asyncio.Future[Any], what: str) -> None:
    """Cancel `task` and wait until it finished, as `wait_finished` does."""
    task.cancel()
    await wait_finished(task, what)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else repr(error)


class Countdown:
    """How many of something are under way (views open, shards taking over), and a
    wait until none is."""

    def __init__(self) -> None:
        self.count = 0
        self._zero: asyncio.Future[None] | None = None

    @contextlib.contextmanager
    def counted(self) -> Iterator[None]:
        """One more under way while the block runs."""
        self.count += 1
        try:
            yield
        finally:
            self.count -= 1
            if not self.count and self._zero is not None and not self._zero.done():
                self._zero.set_result(None)

    async def zero(self) -> None:
        """Until none is under way (every waiter shares one future, so all wake)."""
        while self.count:
            if self._zero is None or self._zero.done():
                self._zero = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._zero)


async def finish(step: Awaitable[T]) -> T:
    """Await `step` to its end even if the caller is cancelled meanwhile, once or more
    (the cancellation is raised after it): for a clean-up that must not be cut short."""
    task = asyncio.ensure_future(step)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                break
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return task.result()


async def on_thread(executor: Executor, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` run on `executor`'s threads: a pool of one's own (a store's, the broker's
    disk work) rather than the loop's default, which anything may fill."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor, functools.partial(fn, *args))


def leave_behind(what: str) -> None:
    """Note that this process gave up waiting for `what` (a shard's store, its thread blocked
    in its database): the process's exit must not wait for it either (`left_behind`)."""
    _LEFT_BEHIND.append(what)


def left_behind() -> list[str]:
    """What this process gave up waiting for (`leave_behind`), oldest first; the same thing
    given up on twice is there twice."""
    return list(_LEFT_BEHIND)
