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


def test_a_disabled_shard_is_named_so(app: Path) -> None:
    """A shard its spec disables has no primary whether the app runs or not: said so, not
    "no primary is serving it … is the app running?"."""
    import asyncio

    from streamkit.app.config import load_config
    from streamkit.app.deploy import ensure_shard_specs
    from streamkit.keyspace import open_keyspace

    config = load_config(app)
    config.data_dir.mkdir(parents=True, exist_ok=True)

    async def deploy_disabled() -> None:
        async with open_keyspace(str(config.data_dir / "keyspace.db")) as keyspace:
            specs = config.shard_specs()
            specs[0].disable = True
            await ensure_shard_specs(keyspace, config.keyspace_root, specs)

    asyncio.run(deploy_disabled())
    result = CliRunner().invoke(cli, ["query", str(app), '{"key": "a"}', "--shard",
                                      "shard-000"])
    assert result.exit_code == 1, result.output
    assert "shard-000: it is disabled (its spec's `disable`)" in result.output, result.output
    assert "is the app running" not in result.output
    other = CliRunner().invoke(cli, ["query", str(app), '{"key": "a"}', "--shard",
                                     "shard-001"])
    assert "no primary is serving it" in other.output and "is the app running" in (
        other.output), other.output


def test_a_keyspace_without_the_app_is_named_so(app: Path, tmp_path: Path) -> None:
    """A KeySpace holding no shards of the app (a URL's prefix mistyped): said so, not "no
    primary is serving shard-000 … is the app running?"."""
    import asyncio

    from streamkit.keyspace import open_keyspace

    other = tmp_path / "other.db"

    async def make() -> None:
        async with open_keyspace(str(other)) as keyspace:
            await keyspace.put("/elsewhere", b"x")

    asyncio.run(make())
    result = CliRunner().invoke(cli, ["query", str(app), '{"key": "a"}', "--keyspace",
                                      str(other)])
    assert result.exit_code == 1, result.output
    assert "app asked has no shards in KeySpace" in result.output, result.output
    assert "is --keyspace's prefix right" in result.output
