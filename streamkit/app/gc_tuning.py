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
while its shards take over. Before that, while a member process imports its
modules and loads the app, cyclic collection is off altogether
(`hold_collections`): imports make ~80,000 objects and no cyclic garbage, and
the collections they set off cost ~10 % of them (~20 ms). STREAMKIT_GC_TUNING=0
in the environment keeps CPython's defaults (to compare, or to rule it out).
"""

from __future__ import annotations

import gc
import os

__all__ = ["hold_collections", "tune_for_throughput"]

YOUNG = 50_000  # net allocations between young-generation collections (CPython: 700)
OLDER = (20, 10)  # young, then middle collections between older ones (CPython: 10, 10)
_tuned = False


def _wanted() -> bool:
    return os.environ.get("STREAMKIT_GC_TUNING", "1").strip() != "0"


def hold_collections() -> None:
    """No cyclic collection until `tune_for_throughput` (a member's start-up, from the
    command on: it makes many objects and no cycles worth collecting)."""
    if not _tuned and _wanted():
        gc.disable()


def tune_for_throughput() -> None:
    """Freeze what start-up made, raise the collection thresholds and turn the collector
    (back) on (`hold_collections` turned it off), once per process.

    For processes that own their lifetime (a member, a backfill task), not for
    libraries to call on their host's behalf."""
    global _tuned
    if _tuned or not _wanted():
        return
    _tuned = True
    gc.freeze()
    gc.set_threshold(YOUNG, *OLDER)
    gc.enable()
