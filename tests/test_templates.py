"""What `streamkit new` makes runs: each store kind's generated test passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


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
