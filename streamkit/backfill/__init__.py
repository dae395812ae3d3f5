"""Backfills: an Application's state recomputed from its journals' history, on Spark.

`plan` lists what each shard reads; `task` runs one shard (plain Python, the
Spark task's body); `handover` makes the result the shard's state in its
recovery log; `spark` drives it all on a Spark cluster or in local mode.
PySpark is imported by `spark` only, and only when a backfill runs there.
"""

from streamkit.backfill.errors import BackfillError
from streamkit.backfill.plan import BackfillPlan, JournalPlan, Segment, ShardPlan, make_plan
from streamkit.backfill.task import ShardResult, run_shard, run_shard_task

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
