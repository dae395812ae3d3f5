"""The KeySpace an app's commands use when none is named: the file `streamkit run` made."""

from __future__ import annotations

from pathlib import Path

from streamkit.app.config import AppConfig
from streamkit.cli.errors import CliError
from streamkit.keyspace.keyspace import sqlite_path

__all__ = ["app_keyspace"]


def app_keyspace(config: AppConfig, app_dir: Path, given: str | None = None) -> str:
    """The KeySpace `given` (--keyspace), else the app's own file; a CliError if the file
    is not there (opening it would make an empty one, and commands would then report an
    app without shards rather than say that it runs elsewhere, or not yet)."""
    if given:
        path = sqlite_path(given)
        if path is not None and not Path(path).exists():
            raise CliError(f"--keyspace {given}: no such KeySpace file (the app's is "
                           f"{config.data_dir / 'keyspace.db'})")
        return given
    path = config.data_dir / "keyspace.db"
    if not path.exists():
        raise CliError(f"no KeySpace at {path}: the app hasn't run here yet "
                       f"(`streamkit run {app_dir}`), or pass --keyspace")
    return str(path)
