"""What `streamkit backfill` shows while tasks run (streamkit/cli/backfill_progress.py)."""

from __future__ import annotations

import json
import os
import time

import pytest

from streamkit.backfill.spark import SparkProgress
from streamkit.cli import backfill_progress
from streamkit.cli.backfill_progress import Progress


def test_a_long_quiet_stretch_shows_how_far_running_shards_have_read(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The engine's updates come only as whole shards finish; in between, the tasks'
    reports (bytes of their journals read) are shown once the command was quiet EVERY
    seconds, but not a stale one (its task was killed); the folder is gone after."""
    monkeypatch.setattr(backfill_progress, "EVERY", 0.2)
    with Progress(3) as progress:
        report = {"shard": "shard-001", "read": 1 << 20, "total": 4 << 20, "messages": 10}
        (progress.folder / "shard-001.json").write_text(json.dumps(report))
        stale = progress.folder / "shard-002.json"  # a task killed long ago left it
        stale.write_text(json.dumps({**report, "shard": "shard-002"}))
        os.utime(stale, (time.time() - 60, time.time() - 60))
        time.sleep(1.4)  # (the display looks once a second)
        progress.show(SparkProgress(3, 1, 1, 0, 2.0))
        folder = progress.folder
    lines = capsys.readouterr().err.splitlines()
    assert any(line.startswith("backfill: 0/3 shards done, 1 running (")
               and line.endswith("s): shard-001 25% of 4.0 MiB read") for line in lines), lines
    assert lines[-1].startswith("backfill: 1/3 shards done, 1 running ("), lines
    assert not folder.exists()
