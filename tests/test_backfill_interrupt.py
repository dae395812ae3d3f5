"""Ctrl-C at a terminal during `streamkit backfill --processes N` that started the app's
bundled broker itself.

The terminal signals the whole foreground group: the command, and its pool's
processes. The command stops the broker it started on the way out, so it must first
stop the processes whose appends and hand-overs use that broker; before, they waited
on it for ever, and so did the command waiting for them. Real processes throughout:
`streamkit run` to publish through the bundled broker, then the backfills.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

from tests.brokerproc import free_port
from tests.e2e import AppView, Feeder, Proc, copy_wordcount, eventually
from tests.waiting import LIVENESS

# Every batch of the backfill takes a while, so that the interrupt comes mid-task.
SLOW_BATCHES = """
import time as _time

_consume = WordCount.consume_messages


def _slow(self, shard, store, envelopes, publisher):
    _time.sleep(2.0)
    _consume(self, shard, store, envelopes, publisher)


WordCount.consume_messages = _slow
"""


def _backfill(app: Path, port: int, log: Path) -> Proc:
    return Proc.streamkit(["backfill", str(app), "--processes", "2", "--port", str(port)],
                          log).start(own_group=True)


def _kill_group(proc: Proc) -> None:
    """SIGKILL the command and what is left of its group (a failed test's pool processes)."""
    if proc.proc is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.proc.pid, signal.SIGKILL)
        proc.kill()


def _counted(output: str) -> int:
    """The messages of the results table's rows (every line consumed once: their count)."""
    rows = [line.split() for line in output.splitlines() if line.startswith("shard-")]
    return sum(int(row[1]) for row in rows if len(row) > 1 and row[1].isdigit())


async def test_ctrl_c_stops_a_local_backfill_and_the_broker_it_started(tmp_path: Path) -> None:
    app = copy_wordcount(tmp_path / "wordcount")
    port = free_port()
    address = f"127.0.0.1:{port}"
    run = Proc.streamkit(["run", str(app), "--port", str(port), "--no-status"],
                         tmp_path / "run.log").start(own_group=True)
    try:
        async with AppView(app, address) as view:
            await view.wait_serving(timeout=60)
            ids = Feeder(app, address, tmp_path / "feed.log", count=2000, batch=200,
                         interval=0).start().finish()
        assert await asyncio.to_thread(run.signal, signal.SIGINT, LIVENESS, True) == 0, run.log()
    finally:
        run.stop()
    with (app / "app.py").open("a") as source:
        source.write(SLOW_BATCHES)

    interrupted = _backfill(app, port, tmp_path / "backfill-1.log")
    try:
        await eventually(lambda: "shards done" in interrupted.text(), timeout=60,
                         what="the backfill's tasks to run")
        stopping = time.monotonic()
        code = await asyncio.to_thread(interrupted.signal, signal.SIGINT, LIVENESS, True)
        print(f"stopped in {time.monotonic() - stopping:.2f}s")
    finally:
        _kill_group(interrupted)
    assert code == 130, interrupted.log()
    assert "Traceback" not in interrupted.text(), interrupted.log()
    assert not (app / ".streamkit" / "broker.pid").exists(), "the broker should be stopped"

    again = _backfill(app, port, tmp_path / "backfill-2.log")
    try:
        assert await asyncio.to_thread(again.proc.wait, LIVENESS) == 0, again.log()
    finally:
        _kill_group(again)
    assert "handed over 8 shards" in again.text(), again.log()
    assert _counted(again.text()) == len(ids), again.log()
