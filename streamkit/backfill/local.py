"""Backfill tasks in processes of this machine: what Spark's executors run, without Spark.

For histories a JVM's start would dominate (Spark takes a second or two to
start before the first task runs), `streamkit backfill --processes N` runs
the very same task (`task.run_shard_task`) for every shard in a pool of N
fresh Python processes, largest shard first, and hands each shard over as
it finishes, exactly as a Spark task does.

The pool's processes die with the command (Linux's parent-death signal, as
`streamkit run`'s children do): one that outlived a command killed outright
would hand its shard over after the command had given up on it, fencing a
live primary, and then wait for more tasks for ever.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any

from streamkit.app.loader import path_without_app_folders
from streamkit.backfill.plan import BackfillPlan, largest_first
from streamkit.backfill.spark import SparkProgress
from streamkit.backfill.task import run_shard_task
from streamkit.errors import StreamkitError
from streamkit.parent_death import die_with_parent

_CANCEL_POLL = 0.1  # seconds between looks at the cancel event while tasks run


class Cancelled(StreamkitError):
    """The backfill was cancelled (its command interrupted): its processes were stopped."""


def run_locally(plan: BackfillPlan, processes: int,
                progress: Callable[[SparkProgress], None] | None = None,
                cancelled: threading.Event | None = None,
                handed_over: Callable[[dict[str, Any]], None] | None = None,
                ) -> list[dict[str, Any]]:
    """Backfill every shard of `plan` in `processes` local processes; the shards' results
    (ShardResult dicts), in the plan's order. The first task to fail is raised once the
    tasks already running end (shards handed over keep their backfilled state; those not
    started are not). `handed_over` gets each shard's result as it is handed over, also
    on the way to an error: what the user is told is done and what is not.

    Setting `cancelled` (from another thread) terminates the processes at once and raises
    Cancelled: a task stopped before its hand-over leaves its shard as it was, and what
    it published is never acknowledged. (Waiting for them instead could be forever: a
    command interrupted at a terminal stops the bundled broker their appends wait for.)
    """
    order = largest_first(plan)
    results: dict[int, dict[str, Any]] = {}
    started = time.monotonic()
    # Fresh interpreters ("spawn"): this process has gRPC channels, which forking would race.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max(1, min(processes, len(order))), mp_context=context,
                             initializer=_tie_to_the_parent, initargs=(os.getpid(),)) as pool:
        with _without_app_folders():  # the pool's processes start within the submits
            pending: dict[Future[dict[str, Any]], int] = {
                pool.submit(run_shard_task, plan, index): index for index in order}

        def finished(future: Future[dict[str, Any]]) -> None:
            index = pending.pop(future)
            results[index] = future.result()
            if handed_over is not None:
                handed_over(results[index])

        try:
            while pending:
                done, _ = wait(pending, timeout=_CANCEL_POLL, return_when=FIRST_COMPLETED)
                if cancelled is not None and cancelled.is_set():
                    _terminate(pool)
                    raise Cancelled("the backfill was cancelled")
                for future in done:
                    finished(future)
                if progress is not None and done:
                    running = min(len(pending), processes)
                    progress(SparkProgress(len(order), len(results), running, 0,
                                           time.monotonic() - started))
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            for future in list(pending):  # ended meanwhile: handed over too
                if future.done() and not future.cancelled() and future.exception() is None:
                    finished(future)
            raise
    return [results[index] for index in range(len(order))]


def _tie_to_the_parent(parent: int) -> None:
    """In a pool process: die with the command `parent` (see the module docstring), and
    ignore SIGINT. A terminal's Ctrl-C reaches the whole process group; the command stops
    its processes itself (`cancelled`), and a task interrupted on its own would only print
    a traceback over the command's output first."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    if os.getppid() != parent:  # it died before we asked: no signal is coming
        os._exit(1)


def _terminate(pool: ProcessPoolExecutor) -> None:
    """SIGTERM the pool's processes (Python 3.14 has `terminate_workers` for this; before
    it, the pool's table of them is the only handle)."""
    terminate = getattr(pool, "terminate_workers", None)
    if terminate is not None:
        terminate()
        return
    workers = getattr(pool, "_processes", None) or {}
    for process in list(workers.values()):
        with contextlib.suppress(OSError):
            process.terminate()


@contextlib.contextmanager
def _without_app_folders() -> Iterator[None]:
    """sys.path less the app folders loading put first, while processes start: they
    start with this process's path, where an app's module named like one a library
    imports (a json.py, say) would shadow it; each task puts its own app's folder back."""
    saved = sys.path[:]
    sys.path[:] = path_without_app_folders()
    try:
        yield
    finally:
        sys.path[:] = saved
