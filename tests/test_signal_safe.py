"""streamkit/signal_safe.py: waking a thread without taking a lock."""

from __future__ import annotations

import os
import resource
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
