"""How far each shard's task has read, for the command to show while tasks run.

A backfill of a long history runs for minutes; whole shards done say little
meanwhile. A task writes how much of its plan's journals it has read (and how
many messages it consumed) to `<folder>/<shard id>.json` every few seconds,
replacing the file (a rename, so a reader never sees half of it); the command
reads the folder it made. Tasks on other machines (a Spark cluster's) find no
such folder and write nothing: the command then shows whole shards only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from streamkit.tasks import cancel_and_wait

__all__ = ["INTERVAL", "ShardProgress", "read_progress", "reporting"]

INTERVAL = 2.0  # seconds between a task's reports


@dataclass(frozen=True)
class ShardProgress:
    """A shard's task, as it last reported: bytes of its journals read of `total`."""

    shard: str
    read: int
    total: int
    messages: int

    def describe(self) -> str:
        share = min(self.read / self.total, 1.0) if self.total else 1.0
        return f"{self.shard} {share:.0%} of {_mib(self.total)}"


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"


@contextlib.asynccontextmanager
async def reporting(folder: str | None, shard: str, total: int, read: Callable[[], int],
                    messages: Callable[[], int]) -> AsyncIterator[None]:
    """While in it, report `shard`'s progress (`read()` of `total` bytes, `messages()`)
    into `folder` every INTERVAL seconds, if `folder` is on this machine."""
    if not folder or not os.path.isdir(folder):
        yield
        return
    path = Path(folder) / f"{shard}.json"

    async def report() -> None:
        while True:
            await asyncio.sleep(INTERVAL)
            _write(path, ShardProgress(shard, read(), total, messages()))

    task = asyncio.create_task(report(), name=f"progress:{shard}")
    try:
        yield
    finally:
        await cancel_and_wait(task, f"shard {shard}'s progress reports")
        path.unlink(missing_ok=True)  # done reading: the folder holds running shards only


def _write(path: Path, progress: ShardProgress) -> None:
    temp = path.with_suffix(".next")
    try:
        temp.write_text(json.dumps(asdict(progress)))
        temp.replace(path)
    except OSError:  # (the command removed its folder: it has ended)
        pass


def read_progress(folder: Path) -> list[ShardProgress]:
    """The reports in `folder`, by shard id; unreadable ones (being replaced) skipped, and
    stale ones: a task killed (its process stopped, an executor lost) left its last."""
    found = []
    for path in sorted(folder.glob("*.json")):
        with contextlib.suppress(OSError, ValueError, TypeError):
            if time.time() - path.stat().st_mtime <= 5 * INTERVAL:
                found.append(ShardProgress(**json.loads(path.read_text())))
    return found
