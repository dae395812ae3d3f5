"""Reading a spec file named on the command line ("-" for stdin), with readable errors."""

from __future__ import annotations

from pathlib import Path

import click

from streamkit.cli.errors import DATA_ERROR, CliError

__all__ = ["read_text_input"]


def read_text_input(path: str, what: str) -> tuple[str, str]:
    """The text of `path` and the name to report it by; CliError if it can't be read."""
    source = "<stdin>" if path == "-" else path
    try:
        text = click.get_text_stream("stdin").read() if path == "-" else Path(path).read_text()
    except OSError as err:
        raise CliError(f"cannot read {what} {source}: {err.strerror}", DATA_ERROR) from None
    except UnicodeDecodeError as err:
        raise CliError(f"cannot read {what} {source}: not UTF-8 text ({err.reason})",
                       DATA_ERROR) from None
    return text, source
