"""Process locks (`streamkit.process_lock`): held while the holder lives, named in their
file, and free the moment the holder dies, however it dies (here: SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from streamkit.process_lock import Held, ProcessLock, holder
from tests.waiting import eventually

HOLD = """
import sys, time
from pathlib import Path
from streamkit.process_lock import ProcessLock
ProcessLock(Path(sys.argv[1])).acquire("serving 127.0.0.1:1234")
print("held", flush=True)
time.sleep(600)
"""


async def test_a_lock_is_held_until_its_holder_is_killed(tmp_path: Path) -> None:
    path = tmp_path / "some.lock"
    assert holder(path) is None  # no file yet
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        held_by = holder(path)
        assert held_by is not None and held_by.pid == proc.pid
        assert held_by.note == "serving 127.0.0.1:1234"
        with pytest.raises(Held, match=f"held by pid {proc.pid}, serving 127.0.0.1:1234"):
            ProcessLock(path).acquire("a second holder")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        await eventually(lambda: holder(path) is None, what="the killed holder's lock to go")
        lock = ProcessLock(path)
        lock.acquire("the next holder")
        assert holder(path) is not None and holder(path).note == "the next holder"
        lock.release()
        assert holder(path) is None
    finally:
        proc.kill()
        proc.wait()
