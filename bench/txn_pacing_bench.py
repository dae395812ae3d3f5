"""What pacing a transaction's runs costs the fast path of TransactionLoop._consume_ready.

    python bench/txn_pacing_bench.py

Since 2026-11-27 a run's length follows the app's pace (`TransactionLoop._paced`): the
loop reads the clock before each run as well as after it, and compares the run's time
with its share of max_duration. This times the loop's per-run bookkeeping both ways,
around a hook that does nothing (best of 7), as ns per message for runs of 16 messages:
the added cost a quick app pays. A slow app's cost is a Python call per run, beside
hooks taking milliseconds.
"""

from __future__ import annotations

import time
import timeit

RUN = list(range(16))  # consume_message's runs are at most _CHECK_EVERY = 16 messages
RUNS = 20_000


def before() -> int:
    now, count, started, max_duration = time.monotonic, 0, time.monotonic(), 1e9
    for _ in range(RUNS):
        for _message in RUN:  # the hooks (here: nothing)
            pass
        count += len(RUN)
        t = now()
        if t - started >= max_duration:
            break
    return count


def after() -> int:
    now, count, started, max_duration = time.monotonic, 0, time.monotonic(), 1e9
    limit = most = 16
    quick = 1.0 / (8 * most)
    for _ in range(RUNS):
        began = now()
        for _message in RUN:
            pass
        ran = len(RUN)
        count += ran
        t = now()
        if limit != most or t - began > ran * quick:
            limit = 1  # not reached: the runs are quick
        if t - started >= max_duration:
            break
    return count


def main() -> None:
    per_message = RUNS * len(RUN)
    for label, fn in (("before", before), ("after", after)):
        best = min(timeit.repeat(fn, number=1, repeat=7))
        print(f"{label:7} {best / per_message * 1e9:5.1f} ns per message")


if __name__ == "__main__":
    main()
