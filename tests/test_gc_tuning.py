"""A member process's collector: off while it starts, then frozen start-up and high thresholds.

Run in a child process: the settings are process-wide."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import gc
from streamkit.app.gc_tuning import YOUNG, hold_collections, tune_for_throughput
hold_collections()
print(gc.isenabled())
tune_for_throughput()
print(gc.isenabled(), gc.get_threshold()[0] == YOUNG, gc.get_freeze_count() > 0)
"""


def _run(**env: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         env={**os.environ, **env}, check=True).stdout
    return out.splitlines()


def test_collections_are_held_during_start_up_then_tuned() -> None:
    assert _run() == ["False", "True True True"]


def test_tuning_off_keeps_the_defaults() -> None:
    assert _run(STREAMKIT_GC_TUNING="0") == ["True", "True False False"]
