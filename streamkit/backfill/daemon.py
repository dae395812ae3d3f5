"""The Python daemon of a local backfill: PySpark's own, started with less waiting.

Spark starts one daemon process per executor and forks a Python worker from
it for each task slot. With PySpark installed by pip, three things slow down
those first forks:

* Spark puts its bundled `pyspark.zip` first on the workers' path, and that
  archive holds sources only: every start compiles PySpark again. The very
  same PySpark is installed, byte-compiled, in site-packages.
* Each worker then imports streamkit, the stores and the clients by itself.
* Spark starts the daemon only when the first job's first task needs a
  worker, long after the driver started Spark: its imports (a third of a
  second) hold up every task of the job.

This daemon moves Spark's archives behind the installed packages and
imports what a backfill task uses before forking, so workers start with it
loaded; then it runs PySpark's daemon as is. `spark.py` names it as
`spark.python.daemon.module` for local masters only (where the executors'
Python is this one, and the installed PySpark is the one Spark runs).

Moreover, `spark.py` starts a preloaded daemon (`--preloaded ADDRESS`) while
Spark's JVM starts, which keeps only one of this machine's cores busy. When
Spark then starts the daemon, that process hands its standard streams,
environment, arguments and folder to the preloaded one over the Unix socket
ADDRESS (`STREAMKIT_BACKFILL_DAEMON` in the environment) and waits for it to
end: the preloaded process is the daemon Spark talks to. Without an answer
there, the daemon imports everything itself, as before.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import signal
import socket
import sys
from collections.abc import Callable

ADDRESS_ENV = "STREAMKIT_BACKFILL_DAEMON"
_WAIT_FOR_SPARK = 600.0  # seconds a preloaded daemon waits to be taken over, at most
_WAIT_FOR_IMPORTS = 30.0  # seconds Spark's daemon waits for the preloaded one to answer
_STREAMS = (0, 1, 2)
# The stores a task builds by kind (SQL's is left out: SQLAlchemy is a tenth of a second and
# tens of MB, for the apps that use it only).
_STORES = ("streamkit.stores.rocksdb", "streamkit.stores.sqlite", "streamkit.stores.json_file")


def _bundled(path: str) -> bool:
    """Spark's own archives of PySpark and Py4J, which it puts on the workers' path."""
    return path.endswith((".zip", ".egg")) and ("pyspark" in path or "py4j" in path)


def _installed_first(path: list[str]) -> list[str]:
    """`path` with Spark's archives last: the installed, byte-compiled PySpark wins."""
    return [p for p in path if not _bundled(p)] + [p for p in path if _bundled(p)]


def _preload() -> Callable[[], None]:
    """Import what every worker needs; PySpark's daemon loop."""
    from pyspark.daemon import manager

    import streamkit.backfill.task  # noqa: F401  (preloaded for every forked worker)

    for module in _STORES:
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    return manager


def _hand_over(address: str) -> bool:
    """Make the preloaded daemon at `address` this daemon; False if none answers.

    It gets this process's standard streams (Spark's pipes), environment
    (the worker factory's secret and settings), arguments and folder. This
    process then stays until it ends, as the process Spark watches and
    stops (SIGTERM is passed on).
    """
    state = pickle.dumps((dict(os.environ), sys.argv, os.getcwd(), sys.path))
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(_WAIT_FOR_IMPORTS)
            conn.connect(address)
            socket.send_fds(conn, [state], list(_STREAMS))
            pid = int(conn.recv(32))
            signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGTERM))
            conn.settimeout(None)
            while conn.recv(32):  # until the preloaded daemon's end closes it
                pass
    except (OSError, ValueError):
        return False
    return True


def _adopt(conn: socket.socket) -> bool:
    """Take over the state of the daemon Spark started (see `_hand_over`); False if it left."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, len(_STREAMS))
    try:
        if len(fds) != len(_STREAMS):
            return False
        conn.sendall(str(os.getpid()).encode())  # fails if it gave up waiting and went on
    except OSError:
        for fd in fds:
            os.close(fd)
        return False
    environ, argv, cwd, path = pickle.loads(data)
    for fd, stream in zip(fds, _STREAMS, strict=True):
        os.dup2(fd, stream)
        os.close(fd)
    os.environ.clear()
    os.environ.update(environ)
    sys.argv[:] = argv
    sys.path[:] = _installed_first(path)
    os.chdir(cwd)
    os.register_at_fork(after_in_child=conn.close)  # its end tells when this daemon ends
    return True


def _accept(listener: socket.socket) -> socket.socket | None:
    """The connection of the daemon Spark starts; None once the driver is gone."""
    driver = os.getppid()
    listener.settimeout(1.0)
    for _ in range(int(_WAIT_FOR_SPARK)):
        try:
            conn = listener.accept()[0]
        except TimeoutError:
            if os.getppid() != driver:
                return None
            continue
        conn.settimeout(None)
        return conn
    return None


def preloaded(address: str) -> None:
    """A daemon that imports first and waits at `address` for Spark's to hand over.

    It listens before importing: a daemon Spark starts meanwhile waits in
    the queue (`_hand_over`) rather than finding nobody.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(address)
        try:
            listener.listen(1)
            manager = _preload()
            conn = _accept(listener)
        finally:
            os.unlink(address)
            os.rmdir(os.path.dirname(address))  # its private folder (see spark.py)
    if conn is not None and _adopt(conn):
        manager()


def main(argv: list[str] | None = None) -> None:
    sys.path[:] = _installed_first(sys.path)
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--preloaded"]:
        preloaded(args[1])
        return
    address = os.environ.get(ADDRESS_ENV)
    if address and _hand_over(address):
        return
    _preload()()


if __name__ == "__main__":
    main()
