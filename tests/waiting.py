"""Synchronisation for tests that cannot flake.

* Never a fixed sleep to "let something happen": poll for the condition with a generous
  deadline (`wait_until` from threads and sync tests, `eventually` from coroutines). The
  deadline only bounds how long a broken test hangs; a passing test returns as soon as the
  condition holds, so it costs nothing to be generous.
* No wall-clock bound as an assertion: how fast something is belongs in bench/. Where the
  point is "it does not hang", bound the wait by `LIVENESS` (a minute, not seconds).
* A helper thread's failure must reach the test: start it as a `Worker`, whose `join`
  re-raises what the thread raised.

`wire.wait_until`, `helpers_client.eventually` and `e2e.eventually` are these functions.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

# The default deadline of a poll: long past anything a loaded machine needs, short of the
# 120 s pytest-timeout, so that the failure names the condition.
DEADLINE = 30.0

# A bound on "this must not hang" (a liveness check, not a performance measurement).
LIVENESS = 60.0


def _failure(what: str, timeout: float, last: Any) -> AssertionError:
    return AssertionError(f"timed out after {timeout}s waiting for {what} (last value: {last!r})")


def wait_until(
    predicate: Callable[[], Any],
    timeout: float = DEADLINE,
    what: str = "the condition",
    interval: float = 0.05,
) -> Any:
    """Poll `predicate` until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _failure(what, timeout, value)
        time.sleep(interval)


async def eventually(
    predicate: Callable[[], Any],
    timeout: float = DEADLINE,
    what: str = "the condition",
    interval: float = 0.05,
) -> Any:
    """Poll sync or async `predicate` until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise _failure(what, timeout, value)
        await asyncio.sleep(interval)


class Worker(threading.Thread):
    """A helper thread whose exception reaches the test: `join` (and `check`) re-raise it.

    Daemon by default, so that a thread stuck on a dead peer cannot keep the run alive; a
    join without a timeout waits `LIVENESS` at most and fails if the thread still runs.
    """

    def __init__(
        self, target: Callable[..., Any], *args: Any, name: str | None = None, daemon: bool = True
    ) -> None:
        super().__init__(target=target, args=args, name=name, daemon=daemon)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            super().run()
        except BaseException as e:  # handed to the test by join()
            self.error = e

    def check(self) -> None:
        """Re-raise the thread's exception, if it raised one (so far)."""
        if self.error is not None:
            raise AssertionError(f"helper thread {self.name} failed: {self.error!r}") from (
                self.error
            )

    def join(self, timeout: float | None = LIVENESS) -> None:  # type: ignore[override]
        super().join(timeout)
        self.check()
        if self.is_alive():
            raise AssertionError(f"helper thread {self.name} still running after {timeout}s")

    def join_quietly(self, timeout: float | None = LIVENESS) -> None:
        """Join without raising (for cleanup paths where a failure is already on its way)."""
        super().join(timeout)


def join_all(workers: Iterable[Worker], timeout: float = LIVENESS) -> None:
    """Join every worker (all of them, even after one failed); raise the first failure."""
    workers = list(workers)
    for w in workers:
        w.join_quietly(timeout)
    for w in workers:
        w.check()
    for w in workers:
        if w.is_alive():
            raise AssertionError(f"helper thread {w.name} still running after {timeout}s")
