"""Child processes of `streamkit run`: the bundled broker and extra workers.

Children are tied to the parent's life (Linux's parent-death signal), so a
`streamkit run` that is killed outright doesn't leave a broker or workers
behind holding ports and files. Each runs in a process group of its own: Ctrl-C
at a terminal signals the whole foreground group, and a bundled broker that
stopped with its parent would leave the shards nothing to commit their last
transactions to (and be restarted by its supervisor as if it had crashed). The
parent stops its children itself, in order: workers and its own shards first,
the broker last. A `Supervisor` keeps a child that serves a
port (the bundled broker) running: the shards outlive a broker crash, since
their clients reconnect and the broker recovers its journals from disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import click

from streamkit.cli.errors import CliError, warn
from streamkit.parent_death import die_with_parent

__all__ = ["Child", "Supervisor", "port_in_use", "start_child"]

def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        return s.connect_ex((host, port)) == 0


class Child:
    """A running child process with its log file (and, if asked, a file with its pid)."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes], log_path: Path,
                 args: list[str] | None = None, pid_file: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.name, self.proc, self.log_path = name, proc, log_path
        self.args, self.pid_file, self.env = args or [], pid_file, env

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def exit_description(self) -> str:
        """How it ended, for messages: "exited with code 1", "was killed by SIGKILL"."""
        code = self.proc.returncode
        if code is None:
            return "is running"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"was killed by {signal.Signals(-code).name}"
            return f"was killed by signal {-code}"
        return f"exited with code {code}"

    def wait_listening(self, port: int, timeout: float = 30.0, poll: float = 0.01) -> None:
        """Until the child accepts connections on `port`. Polled often: `streamkit run`
        waits on this for its bundled broker, and a local connect attempt costs little."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:  # its log says why: a user's to fix, mostly
                raise CliError(f"{self.name} could not start ({self.exit_description()}):\n"
                               f"{self.tail()}")
            if port_in_use(port):
                return
            time.sleep(poll)
        raise TimeoutError(f"{self.name} did not listen on port {port} within {timeout:.0f}s")

    def restarted(self) -> Child:
        """The same command started again, logging to the same file."""
        return start_child(self.name, self.args, self.log_path, self.pid_file, self.env)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM (a graceful stop), then SIGKILL after `timeout`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.pid_file is not None:
            with contextlib.suppress(OSError):
                if self.pid_file.read_text().strip() == str(self.proc.pid):
                    self.pid_file.unlink()
        return self.proc.returncode


def start_child(name: str, args: list[str], log_path: Path,
                pid_file: Path | None = None, env: dict[str, str] | None = None) -> Child:
    """Start `streamkit ARGS...` with this interpreter, logging to `log_path`, in `env`
    (default: this process's environment; the security settings go this way)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamkit.cli.main", *args],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent, process_group=0,  # the parent stops it; see above
            env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"},
        )
    if pid_file is not None:  # for people (and tests) looking for the process
        pid_file.write_text(f"{proc.pid}\n")
    return Child(name, proc, log_path, args, pid_file, env)


class Supervisor:
    """Restarts a child serving `port` (None: a child that serves no port of its own, up
    once started) when it dies, saying so on stderr at once.

    Only quick failures count against giving up: a child that dies within
    `quick` seconds of starting (or never listens). After `max_restarts` of
    those in a row, with growing pauses between them, `Supervisor.run` raises a
    CliError: a child that keeps dying needs a person to read its log.
    """

    max_restarts = 5
    quick = 30.0  # seconds: a child that ran longer before dying starts the count afresh
    settle = 5.0  # seconds after a restart until its clients have surely reconnected
    start_timeout = 30.0

    def __init__(self, child: Child, port: int | None) -> None:
        self.child, self.port = child, port
        self.started = time.monotonic()
        self.up_since = self.started - self.settle  # a first start has no clients to lose
        self.restarting: int | None = None  # the restart under way, if one is
        self._failure: str | None = None  # why the last restart failed

    def running(self) -> bool:
        """Whether the child is up (not dead, nor being restarted)."""
        return self.restarting is None and self.child.proc.poll() is None

    def settled(self) -> bool:
        """Whether the child is up, and has been (since a restart) long enough for its
        clients to be back."""
        return self.running() and time.monotonic() - self.up_since >= self.settle

    def state(self) -> str | None:
        """A few words on a child that isn't simply running (for the status view)."""
        if self.restarting is None:
            return None
        return f"{self.child.name} is down, restarting ({self.restarting} of {self.max_restarts})"

    async def run(self, poll: float = 0.1) -> None:
        """Supervise until cancelled; raises CliError on giving up."""
        failures = 0
        while True:
            while self._failure is None and self.child.proc.poll() is None:
                await asyncio.sleep(poll)
            child = self.child
            failure = self._failure or f"(pid {child.proc.pid}) {child.exit_description()}"
            self._failure = None
            failures = 1 if time.monotonic() - self.started >= self.quick else failures + 1
            name, log = child.name, child.log_path
            if failures > self.max_restarts:
                raise CliError(f"{name} {failure}, after {self.max_restarts} restarts in a row; "
                               f"giving up{self._last_words()}; its log: {log}")
            self.restarting = failures
            on = f" on port {self.port}" if self.port is not None else ""
            warn(f"{name} {failure}; restarting it{on} "
                 f"(restart {failures} of {self.max_restarts}); its log: {log}")
            await asyncio.sleep(0.0 if failures == 1 else min(4.0, 0.5 * 2 ** (failures - 2)))
            self._failure = await self._restart()

    async def _restart(self) -> str | None:
        """Start the child again and wait until it listens: None, else what went wrong."""
        self.started = time.monotonic()
        if self.port is not None and port_in_use(self.port):  # (not the child's: it's dead)
            return f"could not start: port {self.port} is taken by another process"
        self.child = child = self.child.restarted()
        while child.proc.poll() is None:
            if self.port is None or port_in_use(self.port):
                self.restarting, self.up_since = None, time.monotonic()
                on = f" on port {self.port}" if self.port is not None else ""
                click.echo(f"streamkit: {child.name} is running again{on} "
                           f"(pid {child.proc.pid})", err=True)
                return None
            if time.monotonic() - self.started > self.start_timeout:
                await asyncio.to_thread(child.stop, 5.0)
                return f"did not listen on port {self.port} within {self.start_timeout:.0f}s"
            await asyncio.sleep(0.05)
        return f"(pid {child.proc.pid}) {child.exit_description()} while starting"

    def _last_words(self) -> str:
        """What a child that exited with an error logged last (" (it logged: ...)")."""
        if not self.child.proc.returncode or self.child.proc.returncode < 0:
            return ""
        last = " ".join(self.child.tail(1).split())
        return f" (it logged: {last[:300]})" if last else ""
