"""Streamkit's modules compiled to bytecode before tests and benchmarks start processes.

This machine's environment sets PYTHONDONTWRITEBYTECODE, so an editable
install never caches bytecode: every process a test or a benchmark starts
(brokers, members, CLI commands) would compile streamkit's ~180 modules
from source again, a tenth to a third of a second each time. An installed
wheel has its bytecode from `pip install`, and elsewhere Python writes it on
the first import: compiling it once here measures and tests what users run.
"""

from __future__ import annotations

import compileall
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "streamkit"


def compile_bytecode() -> None:
    """Write (or refresh) the bytecode of streamkit's modules; quiet, best effort."""
    compileall.compile_dir(str(PACKAGE), quiet=2, workers=1)
