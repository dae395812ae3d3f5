"""Members' working folders left behind by processes that ended without stopping.

A member keeps its shards' files under `<data dir>/shards/<suffix>/`, and a
shard's folder is removed when the shard is released. A member SIGKILLed (or
lost with its machine) releases nothing, and `streamkit serve`'s default
suffix, `<host>-<pid>`, is never used again, so its folder (a RocksDB store
may be gigabytes) would stay for good. Every member that starts removes the
folders of this host's members whose process is gone: their shards recover
elsewhere from their recovery logs, so nothing in them is needed.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from streamkit.process_lock import running

__all__ = ["abandoned_work_dirs", "remove_abandoned"]

log = logging.getLogger(__name__)


def abandoned_work_dirs(shards_dir: Path, host: str) -> list[Path]:
    """Folders under `shards_dir` named `<host>-<pid>` whose process no longer runs."""
    pattern = re.compile(rf"{re.escape(host)}-(\d+)")
    try:
        entries = list(shards_dir.iterdir())
    except OSError:  # none yet
        return []
    return sorted(entry for entry in entries
                  if (match := pattern.fullmatch(entry.name)) and entry.is_dir()
                  and int(match.group(1)) != os.getpid() and not running(int(match.group(1))))


def remove_abandoned(shards_dir: Path, host: str) -> int:
    """Remove the abandoned folders (`abandoned_work_dirs`); how many went. A folder that
    can't be removed is logged and kept: it costs space, not correctness."""
    removed = 0
    for folder in abandoned_work_dirs(shards_dir, host):
        try:
            shutil.rmtree(folder)
        except OSError as error:
            log.warning("can't remove %s, left by a member that ended without stopping: %s",
                        folder, error)
            continue
        log.info("removed %s, left by a member that ended without stopping", folder)
        removed += 1
    return removed
