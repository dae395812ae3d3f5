"""Rendering command results: aligned tables for people, JSON and YAML for programs."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

import click

from streamkit.protocol import pb

__all__ = [
    "FORMATS",
    "echo_json",
    "echo_table",
    "format_labels",
    "format_mod_time",
    "format_size",
    "plural",
]

FORMATS = ("table", "yaml", "json")
_MAX_LABELS_WIDTH = 48


def echo_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    """Columns padded to their widest cell; the last column is left ragged."""
    table = [[str(cell) for cell in header], *([str(cell) for cell in row] for row in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        cells = [cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=False)]
        click.echo("  ".join([*cells, row[-1]]).rstrip())


def echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=False))


def format_labels(labels: pb.LabelSet, width: int = _MAX_LABELS_WIDTH) -> str:
    """"a=1,b=2", cut with "…" past `width` characters (a table cell, not the full set)."""
    text = ",".join(f"{label.name}={label.value}" if label.value else label.name
                    for label in labels.labels)
    return text if len(text) <= width else text[: width - 1] + "…"


def format_size(size: int) -> str:
    """Bytes in binary units ("512", "1.5KiB", "16MiB"), as fragment lengths are usually set."""
    value = float(size)
    for unit in ("", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f}".removesuffix(".0") + unit if unit else str(size)
        value /= 1024
    raise AssertionError("unreachable")


def plural(count: int, noun: str) -> str:
    """"1 fragment", "3 fragments"."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def format_mod_time(epoch_seconds: int) -> str:
    """An RFC 3339 UTC time, or "-" for a fragment that has none (still local)."""
    if not epoch_seconds:
        return "-"
    return datetime.fromtimestamp(epoch_seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
