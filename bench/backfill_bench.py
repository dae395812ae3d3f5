"""Backfill on Spark versus live catch-up, over the same wordcount history.

    python bench/backfill_bench.py [--lines 2000000] [--master local[2]] [--spooled]
                                   [--skip-live] [--json]

A fresh broker process gets examples/wordcount's journals and `--lines` lines
of the peer benchmark's data (as bench/wordcount_bench.py loads them:
committed {"id": i, "line": ...} messages, partitioned by id over 8 journals).
The broker is then restarted, which persists its spools: the history is in
SNAPPY fragment files, as a history older than the fragments' flush interval
is (with `--spooled` the restart is skipped and executors read the history
through the broker instead).

Measured, each from a cold start of its process:

* backfill: `streamkit backfill APP --spark --master local[2]`, as a
  subprocess, Spark's start-up included, until every shard is handed over;
  once with Spark's classes loaded from its jars, once mapped from the class
  archive the first Spark start on a machine writes (made beforehand if
  missing; see streamkit.backfill.spark);
* the same tasks without Spark: `streamkit backfill APP --processes N` (N: the
  machine's cores), until every shard is handed over;
* the backfill handed to a Spark driver already up (`streamkit spark start
  --master MASTER` beforehand, not timed): its first job, then a second one;
* live catch-up: `streamkit run APP2` (a copy of the app under another name,
  so it starts from nothing) until every shard has processed every line, as
  bench/wordcount_bench.py measures it.

Both rates are lines/s over the whole wall time; the ratio is backfill/live.
Per core: a shard task's lines/s (its messages over its time, as the
command reports them) against live lines per CPU-second of the member
process, and of the member and the broker together. The load averages
before and after tell whether the machine was quiet.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import report, with_broker  # noqa: E402
from bench.wordcount_bench import (  # noqa: E402
    TOPIC,
    heads,
    lines_file,
    publish_lines,
    start_run,
    stop_run,
    wait_processed,
)
from streamkit.app.config import load_config  # noqa: E402
from streamkit.app.member import deploy  # noqa: E402
from streamkit.app.resolver import Resolver  # noqa: E402
from streamkit.client import BrokerClient  # noqa: E402
from streamkit.keyspace import open_keyspace  # noqa: E402
from tests.brokerproc import BrokerProcess  # noqa: E402


def copy_app(tmp: Path, folder: str, name: str) -> Path:
    app = tmp / folder
    shutil.copytree(ROOT / "examples" / "wordcount", app,
                    ignore=shutil.ignore_patterns(".streamkit", "__pycache__"))
    config = app / "streamkit.yaml"
    config.write_text(config.read_text().replace("name: wordcount", f"name: {name}"))
    (app / ".streamkit").mkdir()
    return app


async def preload(broker: BrokerProcess, apps: list[Path], lines: list[str]) -> dict[str, int]:
    async with BrokerClient(broker.address) as client:
        for app in apps:
            config = load_config(app)
            async with open_keyspace(str(config.data_dir / "keyspace.db")) as keyspace:
                await deploy(config, client, keyspace)
        config = load_config(apps[0])
        await publish_lines(client, config, lines, 0)
        return await heads(client, config)


def ensure_class_archive(master: str) -> None:
    """Start Spark once if this machine has no class archive yet (see streamkit.backfill.spark),
    and wait until its JVM wrote it: the first backfill on a machine pays for that once."""
    if not master.startswith("local") or not any(
            "ArchiveClassesAtExit" in option for option in _archive_options()):
        return
    subprocess.run([sys.executable, "-c", "from streamkit.backfill.spark import spark_context, "
                    "stop_context; sc = spark_context('local[2]'); "
                    "sc.parallelize(range(2), 2).map(str).collect(); "
                    "stop_context(sc, exiting=True)"], capture_output=True, check=True)
    deadline = time.monotonic() + 120
    while any("ArchiveClassesAtExit" in option for option in _archive_options()):
        if time.monotonic() > deadline:
            raise RuntimeError("Spark's class archive was not written")
        time.sleep(1)


def _archive_options() -> list[str]:
    import pyspark

    from streamkit.backfill.spark import _class_archive, check_java

    return _class_archive(f"{pyspark.__version__} {pyspark.__file__}", check_java())


def run_backfill(app: Path, broker: BrokerProcess, engine: list[str], cds: bool,
                 driver: Path) -> tuple[float, str]:
    command = [sys.executable, "-m", "streamkit.cli.main", "backfill", str(app), *engine,
               "--broker", broker.address, "--fragment-root", str(broker.data_dir / "fragments")]
    env = {**os.environ, "STREAMKIT_SPARK_CDS": "1" if cds else "0",
           "STREAMKIT_SPARK_DRIVER": str(driver)}
    # Output goes to a file, not a pipe: the command is done when its process exits
    # (Spark's JVM, which shares the output, may take a moment longer to go).
    with tempfile.TemporaryFile("w+") as out:
        started = time.monotonic()
        proc = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        elapsed = time.monotonic() - started
        time.sleep(1)  # (and then nothing of it competes with the next measurement)
        out.seek(0)
        output = out.read()
    if proc.returncode != 0:
        raise RuntimeError(f"backfill failed ({proc.returncode}):\n{output[-3000:]}")
    return elapsed, output


def spark_driver(action: str, socket: Path, *args: str) -> None:
    """`streamkit spark ACTION` for the driver listening at `socket`."""
    subprocess.run([sys.executable, "-m", "streamkit.cli.main", "spark", action, *args],
                   env={**os.environ, "STREAMKIT_SPARK_DRIVER": str(socket)}, check=True)


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a running process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def live_catch_up(app: Path, broker: BrokerProcess, tmp: Path, wanted: dict[str, int]
                        ) -> tuple[float, float, float]:
    """(wall seconds, member CPU seconds, broker CPU seconds) of a live catch-up."""
    config = load_config(app)
    assert broker.proc is not None
    async with open_keyspace(str(config.data_dir / "keyspace.db")) as keyspace:
        resolver = Resolver(config, keyspace)
        broker_cpu = cpu_seconds(broker.proc.pid)
        started = time.monotonic()
        proc = start_run(app, broker, 1, tmp / "run.log")
        try:
            _, done = await wait_processed(resolver, wanted)
            member_cpu = cpu_seconds(proc.pid)
            broker_cpu = cpu_seconds(broker.proc.pid) - broker_cpu
        finally:
            stop_run(proc)
    return done - started, member_cpu, broker_cpu


def task_rate(output: str) -> int:
    """A shard task's lines/s: the shards' messages over the sum of their times."""
    rows = re.findall(r"^shard-\d+\s+(\d+)\s+.*\s([\d.]+)s$", output, re.MULTILINE)
    seconds = sum(float(t) for _, t in rows)
    return round(sum(int(m) for m, _ in rows) / seconds) if seconds else 0


async def bench(broker: BrokerProcess, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    backfilled = copy_app(tmp, "wordcount", "wordcount")
    live = copy_app(tmp, "wordcount-live", "wordcount-live")
    lines = lines_file(args.lines).read_text().splitlines()[: args.lines]
    load_before = os.getloadavg()[0]
    results: dict[str, Any] = {"lines": args.lines, "master": args.master,
                               "history": "spooled" if args.spooled else "fragment files"}
    t = time.monotonic()
    wanted = await preload(broker, [backfilled, live], lines)
    results["preload_s"] = round(time.monotonic() - t, 2)
    if not args.spooled:
        broker.terminate(60)  # a graceful stop persists the spools
        broker.start()
    await asyncio.to_thread(ensure_class_archive, args.master)
    spark = ["--spark", "--master", args.master]
    local = ["--processes", str(os.cpu_count() or 2)]
    driver = tmp / "driver" / "spark.sock"
    for name, engine, cds in (("backfill_without_class_archive", spark, False),
                              ("backfill", spark, True), ("backfill_local_processes", local, True),
                              ("backfill_driver_first_job", ["--spark"], True),
                              ("backfill_driver", ["--spark"], True)):
        if name == "backfill_driver_first_job":
            await asyncio.to_thread(spark_driver, "start", driver, "--master", args.master)
        elapsed, output = await asyncio.to_thread(run_backfill, backfilled, broker, engine, cds,
                                                  driver)
        print(output, file=sys.stderr)
        run: dict[str, Any] = {"s": round(elapsed, 2), "lines_per_s": round(args.lines / elapsed),
                               "task_lines_per_s": task_rate(output)}
        timing = re.search(r"took ([\d.]+)s \(Spark start ([\d.]+)s, shards ([\d.]+)s", output)
        if timing:
            run.update(in_command_s=float(timing.group(1)), spark_start_s=float(timing.group(2)),
                       job_s=float(timing.group(3)))
        handed = {m.group(1): int(m.group(2)) for m in re.finditer(
            r"(wordcount/lines/part-\d+)@(\d+)", output)}
        if handed != wanted:
            raise RuntimeError(f"the backfill read through {handed}, expected {wanted}")
        results[name] = run
    await asyncio.to_thread(spark_driver, "stop", driver)
    results["backfill_s"] = results["backfill"]["s"]
    results["backfill_lines_per_s"] = results["backfill"]["lines_per_s"]
    if not args.skip_live:
        elapsed, member_cpu, broker_cpu = await live_catch_up(live, broker, tmp, wanted)
        results["live_catch_up_s"] = round(elapsed, 2)
        results["live_lines_per_s"] = round(args.lines / elapsed)
        results["live_cpu_s"] = {"member": round(member_cpu, 2), "broker": round(broker_cpu, 2)}
        results["speedup"] = round(results["backfill_lines_per_s"]
                                   / results["live_lines_per_s"], 2)
        results["speedup_driver"] = round(
            results["backfill_driver"]["lines_per_s"] / results["live_lines_per_s"], 2)
        results["speedup_local_processes"] = round(
            results["backfill_local_processes"]["lines_per_s"] / results["live_lines_per_s"], 2)
        task = results["backfill"]["task_lines_per_s"]
        results["task_vs_live_per_core"] = {
            "member_cpu": round(task / (args.lines / member_cpu), 2),
            "member_and_broker_cpu": round(task / (args.lines / (member_cpu + broker_cpu)), 2)}
    results["load_avg"] = {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=2_000_000)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--spooled", action="store_true",
                        help="leave the history in the broker's spools (read through it)")
    parser.add_argument("--skip-live", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    assert TOPIC == "wordcount/lines"
    results = with_broker(lambda broker, tmp: bench(broker, tmp, args))
    report(results, args.json)


if __name__ == "__main__":
    main()
