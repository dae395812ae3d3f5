"""Supervised loops: no long-lived task of a member dies unnoticed.

A member's background loops (the allocator's keepalive, watch and converge,
the member's assignment follower) each run under `supervised`. A crash — any
exception out of the loop, or the loop returning at all, since it is meant to
run until cancelled — is logged at ERROR with the loop's name and traceback,
and then, by the loop's policy:

* restarted after a growing pause (`Restart`), for loops that rebuild their
  state on starting (re-reading the KeySpace); too many quick crashes in a
  row and it is given up on, as below;
* given up on at once: `on_give_up` is called with the `LoopFailure`, and the
  owner stops loudly (crash-only, as Gazette's consumer `Serve` returns its
  first error), so that its shards move to other members.

Cancellation is never a crash: it ends the supervised task as it ends the loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from streamkit.errors import StreamkitError
from streamkit.keyspace import ClusterChangedError

__all__ = ["LoopFailure", "Restart", "supervised"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Restart:
    """Restart a crashed loop after a pause that doubles from `delay` up to `max_delay`.

    Only quick crashes count: one within `quick` seconds of the loop's (re)start.
    After `limit` restarts that each crashed quickly again, the loop is given up
    on: a loop that keeps failing at once is not going to recover by itself.
    """

    limit: int = 5
    quick: float = 30.0
    delay: float = 0.1
    max_delay: float = 5.0

    def pause(self, crashes: int) -> float:
        return min(self.max_delay, self.delay * 2 ** (crashes - 1))


@dataclass(frozen=True)
class LoopFailure:
    """A loop given up on: its name and the error that ended it."""

    loop: str
    error: BaseException

    def __str__(self) -> str:
        error = self.error
        return f"loop {self.loop} failed: {type(error).__name__}: {' '.join(str(error).split())}"


def supervised(
    name: str,
    loop: Callable[[], Coroutine[Any, Any, None]],
    *,
    on_give_up: Callable[[LoopFailure], None],
    restart: Restart | None = None,
    owner: str = "",
) -> asyncio.Task[None]:
    """Run `loop()` in a task named after `name` (and `owner`, e.g. "member zone#a", which
    log lines start with); see the module docstring. Without `restart`, the first crash
    is given up on. `loop` is called again for every restart."""
    return asyncio.create_task(
        _supervise(name, loop, on_give_up, restart, f"{owner}: " if owner else ""),
        name=f"{name} ({owner})" if owner else name,
    )


async def _supervise(
    name: str,
    loop: Callable[[], Coroutine[Any, Any, None]],
    on_give_up: Callable[[LoopFailure], None],
    restart: Restart | None,
    who: str,
) -> None:
    clock = asyncio.get_running_loop()
    crashes = 0
    while True:
        started = clock.time()
        try:
            await loop()
            error: Exception = RuntimeError("returned, but it should run until cancelled")
        except Exception as e:
            error = e
        quick = restart is not None and clock.time() - started < restart.quick
        crashes = crashes + 1 if quick else 1
        if restart is None or crashes > restart.limit or isinstance(error, ClusterChangedError):
            # (A KeySpace replaced under the process fails every call from then on: no
            # restart mends that, only the process's.)
            after = f" after {restart.limit} quick restarts in a row" if restart and \
                crashes > restart.limit else ""
            # LeaseLost and its like say what happened: a traceback is for bugs.
            log.error("%sloop %s failed%s; giving up on it: %s: %s", who, name, after,
                      type(error).__name__, error,
                      exc_info=None if isinstance(error, StreamkitError) else error)
            on_give_up(LoopFailure(name, error))
            return
        pause = restart.pause(crashes)
        log.error(
            "%sloop %s crashed; restarting it in %.1fs (restart %d of %d in a row)",
            who,
            name,
            pause,
            crashes,
            restart.limit,
            exc_info=error,
        )
        await asyncio.sleep(pause)
