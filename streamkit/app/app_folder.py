"""An app's folder: the file that makes it one, and where its local data goes.

Apart from `streamkit.app.config` (which validates that file with pydantic), so that
`streamkit run` can start its broker and workers before loading the app.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CONFIG_FILE", "DATA_DIR", "bundled_fragments", "data_dir_of", "is_app_folder"]

CONFIG_FILE = "streamkit.yaml"
DATA_DIR = ".streamkit"  # the bundled broker's data, the KeySpace, the shards' directories


def data_dir_of(app_dir: Path) -> Path:
    return app_dir / DATA_DIR


def bundled_fragments(app_dir: Path) -> Path:
    """Where the app's bundled broker keeps its fragments (its file:/// store root)."""
    return data_dir_of(app_dir) / "broker" / "fragments"


def is_app_folder(app_dir: Path) -> bool:
    return (app_dir / CONFIG_FILE).is_file()
