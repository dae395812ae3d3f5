"""Shard metrics are made on first use (streamkit/app/metrics.py), from more than one thread."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_FIRST_USES = textwrap.dedent("""
    import sys, threading
    from streamkit.app import metrics
    assert "prometheus_client" not in sys.modules  # not imported before a first use
    start = threading.Barrier(4)
    failures = []

    def first_use(i):
        start.wait()
        try:
            if i % 2:
                metrics.shard_metrics(f"shard-{i}").messages.inc()
            else:
                metrics.lag_gauge(f"shard-{i}", "a/journal").set(i)
        except Exception as error:
            failures.append(repr(error))

    threads = [threading.Thread(target=first_use, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
""")


def test_first_uses_on_several_threads_make_the_families_once() -> None:
    """A shard's reader (on the event loop) and a scrape (on the HTTP API's thread) may be
    first at the same moment: both get the same families, neither fails (registering a
    family twice raises in prometheus_client; it did, 3 threads of 4, without the lock)."""
    done = subprocess.run([sys.executable, "-c", _FIRST_USES], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
