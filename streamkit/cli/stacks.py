"""`kill -USR1 PID`: a streamkit process writes every thread's stack to its standard
error (the log) and runs on: the way to see where a process that seems to hang is.

A Python-level handler rather than faulthandler's: it runs on the main thread with
the GIL held, between two bytecodes, so every stack it reads is whole. faulthandler
reads the other threads' frames while they run; a dump raced with a busy thread (the
broker's start-up imports) ended mid-line, and its "current thread" is whichever
thread the kernel chose, often one of gRPC's.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from types import FrameType

__all__ = ["install"]


def install() -> None:
    """Answer SIGUSR1 with the stacks (where the platform has it)."""
    if hasattr(signal, "SIGUSR1"):
        signal.signal(signal.SIGUSR1, _write_stacks)


def _write_stacks(signum: int, interrupted: FrameType | None) -> None:
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    here = threading.get_ident()
    frames = sys._current_frames()
    parts = [f"process {os.getpid()}: the stacks of its {len(frames)} threads (SIGUSR1)\n"]
    for ident, top in frames.items():
        current = ident == here
        parts.append(f"\nThread {names.get(ident, 'unnamed')} ({ident:#x})"
                     f"{' [current thread: where the signal was handled]' if current else ''}"
                     ", most recent call last:\n")
        parts.extend(traceback.format_stack(interrupted if current else top))
    sys.stderr.write("".join(parts))
    sys.stderr.flush()
