"""What `streamkit backfill` shows while its tasks run.

Each change in whole shards done, as the engine reports it (Spark's status
tracker, or the local pool); and, every EVERY seconds without one, how far
each running shard has read, from the reports its task writes into a folder
this command makes (`streamkit.backfill.progress`), so that a long backfill
is never silent for long.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import click

from streamkit.backfill.progress import read_progress

__all__ = ["Progress"]

EVERY = 15.0  # seconds without a line before the running shards' reads are shown


class Progress:
    """A context: `folder` for the tasks' reports, `show` for the engine's updates."""

    def __init__(self, shards: int) -> None:
        self.shards = shards
        self.folder = Path(tempfile.mkdtemp(prefix="streamkit-backfill-progress-"))
        self._started = self._printed = time.monotonic()
        self._done = self._running = self._failed = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="backfill-progress",
                                        daemon=True)

    def __enter__(self) -> Progress:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        shutil.rmtree(self.folder, ignore_errors=True)

    def show(self, update: Any) -> None:
        """The engine's update (a SparkProgress), from any thread."""
        with self._lock:
            self._done, self._running, self._failed = update.done, update.running, update.failed
            self._print("")

    def _print(self, detail: str) -> None:
        failed = f", {self._failed} failed" if self._failed else ""
        click.echo(f"backfill: {self._done}/{self.shards} shards done, {self._running} running"
                   f"{failed} ({time.monotonic() - self._started:.1f}s){detail}", err=True)
        self._printed = time.monotonic()

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            with self._lock:
                if time.monotonic() - self._printed < EVERY:
                    continue
                reports = read_progress(self.folder)
                if reports:
                    self._running = max(self._running, len(reports))
                self._print(f": {', '.join(r.describe() for r in reports)} read" if reports
                            else "")
