"""Members' working folders left behind by processes that ended without stopping.

A member keeps its shards' files under `<data dir>/shards/<suffix>/`, and a
shard's folder is removed when the shard is released. A member SIGKILLed (or
lost with its machine) releases nothing, and `streamkit serve`'s default
suffix, `<host>-<pid>`, is never used again, so its folder (a RocksDB store
may be gigabytes) would stay for good.

So a member holds a lock on its folder (`.member.lock`, an flock the kernel
drops however the process ends), and every member that starts removes this
host's `<host>-<pid>` folders whose lock no process holds: their shards recover
elsewhere from their recovery logs, so nothing in them is needed. The lock,
not the pid, says who is alive: it holds across PID namespaces (containers
sharing the app folder) and pid reuse. A folder without a lock file (made
before these locks) is left alone.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

from streamkit.process_lock import Held, ProcessLock

__all__ = ["LOCK_FILE", "hold_work_dir", "remove_abandoned"]

log = logging.getLogger(__name__)

LOCK_FILE = ".member.lock"


def hold_work_dir(folder: Path, note: str) -> ProcessLock:
    """Make `folder` and take its lock for this process's life (Held if another holds it)."""
    folder.mkdir(parents=True, exist_ok=True)
    lock = ProcessLock(folder / LOCK_FILE)
    lock.acquire(note)
    return lock


def remove_abandoned(shards_dir: Path, host: str) -> int:
    """Remove this host's `<host>-<pid>` folders whose lock no process holds; how many
    went. Each is locked while it is removed. A folder that can't be removed is logged
    and kept: it costs space, not correctness."""
    pattern = re.compile(rf"{re.escape(host)}-\d+")
    try:
        folders = sorted(f for f in shards_dir.iterdir() if pattern.fullmatch(f.name))
    except OSError:  # none yet
        return 0
    removed = 0
    for folder in folders:
        if not (folder / LOCK_FILE).is_file():
            continue
        lock = ProcessLock(folder / LOCK_FILE)
        try:
            lock.acquire("removing the folder of a member that ended without stopping")
        except (Held, OSError):  # its member runs (or it went meanwhile)
            continue
        try:
            shutil.rmtree(folder)
        except OSError as error:
            log.warning("can't remove %s, left by a member that ended without stopping: %s",
                        folder, error)
            continue
        finally:
            lock.release()
        log.info("removed %s, left by a member that ended without stopping", folder)
        removed += 1
    return removed
