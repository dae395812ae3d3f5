"""The Spark driver of a backfill: one task per shard, on local cores or a cluster.

Each task runs `task.run_shard_task` for its shard in a Python worker. In
local mode (`local[*]`, `local[N]`) the workers are this machine's and read
the app folder and fragment files where they are; for a cluster master the
app folder is zipped and shipped with the job (streamkit itself, and the
app's dependencies, must be installed on the executors), and fragment files
must be reachable there (a shared mount as `--fragment-root`, or a store
with signed http(s) URLs), or they are read through the broker.

This is the only module that imports PySpark, and only when a backfill runs.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamkit.backfill.errors import BackfillError
from streamkit.backfill.plan import BackfillPlan, largest_first

if TYPE_CHECKING:
    from pyspark import SparkContext

__all__ = ["SparkProgress", "check_java", "run_on_spark", "spark_context", "stop_context"]

JOB_GROUP = "streamkit-backfill"
_JAVA_VERSIONS = (17, 21)
_ERROR_RE = re.compile(r"BackfillError: (.+)")
_MISSING_RE = re.compile(r"ModuleNotFoundError: No module named '([^']+)'")


@dataclass(frozen=True)
class SparkProgress:
    """The backfill job's progress as Spark's status tracker reports it."""

    shards: int
    done: int
    running: int
    failed: int
    elapsed: float


def check_java() -> str:
    """The `java -version` line of the Java PySpark will use; BackfillError if unusable."""
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home, "bin", "java")) if home else shutil.which("java")
    if not java or not Path(java).exists():
        where = f"JAVA_HOME={home} has no bin/java" if home else "no java on PATH"
        raise BackfillError(
            f"Spark needs Java {' or '.join(map(str, _JAVA_VERSIONS))} and found none "
            f"({where}): install a JDK (e.g. `apt-get install openjdk-17-jre-headless`) "
            "or set JAVA_HOME"
        )
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise BackfillError(f"running {java} -version failed: {error}") from None
    first = (out.stderr or out.stdout).strip().splitlines()[:1]
    line = first[0] if first else ""
    match = re.search(r'version "(\d+)(?:\.(\d+))?', line)
    if out.returncode != 0 or match is None:
        raise BackfillError(f"{java} -version failed: {line or out.returncode}")
    major = int(match.group(1)) if match.group(1) != "1" else int(match.group(2) or 0)
    if major < _JAVA_VERSIONS[0]:
        raise BackfillError(f"Spark needs Java 17 or later; {java} is Java {major} ({line})")
    return line


def _import_pyspark() -> Any:
    try:
        import pyspark
    except ImportError as error:
        raise BackfillError(
            f"PySpark is not installed ({error}): `pip install pyspark` (4.x), in the same "
            "environment as streamkit"
        ) from None
    return pyspark


def spark_context(master: str = "local[*]", conf: dict[str, str] | None = None) -> SparkContext:
    """A SparkContext for backfills (the one already running, if any).

    Local masters get their workers on 127.0.0.1 and this interpreter as
    their Python, so that the app's imports resolve as they do here.
    """
    java = check_java()
    pyspark = _import_pyspark()
    if master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark_conf = pyspark.SparkConf().setMaster(master).setAppName("streamkit backfill")
    spark_conf.set("spark.ui.enabled", "false")
    spark_conf.set("spark.ui.showConsoleProgress", "false")  # progress is reported by us
    # The driver only schedules a few tasks: a quick-starting JIT beats a fast one.
    # Spark's own log says little a backfill's user can act on: errors only.
    options = ["-XX:TieredStopAtLevel=1", f"-Dlog4j2.configurationFile={_quiet_log4j()}"]
    if master.startswith("local"):
        options += _class_archive(f"{pyspark.__version__} {pyspark.__file__}", java)
        spark_conf.set("spark.python.daemon.module", "streamkit.backfill.daemon")
    spark_conf.set("spark.driver.extraJavaOptions", " ".join(options))
    for key, value in (conf or {}).items():
        spark_conf.set(key, value)
    stop_daemon = None
    if master.startswith("local") and pyspark.SparkContext._active_spark_context is None:
        stop_daemon = _preloaded_daemon(spark_conf)
    try:
        sc = pyspark.SparkContext.getOrCreate(spark_conf)
    except Exception as error:
        if stop_daemon is not None:
            stop_daemon()
        raise BackfillError(f"starting Spark ({master}) failed: {error}") from None
    sc.setLogLevel("ERROR")
    return sc


def _preloaded_daemon(spark_conf: Any) -> Callable[[], None] | None:
    """Start importing the local workers' modules while Spark's JVM starts (see daemon.py);
    what stops it if Spark doesn't start.

    The daemon Spark starts later finds it through its environment (the
    context's executor environment). It waits in a folder only this user
    can enter. STREAMKIT_SPARK_PRELOAD=0 turns this off.
    """
    from streamkit.backfill.daemon import ADDRESS_ENV

    if os.environ.get("STREAMKIT_SPARK_PRELOAD", "1") == "0":
        return None
    folder = Path(tempfile.mkdtemp(prefix="streamkit-daemon-"))
    try:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "streamkit.backfill.daemon", "--preloaded",
             str(folder / "daemon.sock")], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    except OSError:
        folder.rmdir()
        return None
    spark_conf.setExecutorEnv(ADDRESS_ENV, str(folder / "daemon.sock"))

    def stop() -> None:
        daemon.kill()
        daemon.wait()
        shutil.rmtree(folder, ignore_errors=True)

    return stop


def _class_archive(pyspark: str, java: str) -> list[str]:
    """JVM options that map Spark's classes from an archive (AppCDS) instead of loading them.

    Loading Spark's classes is most of its start-up. The first start on a
    machine (per PySpark and Java version) writes the archive when its JVM
    exits; later starts map it, which roughly halves the time to a running
    SparkContext. A missing, stale or damaged archive is ignored by the JVM.
    STREAMKIT_SPARK_CDS=0 turns this off.
    """
    if os.environ.get("STREAMKIT_SPARK_CDS", "1") == "0":
        return []
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "streamkit")
    key = hashlib.sha1(f"{pyspark} {java}".encode()).hexdigest()[:16]
    archive = cache / f"spark-classes-{key}.jsa"
    try:
        cache.mkdir(parents=True, exist_ok=True)
        for written in cache.glob(f"{archive.name}.*.tmp"):  # an earlier first start's,
            if time.time() - written.stat().st_mtime > 10:  # its JVM done writing it
                written.replace(archive)
    except OSError:
        return []
    if archive.exists():
        return [f"-XX:SharedArchiveFile={archive}", "-Xlog:cds=off", "-Xlog:cds+dynamic=off"]
    return [f"-XX:ArchiveClassesAtExit={archive}.{os.getpid()}.tmp", "-Xlog:cds=off",
            "-Xlog:cds+dynamic=off"]


def _quiet_log4j() -> str:
    """A log4j2 configuration logging Spark's errors only (written once per process), and
    not those of failed tasks (their executor's and task context's stacks): the command
    reports a task's failure itself, in one line naming the shard and the app's line."""
    path = Path(tempfile.gettempdir(), f"streamkit-backfill-log4j2-{os.getuid()}-v4.properties")
    if not path.exists():
        temp = path.with_suffix(f".{os.getpid()}")
        temp.write_text(_LOG4J2)
        temp.replace(path)
    return path.as_uri()


_LOG4J2 = """\
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = spark: %p %c{1}: %m%n
logger.tasks.name = org.apache.spark.scheduler.TaskSetManager
logger.tasks.level = off
logger.executor.name = org.apache.spark.executor.Executor
logger.executor.level = off
logger.taskcontext.name = org.apache.spark.TaskContextImpl
logger.taskcontext.level = off
logger.repl.name = org.apache.spark.repl.Main
logger.repl.level = error
"""


def stop_context(sc: SparkContext, *, exiting: bool = False) -> None:
    """Stop Spark. `exiting`: this process ends right after, so only Spark's side is
    stopped; PySpark's accumulator server (a daemon thread that takes up to a second
    to notice a shutdown) ends with the process, and so does the JVM."""
    jsc = getattr(sc, "_jsc", None)
    if exiting and jsc is not None:
        jsc.stop()
        return
    sc.stop()


def _zip_app(app_dir: Path) -> Path:
    """The app folder (without local data and caches) as a zip to ship to executors.

    Its name is unique, so backfills sharing a SparkContext never mix apps up.
    """
    out = Path(tempfile.mkdtemp(prefix="streamkit-backfill-")) / f"app-{uuid.uuid4().hex}.zip"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(app_dir.rglob("*")):
            relative = path.relative_to(app_dir)
            if relative.parts[0] == ".streamkit" or "__pycache__" in relative.parts:
                continue
            if path.is_file():
                archive.write(path, relative.as_posix())
    return out


def _executor_task(plan: BackfillPlan, shipped: str | None) -> Callable[[int], dict[str, Any]]:
    """The function Spark runs per shard index (pickled with the plan it closes over)."""

    def task(index: int) -> dict[str, Any]:
        from streamkit.backfill.task import run_shard_task

        # The shipped copy wins even where the driver's path exists too: a folder at that
        # path on a worker machine (the app deployed at the same place everywhere, a shared
        # mount) may hold another version of the app, which would backfill silently.
        app_dir = _unpacked(shipped) if shipped else plan.app_dir
        return run_shard_task(plan, index, app_dir)

    return task


def _unpacked(shipped: str) -> str:
    """Where the shipped app folder is unpacked on this executor (once, whole or not at all)."""
    from pyspark import SparkFiles

    target = Path(SparkFiles.getRootDirectory(), Path(shipped).stem)
    if not target.is_dir():
        temp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".unpacking-"))
        with zipfile.ZipFile(SparkFiles.get(shipped)) as archive:
            archive.extractall(temp)
        try:
            temp.rename(target)
        except OSError:  # another worker of this executor was first
            shutil.rmtree(temp, ignore_errors=True)
    return str(target)


def _task_counts(sc: SparkContext, group: str) -> tuple[int, int, int]:
    """The tasks of `group`'s jobs that are done, running and failed, as Spark tracks them."""
    tracker = sc.statusTracker()
    done = running = failed = 0
    for job_id in tracker.getJobIdsForGroup(group):
        job = tracker.getJobInfo(job_id)
        for stage_id in job.stageIds if job else []:
            stage = tracker.getStageInfo(stage_id)
            if stage is not None:
                done += stage.numCompletedTasks
                running += stage.numActiveTasks
                failed += stage.numFailedTasks
    return done, running, failed


def _report_progress(sc: SparkContext, group: str, shards: int, started: float,
                     progress: Callable[[SparkProgress], None], stop: threading.Event) -> None:
    last = None
    while not stop.wait(0.5):
        now = _task_counts(sc, group)
        if now != last:
            last = now
            progress(SparkProgress(shards, *now, time.monotonic() - started))


def _until_tasks_end(sc: SparkContext, group: str, patience: float = 10.0) -> None:
    """Wait (up to `patience` s) for a failed job's other tasks to end.

    Spark kills them when one fails, but their last status updates come
    later; stopping Spark under them makes its scheduler log an error (and a
    Java stack) of its own after the command's one-line report.
    """
    deadline = time.monotonic() + patience
    while _task_counts(sc, group)[1] and time.monotonic() < deadline:
        time.sleep(0.05)


def _backfill_error(error: BaseException) -> BackfillError | None:
    """Our error as raised in an executor, found in Spark's report of the failed job."""
    match = _ERROR_RE.search(str(error))
    if match:
        return BackfillError(match.group(1).strip())
    # A task that could not even be unpickled: the executors' Python lacks streamkit. On a
    # cluster that is the workers' `python3` unless PYSPARK_PYTHON names another; without
    # this, the user gets Spark's whole Java stack trace with the cause buried in it.
    missing = _MISSING_RE.search(str(error))
    if missing:
        return BackfillError(
            f"Spark's executors could not import {missing.group(1)!r} "
            "(ModuleNotFoundError): install streamkit (and the app's dependencies) for the "
            "Python they run, and name that Python with PYSPARK_PYTHON (default: python3 on "
            "the worker machines)"
        )
    return None


def run_on_spark(
    plan: BackfillPlan,
    *,
    master: str = "local[*]",
    sc: SparkContext | None = None,
    progress: Callable[[SparkProgress], None] | None = None,
    ship_app: bool | None = None,
    job_group: str | None = None,
) -> list[dict[str, Any]]:
    """Backfill every shard of `plan` on Spark; the shards' results (ShardResult dicts).

    With `sc` the job runs on that SparkContext (left running); otherwise one
    is started for `master` and stopped afterwards. The app folder is
    shipped to the executors (`ship_app`) unless the master is local. The
    job runs in Spark's `job_group` (default: one of its own), which
    `sc.cancelJobGroup` cancels from another thread.
    """
    own = sc is None
    group = job_group or f"{JOB_GROUP}-{uuid.uuid4().hex[:12]}"
    context = sc if sc is not None else spark_context(master)
    shipped = None
    zipped: Path | None = None
    if ship_app if ship_app is not None else not context.master.startswith("local"):
        zipped = _zip_app(Path(plan.app_dir))
        context.addFile(str(zipped))
        shipped = zipped.name
    stop = threading.Event()
    reporter = None
    started = time.monotonic()
    if progress is not None:
        reporter = threading.Thread(
            target=_report_progress,
            args=(context, group, len(plan.shards), started, progress, stop),
            daemon=True,
        )
        reporter.start()
    try:
        context.setJobGroup(group, f"backfill of {len(plan.shards)} shard(s)")
        order = largest_first(plan)
        indexes = context.parallelize(order, max(len(order), 1))
        ran = dict(zip(order, indexes.map(_executor_task(plan, shipped)).collect(), strict=True))
        results: list[dict[str, Any]] = [ran[i] for i in range(len(order))]
        if progress is not None:
            stop.set()
            if reporter is not None:
                reporter.join()
            progress(SparkProgress(len(plan.shards), len(results), 0, 0,
                                   time.monotonic() - started))
        return results
    except Exception as error:
        stop.set()
        _until_tasks_end(context, group)
        found = _backfill_error(error)
        if found is not None:
            raise found from None
        raise
    finally:
        stop.set()
        if reporter is not None:
            reporter.join()
        if zipped is not None:
            shutil.rmtree(zipped.parent, ignore_errors=True)
        if own:
            context.stop()
