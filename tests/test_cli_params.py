"""Shared option types: a number of seconds is a finite number (click's FloatRange lets NaN
through any bounds)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from streamkit.cli.main import cli


@pytest.mark.parametrize("args", [
    ["query", ".", "{}", "--timeout", "nan"],
    ["shards", "stat", "shard-000", "--timeout", "inf"],
    ["run", ".", "--lease-ttl", "nan"],
    ["broker", "serve", "--append-timeout", "NaN"],
    ["spark", "stop", "--timeout", "nan"],
])
def test_seconds_that_are_no_number_are_usage_errors(args: list[str]) -> None:
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert "is not a number of seconds" in result.output, result.output
