"""Tying a child process's life to its parent's (Linux's parent-death signal).

A `streamkit run` or `streamkit backfill` killed outright must not leave its
children behind: a bundled broker holding ports and files, a worker serving
shards, a backfill task handing its shard over after the command gave up on it.
"""

from __future__ import annotations

import ctypes
import signal

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child: receive SIGTERM when the parent dies. (A parent that died before
    this call sends nothing: check `os.getppid()` after it.)"""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: children outlive a killed parent, as usual elsewhere
