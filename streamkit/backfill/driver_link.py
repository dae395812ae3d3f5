"""Talking to a long-lived Spark driver (`streamkit spark start`), without PySpark.

A SparkContext takes seconds to start (a JVM, Spark's classes, the first
job's Python workers): more than a short backfill's whole work. A driver
process that keeps one running takes backfill jobs instead, over a Unix
socket in a folder only this user can enter; `streamkit backfill --spark`
hands it the plan and gets the progress and the shards' results back.

The wire is a frame per message: 4 bytes of length, then a pickle. Pickles
are trusted because only this user can reach the socket (its folder is
checked to be this user's, not a symbolic link, and closed to everyone
else), and because both ends check that the other runs as this user (the
socket's peer credentials) on every connection.

A driver runs the streamkit it was started with, in its Python: a command
from another environment, or after packages were installed or upgraded or
streamkit's files changed, gets an error asking for a restart of the
driver, never a backfill by other code.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pickle
import socket
import stat
import struct
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from streamkit.backfill.errors import BackfillError

__all__ = ["DriverLink", "code_fingerprint", "driver_socket", "find_driver", "other_code"]

SOCKET_ENV = "STREAMKIT_SPARK_DRIVER"
_HEADER = struct.Struct(">I")
_MAX_FRAME = 1 << 30
_PROMPT = 2.0  # seconds a driver that is up takes to answer a status, at most


def driver_socket() -> Path:
    """Where this user's driver listens: $STREAMKIT_SPARK_DRIVER, else a socket in
    $XDG_RUNTIME_DIR/streamkit or /tmp/streamkit-UID."""
    named = os.environ.get(SOCKET_ENV)
    if named:
        return Path(named)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    folder = Path(runtime, "streamkit") if runtime else Path(
        tempfile.gettempdir(), f"streamkit-{os.getuid()}")
    return folder / "spark-driver.sock"


def private_folder(path: Path, *, create: bool) -> None:
    """Check (or make) the socket's folder: this user's, closed to others.

    Anyone who can reach the socket can have the driver run code, so a folder
    someone else made, or one others may enter, is refused.
    """
    folder = path.parent
    if create:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.lstat()  # a symbolic link's target could be swapped after the check
    if (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid()
            or stat.S_IMODE(info.st_mode) & 0o077):
        raise BackfillError(
            f"{folder} (the Spark driver's socket folder) must be a folder (not a link) of "
            f"this user's, closed to others (mode {stat.S_IMODE(info.st_mode):o}): remove "
            f"it, or set {SOCKET_ENV} to a socket path in a private folder")


def is_socket(path: Path) -> bool:
    """Whether `path` is a Unix socket (not some other file to be left alone)."""
    try:
        return stat.S_ISSOCK(path.lstat().st_mode)
    except OSError:
        return False


def check_peer(sock: socket.socket) -> None:
    """Refuse a connection whose other end runs as another user (where the system says)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return
    _, uid, _ = struct.unpack("3i", sock.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if uid != os.getuid():
        raise BackfillError(f"the other end of the Spark driver's socket runs as user {uid}, "
                            f"not as this user ({os.getuid()}): refused")


@functools.cache
def code_fingerprint() -> str:
    """This environment's Python, its installed packages' versions and streamkit's files
    (names, sizes, times): a driver whose fingerprint differs would run other code than
    the command that calls it (Spark's Python workers keep what they imported). Taken once
    per process: the driver's as it starts, a command's as it first asks."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha1(f"{sys.prefix} {sys.version} {root}".encode())
    digest.update(" ".join(_installed_packages()).encode())
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".so"):
            try:
                info = path.stat()
            except OSError:  # a dangling link (an editor's lock file, say)
                continue
            digest.update(f"{path.relative_to(root)} {info.st_size} {info.st_mtime_ns}".encode())
    return digest.hexdigest()


def _installed_packages() -> list[str]:
    """The distributions installed where this Python imports from, with their versions
    (their metadata folders: `rocksdict-0.3.25.dist-info`); an upgrade renames them."""
    found = []
    for entry in sys.path:
        folder = Path(entry)
        if folder.name in ("site-packages", "dist-packages"):
            try:
                names = os.listdir(folder)
            except OSError:
                continue
            found += (f"{folder}/{name}" for name in names
                      if name.endswith((".dist-info", ".egg-info")))
    return sorted(found)


def other_code(path: Path) -> str:
    """Why a driver whose fingerprint differs from the command's is refused, and what to do."""
    return (f"the Spark driver at {path} runs other code than this command (another Python "
            "environment, packages installed or upgraded, or streamkit's files changed since it "
            "started): `streamkit spark "
            "stop`, then `streamkit spark start` from this environment")


def send(sock: socket.socket, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def receive(sock: socket.socket) -> Any:
    """The next message; EOFError when the other side closed between messages."""
    (size,) = _HEADER.unpack(_read(sock, _HEADER.size))
    if size > _MAX_FRAME:
        raise BackfillError(f"the Spark driver sent a frame of {size} bytes: not a driver?")
    return pickle.loads(_read(sock, size))


def _read(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(min(size - len(chunks), 1 << 20))
        if not chunk:
            raise EOFError("connection closed")
        chunks += chunk
    return bytes(chunks)


class DriverLink:
    """A connection to a running driver; one request per connection."""

    def __init__(self, path: Path, timeout: float | None = None) -> None:
        self.path = path
        self.timeout = timeout  # seconds a request may take (None: no limit)
        self._open: socket.socket | None = None
        self._cancelled = False

    @contextlib.contextmanager
    def _connection(self) -> Iterator[socket.socket]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._open = sock
        sock.settimeout(self.timeout)
        try:
            private_folder(self.path, create=False)
            sock.connect(str(self.path))
            check_peer(sock)
            yield sock
        except (EOFError, OSError) as error:
            if self._cancelled:
                raise BackfillError("cancelled") from None
            raise BackfillError(f"the Spark driver at {self.path} went away ({error}): "
                                f"see its log, {self.path.with_suffix('.log')}") from None
        finally:
            self._open = None
            sock.close()

    def cancel(self) -> None:
        """End the request in progress (from another thread): the driver cancels its job."""
        self._cancelled = True
        sock = self._open
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def request(self, op: str, **fields: Any) -> Any:
        """A request answered by one message; its `error` raised as BackfillError."""
        with self._connection() as sock:
            send(sock, {"op": op, **fields})
            return _answer(receive(sock))

    def status(self) -> dict[str, Any]:
        return dict(self.request("status"))

    def status_once_up(self, waiting: Callable[[], None]) -> dict[str, Any]:
        """The status, calling `waiting()` first if the driver doesn't answer at once
        (its Spark still starting: it answers once Spark is up)."""
        try:
            return DriverLink(self.path, timeout=_PROMPT).status()
        except BackfillError:
            waiting()
            return self.status()

    def stop(self) -> None:
        self.request("stop")

    def backfill(self, plan: Any, progress: Callable[[Any], None] | None = None
                 ) -> list[dict[str, Any]]:
        """Run `plan` on the driver's SparkContext; the shards' results.

        Closing the connection (this process ends, or is interrupted) makes the
        driver cancel the job.
        """
        with self._connection() as sock:
            send(sock, {"op": "backfill", "plan": plan, "fingerprint": code_fingerprint()})
            while True:
                kind, value = _answer(receive(sock))
                if kind == "result":
                    return list(value)
                if progress is not None:
                    progress(value)


def _answer(message: dict[str, Any]) -> Any:
    if "error" in message:
        raise BackfillError(message["error"])
    return message["ok"]


def find_driver(path: Path | None = None) -> DriverLink | None:
    """The driver listening at `path` (default: this user's), or None if none is up."""
    path = path or driver_socket()
    if not is_socket(path):
        return None
    private_folder(path, create=False)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except OSError:  # a socket left by a driver that was killed
        return None
    finally:
        sock.close()
    return DriverLink(path)
