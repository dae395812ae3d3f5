"""streamkit.tasks: waiting for a task without taking its outcome for the caller's own;
Countdown's waiters."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest

from streamkit.tasks import Countdown, cancel_and_wait, finish, wait_finished
from tests.waiting import DEADLINE


async def _stubborn(release: asyncio.Event) -> str:
    """Takes its time to stop: a cancellation only ends it once `release` is set."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        await release.wait()
        raise
    return "never"


async def _loop_steps_until(condition: Callable[[], object]) -> None:
    """Let the event loop run until `condition` holds: steps, not time (no clock involved,
    so a slow machine cannot change the outcome)."""
    for _ in range(100):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not met within 100 event-loop steps")


async def test_the_tasks_own_cancellation_is_absorbed(caplog: pytest.LogCaptureFixture) -> None:
    task = asyncio.ensure_future(asyncio.sleep(3600))
    await cancel_and_wait(task, "a sleeper")
    assert task.cancelled()
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0
    assert not caplog.records


async def test_the_callers_cancellation_propagates_while_it_waits() -> None:
    release = asyncio.Event()
    task = asyncio.ensure_future(_stubborn(release))
    await asyncio.sleep(0)
    caller = asyncio.ensure_future(cancel_and_wait(task, "a stubborn task"))
    await _loop_steps_until(task.cancelling)  # the caller cancelled it, and waits
    assert not caller.done()  # waiting for the task to finish its cancellation
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert not task.done()  # left to finish on its own
    release.set()
    await asyncio.wait((task,))
    assert task.cancelled()


async def test_the_callers_cancellation_does_not_cancel_a_task_it_only_waits_for() -> None:
    done = asyncio.Event()
    task = asyncio.ensure_future(done.wait())
    caller = asyncio.ensure_future(wait_finished(task, "a waiter"))
    await asyncio.sleep(0)  # one loop step: the caller runs into its wait for the task
    assert not caller.done()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert not task.done()
    done.set()
    assert await task is True


async def test_a_caller_already_cancelled_still_waits_while_cleaning_up() -> None:
    """A `finally` run by the caller's cancellation waits for the task, then the
    cancellation goes on: the task's CancelledError is not taken for a new one."""
    release = asyncio.Event()
    task = asyncio.ensure_future(_stubborn(release))
    cleaned_up = asyncio.Event()

    async def caller() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await cancel_and_wait(task, "a stubborn task")
            cleaned_up.set()

    running = asyncio.ensure_future(caller())
    await asyncio.sleep(0)
    running.cancel()
    await _loop_steps_until(task.cancelling)  # the caller's finally cancelled it, and waits
    assert not running.done()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert cleaned_up.is_set() and task.cancelled()


async def test_a_tasks_error_is_logged_as_dropped_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def failing() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            raise ValueError("flush failed")

    task = asyncio.ensure_future(failing())
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="streamkit.tasks"):
        await cancel_and_wait(task, "the flusher")
    assert [r.getMessage() for r in caplog.records] == [
        "dropped the error of the flusher: ValueError: flush failed"
    ]
    assert caplog.records[0].levelno == logging.WARNING


async def test_wait_finished_returns_the_result_or_none() -> None:
    async def answer() -> int:
        return 42

    assert await wait_finished(asyncio.ensure_future(answer()), "an answer") == 42
    cancelled = asyncio.ensure_future(asyncio.sleep(3600))
    cancelled.cancel()
    assert await wait_finished(cancelled, "a sleeper") is None


async def test_every_waiter_wakes_when_the_last_one_ends() -> None:
    views = Countdown()
    await asyncio.wait_for(views.zero(), DEADLINE)  # none open: no wait
    with views.counted():
        with views.counted():
            # A commit and a destroy (say) wait at once.
            waiters = [asyncio.ensure_future(views.zero()) for _ in range(3)]
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.01)
        assert not any(w.done() for w in waiters)  # one view is still open
    await asyncio.wait_for(asyncio.gather(*waiters), DEADLINE)
    assert views.count == 0


async def test_a_cancelled_waiter_leaves_the_others_waiting() -> None:
    views = Countdown()
    with views.counted():
        first, second = (asyncio.ensure_future(views.zero()) for _ in range(2))
        await asyncio.sleep(0.01)
        first.cancel()
        await asyncio.sleep(0.01)
        assert not second.done()
    await asyncio.wait_for(second, DEADLINE)


async def test_finish_runs_a_clean_up_to_its_end_through_cancellations() -> None:
    release, done = asyncio.Event(), []

    async def clean_up() -> str:
        await release.wait()
        done.append(True)
        return "closed"

    caller = asyncio.ensure_future(finish(clean_up()))
    for _ in range(2):  # cancelled twice while the clean-up runs
        await asyncio.sleep(0.01)
        caller.cancel()
    await asyncio.sleep(0.01)
    assert not caller.done()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert done == [True]
    assert await finish(clean_up()) == "closed"  # not cancelled: its result
