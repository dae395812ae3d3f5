"""Shared option types: a number of seconds is a finite number (click's FloatRange lets NaN
through any bounds)."""

from __future__ import annotations

from pathlib import Path

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


@pytest.mark.parametrize("args", [
    ["journals", "read", "a/b", "--offset", "9223372036854775808"],
    ["journals", "fragments", "a/b", "--from", "99999999999999999999"],
    ["shards", "stat", "shard-000", "--read-through", "a/b=9223372036854775808"],
])
def test_offsets_beyond_64_bits_are_usage_errors(args: list[str]) -> None:
    """(They reached protobuf, whose "Value out of range" was an unexpected error.)"""
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output


def test_an_offsets_file_beyond_64_bits_is_named(tmp_path: Path) -> None:
    from streamkit.cli.errors import CliError
    from streamkit.cli.journal_io import load_offsets

    offsets = tmp_path / "offsets.json"
    offsets.write_text('{"a/b": 99999999999999999999999}')
    with pytest.raises(CliError, match="must map journal names to offsets >= -1"):
        load_offsets(offsets)


@pytest.mark.parametrize("args, said", [
    (["journals", "append", "a/b", "-m", "direct"], "it needs --framing lines"),
    (["publish", "-l", "topic=x", "--key", ""], "--key names a top-level field"),
])
def test_options_that_would_be_ignored_are_usage_errors(args: list[str], said: str) -> None:
    """(`-m direct` without lines was ignored; `--key ''` mapped at random.)"""
    result = CliRunner().invoke(cli, args, input="")
    assert result.exit_code == 2 and said in result.output, result.output


def test_a_bad_value_from_the_environment_names_its_variable() -> None:
    """A value the user did not type on the command line (an exported STREAMKIT_BROKER) is
    named with the variable that set it; typed, it is not."""
    runner = CliRunner()
    exported = runner.invoke(cli, ["journals", "list"], env={"STREAMKIT_BROKER": "ftp://x"})
    assert exported.exit_code == 2, exported.output
    assert "scheme must be https:// (TLS) or http:// (plaintext), got ftp:// " \
        "(set by STREAMKIT_BROKER)" in exported.output, exported.output
    typed = runner.invoke(cli, ["journals", "list", "--broker", "ftp://x"],
                          env={"STREAMKIT_BROKER": "ftp://y"})
    assert typed.exit_code == 2 and "ftp://x" in typed.output, typed.output
    assert "set by" not in typed.output, typed.output
