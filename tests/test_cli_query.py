"""`streamkit query`'s own mistakes, before and after asking the shards: one line each."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from streamkit.cli.errors import CliError
from streamkit.cli.main import cli
from streamkit.cli.query import _combined


@pytest.fixture
def app(tmp_path: Path) -> Path:
    result = CliRunner().invoke(cli, ["new", "asked", "--dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    return tmp_path / "asked"


def test_key_and_shard_together_are_a_usage_error(app: Path) -> None:
    result = CliRunner().invoke(cli, ["query", str(app), "{}", "--key", "a", "--shard",
                                      "shard-001"])
    assert result.exit_code == 2 and "--key and --shard" in result.output, result.output


def test_a_keyspace_file_that_is_not_there_is_named_not_made(app: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.db"
    for given in (str(missing), f"sqlite:///{missing}"):
        result = CliRunner().invoke(cli, ["query", str(app), "{}", "--keyspace", given])
        assert result.exit_code == 1, result.output
        assert f"--keyspace {given}: no such KeySpace file" in result.output, result.output
        assert not missing.exists()


def test_combine_answers_failing_is_named_as_the_apps(tmp_path: Path) -> None:
    class Combining:
        def combine_answers(self, answers: dict) -> object:
            raise ValueError("cannot combine boom")

    with pytest.raises(CliError, match=r"^the app's combine_answers failed: ValueError: "
                                       r"cannot combine boom$"):
        _combined(Combining, {"shard-000": "boom"}, tmp_path)
