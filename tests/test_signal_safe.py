"""streamkit/signal_safe.py: waking a thread without taking a lock; stop signals that come
while a member's process ends."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import time

import pytest

from streamkit.signal_safe import Waker


def test_a_waker_with_a_descriptor_above_1023_still_wakes() -> None:
    """Members raise their open-file limit (a store's files): a Waker made late gets a
    pipe above select's limit, where select raised ValueError in the waiting thread (and
    a second stop signal was lost with it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the open-file limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.dup(0) for _ in range(1100)]
    waker = Waker()
    try:
        assert waker._read > 1023
        started = time.monotonic()
        waker.wait(0.05)  # nothing set: times out
        assert time.monotonic() - started >= 0.04
        woken = threading.Event()

        def wait() -> None:
            waker.wait(30)
            woken.set()

        threading.Thread(target=wait, daemon=True).start()
        waker.set()
        assert woken.wait(5)
    finally:
        waker.close()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


_LATE_SIGNALS = """
import asyncio, os, signal
from streamkit.cli.run import _until_signalled

async def main():
    asyncio.get_running_loop().call_later(0.1, os.kill, os.getpid(), signal.SIGTERM)
    await _until_signalled()

asyncio.run(main())
for late in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # the loop is closed
    os.kill(os.getpid(), late)
print("ended", flush=True)
"""


def test_stop_signals_after_the_loop_closes_neither_kill_nor_print() -> None:
    """A process of `run` gets its stop signal several times (from its terminal's group,
    then from `run`). Those coming once it stops went to the event loop's handlers, whose
    wakeup fd the loop closes as the process ends: written to then, a traceback in the
    worker's log; after it, Python's default action (killed by SIGTERM)."""
    done = subprocess.run([sys.executable, "-c", _LATE_SIGNALS], capture_output=True,
                          text=True, timeout=60, start_new_session=True)
    assert (done.returncode, done.stdout, done.stderr) == (0, "ended\n", "")
