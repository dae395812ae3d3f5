"""`streamkit run` supervising its bundled broker: a SIGKILLed broker is reported at once
and restarted on the same port and data, the shards (in `run` and in its `--workers`)
carry on exactly once, Ctrl-C stays prompt, and a broker that cannot start again makes
`run` give up with a one-line error.

Like tests/test_run_e2e.py, these run real processes and judge only what a user could
observe: run's output and exit code, the KeySpace, the members' APIs and the committed
output topic.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import time
from pathlib import Path

import pytest

from tests.brokerproc import free_port
from tests.e2e import (
    AppView,
    Feeder,
    Proc,
    copy_wordcount,
    eventually,
    expected_counts,
    totals_of_updates,
)
from tests.waiting import DEADLINE, LIVENESS


def _run_bundled(app: Path, port: int, log_path: Path, *extra: str,
                 own_group: bool = False) -> Proc:
    """`streamkit run` starting its own broker (no --broker) on `port`."""
    return Proc.streamkit(["run", str(app), "--port", str(port), "--no-status",
                           "--log-level", "INFO", *extra], log_path).start(own_group)


def _app_on_a_port(tmp_path: Path) -> tuple[Path, int, str]:
    """A copy of the wordcount app, a free port for its bundled broker, and its address."""
    app = copy_wordcount(tmp_path / "wordcount")
    port = free_port()
    return app, port, f"127.0.0.1:{port}"


async def _serving_then_fed(view: AppView, app: Path, address: str, log: Path, count: int,
                            batch: int) -> range:
    """Once the app serves, `count` lines published and acknowledged (their ids)."""
    await view.wait_serving(timeout=60)
    return _feed(app, address, log, count, batch)


def _feed(app: Path, address: str, log: Path, count: int, batch: int,
          start: int = 0) -> range:
    """`count` lines published and acknowledged (their ids)."""
    return Feeder(app, address, log, start=start, count=count, batch=batch,
                  interval=0).start().finish()


def _broker_pid(app: Path) -> int | None:
    try:
        return int((app / ".streamkit" / "broker.pid").read_text())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed but not yet reaped by run, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_broker(app: Path) -> int:
    pid = _broker_pid(app)
    assert pid is not None and _alive(pid), "run should name its live broker in broker.pid"
    os.kill(pid, signal.SIGKILL)
    return pid


def _worker_pid(run_pid: int, suffix: str) -> int | None:
    """The pid of `run`'s live worker process serving as `suffix`."""
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or int(
                    (proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) != run_pid:
                continue
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--suffix" in args and args[args.index(b"--suffix") + 1] == suffix.encode() \
                and _alive(int(proc.name)):
            return int(proc.name)
    return None


async def _check_exact(view: AppView, ids: range) -> None:
    """Counts are exact as queried, and the committed output holds each update once."""
    expected = expected_counts(ids)
    serving = await view.wait_caught_up(timeout=60)
    assert await view.query_counts(serving) == expected
    assert totals_of_updates(await view.output_updates()) == expected


def _death_lines(run: Proc) -> list[str]:
    return [line for line in run.text().splitlines()
            if line.startswith("streamkit: warning: the bundled broker")]


async def test_a_worker_killed_is_reported_and_restarted(tmp_path: Path) -> None:
    """SIGKILL a worker process of `run --workers 2`: run says so naming it and its log,
    starts it again, and it serves again; counts stay exact. It was left dead (a zombie)
    without a word, `run` going on with one process."""
    app, port, address = _app_on_a_port(tmp_path)
    run = _run_bundled(app, port, tmp_path / "run.log", "--workers", "2")
    try:
        async with AppView(app, address) as view:
            await view.wait_serving(timeout=60)
            ids = Feeder(app, address, tmp_path / "feed-1.log", count=200,
                         interval=0).start().finish()
            await _check_exact(view, ids)
            killed = await eventually(lambda: _worker_pid(run.proc.pid, "worker-1"), 10,
                                      "worker 1's process")
            os.kill(killed, signal.SIGKILL)
            await eventually(lambda: "worker 1 (pid" in run.text(), DEADLINE,
                             "run to report the worker's death")
            assert "was killed by SIGKILL; restarting it" in run.text(), run.log()
            assert "worker-1.log" in run.text()
            await eventually(lambda: "worker 1 is running again" in run.text(), 30,
                             "the worker to be restarted")
            again = _worker_pid(run.proc.pid, "worker-1")
            assert again is not None and again != killed

            async def both_serve() -> bool:
                state = await view.state()
                primaries = [state.primary_of(s) for s in view.config.shard_ids()]
                return None not in primaries and {p.suffix for p in primaries if p} == {
                    "worker-0", "worker-1"}

            await eventually(both_serve, 60, "the restarted worker to serve shards again")
            more = Feeder(app, address, tmp_path / "feed-2.log", start=ids.stop, count=200,
                          interval=0).start().finish()
            await _check_exact(view, range(0, more.stop))
            code = await asyncio.to_thread(run.signal, signal.SIGINT, LIVENESS)
            assert code == 0, run.log()
            assert not _alive(again), "run should stop the worker it restarted"
    finally:
        run.stop()


async def test_broker_sigkill_is_reported_restarted_and_counts_stay_exact(
        tmp_path: Path) -> None:
    """SIGKILL the bundled broker under `run --workers 2`: run says so naming the broker,
    the signal and its log, starts it again, both members keep serving, every line is
    counted once and no output update repeats; Ctrl-C then stops run, committing. (How
    soon it reports and stops is printed as a hint: timings are measured in bench/.)"""
    app, port, address = _app_on_a_port(tmp_path)
    run = _run_bundled(app, port, tmp_path / "run.log", "--workers", "2", "--lease-ttl", "3")
    try:
        async with AppView(app, address) as view:
            await view.wait_serving(timeout=60)
            # Both members hold leases of --lease-ttl (run had no such option).
            with sqlite3.connect(app / ".streamkit" / "keyspace.db") as db:
                ttls = [ttl for (ttl,) in db.execute("SELECT ttl FROM leases")]
            assert len(ttls) >= 2 and set(ttls) == {3.0}, ttls
            ids = Feeder(app, address, tmp_path / "feed-1.log", count=400,
                         interval=0).start().finish()
            await _check_exact(view, ids)

            killed = _kill_broker(app)
            killed_at = time.monotonic()
            lines = await eventually(lambda: _death_lines(run), DEADLINE,
                                     "run to report the broker's death", interval=0.02)
            print(f"reported after {time.monotonic() - killed_at:.2f}s: {lines[0]}")
            assert len(lines) == 1, lines
            assert f"(pid {killed})" in lines[0] and "SIGKILL" in lines[0], lines[0]
            assert ".streamkit/broker.log" in lines[0] and "restarting" in lines[0], lines[0]

            await eventually(lambda: "bundled broker is running again" in run.text(), 30,
                             "the broker to be restarted")
            restarted = _broker_pid(app)
            assert restarted is not None and restarted != killed and _alive(restarted)

            more = Feeder(app, address, tmp_path / "feed-2.log", start=ids.stop, count=400,
                          interval=0).start().finish()
            await _check_exact(view, range(0, more.stop))
            state = await view.state()
            serving = {state.primary_of(s).suffix for s in view.config.shard_ids()}
            assert serving == {"worker-0", "worker-1"}, serving
            assert run.alive, run.log()

            stopping = time.monotonic()
            # LIVENESS only bounds "it stops by itself"; how soon is no business of a test.
            code = await asyncio.to_thread(run.signal, signal.SIGINT, LIVENESS)
            stopped = time.monotonic() - stopping
            print(f"stopped in {stopped:.2f}s")
            assert code == 0, run.log()
            assert "committing the shards' last transactions" in run.text()
            assert "Traceback" not in run.text(), run.log()
            assert not _alive(restarted), "run should stop the broker it restarted"
            assert _broker_pid(app) is None, "a stopped broker's pid file should be gone"
    finally:
        run.stop()


async def test_a_broker_stopping_gracefully_fails_no_shard(tmp_path: Path) -> None:
    """SIGTERM the bundled broker (an operator's restart) right after a feed, its shards
    reading and committing: run starts it again and no shard fails. Calls open at its stop
    ended CANCELLED, which members took as final: busy shards stayed FAILED."""
    app, port, address = _app_on_a_port(tmp_path)
    run = _run_bundled(app, port, tmp_path / "run.log")
    try:
        async with AppView(app, address) as view:
            await view.wait_serving(timeout=60)
            fed = 0
            for restart in (1, 2):  # twice: a stop's calls do not always race it
                fed = _feed(app, address, tmp_path / f"feed-{restart}.log", 30000, 1000,
                            start=fed).stop
                pid = _broker_pid(app)
                assert pid is not None
                os.kill(pid, signal.SIGTERM)
                await eventually(lambda n=restart: run.text().count(
                    "bundled broker is running again") == n, 30, "the broker to be restarted")
            await _check_exact(view, range(fed))
            assert "failed at" not in run.text(), run.log()  # no transaction failed
    finally:
        run.stop()


async def test_interrupt_while_the_broker_is_down_is_prompt(tmp_path: Path) -> None:
    """Ctrl-C right after the broker died, with transactions in flight: run stops by itself
    (abandoning what it cannot commit, not waiting for the broker), and a new run counts
    every line once."""
    app, port, address = _app_on_a_port(tmp_path)
    run = _run_bundled(app, port, tmp_path / "run-1.log", "--workers", "2")
    try:
        async with AppView(app, address) as view:
            ids = await _serving_then_fed(view, app, address, tmp_path / "feed.log", 1500, 100)
            _kill_broker(app)
            await eventually(lambda: _death_lines(run), DEADLINE,
                             "run to report the broker's death", interval=0.02)
            stopping = time.monotonic()
            # LIVENESS only bounds "it stops by itself"; how soon is no business of a test.
            code = await asyncio.to_thread(run.signal, signal.SIGINT, LIVENESS)
            stopped = time.monotonic() - stopping
            print(f"stopped in {stopped:.2f}s")
            assert code == 0, run.log()
            assert "stopping: the bundled broker is down" in run.text(), run.log()
            assert "Traceback" not in run.text(), run.log()

            run = _run_bundled(app, port, tmp_path / "run-2.log", "--workers", "2")
            await _check_exact(view, ids)
    finally:
        run.stop()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP], ids=["ctrl-c", "hang-up"])
async def test_ctrl_c_at_a_terminal_stops_the_broker_last(tmp_path: Path,
                                                          sig: signal.Signals) -> None:
    """Ctrl-C at a terminal signals every process of the foreground group, not only `run`
    (and a terminal or SSH session that goes away sends its jobs' groups SIGHUP). The
    bundled broker and the workers must not stop by themselves under the shards' last
    commits: with a catch-up in flight, run exits 0 without the broker being restarted or a
    transaction abandoned, and a new run counts every line once."""
    if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
        pytest.skip("these tests run under nohup: run inherits ignoring hang-ups, as asked")
    app, port, address = _app_on_a_port(tmp_path)
    run = _run_bundled(app, port, tmp_path / "run-1.log", "--workers", "2", own_group=True)
    try:
        async with AppView(app, address) as view:
            ids = await _serving_then_fed(view, app, address, tmp_path / "feed.log", 3000, 200)
            code = await asyncio.to_thread(run.signal, sig, LIVENESS, group=True)
            assert code == 0, run.log()
            assert "committing the shards' last transactions" in run.text(), run.log()
            worker_log = (app / ".streamkit" / "worker-1.log").read_text()
            assert not _death_lines(run), "the broker stopped before run's shards"
            for text in (run.text(), worker_log):
                assert "abandoning" not in text, text[-3000:]
                assert "Traceback" not in text, text[-3000:]

            run = _run_bundled(app, port, tmp_path / "run-2.log", "--workers", "2")
            await _check_exact(view, ids)
    finally:
        run.stop()


async def test_a_broker_that_cannot_start_again_makes_run_give_up(tmp_path: Path) -> None:
    """The broker's data dir turned into a file, then the broker killed: each restart fails
    at once, and after the bounded retries run exits 1 with a one-line error naming the
    broker and why, without a traceback."""
    app = copy_wordcount(tmp_path / "wordcount")
    port = free_port()
    run = _run_bundled(app, port, tmp_path / "run.log")
    try:
        async with AppView(app, f"127.0.0.1:{port}") as view:
            await view.wait_serving(timeout=60)
        data = app / ".streamkit" / "broker"
        data.rename(data.with_name("broker-moved"))
        data.write_text("not a directory\n")
        _kill_broker(app)
        started = time.monotonic()
        assert run.proc is not None
        code = await asyncio.to_thread(run.proc.wait, 90)
        print(f"gave up after {time.monotonic() - started:.2f}s")
        output = run.text()
        assert code == 1, output
        assert "Traceback" not in output, output
        assert len(_death_lines(run)) == 5, _death_lines(run)
        errors = [line for line in output.splitlines() if line.startswith("streamkit: error:")]
        assert len(errors) == 1, errors
        error = errors[0]
        assert output.rstrip().endswith(error), output[-2000:]
        assert "the bundled broker" in error and "exited with code" in error, error
        assert "giving up" in error and "after 5 restarts" in error, error
        assert "is a file" in error and ".streamkit/broker.log" in error, error
    finally:
        run.stop()


async def test_one_run_and_one_broker_per_app(tmp_path: Path) -> None:
    """A second `run` of the same app folder is refused at once (its members would take
    the first one's names, and a second bundled broker on the app's data would lose
    acknowledged appends); a backfill not told the running app's port uses its broker
    instead of starting another on the same data; a broker started by hand on that data
    is refused. After all that, and a restart, every line is counted once."""
    app = copy_wordcount(tmp_path / "wordcount")
    port, other = free_port(), free_port()
    address = f"127.0.0.1:{port}"
    run = _run_bundled(app, port, tmp_path / "run-1.log", own_group=True)
    others: list[Proc] = []  # stopped at the end, whatever happened
    try:
        async with AppView(app, address) as view:
            first = await _serving_then_fed(view, app, address, tmp_path / "feed-1.log", 1000, 100)
            pid = _broker_pid(app)

            second = _run_bundled(app, other, tmp_path / "run-2.log")
            others.append(second)
            assert second.proc is not None
            assert await asyncio.to_thread(second.proc.wait, LIVENESS) == 2, second.log()
            assert "`streamkit run` already runs the app" in second.text(), second.log()
            assert "Traceback" not in second.text(), second.log()
            assert pid is not None and _broker_pid(app) == pid and _alive(pid)

            backfill = Proc.streamkit(["backfill", str(app), "--processes", "2", "--port",
                                       str(other)], tmp_path / "backfill.log").start()
            others.append(backfill)
            assert backfill.proc is not None
            assert await asyncio.to_thread(backfill.proc.wait, LIVENESS) == 0, backfill.log()
            assert f"using the app's bundled broker at {address}" in backfill.text()

            by_hand = Proc.streamkit(["broker", "serve", "--data-dir",
                                      str(app / ".streamkit" / "broker"), "--port", str(other)],
                                     tmp_path / "broker.log").start()
            others.append(by_hand)
            assert by_hand.proc is not None
            assert await asyncio.to_thread(by_hand.proc.wait, LIVENESS) == 1, by_hand.log()
            assert f"another broker (pid {pid}, {address})" in by_hand.text(), by_hand.log()

            more = Feeder(app, address, tmp_path / "feed-2.log", start=first.stop, count=1000,
                          batch=100, interval=0).start().finish()
            serving = await view.wait_caught_up(timeout=60)
            assert await view.query_counts(serving) == expected_counts(range(more.stop))
            code = await asyncio.to_thread(run.signal, signal.SIGINT, LIVENESS, group=True)
            assert code == 0, run.log()

            run = _run_bundled(app, port, tmp_path / "run-3.log")
            serving = await view.wait_caught_up(timeout=60)
            assert await view.query_counts(serving) == expected_counts(range(more.stop))
    finally:
        for proc in [*others, run]:
            proc.stop()


def _workers_of(app: Path) -> list[int]:
    """Pids of the `streamkit serve` workers of `app` (by their command lines)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and _alive(int(proc.name)):
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"serve" in argv and str(app).encode() in argv:
                found.append(int(proc.name))
    return found


async def test_workers_of_a_killed_run_go_at_once(tmp_path: Path) -> None:
    """SIGKILL `run --workers 2` mid catch-up: its bundled broker goes with it, and its worker
    stops (the parent-death signal) without waiting on that broker (it lingered ~40 s,
    flushing its recorders to nobody); a new run started at once waits for the old broker
    to let go of the data, and counts every line once."""
    app, port, address = _app_on_a_port(tmp_path)
    run = _run_bundled(app, port, tmp_path / "run-1.log", "--workers", "2")
    try:
        async with AppView(app, address) as view:
            ids = await _serving_then_fed(view, app, address, tmp_path / "feed.log", 1500, 100)
            workers = _workers_of(app)
            assert len(workers) == 1, workers
            run.kill()
            killed = time.monotonic()
            # Started at once, the new run finds the old broker still stopping (persisting
            # its spools, holding the data dir's lock): it waits for it, then starts.
            run = _run_bundled(app, port, tmp_path / "run-2.log", "--workers", "2")
            await eventually(lambda: not _alive(workers[0]), timeout=15,
                             what="the worker of the killed run to stop", interval=0.05)
            print(f"worker gone {time.monotonic() - killed:.2f}s after the kill")
            await _check_exact(view, ids)
    finally:
        run.stop()
