"""Which members' folders `streamkit/app/work_dirs.py` takes for abandoned."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from streamkit.app.work_dirs import LOCK_FILE, hold_work_dir, remove_abandoned

HOLD = """
import sys, time
from pathlib import Path
from streamkit.app.work_dirs import hold_work_dir
lock = hold_work_dir(Path(sys.argv[1]), "a member")
print("held", flush=True)
time.sleep(60)
"""


def test_a_folder_is_abandoned_once_no_process_holds_its_lock(tmp_path: Path) -> None:
    """A member holds its folder's lock for its life, however it ends (an flock): folders of
    this host's `<host>-<pid>` members whose lock is free go, whatever their pid says (a
    pid seen from another PID namespace, or reused); those held, named otherwise, or
    without a lock file (made before the locks) stay."""
    host = "vm"
    held = tmp_path / f"{host}-1"  # a pid that runs here (init): its lock decides
    member = subprocess.Popen([sys.executable, "-c", HOLD, str(held)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert member.stdout is not None and member.stdout.readline() == "held\n"
        dead = tmp_path / f"{host}-999999"
        hold_work_dir(dead / "shard-000", "a member").release()  # (made, not a member's)
        hold_work_dir(dead, "a member").release()  # its member ended: the lock is free
        (dead / "shard-000" / "CURRENT").write_text("x")
        old = tmp_path / f"{host}-999998"  # from before the locks
        old.mkdir()
        other = tmp_path / "worker-1"
        hold_work_dir(other, "a member").release()
        assert remove_abandoned(tmp_path, host) == 1
        assert not dead.exists()
        assert (held / LOCK_FILE).is_file() and old.is_dir() and other.is_dir()
        member.kill()  # SIGKILL: the kernel drops its lock
        member.wait()
        assert remove_abandoned(tmp_path, host) == 1
        assert not held.exists()
    finally:
        member.kill()
        member.wait()
