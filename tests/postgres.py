"""A real PostgreSQL 15 server for tests and benchmarks, in a temporary directory.

The server listens on 127.0.0.1 at a free port with trust authentication and
holds one database, `streamkit`. initdb refuses to run as root, so under root
the server's commands run as the `postgres` user, in a directory it owns.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PG_BIN = Path(os.environ.get("STREAMKIT_PG_BIN", "/usr/lib/postgresql/15/bin"))
DATABASE = "streamkit"
SERVER_USER = "postgres"


def unavailable_reason() -> str | None:
    """Why a server cannot be started here, or None if it can."""
    for tool in ("initdb", "pg_ctl", "postgres"):
        if not (PG_BIN / tool).exists():
            return f"PostgreSQL binaries not found: {PG_BIN / tool} (set STREAMKIT_PG_BIN)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(SERVER_USER)
        except KeyError:
            return f"running as root, and there is no {SERVER_USER!r} user to run initdb as"
        if shutil.which("runuser") is None:
            return "running as root, and runuser is missing to drop to the postgres user"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PostgresServer:
    """One `postgres` process over a throwaway data directory."""

    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="streamkit-pg-")))
    port: int = field(default_factory=_free_port)

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{DATABASE}"  # as documented

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def log_path(self) -> Path:
        return self.root / "server.log"

    def _run(self, *argv: str) -> None:
        """Run a server tool, as the postgres user when we are root."""
        command = [str(PG_BIN / argv[0]), *argv[1:]]
        if os.geteuid() == 0:
            command = ["runuser", "-u", SERVER_USER, "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            log = self.log_path.read_text() if self.log_path.exists() else ""
            raise RuntimeError(
                f"{argv[0]} failed ({done.returncode}): {done.stderr.strip()}\n{log[-4000:]}"
            )

    def start(self) -> PostgresServer:
        (self.root / "sock").mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            user = pwd.getpwnam(SERVER_USER)
            for path in (self.root, self.root / "sock"):
                os.chown(path, user.pw_uid, user.pw_gid)
        self._run("initdb", "-D", str(self.data_dir), "-U", "postgres", "--auth=trust",
                  "--encoding=UTF8", "--no-sync")
        options = f"-k {self.root / 'sock'} -h 127.0.0.1 -p {self.port}"
        self._run("pg_ctl", "start", "-D", str(self.data_dir), "-l", str(self.log_path),
                  "-w", "-t", "60", "-o", options)
        try:
            self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
                      DATABASE)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the server (fast: roll back open transactions) and delete its directory."""
        try:
            if (self.data_dir / "postmaster.pid").exists():
                self._run("pg_ctl", "stop", "-D", str(self.data_dir), "-m", "fast", "-w")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """The SQLAlchemy URL of a real PostgreSQL 15 server shared by the test session."""
    reason = unavailable_reason()
    if reason is not None:
        from tests.conftest import unavailable

        unavailable(reason)
    with PostgresServer() as server:
        yield server.url
