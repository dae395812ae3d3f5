"""`streamkit spark start|status|stop`: a Spark driver kept up between backfills.

Starting Spark takes seconds, which a short backfill would spend mostly
waiting. `streamkit spark start` starts a driver process in the background
(see streamkit.backfill.driver) that keeps a SparkContext; while it runs,
`streamkit backfill --spark` (without --master or --spark-conf) hands its
job to it instead of starting Spark itself.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import click

from streamkit.cli.errors import DATA_ERROR, CliError, reporting_errors
from streamkit.cli.params import Seconds
from streamkit.process_lock import running

__all__ = ["spark"]

_START_TIMEOUT = 180.0  # seconds Spark may take to start (a first start writes its archive)


@click.group()
def spark() -> None:
    """A Spark driver kept up between backfills."""


@spark.command("start")
@click.option("--master", default="local[*]", show_default=True,
              help="Spark master: local[*], local[N], or a cluster's URL.")
@click.option("--spark-conf", multiple=True, metavar="KEY=VALUE",
              help="Spark configuration (repeatable).")
def start(master: str, spark_conf: tuple[str, ...]) -> None:
    """Start the driver in the background and wait until Spark is up."""
    from streamkit.backfill.driver_link import (
        driver_socket,
        find_driver,
        is_socket,
        private_folder,
    )

    with reporting_errors():
        for item in spark_conf:
            if "=" not in item or item.startswith("="):
                raise CliError(f"--spark-conf {item!r}: expected KEY=VALUE", DATA_ERROR)
        path = driver_socket()
        if find_driver(path) is not None:
            raise CliError(f"a Spark driver already runs at {path} (`streamkit spark status`)")
        private_folder(path, create=True)
        if path.exists() and not is_socket(path):
            raise CliError(f"{path} exists and is not a socket: set STREAMKIT_SPARK_DRIVER to "
                           "another path", DATA_ERROR)
        path.unlink(missing_ok=True)  # left by a driver that was killed (none answers there)
        log = path.with_suffix(".log")
        args = [sys.executable, "-m", "streamkit.backfill.driver", "--socket", str(path),
                "--master", master, *(f"--conf={item}" for item in spark_conf)]
        with log.open("ab") as out:
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                    start_new_session=True)  # outlives this command
        click.echo(f"starting Spark ({master})...", err=True)
        try:
            status = _wait_up(proc, path, log)
        except BaseException:  # failed, timed out or interrupted: no driver left behind
            proc.terminate()
            raise
        click.echo(f"Spark driver up (pid {status['pid']}, {status['master']}, Spark "
                   f"{status['spark']}) at {path}; log: {log}", err=True)
        click.echo("`streamkit backfill APP --spark` now runs its jobs there; "
                   "`streamkit spark stop` stops it", err=True)


def _wait_up(proc: subprocess.Popen[bytes], path: Path, log: Path) -> dict[str, object]:
    """The driver's status once it answers; CliError (with its log's tail) if it ends."""
    from streamkit.backfill.driver_link import DriverLink
    from streamkit.backfill.errors import BackfillError

    deadline = time.monotonic() + _START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise CliError(f"the Spark driver exited ({proc.returncode}) while starting:\n"
                           f"{_tail(log)}")
        if path.exists():
            try:
                remaining = max(deadline - time.monotonic(), 0.1)
                return DriverLink(path, remaining).status()  # answered once Spark is up
            except BackfillError:  # not listening yet
                pass
        time.sleep(0.1)
    raise CliError(f"Spark did not start within {_START_TIMEOUT:.0f}s; see {log}")


def _tail(log: Path, lines: int = 12) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {log})"


@spark.command("status")
def status() -> None:
    """Whether a driver runs, on which master, and its jobs (exit 1 if none runs)."""
    from streamkit.backfill.driver_link import driver_socket, find_driver

    with reporting_errors():
        path = driver_socket()
        link = find_driver(path)
        if link is None:
            raise CliError(f"no Spark driver runs at {path} (`streamkit spark start`)")
        info = link.status_once_up(lambda: click.echo(
            f"the Spark driver at {path} is starting Spark; waiting...", err=True))
        click.echo(f"Spark driver at {path}: pid {info['pid']}, master {info['master']}, "
                   f"Spark {info['spark']}, up {info['up_s']:.0f}s, {info['done']} backfill(s) "
                   f"done, {len(info['running'])} running")
        for job in info["running"]:
            click.echo(f"  running: {job}")


@spark.command("stop")
@click.option("--timeout", type=Seconds(min=1), default=60.0, show_default=True,
              help="Seconds to wait for the driver to end.")
def stop(timeout: float) -> None:
    """Stop the driver: its running backfills are cancelled, then Spark stops."""
    from streamkit.backfill.driver_link import driver_socket, find_driver

    with reporting_errors():
        path = driver_socket()
        link = find_driver(path)
        if link is None:
            click.echo(f"no Spark driver runs at {path}", err=True)
            return
        pid = int(link.status()["pid"])
        link.stop()
        deadline = time.monotonic() + timeout
        while running(pid):
            if time.monotonic() > deadline:
                raise CliError(f"the Spark driver (pid {pid}) did not end within {timeout:.0f}s")
            time.sleep(0.1)
        click.echo(f"stopped the Spark driver (pid {pid})", err=True)
