"""Prometheus metrics of consumer shards (a member process serves them on /metrics)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

_PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

MESSAGES = Counter("streamkit_shard_messages_total", "Committed messages consumed", ["shard"])
TRANSACTIONS = Counter(
    "streamkit_shard_transactions_total", "Transactions committed and acked", ["shard"]
)
PHASES = Histogram(
    "streamkit_shard_txn_phase_seconds",
    "Time transactions spent consuming, stalled on the previous commit, committing",
    ["shard", "phase"],
    buckets=_PHASE_BUCKETS,
)
LAG = Gauge("streamkit_shard_lag_bytes", "Source bytes not yet processed", ["shard", "journal"])
# Source messages a transaction passed over by its source's policy (streamkit.yaml's
# on_undecodable, on_consume_error): cause "undecodable" or "consume-error", policy "skip" or
# "dead-letter". Counted each time a transaction does, so again if that one is retried.
SKIPPED = Counter(
    "streamkit_shard_skipped_messages_total",
    "Source messages skipped or dead-lettered by their source's policy",
    ["shard", "journal", "cause", "policy"],
)


@dataclass(frozen=True, slots=True)
class ShardMetrics:
    """The metric children of one shard, looked up once rather than per transaction."""

    messages: Counter
    transactions: Counter
    consumed: Histogram
    stalled: Histogram
    committed: Histogram


class _Metrics:
    def labels_for(self, shard: str) -> ShardMetrics:
        return ShardMetrics(
            MESSAGES.labels(shard),
            TRANSACTIONS.labels(shard),
            PHASES.labels(shard, "consuming"),
            PHASES.labels(shard, "stalled"),
            PHASES.labels(shard, "committing"),
        )


SHARD_METRICS = _Metrics()
