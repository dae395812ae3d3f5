"""Which members' folders `streamkit/app/work_dirs.py` takes for abandoned."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from streamkit.app.work_dirs import abandoned_work_dirs


def test_a_killed_member_not_yet_reaped_has_abandoned_its_folder(tmp_path: Path) -> None:
    """A SIGKILLed member stays a zombie until its parent (a slow supervisor, or init)
    reaps it: `kill(pid, 0)` still finds it, yet it will never come back. Its folder is
    abandoned; a live process's and a folder named otherwise are not."""
    host = "vm"
    zombie = subprocess.Popen(["sleep", "60"])
    live = subprocess.Popen(["sleep", "60"])
    try:
        zombie.kill()
        stat = Path(f"/proc/{zombie.pid}/stat")
        deadline = time.monotonic() + 10
        while stat.read_text().rpartition(")")[2].split()[0] != "Z":  # killed, not reaped
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for name in (f"{host}-{zombie.pid}", f"{host}-{live.pid}", f"{host}-{os.getpid()}",
                     "worker-1", f"other-{zombie.pid}"):
            (tmp_path / name).mkdir()
        assert abandoned_work_dirs(tmp_path, host) == [tmp_path / f"{host}-{zombie.pid}"]
        zombie.wait()  # reaped: gone for good, still abandoned
        assert abandoned_work_dirs(tmp_path, host) == [tmp_path / f"{host}-{zombie.pid}"]
    finally:
        for process in (zombie, live):
            process.kill()
            process.wait()
