"""The KeySpace an app's commands use when none is named: the file `streamkit run` made."""

from __future__ import annotations

from pathlib import Path

from streamkit.app.config import AppConfig
from streamkit.cli.errors import CliError

__all__ = ["app_keyspace"]


def app_keyspace(config: AppConfig, app_dir: Path) -> str:
    """The app's own KeySpace file; a CliError if there is none (opening it would make an
    empty one, and commands would then report an app without shards rather than say that
    it runs elsewhere, or not yet)."""
    path = config.data_dir / "keyspace.db"
    if not path.exists():
        raise CliError(f"no KeySpace at {path}: the app hasn't run here yet "
                       f"(`streamkit run {app_dir}`), or pass --keyspace")
    return str(path)
