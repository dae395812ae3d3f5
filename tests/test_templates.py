"""What `streamkit new` makes runs: each store kind's generated test passes."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from streamkit.testing import AppHarness


@pytest.mark.parametrize("store", ["rocksdb", "sqlite", "sql", "json"])
def test_generated_app_passes_its_own_test(tmp_path: Path, store: str) -> None:
    made = subprocess.run([sys.executable, "-m", "streamkit.cli.main", "new", "demo",
                           "--store", store, "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "test_app.py"], cwd=tmp_path / "demo", capture_output=True, text=True,
                         timeout=120)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-2000:]
    assert not (tmp_path / "demo" / ".streamkit").exists()  # tests leave the app folder alone


async def test_generated_sql_app_on_postgresql(tmp_path: Path, postgres_url: str) -> None:
    """The SQL app on PostgreSQL, its shards' first transactions together: one creating
    the table in its transaction failed the other's ("duplicate key … pg_type")."""
    name = f"pg-{uuid.uuid4().hex[:8]}"  # a table of its own: the race is on creating it
    made = subprocess.run([sys.executable, "-m", "streamkit.cli.main", "new", name,
                           "--store", "sql", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    config = tmp_path / name / "streamkit.yaml"
    text = re.sub(r"(?m)^  url: null.*$", f"  url: {postgres_url}", config.read_text())
    config.write_text(re.sub(r"(?m)^shards: 2 ", "shards: 4 ", text))
    keys = [f"k{i}" for i in range(40)]  # every shard's partition
    async with AppHarness(tmp_path / name) as h:
        assert len(h.replicas) == 4
        await h.publish("events", [{"key": key} for key in keys * 3])
        await h.wait_idle(timeout=60)
        for key in keys[:8]:
            assert await h.query({"key": key}, key=key) == {"key": key, "total": 3}


# A write in the query hook, per store: what a query must not be able to commit.
QUERY_WRITES = {
    "rocksdb": 'store.put("a", 1000)',
    "sqlite": 'store.db.execute("UPDATE totals SET total = 1000")',
    "json": 'store.state["a"] = 1000',
}


@pytest.mark.parametrize("store", sorted(QUERY_WRITES))
async def test_a_query_waiting_for_the_transaction_cannot_write(tmp_path: Path,
                                                                store: str) -> None:
    """An app without `concurrent_queries` queries between transactions; its query still
    reads in a (read-only) view, so a write there is refused or lost, never committed with
    the next transaction (it was, for RocksDB, SQLite and JSON stores)."""
    made = subprocess.run([sys.executable, "-m", "streamkit.cli.main", "new", "ro",
                           "--store", store, "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    app = tmp_path / "ro" / "app.py"
    text = app.read_text().replace("concurrent_queries = True", "concurrent_queries = False")
    text, found = re.subn(r"(    def query\(self, shard, store[^\n]*\n)",
                          rf'\1        if request.get("write"):\n'
                          rf"            {QUERY_WRITES[store]}\n", text)
    assert found == 1
    app.write_text(text)
    async with AppHarness(tmp_path / "ro") as h:
        await h.publish("events", [{"key": "a"}, {"key": "a"}])
        await h.wait_idle(timeout=30)
        try:
            await h.query({"key": "a", "write": True}, key="a")
        except Exception as refused:  # RocksDB's StoreError, SQLite's read-only error
            assert "read" in str(refused).lower(), refused
        await h.publish("events", [{"key": "a"}])
        await h.wait_idle(timeout=30)
        assert await h.query({"key": "a"}, key="a") == {"key": "a", "total": 3}
