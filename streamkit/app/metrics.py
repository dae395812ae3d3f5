"""Prometheus metrics of consumer shards (a member process serves them on /metrics).

The families are made, and prometheus_client imported, on first use: its import
(with the HTTP, e-mail and URL modules its exposition code pulls in) is ~25 ms
of a member's start-up CPU, and nothing needs it before a shard has read or
committed something. A shard's series appear from then on.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge, Histogram

__all__ = ["ShardMetrics", "count_skipped", "ensure_registered", "lag_gauge", "shard_metrics"]

_PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


@dataclass(frozen=True, slots=True)
class _Families:
    messages: Counter
    transactions: Counter
    phases: Histogram
    lag: Gauge
    skipped: Counter


_made: _Families | None = None
_making = threading.Lock()  # first uses come from the event loop and the HTTP API's thread


def _families() -> _Families:
    global _made
    if _made is None:
        with _making:  # registering a family twice raises: make them once
            if _made is None:
                _made = _make_families()
    return _made


def _make_families() -> _Families:
    from prometheus_client import Counter, Gauge, Histogram

    return _Families(
        messages=Counter("streamkit_shard_messages_total", "Committed messages consumed",
                         ["shard"]),
        transactions=Counter("streamkit_shard_transactions_total",
                             "Transactions committed and acked", ["shard"]),
        phases=Histogram(
            "streamkit_shard_txn_phase_seconds",
            "Time transactions spent consuming, stalled on the previous commit, committing",
            ["shard", "phase"],
            buckets=_PHASE_BUCKETS,
        ),
        lag=Gauge("streamkit_shard_lag_bytes", "Source bytes not yet processed",
                  ["shard", "journal"]),
        # Source messages a transaction passed over by its source's policy (streamkit.yaml's
        # on_undecodable, on_consume_error): cause "undecodable" or "consume-error", policy
        # "skip" or "dead-letter". Counted each time a transaction does, so again if that
        # one is retried.
        skipped=Counter(
            "streamkit_shard_skipped_messages_total",
            "Source messages skipped or dead-lettered by their source's policy",
            ["shard", "journal", "cause", "policy"],
        ),
    )


@dataclass(frozen=True, slots=True)
class ShardMetrics:
    """The metric children of one shard, looked up once rather than per transaction."""

    messages: Counter
    transactions: Counter
    consumed: Histogram
    stalled: Histogram
    committed: Histogram


def shard_metrics(shard: str) -> ShardMetrics:
    """`shard`'s transaction metrics."""
    families = _families()
    phases = families.phases
    return ShardMetrics(
        families.messages.labels(shard),
        families.transactions.labels(shard),
        phases.labels(shard, "consuming"),
        phases.labels(shard, "stalled"),
        phases.labels(shard, "committing"),
    )


def lag_gauge(shard: str, journal: str) -> Gauge:
    """The gauge of the source bytes `shard` has not yet processed of `journal`."""
    return _families().lag.labels(shard, journal)


def count_skipped(shard: str, journal: str, cause: str, policy: str) -> None:
    """One source message of `journal` that `shard`'s transaction passed over."""
    _families().skipped.labels(shard, journal, cause, policy).inc()


def ensure_registered() -> None:
    """Make the families (before a scrape, so that it lists them all)."""
    _families()
