"""Child processes of `streamkit run`: the bundled broker and extra workers.

Children are tied to the parent's life (Linux's parent-death signal), so a
`streamkit run` that is killed outright doesn't leave a broker or workers
behind holding ports and files.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["Child", "port_in_use", "start_child"]

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: receive SIGTERM when the parent dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: children outlive a killed parent, as usual elsewhere


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        return s.connect_ex((host, port)) == 0


class Child:
    """A running child process with its log file."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        self.name, self.proc, self.log_path = name, proc, log_path

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_listening(self, port: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}:\n"
                                   f"{self.tail()}")
            if port_in_use(port):
                return
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} did not listen on port {port} within {timeout:.0f}s")

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM (a graceful stop), then SIGKILL after `timeout`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_child(name: str, args: list[str], log_path: Path) -> Child:
    """Start `streamkit ARGS...` with this interpreter, logging to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamkit.cli.main", *args],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    return Child(name, proc, log_path)
