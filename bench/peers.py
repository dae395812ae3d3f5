"""Streamkit's wordcount beside Bytewax's, on the same file, in the same run.

    python bench/peers.py [--lines 1000000] [--rounds 2] [--workers 1,2]
                          [--streamkit-workers 1[,2]] [--json]
                          [--broker-arg ARG ...] [--run-env NAME=VALUE ...]
                          [--logs DIR] [--profile DIR]

The input is the peer benchmark's file: `gen_data.py LINES 10000` of
../shared/peers/bytewax-wordcount (lines of 3-7 words, 10,000-word vocabulary,
seed 42), cached as bench/wordcount_bench.py caches it.

Bytewax 0.21.1 is installed from PyPI into a virtual environment of its own
($TMPDIR/streamkit-peers/bytewax-venv, made on first use) and runs the peer's
`wc_flow:flow` (MODE=final: no broker, at-least-once) on the file, once per
`--workers` count (`-w N`); the best of them is Bytewax's figure of the round.
Its time runs from its command until its process exits, and its output is
checked (every word of the file counted).

Streamkit: one broker process gets the lines once, before any measurement,
as committed {"id": i, "line": ...} messages over 8 journals (not counted,
as the peer's file generation is not). Each round then starts
`streamkit run` of its own copy of examples/wordcount (named wordcount-rN, so
it starts from nothing: RocksDB stores, recovery logs, exactly-once through
the broker, 1 worker) and the clock runs from that command until every shard
has committed a transaction covering its whole input (the shards' /status,
polled every 0.1 s), as bench/wordcount_bench.py measures a catch-up.
`--streamkit-workers 1,2` runs it once per worker count (`run --workers N`,
each on an app copy of its own), and the round's ratio is that of the first
count; the CPU seconds then include the worker processes.

The two sides alternate within every round (Bytewax -w 1, streamkit,
Bytewax -w 2; the Bytewax order is reversed in odd rounds). Printed: each
run as it ends (with the CPU seconds of the measured process and the load
average, since this machine is shared), then per round the ratio
streamkit / best Bytewax, and overall best / best.

A streamkit run whose shard fails is reported as FAILED (with its log's
tail) and the rounds go on. `--broker-arg` passes an option to the broker
(e.g. `--broker-arg=--min-append-rate=0`, for a diagnosis: say so with the
numbers); `--run-env NAME=VALUE` is set for the `streamkit run` processes
only (an experiment, e.g. PYTHONPATH of a sitecustomize); `--logs DIR` keeps
their logs; `--profile DIR` attaches `py-spy record` to each of them for the
measured time (speedscope files in DIR; those runs carry py-spy's cost and
are marked).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.backfill_bench import copy_app, preload  # noqa: E402
from bench.common import machine  # noqa: E402
from bench.wordcount_bench import (  # noqa: E402
    PEER,
    lines_file,
    stop_run,
    wait_processed,
    wait_serving,
)
from streamkit.app.config import load_config  # noqa: E402
from streamkit.app.resolver import Resolver  # noqa: E402
from streamkit.keyspace import open_keyspace  # noqa: E402
from tests.brokerproc import BrokerProcess  # noqa: E402

BYTEWAX = "bytewax==0.21.1"
CACHE = Path(tempfile.gettempdir()) / "streamkit-peers"


# --- Bytewax ----------------------------------------------------------------------------


def bytewax_python(venv: Path) -> Path:
    """The Python of a virtual environment with Bytewax (created and installed if missing)."""
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import bytewax"],
                                          capture_output=True).returncode == 0:
        return python
    print(f"installing {BYTEWAX} into {venv} ...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", BYTEWAX], check=True)
    return python


def run_bytewax(python: Path, data: Path, workers: int, tmp: Path, words: int
                ) -> dict[str, Any]:
    """One Bytewax wordcount of `data`, timed from its command until its process exits."""
    out = tmp / f"bytewax-counts-{workers}.txt"
    env = {**os.environ, "WC_INPUT": str(data), "WC_OUTPUT": str(out), "MODE": "final",
           "PYTHONPATH": str(PEER)}
    command = [str(python), "-m", "bytewax.run", "wc_flow:flow", "-w", str(workers)]
    before = os.getloadavg()[0]
    cpu = _children_cpu()
    started = time.monotonic()
    proc = subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True)
    elapsed = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"bytewax failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    counted = sum(int(line.rpartition("\t")[2]) for line in out.read_text().splitlines())
    if counted != words:
        raise RuntimeError(f"bytewax counted {counted} words, the file has {words}")
    return {"side": "bytewax", "workers": workers, "s": round(elapsed, 2),
            "cpu_s": round(_children_cpu() - cpu, 2), "load": [before, os.getloadavg()[0]]}


def _children_cpu() -> float:
    usage = os.times()
    return usage.children_user + usage.children_system


# --- streamkit --------------------------------------------------------------------------


def _process_cpu(pid: int, children: bool = False) -> float:
    """CPU seconds (user + system) a live process has used so far (and its live children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    if children:
        for child in Path(f"/proc/{pid}/task").glob("*/children"):
            for kid in child.read_text().split():
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                    cpu += _process_cpu(int(kid), children=True)
    return cpu


async def run_streamkit(app: Path, broker: BrokerProcess, wanted: dict[str, int], tmp: Path,
                        args: argparse.Namespace, round_: int, workers: int = 1
                        ) -> dict[str, Any]:
    """`streamkit run APP --workers N`, timed from its command until the input is committed."""
    config = load_config(app)
    env = {**os.environ, **dict(item.split("=", 1) for item in args.run_env)}
    command = [sys.executable, "-m", "streamkit.cli.main", "run", str(app), "--broker",
               broker.address, "--no-status", "--workers", str(workers)]
    assert broker.proc is not None
    broker_cpu = _process_cpu(broker.proc.pid)
    async with open_keyspace(str(config.data_dir / "keyspace.db")) as keyspace:
        resolver = Resolver(config, keyspace)
        before = os.getloadavg()[0]
        log_path = (args.logs or tmp) / f"run-{round_}-w{workers}.log"
        with open(log_path, "ab") as log:
            started = time.monotonic()
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        spy = _py_spy(proc.pid, args.profile, round_) if args.profile else None
        try:
            serving = asyncio.create_task(wait_serving(resolver, config.shards))
            first, done = await _until_processed(resolver, wanted, proc)
            serving_at = serving.result() if serving.done() else done
            serving.cancel()
            cpu = _process_cpu(proc.pid, children=True)
        except (RuntimeError, TimeoutError) as error:  # a shard failed: say so, go on
            print(log_path.read_text()[-3000:], file=sys.stderr)
            return {"side": "streamkit", "workers": workers, "failed": str(error),
                    "s": round(time.monotonic() - started, 2)}
        finally:
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its file and ends
                spy.wait(60)
            stop_run(proc)
    result = {"side": "streamkit", "workers": workers, "s": round(done - started, 2),
              "serving_s": round(serving_at - started, 2),
              "lines_per_s_serving": round(args.lines / max(done - serving_at, 1e-3)),
              "first_commit_s": round(first - started, 2), "cpu_s": round(cpu, 2),
              "broker_cpu_s": round(_process_cpu(broker.proc.pid) - broker_cpu, 2),
              "load": [before, os.getloadavg()[0]]}
    if spy is not None:
        result["profiled"] = True
    return result


async def _until_processed(resolver: Resolver, wanted: dict[str, int],
                           proc: subprocess.Popen) -> tuple[float, float]:
    """wait_processed, unless `streamkit run` ends first (then a RuntimeError)."""
    waiting = asyncio.ensure_future(wait_processed(resolver, wanted))
    while not waiting.done():
        await asyncio.wait((waiting,), timeout=0.5)
        if proc.poll() is not None and not waiting.done():
            waiting.cancel()
            raise RuntimeError(f"streamkit run exited ({proc.returncode}) before the end")
    return waiting.result()


def _py_spy(pid: int, folder: Path, round_: int) -> subprocess.Popen:
    folder.mkdir(parents=True, exist_ok=True)
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return subprocess.Popen([py_spy, "record", "--pid", str(pid), "--format", "speedscope",
                             "--rate", "100", "--nonblocking",
                             "-o", str(folder / f"streamkit-r{round_}.json")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# --- the rounds -------------------------------------------------------------------------


def schedule(round_: int, workers: list[int], ours: list[int]) -> list[tuple[str, int]]:
    """A round's runs in order: (side, worker count); each side's order flips every round."""
    order = list(workers) if round_ % 2 == 0 else list(reversed(workers))
    mine = [("streamkit", w) for w in (ours if round_ % 2 == 0 else reversed(ours))]
    theirs = [("bytewax", w) for w in order]
    if len(theirs) == 1:
        return [*theirs, *mine] if round_ % 2 == 0 else [*mine, *theirs]
    return [theirs[0], *mine, *theirs[1:]]


def show(run: dict[str, Any]) -> None:
    name = f"{run['side']} -w {run['workers']}"
    if "failed" in run:
        print(f"  round {run['round']} {name:<14} FAILED after {run['s']} s: {run['failed']}",
              file=sys.stderr, flush=True)
        return
    extra = (f", serving at {run['serving_s']} s ({run['lines_per_s_serving']:,} lines/s "
             f"since), first commit {run['first_commit_s']} s, broker CPU "
             f"{run['broker_cpu_s']} s") if run["side"] == "streamkit" else ""
    mark = " (py-spy attached)" if run.get("profiled") else ""
    print(f"  round {run['round']} {name:<14} {run['s']:7.2f} s {run['lines_per_s']:>9,} lines/s"
          f"  CPU {run['cpu_s']} s{extra}, load {run['load'][0]:.2f}->{run['load'][1]:.2f}"
          f"{mark}", file=sys.stderr, flush=True)


async def bench(broker: BrokerProcess, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    data = lines_file(args.lines)
    text = data.read_text()
    words = len(text.split())
    python = bytewax_python(args.bytewax_venv)
    apps = {(r, w): copy_app(tmp, f"wordcount-r{r}w{w}", f"wordcount-r{r}w{w}")
            for r in range(args.rounds) for w in args.streamkit_workers}
    t = time.monotonic()
    wanted = await preload(broker, list(apps.values()), text.splitlines())
    del text
    print(f"preloaded {args.lines:,} lines in {time.monotonic() - t:.1f} s", file=sys.stderr)
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for side, workers in schedule(round_, args.workers, args.streamkit_workers):
            if side == "streamkit":
                run = await run_streamkit(apps[round_, workers], broker, wanted, tmp, args,
                                          round_, workers)
            else:
                run = await asyncio.to_thread(run_bytewax, python, data, workers, tmp, words)
            run["round"] = round_
            run["lines_per_s"] = 0 if "failed" in run else round(args.lines / run["s"])
            runs.append(run)
            show(run)
    rounds = []
    for round_ in range(args.rounds):
        ours = next(r for r in runs if r["round"] == round_ and r["side"] == "streamkit"
                    and r["workers"] == args.streamkit_workers[0])
        scaling = {f"w{r['workers']}": r["lines_per_s"] for r in sorted(
            (r for r in runs if r["round"] == round_ and r["side"] == "streamkit"),
            key=lambda r: args.streamkit_workers.index(r["workers"]))}
        best = max((r for r in runs if r["round"] == round_ and r["side"] == "bytewax"),
                   key=lambda r: r["lines_per_s"])
        rounds.append({"round": round_, "streamkit": ours["lines_per_s"],
                       "bytewax_best": best["lines_per_s"], "bytewax_best_w": best["workers"],
                       "ratio": round(ours["lines_per_s"] / best["lines_per_s"], 2),
                       "streamkit_by_workers": scaling})
    best_ours = max(r["streamkit"] for r in rounds)  # 0 if every streamkit run failed
    best_theirs = max(r["bytewax_best"] for r in rounds)
    return {"lines": args.lines, "rounds": rounds, "runs": runs,
            "streamkit_best": best_ours, "bytewax_best": best_theirs,
            "ratio_best": round(best_ours / best_theirs, 2), "machine": machine()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", default="1,2",
                        help="Bytewax worker counts (-w) to run each round; the best counts")
    parser.add_argument("--streamkit-workers", default="1",
                        help="`streamkit run --workers` counts to run each round (the first "
                             "one's ratio is printed)")
    parser.add_argument("--bytewax-venv", type=Path, default=CACHE / "bytewax-venv")
    parser.add_argument("--broker-arg", action="append", default=[], metavar="ARG",
                        help="an option of `streamkit broker serve` (repeatable)")
    parser.add_argument("--run-env", action="append", default=[], metavar="NAME=VALUE",
                        help="environment of the `streamkit run` processes only")
    parser.add_argument("--logs", type=Path, default=None, metavar="DIR",
                        help="keep the `streamkit run` logs in DIR")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="py-spy speedscope profiles of the streamkit runs, into DIR")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.workers = [int(w) for w in args.workers.split(",")]
    args.streamkit_workers = [int(w) for w in args.streamkit_workers.split(",")]
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="streamkit-peers-") as tmp:
        broker = BrokerProcess(Path(tmp) / "broker", extra_args=args.broker_arg).start()
        try:
            results = asyncio.run(bench(broker, Path(tmp), args))
        finally:
            broker.kill()
    results["broker_args"] = args.broker_arg
    if args.json:
        print(json.dumps(results))
        return
    for r in results["rounds"]:
        ours = f"{r['streamkit']:,} lines/s" if r["streamkit"] else "FAILED"
        print(f"round {r['round']}: streamkit {ours}, Bytewax best "
              f"{r['bytewax_best']:,} lines/s (-w {r['bytewax_best_w']}): "
              f"streamkit/Bytewax = {r['ratio']}")
        by_workers = r["streamkit_by_workers"]
        if len(by_workers) > 1 and all(by_workers.values()):
            first, *others = by_workers.items()
            print("  streamkit " + ", ".join(f"{name}/{first[0]} = {n / first[1]:.2f}"
                                             for name, n in others))
    print(f"best of each: streamkit {results['streamkit_best']:,} lines/s, Bytewax "
          f"{results['bytewax_best']:,} lines/s: streamkit/Bytewax = {results['ratio_best']}"
          f"  ({results['lines']:,} lines, {results['machine']}"
          f"{', broker ' + ' '.join(args.broker_arg) if args.broker_arg else ''})")


if __name__ == "__main__":
    main()
