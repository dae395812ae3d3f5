"""Garbage-collector settings for a process that consumes messages in bulk.

A catch-up makes millions of short-lived objects (decoded messages, envelopes,
count updates) that reference-counting frees at once; with CPython's default
thresholds the cyclic collector still runs every 700 allocations and walks the
young objects each time: about 8 % of a wordcount member's CPU, measured in
bench/PROFILE.md (1,100 collections per 300k lines). What start-up made
(modules, the app, its config) lives as long as the process, so it is moved out
of the collector's sight (`gc.freeze`), and the young generation is collected
every 50,000 net allocations instead: a few dozen collections per 300k lines.
Cycles are still collected, just in larger batches. No full collection comes
before the freeze: start-up leaves little garbage (what it leaves is frozen
with the rest), and walking every object of a member's imports costs ~20 ms
while its shards take over. STREAMKIT_GC_TUNING=0 in
the environment keeps CPython's defaults (to compare, or to rule it out).
"""

from __future__ import annotations

import gc
import os

__all__ = ["tune_for_throughput"]

YOUNG = 50_000  # net allocations between young-generation collections (CPython: 700)
OLDER = (20, 10)  # young, then middle collections between older ones (CPython: 10, 10)
_tuned = False


def tune_for_throughput() -> None:
    """Freeze what start-up made and raise the collection thresholds, once per process.

    For processes that own their lifetime (a member, a backfill task), not for
    libraries to call on their host's behalf."""
    global _tuned
    if _tuned or os.environ.get("STREAMKIT_GC_TUNING", "1").strip() == "0":
        return
    _tuned = True
    gc.freeze()
    gc.set_threshold(YOUNG, *OLDER)
