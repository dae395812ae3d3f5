"""Backfills: an Application's state recomputed from its journals' history, on Spark.

`plan` lists what each shard reads; `task` runs one shard (plain Python, the
Spark task's body); `handover` makes the result the shard's state in its
recovery log; `spark` drives it all on a Spark cluster or in local mode;
`driver` keeps a SparkContext up between backfills, and `driver_link` is
how a command hands it a plan. PySpark is imported by `spark` only (and by
`driver`, through it), and only when a backfill runs there.

The names below are imported on first use (PEP 562), so that a module of
this package (`daemon`, which Spark starts as a process) costs only itself.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streamkit.backfill.errors import BackfillError
    from streamkit.backfill.plan import BackfillPlan, JournalPlan, Segment, ShardPlan, make_plan
    from streamkit.backfill.task import ShardResult, run_shard, run_shard_task

_EXPORTS = {
    "BackfillError": "errors",
    "BackfillPlan": "plan",
    "JournalPlan": "plan",
    "Segment": "plan",
    "ShardPlan": "plan",
    "make_plan": "plan",
    "ShardResult": "task",
    "run_shard": "task",
    "run_shard_task": "task",
}

__all__ = [
    "BackfillError",
    "BackfillPlan",
    "JournalPlan",
    "Segment",
    "ShardPlan",
    "ShardResult",
    "make_plan",
    "run_shard",
    "run_shard_task",
]


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value
