"""Watchdog: names an application hook that runs too long, and ends a process stuck in one.

A hook is user code: a `finalize_txn` that blocks (a sleep, a dead socket)
stops the event loop and with it every shard of the process; an async hook
that never returns stalls its shard. Neither says anything by itself. The
transaction loop and queries mark each hook call in their shard's
`HookRecord` (one attribute set before and after: cheap enough per message),
and a daemon thread of the `Watchdog` -- it runs even when the event loop is
blocked -- looks at the records a few times per limit. A call seen running
longer than the limit is logged once, as a WARNING naming the shard, the hook
and its current Python stack (the blocked thread's for a plain hook, the
task's coroutine chain for an async one).

When the process is asked to stop (`stop_requested`, from a signal handler
that works without the event loop) while a hook is stuck, the loop can't
commit anything: after a grace period, or at a second request, the watchdog
hands the stuck calls to the `on_stuck` callback given to `arm_exit`, which
is expected to exit the process. Nothing is lost by that: the transaction was
never committed, and the shard's next primary does it again from its
checkpoint and recovery log.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from streamkit.signal_safe import Waker

__all__ = ["HOOK_TIMEOUT", "HookCall", "HookRecord", "Stuck", "Watchdog"]

log = logging.getLogger(__name__)

# Seconds an application hook may run before the watchdog logs it (a MemberOptions and
# Watchdog parameter; read when a Watchdog is made, so tests may lower it).
HOOK_TIMEOUT = 30.0
_STACK_FRAMES = 20  # innermost frames of a stack to log


class HookCall:
    """One call of a rare hook (all but consume_message), with when and where it runs."""

    __slots__ = ("hook", "is_async", "started", "task", "thread")

    def __init__(self, hook: str, is_async: bool) -> None:
        self.hook, self.is_async, self.started = hook, is_async, time.monotonic()
        self.thread = threading.get_ident()
        try:
            self.task: asyncio.Task[Any] | None = asyncio.current_task()
        except RuntimeError:  # no running loop
            self.task = None


class HookRecord:
    """What hook a shard runs right now: `current` is a HookCall, the message being
    consumed (by `consume_hook`: only the envelope is set, to keep its cost at one
    attribute; a batch hook's first), or None between hooks."""

    __slots__ = ("consume_async", "consume_hook", "current", "shard", "task", "thread")

    def __init__(self, shard: str) -> None:
        self.shard = shard
        self.current: object = None
        self.consume_hook = "consume_message"  # or "consume_messages", the batch hook
        self.consume_async = False
        self.task: asyncio.Task[Any] | None = None  # the transaction loop's, for consume
        self.thread = threading.get_ident()

    def call(self, hook: str, is_async: bool) -> _Marking:
        """`with record.call("finalize_txn", False): ...` marks one call of a rare hook."""
        return _Marking(self, HookCall(hook, is_async))

    def describe(self, token: object) -> tuple[str, bool, asyncio.Task[Any] | None, int]:
        """(hook, is_async, task, thread) of what `current` was."""
        if isinstance(token, HookCall):
            return token.hook, token.is_async, token.task, token.thread
        return self.consume_hook, self.consume_async, self.task, self.thread


class _Marking:
    __slots__ = ("call", "record")

    def __init__(self, record: HookRecord, call: HookCall) -> None:
        self.record, self.call = record, call

    def __enter__(self) -> HookCall:
        self.record.current = self.call
        return self.call

    def __exit__(self, *exc: object) -> None:
        self.record.current = None


@dataclass(frozen=True)
class Stuck:
    """A hook call running for `elapsed` seconds, and its stack."""

    shard: str
    hook: str
    elapsed: float
    stack: str
    is_async: bool


def _thread_stack(thread: int) -> str:
    frame = sys._current_frames().get(thread)
    return "".join(traceback.format_stack(frame, _STACK_FRAMES)) if frame is not None else ""


def _task_stack(task: asyncio.Task[Any] | None) -> str:
    """The coroutine chain a task is suspended in, outermost first (what `task.get_stack`
    leaves out: it shows only the outermost coroutine's frame)."""
    frames: list[FrameType] = []
    coro: Any = task.get_coro() if task is not None else None
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            frames.append(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    summary = traceback.StackSummary.extract(((f, f.f_lineno) for f in frames[-_STACK_FRAMES:]),
                                             lookup_lines=True)
    return "".join(summary.format())


class Watchdog:
    """Watches the HookRecords of a process's shards from a daemon thread of its own.

    The thread runs while some record is watched. `limit` is the seconds a
    hook may run before it is logged (default HOOK_TIMEOUT).
    """

    def __init__(self, limit: float | None = None) -> None:
        self.limit = HOOK_TIMEOUT if limit is None else limit
        self._records: dict[int, HookRecord] = {}
        self._seen: dict[int, tuple[object, float, bool]] = {}  # id -> (token, since, warned)
        self._lock = threading.Lock()
        self._wake = Waker()  # (not a threading.Event: see stop_requested)
        self._thread: threading.Thread | None = None
        self._on_stuck: Callable[[list[Stuck]], None] | None = None
        self._grace = self._async_grace = 0.0
        self._stop_at: float | None = None
        self._now_exit = False

    def watch(self, shard: str) -> HookRecord:
        """A new record of `shard`'s hook calls, watched until `unwatch`."""
        record = HookRecord(shard)
        with self._lock:
            self._records[id(record)] = record
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="streamkit hook watchdog")
                self._thread.start()
        return record

    def unwatch(self, record: HookRecord) -> None:
        with self._lock:
            self._records.pop(id(record), None)
            self._seen.pop(id(record), None)
            last = not self._records
        if last:  # the thread ends now rather than at its next look (queries come and go)
            self._wake.set()

    def arm_exit(self, on_stuck: Callable[[list[Stuck]], None], grace: float,
                 async_grace: float) -> None:
        """Once stop is requested, give a hook call running then (or starting later) `grace`
        seconds (an async one, which doesn't block the loop, `async_grace`), then call
        `on_stuck` with those still running; it is expected to end the process."""
        self._on_stuck, self._grace, self._async_grace = on_stuck, grace, async_grace

    def stop_requested(self) -> None:
        """The process was asked to stop; a second time ends it now if a hook is stuck.

        Safe to call from a signal handler, also one that interrupts another call of it:
        it sets flags and wakes the thread through a pipe, taking no lock."""
        if self._stop_at is None:
            self._stop_at = time.monotonic()
        else:
            self._now_exit = True
        self._wake.set()

    # --- the thread ---------------------------------------------------------------

    def _interval(self) -> float:
        return max(0.02, min(self.limit / 4, 0.5 if self._stop_at is not None else 1.0))

    def _run(self) -> None:
        while True:
            with self._lock:
                records = list(self._records.values())
                if not records and self._stop_at is None:
                    self._thread = None
                    return
            try:
                self._look(records, time.monotonic())
            except Exception:  # the watchdog must outlive any surprise in what it looks at
                log.exception("the hook watchdog failed to look at the shards")
            with self._lock:  # records unwatched while it looked left no entry behind
                for gone in self._seen.keys() - self._records.keys():
                    del self._seen[gone]
            self._wake.wait(self._interval())

    def _look(self, records: list[HookRecord], now: float) -> None:
        stuck: list[Stuck] = []
        for record in records:
            token = record.current
            if token is None:
                self._seen.pop(id(record), None)
                continue
            seen = self._seen.get(id(record))
            if seen is None or seen[0] is not token:
                since = token.started if isinstance(token, HookCall) else now
                seen = (token, since, False)
            _, since, warned = seen
            hook, is_async, task, thread = record.describe(token)
            elapsed = now - since
            if elapsed >= self.limit and not warned:
                log.warning("shard %s: %s has run for %.1fs (the limit is %gs); it is at:\n%s",
                            record.shard, hook, elapsed, self.limit,
                            self._stack(is_async, task, thread))
                warned = True
            self._seen[id(record)] = (token, since, warned)
            if self._stop_at is not None:
                grace = self._async_grace if is_async else self._grace
                if self._now_exit or now - max(since, self._stop_at) >= grace:
                    stuck.append(Stuck(record.shard, hook, elapsed,
                                       self._stack(is_async, task, thread), is_async))
        if stuck and self._on_stuck is not None:
            self._on_stuck(stuck)
        self._now_exit = False

    @staticmethod
    def _stack(is_async: bool, task: asyncio.Task[Any] | None, thread: int) -> str:
        """Where the call is: an async hook's coroutine chain while it is suspended; the
        thread's stack for a plain hook, or an async one blocking its thread right now
        (a running coroutine's chain stops at the task: it awaits nothing)."""
        coro = task.get_coro() if task is not None else None
        suspended = is_async and not getattr(coro, "cr_running", False)
        return (_task_stack(task) if suspended else _thread_stack(thread)).rstrip()
