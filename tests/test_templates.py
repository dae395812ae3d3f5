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
