"""Ctrl-C at a terminal during `streamkit backfill --processes N` that started the app's
bundled broker itself.

The terminal signals the whole foreground group: the command, and its pool's
processes. The command stops the broker it started on the way out, so it must first
stop the processes whose appends and hand-overs use that broker; before, they waited
on it for ever, and so did the command waiting for them. Real processes throughout:
`streamkit run` to publish through the bundled broker, then the backfills.

A command killed outright (SIGKILL) can't stop anything: its pool's processes must die
with it by themselves, before they hand a shard over that the command gave up on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from streamkit.app.config import load_config
from streamkit.app.member import deploy
from streamkit.client import AppendService, BrokerClient
from streamkit.keyspace import open_keyspace
from streamkit.message.publisher import Publisher
from tests.brokerproc import BrokerProcess, free_port
from tests.e2e import AppView, Feeder, Proc, copy_wordcount, eventually
from tests.waiting import LIVENESS

# Every batch of the backfill takes a while, so that the interrupt comes mid-task; the
# process consuming it leaves a file named busy-PID in the app's folder.
SLOW_BATCHES = """
import os as _os
import time as _time
from pathlib import Path as _Path

_consume = WordCount.consume_messages


def _slow(self, shard, store, envelopes, publisher):
    (_Path(__file__).parent / f"busy-{_os.getpid()}").touch()
    _time.sleep(2.0)
    _consume(self, shard, store, envelopes, publisher)


WordCount.consume_messages = _slow
"""


def _backfill(app: Path, log: Path, *where: str) -> Proc:
    """`streamkit backfill APP --processes 2`, `where` saying where the broker is."""
    return Proc.streamkit(["backfill", str(app), "--processes", "2", *where],
                          log).start(own_group=True)


def _kill_group(proc: Proc) -> None:
    """SIGKILL the command and what is left of its group (a failed test's pool processes)."""
    if proc.proc is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.proc.pid, signal.SIGKILL)
        proc.kill()


def _interrupted_note(output: str) -> tuple[list[str], list[str]]:
    """The shards the interrupted backfill's last line says it handed over, and those not."""
    found = re.search(r"backfill interrupted: handed over \d+ of 8 shards: (.*?)(?: \(.*?\))?; "
                      r"not finished: (.*?); running the same `streamkit backfill` again is "
                      r"safe", output)
    assert found, output
    return [[] if names == "none" else names.split(", ") for names in found.groups()]


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

    interrupted = _backfill(app, tmp_path / "backfill-1.log", "--port", str(port))
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
    handed, unfinished = _interrupted_note(interrupted.text())
    assert sorted(handed + unfinished) == [f"shard-{i:03d}" for i in range(8)], interrupted.log()
    done = re.findall(r"backfill: (\d+)/8 shards done", interrupted.text())
    assert unfinished and len(handed) >= int(done[-1]), interrupted.log()
    assert not (app / ".streamkit" / "broker.pid").exists(), "the broker should be stopped"

    again = _backfill(app, tmp_path / "backfill-2.log", "--port", str(port))
    try:
        assert await asyncio.to_thread(again.proc.wait, LIVENESS) == 0, again.log()
    finally:
        _kill_group(again)
    assert "handed over 8 shards" in again.text(), again.log()
    assert _counted(again.text()) == len(ids), again.log()


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not reaped by whoever adopted it, doesn't)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            if int(stat.read_text().rpartition(")")[2].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


async def _published(app: Path, broker: BrokerProcess, lines: int) -> list[str]:
    """Deploy the app on `broker` and publish `lines` lines: the backfill's options to read
    them (the broker, the app's KeySpace and the broker's fragments)."""
    config = load_config(app)
    config = config.for_application(config.load_application())
    keyspace = str(app / "keyspace.db")
    async with BrokerClient(broker.address) as client, open_keyspace(keyspace) as ks:
        await deploy(config, client, ks)
        async with AppendService(client) as service:
            publisher = Publisher(service)
            mapping = config.mapping_for("wordcount/lines")
            for i in range(lines):
                await publisher.publish_committed(mapping, {"id": i, "line": f"w{i % 7} x"})
    return ["--broker", broker.address, "--keyspace", keyspace,
            "--fragment-root", str(broker.data_dir / "fragments")]


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
async def test_a_killed_backfill_takes_its_processes_with_it(broker_proc: BrokerProcess,
                                                            tmp_path: Path) -> None:
    """SIGKILL of `streamkit backfill --processes 2` mid-task: its pool's processes (and
    multiprocessing's resource tracker) end within seconds. Before, they were adopted by
    init and went on: one handed its shard over after the command had died, fencing the
    live primary, and all of them then waited for ever."""
    app = copy_wordcount(tmp_path / "wordcount")
    where = await _published(app, broker_proc, 200)
    with (app / "app.py").open("a") as source:
        source.write(SLOW_BATCHES)
    command = _backfill(app, tmp_path / "backfill.log", *where)
    assert command.proc is not None
    children: list[int] = []
    try:
        await eventually(lambda: len(list(app.glob("busy-*"))) == 2, timeout=LIVENESS,
                         what="both pool processes to be consuming")
        children = _children(command.proc.pid)
        workers = {int(path.name.removeprefix("busy-")) for path in app.glob("busy-*")}
        assert workers <= set(children), (workers, children)
        command.kill()
        await eventually(lambda: not any(map(_alive, children)), timeout=5,
                         what="the killed backfill's processes to end")
    finally:
        command.kill()
        for pid in children:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
