"""A long-lived Spark driver: one SparkContext kept up to run backfill after backfill.

    python -m streamkit.backfill.driver --socket PATH [--master M] [--conf K=V ...]

(`streamkit spark start` starts it in the background.) It starts Spark,
listens on the Unix socket PATH (see `driver_link`), and serves each
connection on a thread: a backfill runs as a Spark job of its own group
(several may run at once), reporting progress as it goes; a client that
goes away cancels its job. SIGTERM, SIGINT or a `stop` request cancel the
jobs, stop Spark and remove the socket; so does Spark dying under it.

Spark's Python workers live on between jobs: each task forgets the modules
of its app folder before loading the app (`loader.forget_app_modules`), so
an app edited between two backfills runs as it is now. Streamkit's own code
is the driver's: a command whose streamkit differs is refused (see
`driver_link.code_fingerprint`).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamkit.backfill.driver_link import (
    check_peer,
    code_fingerprint,
    find_driver,
    is_socket,
    other_code,
    private_folder,
    receive,
    send,
)
from streamkit.backfill.errors import BackfillError
from streamkit.backfill.spark import run_on_spark, spark_context
from streamkit.signal_safe import Waker

if TYPE_CHECKING:
    from pyspark import SparkContext

__all__ = ["Driver", "main"]

log = logging.getLogger("streamkit.spark.driver")
_HEALTH_EVERY = 5.0  # seconds between checks that Spark still runs
_CANCEL_AGAIN = 0.5  # seconds between cancels of a job that is to end and has not yet
_ANSWER_CANCELLED = 10.0  # seconds a stopping driver waits for cancelled jobs to answer
_STOPPED = "the Spark driver was stopped while the backfill ran"


@dataclass
class _Job:
    """A backfill running on the driver."""

    what: str  # for status: its shards and app
    cancel: threading.Event = field(default_factory=threading.Event)  # its command left
    finished: threading.Event = field(default_factory=threading.Event)  # (or a stop)


class Driver:
    """The SparkContext, the listening socket, and the jobs running on them."""

    def __init__(self, sc: SparkContext, listener: socket.socket, path: Path,
                 conf: dict[str, str]) -> None:
        self.sc = sc
        self.listener = listener
        self.path = path
        self.conf = conf
        self.fingerprint = code_fingerprint()
        self.started = time.time()
        self.stopping = threading.Event()
        self._jobs: dict[str, _Job] = {}  # by Spark job group
        self._done = 0
        self._lock = threading.Lock()
        self._numbers = itertools.count(1)

    def serve(self) -> None:
        """Accept connections until stopped; each is served on a thread of its own."""
        threading.Thread(target=self._watch_spark, name="spark-health", daemon=True).start()
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed by stop()
                break
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="driver-connection").start()

    def stop(self, why: str) -> None:
        """Cancel the jobs and stop accepting (once); `close` stops Spark."""
        if self.stopping.is_set():
            return
        log.warning("stopping: %s", why)
        self.stopping.set()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() of serve()
        self.listener.close()
        with self._lock:
            for job in self._jobs.values():
                job.cancel.set()

    def close(self) -> None:
        """Stop Spark, once the cancelled jobs told their commands why (or soon after)."""
        self.path.unlink(missing_ok=True)
        deadline = time.monotonic() + _ANSWER_CANCELLED
        while self._jobs and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            self.sc.stop()
        except Exception as error:  # Spark already gone
            log.warning("stopping Spark: %s", _first_lines(str(error), 1))

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                check_peer(conn)
                request = receive(conn)
            except EOFError:  # a client checking that the driver is up
                return
            except BackfillError as error:  # another user
                log.warning("%s", error)
                return
            except Exception as error:  # unreadable: answered
                send(conn, {"error": f"unreadable request ({type(error).__name__}: {error})"})
                return
            op = request.get("op") if isinstance(request, dict) else None
            try:
                if op == "status":
                    send(conn, {"ok": self.status()})
                elif op == "stop":
                    send(conn, {"ok": None})
                    self.stop("asked to")
                elif op == "backfill":
                    self._backfill(conn, request)
                else:
                    send(conn, {"error": f"unknown request {op!r}"})
            except OSError:  # the client went away; its job (if any) is cancelled
                pass
            except Exception as error:  # Spark's gateway gone (the JVM killed, say)
                with contextlib.suppress(OSError):
                    send(conn, {"error": f"the Spark driver failed: {type(error).__name__}: "
                                         f"{_first_lines(str(error), 1)}"})

    def status(self) -> dict[str, Any]:
        with self._lock:
            running = [job.what for job in self._jobs.values()]
            done = self._done
        return {"pid": os.getpid(), "master": self.sc.master, "conf": self.conf,
                "fingerprint": self.fingerprint,
                "up_s": round(time.time() - self.started, 1), "python": sys.executable,
                "running": running, "done": done, "spark": self.sc.version}

    def _backfill(self, conn: socket.socket, request: dict[str, Any]) -> None:
        if request.get("fingerprint") != self.fingerprint:
            send(conn, {"error": other_code(self.path)})
            return
        plan = request["plan"]
        group = f"streamkit-backfill-{os.getpid()}-{next(self._numbers)}"
        job = _Job(f"{len(plan.shards)} shard(s) of {plan.app_dir}")
        with self._lock:
            self._jobs[group] = job
            if self.stopping.is_set():  # accepted just before a stop
                job.cancel.set()
        sending = threading.Lock()

        def progress(update: Any) -> None:
            with sending, contextlib.suppress(OSError):  # gone: the watcher cancels the job
                send(conn, {"ok": ("progress", update)})

        threading.Thread(target=self._cancel_when_gone, args=(conn, group, job),
                         daemon=True, name="driver-client-watch").start()
        threading.Thread(target=self._cancel_when_asked, args=(group, job), daemon=True,
                         name="driver-job-cancel").start()
        log.warning("backfill %s: %s", group, job.what)
        try:
            results = run_on_spark(plan, sc=self.sc, progress=progress, job_group=group)
            answer: dict[str, Any] = {"ok": ("result", results)}
        except BackfillError as error:
            answer = {"error": str(error)}
        except Exception as error:  # Spark's own failure, or our stop's cancel
            answer = {"error": _STOPPED if self.stopping.is_set()
                      else "cancelled: its command went away" if job.cancel.is_set()
                      else _first_lines(f"Spark failed the backfill: {error}")}
        finally:
            job.finished.set()
            job.cancel.set()  # (wakes the canceller, which then ends)
        log.warning("backfill %s: %s", group, "done" if "ok" in answer else answer["error"])
        try:
            with sending:
                send(conn, answer)
        finally:  # answered: a stopping driver may now stop Spark
            with self._lock:
                del self._jobs[group]
                self._done += 1

    def _cancel_when_gone(self, conn: socket.socket, group: str, job: _Job) -> None:
        """Cancel the job if its client closes the connection before it ends."""
        with contextlib.suppress(OSError):
            conn.recv(1)  # the client sends nothing more: this returns when it goes
        if not job.finished.is_set():
            log.warning("backfill %s: its client went away; cancelling the job", group)
            job.cancel.set()

    def _cancel_when_asked(self, group: str, job: _Job) -> None:
        """Once the job is to be cancelled, cancel its Spark job group until it ends:
        asked before the job was submitted, a single cancel would find nothing to cancel."""
        job.cancel.wait()
        while not job.finished.is_set():
            self.sc.cancelJobGroup(group)
            job.finished.wait(_CANCEL_AGAIN)

    def _watch_spark(self) -> None:
        """Stop serving if Spark died (its JVM killed, out of memory): a driver without
        Spark would accept backfills only to fail them."""
        while not self.stopping.wait(_HEALTH_EVERY):
            try:
                stopped = self.sc._jsc.sc().isStopped()
            except Exception:  # the JVM's gateway is gone
                stopped = True
            if stopped:
                self.stop("Spark stopped")


def _first_lines(text: str, lines: int = 6) -> str:
    """A Java stack trace's head: what failed, without a hundred lines of frames."""
    kept = text.strip().splitlines()[:lines]
    return "\n".join(kept)


def _listen(path: Path) -> socket.socket:
    """A socket listening at `path`; BackfillError if a driver already listens there."""
    private_folder(path, create=True)
    if path.exists() and not is_socket(path):
        raise BackfillError(f"{path} exists and is not a socket: choose another path")
    if find_driver(path) is not None:
        raise BackfillError(f"a Spark driver already listens at {path}")
    path.unlink(missing_ok=True)  # a socket left by a driver that was killed
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(16)
    return listener


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True, type=Path)
    parser.add_argument("--master", default="local[*]")
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    conf = dict(item.split("=", 1) for item in args.conf)
    try:
        listener = _listen(args.socket)
    except (BackfillError, OSError) as error:
        log.error("%s", error)
        return 1
    # A stop asked while Spark starts takes effect once it has (a start cut short leaves
    # its JVM behind).
    asked: list[str] = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda n, _f: asked.append(signal.Signals(n).name))
    try:
        sc = spark_context(args.master, conf)
        if sc._jsc.sc().isStopped():  # e.g. a cluster's master never answered
            sc.stop()
            raise BackfillError(f"Spark ({args.master}) stopped as it started: see above")
    except BackfillError as error:
        listener.close()
        args.socket.unlink(missing_ok=True)
        log.error("%s", error)
        return 1
    driver = Driver(sc, listener, args.socket, conf)
    # The stop runs in a thread of its own: it takes locks (logging's, the jobs'), which a
    # signal handler must not, as it may interrupt their holder (signal_safe.py).
    wake = Waker()

    def stop_when_asked() -> None:
        while not asked:
            wake.wait()
        driver.stop(asked[0])

    threading.Thread(target=stop_when_asked, name="stop signal", daemon=True).start()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda n, _f: (asked.append(signal.Signals(n).name), wake.set()))
    wake.set()  # (asked while Spark started?)
    log.warning("Spark driver up (%s, Spark %s), listening at %s", sc.master, sc.version,
                args.socket)
    try:
        driver.serve()
    finally:
        driver.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
