"""A Spark driver kept up between backfills (`streamkit spark start|status|stop`).

Real processes throughout: the driver (and its Spark, local[2]) started by the
CLI, backfills handed to it by `streamkit backfill --spark`, against a real
broker.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamkit.backfill.driver_link import DriverLink, find_driver, private_folder
from streamkit.backfill.errors import BackfillError
from tests.brokerproc import BrokerProcess
from tests.conftest import unavailable
from tests.test_backfill import Setup, copy_wordcount, publish
from tests.waiting import eventually

try:
    import pyspark  # noqa: F401
except ImportError:
    unavailable("pyspark is not installed")

# The app checks every batch with tweak.check(), a sibling module the test rewrites.
TWEAKED_APP = """
import tweak

_consume = WordCount.consume_messages


def _checked(self, shard, store, envelopes, publisher):
    tweak.check()
    _consume(self, shard, store, envelopes, publisher)


WordCount.consume_messages = _checked
"""


SLEEPING = "import time\n\n\ndef check():\n    time.sleep(120)\n"  # a task that hangs


@pytest.fixture
def socket_path() -> Iterator[Path]:
    """A driver socket of the test's own (short: a socket path has at most 107 bytes);
    any driver started for it is killed afterwards (its JVM ends with it), listening
    yet or not."""
    folder = Path(tempfile.mkdtemp(prefix="skd-"))
    path = folder / "spark.sock"
    try:
        yield path
    finally:
        subprocess.run(["pkill", "-KILL", "-f", f"streamkit.backfill.driver --socket {path}"],
                       check=False)
        log = folder / "spark.log"
        print(log.read_text() if log.exists() else "")  # shown if the test failed
        shutil.rmtree(folder, ignore_errors=True)


def _streamkit(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "streamkit.cli.main", *args],
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "STREAMKIT_SPARK_DRIVER": str(path)})


def _start_backfill(path: Path, app: Path, where: list[str]) -> subprocess.Popen[str]:
    """`streamkit backfill APP --spark` on the driver at `path`, in the background."""
    return subprocess.Popen(
        [sys.executable, "-m", "streamkit.cli.main", "backfill", str(app), "--spark", *where],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "STREAMKIT_SPARK_DRIVER": str(path)})


def _counted(output: str) -> int:
    """The messages of the results table's rows (every line consumed once: their count)."""
    rows = [line.split() for line in output.splitlines() if line.startswith("shard-")]
    return sum(int(row[1]) for row in rows if row[1].isdigit())


async def test_backfills_run_on_a_driver_kept_up(broker_proc: BrokerProcess, tmp_path: Path,
                                                  socket_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # A package folder of the test's own on every process's path (the driver's included),
    # whose one package the test "upgrades" below.
    packages = tmp_path / "site-packages"
    (packages / "fakepkg-1.0.dist-info").mkdir(parents=True)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(packages), *filter(None, [os.environ.get("PYTHONPATH")])]))
    app = copy_wordcount(tmp_path / "app")
    with (app / "app.py").open("a") as source:
        source.write(TWEAKED_APP)
    (app / "tweak.py").write_text("def check():\n    pass\n")
    setup = await Setup.start(app, broker_proc)
    try:
        await publish(setup, "wordcount/lines", [{"id": i, "line": "a b c"} for i in range(60)])
    finally:
        await setup.close()
    where = ["--broker", broker_proc.address, "--keyspace", str(app / "keyspace.db"),
             "--fragment-root", str(broker_proc.data_dir / "fragments")]

    def backfill(*more: str) -> subprocess.CompletedProcess[str]:
        return _streamkit(socket_path, "backfill", str(app), "--spark", *where, *more)

    none = await asyncio.to_thread(_streamkit, socket_path, "spark", "status")
    assert none.returncode == 1 and "no Spark driver runs" in none.stderr, none.stderr
    started = await asyncio.to_thread(_streamkit, socket_path, "spark", "start", "--master",
                                      "local[2]")
    assert started.returncode == 0 and "Spark driver up" in started.stderr, started.stderr
    again = await asyncio.to_thread(_streamkit, socket_path, "spark", "start")
    assert again.returncode == 1 and "already runs" in again.stderr, again.stderr

    first = await asyncio.to_thread(backfill)
    assert first.returncode == 0, first.stderr
    assert "using the Spark driver" in first.stderr and "handed over 8 shards" in first.stderr
    assert _counted(first.stdout) == 60

    # Spark's Python workers outlive a job: the next backfill still runs the app's files
    # as they are now, its sibling modules included.
    (app / "tweak.py").write_text("def check():\n    raise ValueError('tweak was edited')\n")
    edited = await asyncio.to_thread(backfill)
    assert edited.returncode == 1 and "tweak was edited" in edited.stderr, edited.stderr
    assert "Traceback" not in edited.stderr

    # A backfill whose command goes away is cancelled; the driver serves on.
    link = DriverLink(socket_path)
    (app / "tweak.py").write_text(SLEEPING)
    stuck = _start_backfill(socket_path, app, where)
    try:
        await eventually(lambda: bool(link.status()["running"]), timeout=60,
                         what="the backfill to run on the driver")
    finally:
        stuck.kill()
        stuck.wait()
    cancelled = time.monotonic()
    await eventually(lambda: not link.status()["running"], timeout=60,
                     what="the driver to cancel the backfill of a command that went away")
    assert time.monotonic() - cancelled < 60
    (app / "tweak.py").write_text("def check():\n    pass\n")
    after = await asyncio.to_thread(backfill)
    assert after.returncode == 0, after.stderr
    assert _counted(after.stdout) == 60

    # A command from other code (another environment, streamkit changed) is refused, as is
    # one after a package was upgraded (the driver's Python workers keep the old one).
    with pytest.raises(BackfillError, match="runs other code than this command"):
        link.request("backfill", plan=None, fingerprint="another streamkit")
    (packages / "fakepkg-1.0.dist-info").rename(packages / "fakepkg-1.1.dist-info")
    upgraded = await asyncio.to_thread(backfill)
    assert upgraded.returncode == 1, upgraded.stderr
    assert "runs other code than this command" in upgraded.stderr, upgraded.stderr
    (packages / "fakepkg-1.1.dist-info").rename(packages / "fakepkg-1.0.dist-info")
    (packages / "__pycache__").mkdir()  # what a first import may write: not an upgrade

    status = await asyncio.to_thread(_streamkit, socket_path, "spark", "status")
    assert status.returncode == 0, status.stderr
    assert "master local[2]" in status.stdout and "4 backfill(s) done" in status.stdout

    # --master: a Spark of the command's own, not the driver's.
    own = await asyncio.to_thread(backfill, "--master", "local[1]")
    assert own.returncode == 0, own.stderr
    assert "using the Spark driver" not in own.stderr and "Spark start" in own.stderr

    # Stopping the driver cancels the backfill running there, whose command says so.
    (app / "tweak.py").write_text(SLEEPING)
    running = _start_backfill(socket_path, app, where)
    await eventually(lambda: bool(link.status()["running"]), timeout=60,
                     what="the backfill to run on the driver")
    stopped = await asyncio.to_thread(_streamkit, socket_path, "spark", "stop")
    assert stopped.returncode == 0 and "stopped the Spark driver" in stopped.stderr
    _, said = await asyncio.to_thread(running.communicate, timeout=60)
    assert running.returncode == 1, said
    assert "the Spark driver was stopped while the backfill ran" in said
    assert not socket_path.exists() and find_driver(socket_path) is None
    (app / "tweak.py").write_text("def check():\n    pass\n")
    without = await asyncio.to_thread(backfill)  # no driver: Spark of its own
    assert without.returncode == 0 and "using the Spark driver" not in without.stderr


async def test_a_killed_driver_is_replaced(socket_path: Path) -> None:
    started = await asyncio.to_thread(_streamkit, socket_path, "spark", "start", "--master",
                                      "local[1]")
    assert started.returncode == 0, started.stderr
    link = find_driver(socket_path)
    assert link is not None
    pid = int(link.status()["pid"])
    os.kill(pid, signal.SIGKILL)
    await eventually(lambda: find_driver(socket_path) is None, timeout=30,
                     what="the killed driver's socket to refuse connections")
    assert socket_path.exists()  # left behind: the next start replaces it
    status = await asyncio.to_thread(_streamkit, socket_path, "spark", "status")
    assert status.returncode == 1 and "no Spark driver runs" in status.stderr
    restarted = await asyncio.to_thread(_streamkit, socket_path, "spark", "start", "--master",
                                        "local[1]")
    assert restarted.returncode == 0, restarted.stderr
    assert find_driver(socket_path) is not None
    stopped = await asyncio.to_thread(_streamkit, socket_path, "spark", "stop")
    assert stopped.returncode == 0, stopped.stderr

    # `status` while the driver's Spark starts: it waits (saying so when that takes a while).
    starting = subprocess.Popen(
        [sys.executable, "-m", "streamkit.backfill.driver", "--socket", str(socket_path),
         "--master", "local[1]"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await eventually(lambda: find_driver(socket_path) is not None, timeout=60,
                         what="the driver to listen")
        status = await asyncio.to_thread(_streamkit, socket_path, "spark", "status")
        assert status.returncode == 0, status.stderr
        assert "master local[1]" in status.stdout
    finally:
        starting.terminate()
        assert starting.wait(60) == 0


def test_socket_folder_must_be_private(tmp_path: Path) -> None:
    folder = tmp_path / "shared"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    with pytest.raises(BackfillError, match="closed to others"):
        private_folder(folder / "spark.sock", create=False)
    with socket.socket(socket.AF_UNIX) as bound:  # a socket there, in an open folder
        bound.bind(str(folder / "spark.sock"))
        with pytest.raises(BackfillError, match="closed to others"):
            find_driver(folder / "spark.sock")
    folder.chmod(0o700)
    private_folder(folder / "spark.sock", create=False)
    link = tmp_path / "link"  # a link to a private folder: its target could be swapped
    link.symlink_to(folder)
    with pytest.raises(BackfillError, match="not a link"):
        private_folder(link / "spark.sock", create=False)


def test_bad_start_options_are_named(socket_path: Path) -> None:
    bad = _streamkit(socket_path, "spark", "start", "--spark-conf", "nokey")
    assert bad.returncode == 2 and "expected KEY=VALUE" in bad.stderr, bad.stderr
    socket_path.write_text("not a socket")
    taken = _streamkit(socket_path, "spark", "start")
    assert taken.returncode == 2 and "is not a socket" in taken.stderr, taken.stderr
    assert socket_path.read_text() == "not a socket"
    socket_path.unlink()
    failing = _streamkit(socket_path, "spark", "start", "--master", "nonsense://nowhere")
    assert failing.returncode == 1, failing.stderr
    assert "exited" in failing.stderr and "Traceback" not in failing.stderr.split("\n")[0]
