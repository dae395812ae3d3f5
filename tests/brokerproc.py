"""Run real broker processes for tests: start, wait until serving, SIGTERM/SIGKILL."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    """A port that is free now, with the next one free too (for the HTTP gateway)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65535:
            with socket.socket() as s2:
                try:
                    s2.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair")


def wait_for_port(port: int, timeout: float = 20.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before serving")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on port {port} after {timeout}s")


@dataclass
class BrokerProcess:
    """A `streamkit broker serve` child process on 127.0.0.1."""

    data_dir: Path
    port: int = field(default_factory=free_port)
    extra_args: list[str] = field(default_factory=list)
    fsize_limit: int | None = None  # RLIMIT_FSIZE of the broker (`ulimit -f`), in bytes
    open_files: int | None = None  # its soft RLIMIT_NOFILE (`ulimit -Sn`) as started
    env: dict[str, str] = field(default_factory=dict)  # more environment (AUTH_KEYS, say)
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def tls(self) -> bool:
        """Whether the broker serves TLS (given a certificate by argument or environment)."""
        return "--tls-cert" in self.extra_args or "STREAMKIT_TLS_CERT" in self.env

    @property
    def address(self) -> str:
        return f"https://127.0.0.1:{self.port}" if self.tls else f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port + 1}"

    def start(self) -> BrokerProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.data_dir.parent / f"broker-{self.port}.log"
        log = open(self.log_path, "ab")  # noqa: SIM115 (owned by the child)
        cmd = [sys.executable, "-m", "streamkit.cli.main", "broker", "serve",
               "--data-dir", str(self.data_dir), "--port", str(self.port), *self.extra_args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=self._limits
                                     if self.fsize_limit or self.open_files else None)
        log.close()
        wait_for_port(self.port, proc=self.proc)
        wait_for_port(self.port + 1, proc=self.proc)
        return self

    def _limits(self) -> None:
        """In the child: no file it writes may grow past `fsize_limit` (a disk filling up);
        a soft limit of `open_files` (the hard one kept)."""
        if self.fsize_limit:
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.fsize_limit, self.fsize_limit))
        if self.open_files:
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (self.open_files, hard))

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path and self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: no chance to flush or persist anything."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait for the graceful stop; returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def restart(self) -> BrokerProcess:
        self.kill()
        return self.start()
