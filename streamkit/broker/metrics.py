"""Prometheus metrics of the broker, served on the HTTP gateway's /metrics."""

from prometheus_client import Counter, Gauge

APPENDS = Counter("streamkit_broker_appends_total", "Appends committed", ["journal"])
APPEND_BYTES = Counter("streamkit_broker_append_bytes_total", "Bytes committed", ["journal"])
APPEND_FAILURES = Counter(
    "streamkit_broker_append_failures_total", "Appends answered with a non-OK status", ["status"]
)
READS_OPEN = Gauge("streamkit_broker_reads_open", "Read streams being served (gRPC and HTTP)")
READ_BYTES = Counter("streamkit_broker_read_bytes_total", "Content bytes sent to readers")
FRAGMENTS_PERSISTED = Counter(
    "streamkit_broker_fragments_persisted_total", "Fragments persisted to stores"
)
BYTES_PERSISTED = Counter(
    "streamkit_broker_persisted_bytes_total", "Uncompressed bytes persisted to stores"
)
UNPERSISTED = Gauge(
    "streamkit_broker_unpersisted_spools",
    "Rolled spools not yet in their store (queued, being persisted, or waiting on a store "
    "that fails): a number that only grows means a store is out of reach",
)
PERSIST_FAILURES = Counter(
    "streamkit_broker_persist_failures_total", "Failed attempts to persist a fragment", ["journal"]
)
RPC_ERRORS = Counter(
    "streamkit_broker_rpc_errors_total", "RPCs failed with a gRPC error", ["method", "code"]
)
