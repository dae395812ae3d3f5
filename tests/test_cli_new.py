"""`streamkit new`: the generated app folder loads, imports and is lint-clean, for every store."""

from __future__ import annotations

import py_compile
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from streamkit.app.application import Application
from streamkit.app.config import STORE_KINDS, load_config
from streamkit.cli.main import cli
from streamkit.cli.new import class_name_for

FILES = {".gitignore", "README.md", "app.py", "streamkit.yaml", "test_app.py"}


def run_new(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, ["new", *args])
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("store", STORE_KINDS)
def test_new_app_for_each_store(tmp_path: Path, store: str) -> None:
    name = f"totals-{store}"
    code, out, err = run_new(name, "--store", store, "--dir", str(tmp_path))
    assert (code, err) == (0, "")
    folder = tmp_path / name
    assert {p.name for p in folder.iterdir()} == FILES

    config = load_config(folder)
    assert config.name == name
    assert config.store.kind == store
    assert config.application == f"app:{class_name_for(name)}"
    assert [s.topic for s in config.sources] == ["events"]
    assert [o.topic for o in config.outputs] == ["totals"]
    assert (config.store.url is None) and config.journal_specs()

    cls = config.load_application()
    assert issubclass(cls, Application)
    assert cls.__name__ == class_name_for(name)
    assert cls.store == store
    cls()  # constructible without arguments, as the runtime makes it

    py_compile.compile(str(folder / "test_app.py"), doraise=True)
    assert ".streamkit/" in (folder / ".gitignore").read_text().splitlines()
    assert f"streamkit run {name}" in (folder / "README.md").read_text()
    assert "$" not in (folder / "streamkit.yaml").read_text()  # every placeholder filled

    assert f"streamkit run {tmp_path / name}" in out
    assert "streamkit publish -l app.streamkit.dev/topic=events --key key" in out


def test_generated_code_is_lint_clean(tmp_path: Path) -> None:
    for store in STORE_KINDS:
        assert run_new(f"lint-{store}", "--store", store, "--dir", str(tmp_path))[0] == 0
    lint = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--isolated", "--line-length",
         "88", "--select", "E,F,W,I,B,UP,SIM,RUF", "."],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,  # as in the user's folder
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_default_store_and_relative_paths(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, _ = run_new("word-count")
    assert code == 0
    assert load_config(tmp_path / "word-count").store.kind == "rocksdb"
    assert out.startswith("Created word-count/: app 'word-count' with a RocksDB store.")
    assert "  streamkit run word-count\n" in out
    assert "  cd word-count && python -m pytest\n" in out


def test_an_empty_existing_folder_is_used(tmp_path: Path) -> None:
    (tmp_path / "ready").mkdir()
    assert run_new("ready", "--dir", str(tmp_path))[0] == 0
    assert {p.name for p in (tmp_path / "ready").iterdir()} == FILES


def test_a_missing_parent_is_created(tmp_path: Path) -> None:
    assert run_new("deep", "--dir", str(tmp_path / "a" / "b"))[0] == 0
    assert (tmp_path / "a" / "b" / "deep" / "streamkit.yaml").exists()


def test_refuses_a_non_empty_folder(tmp_path: Path) -> None:
    folder = tmp_path / "taken"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    code, _, err = run_new("taken", "--dir", str(tmp_path))
    assert code == 2
    assert err == (f"streamkit: error: {folder} already exists and is a folder that is not "
                   "empty: choose another name or --dir\n")
    assert [p.name for p in folder.iterdir()] == ["notes.txt"]  # untouched


def test_refuses_a_file_in_the_way(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    code, _, err = run_new("afile", "--dir", str(tmp_path))
    assert code == 2
    assert "already exists and is a file" in err


@pytest.mark.parametrize("name", ["WordCount", "word_count", "9lives", "-x", "a/b", "", "é"])
def test_refuses_invalid_names(tmp_path: Path, name: str) -> None:
    code, _, err = run_new("--dir", str(tmp_path), "--", name)
    assert code == 2
    assert err.startswith(f"streamkit: error: invalid app name {name!r}: use lower-case")
    assert list(tmp_path.iterdir()) == []


def test_unknown_store_is_a_usage_error(tmp_path: Path) -> None:
    code, _, err = run_new("x-app", "--store", "redis", "--dir", str(tmp_path))
    assert code == 2
    assert "Invalid value for '--store'" in err


@pytest.mark.parametrize(("name", "class_name"), [
    ("wordcount", "Wordcount"),
    ("word-count", "WordCount"),
    ("a-2-b", "A2B"),
    ("none", "NoneApp"),  # "None" is a keyword
])
def test_class_names(name: str, class_name: str) -> None:
    assert class_name_for(name) == class_name


def test_errors_through_the_real_command(tmp_path: Path) -> None:
    """The installed entry point: exit code 2, one line, no traceback."""
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    done = subprocess.run(
        [sys.executable, "-m", "streamkit.cli.main", "new", "busy", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "new" in subprocess.run(
        [sys.executable, "-m", "streamkit.cli.main", "--help"],
        capture_output=True, text=True, timeout=60,
    ).stdout
