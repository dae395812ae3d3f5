"""`streamkit new`: a new application folder, from the templates in templates/.

The skeleton is a small but complete app (events counted per key, totals
published and queryable) in the store kind asked for, with its
streamkit.yaml, a README and an in-process test, so that `streamkit run` and
`pytest` work on it straight away. Templates are filled with string.Template
(`$name`, `$class_name`, ...); `app/` holds the files every app gets,
`stores/<kind>.py.tmpl` the app.py of each store kind. The top-level templates/
folder is installed as the package streamkit.templates (see pyproject.toml), so
importlib.resources finds it in a wheel and in an editable install alike.
"""

from __future__ import annotations

import keyword
import os
import shlex
from importlib import resources
from pathlib import Path
from string import Template

import click

from streamkit.app.config import MAX_NAME_LEN, NAME_RE, STORE_KINDS, TOPIC_LABEL
from streamkit.cli.errors import DATA_ERROR, CliError, reporting_errors

__all__ = ["class_name_for", "new", "render_app"]

_SUFFIX = ".tmpl"
_RENAMED = {"gitignore": ".gitignore"}  # dot-files don't travel well as package data
_STORE_TITLES = {"rocksdb": "RocksDB", "sqlite": "SQLite", "sql": "SQL", "json": "JSON file"}
_COMMENT_COLUMN = 34  # where streamkit.yaml's comments start


def class_name_for(name: str) -> str:
    """"word-count" -> "WordCount": the Application subclass app.py defines."""
    class_name = "".join(part[:1].upper() + part[1:] for part in name.split("-"))
    return f"{class_name}App" if keyword.iskeyword(class_name) else class_name


def _setting(text: str, comment: str) -> str:
    return f"{text.ljust(_COMMENT_COLUMN - 1)} # {comment}"


def _store_settings(store: str) -> str:
    lines = [_setting(f"  kind: {store}", " | ".join(STORE_KINDS))]
    if store == "sql":
        lines.append(_setting("  url: null", "SQLAlchemy URL; null: an SQLite file in .streamkit/"))
    return "\n".join(lines)


def _check_name(name: str) -> None:
    if not NAME_RE.fullmatch(name) or len(name) > MAX_NAME_LEN:
        raise CliError(
            f"invalid app name {name!r}: use lower-case letters, digits and '-', starting with "
            f"a letter, at most {MAX_NAME_LEN} characters (e.g. word-count)",
            DATA_ERROR,
        )


def render_app(name: str, store: str) -> dict[str, str]:
    """The new app's files, by relative path, with every placeholder filled."""
    values = {
        "name": name,
        "class_name": class_name_for(name),
        "store": store,
        "store_title": _STORE_TITLES[store],
        "store_settings": _store_settings(store),
        "application_setting": _setting(f"application: app:{class_name_for(name)}",
                                        "module:Class, the module relative to this folder"),
        "table": f"{name.replace('-', '_')}_totals",
    }
    templates = resources.files("streamkit.templates")
    files: dict[str, str] = {}
    for entry in sorted(templates.joinpath("app").iterdir(), key=lambda e: e.name):
        if entry.name.endswith(_SUFFIX):
            target = entry.name.removesuffix(_SUFFIX)
            files[_RENAMED.get(target, target)] = entry.read_text(encoding="utf-8")
    files["app.py"] = templates.joinpath("stores", f"{store}.py{_SUFFIX}").read_text(
        encoding="utf-8"
    )
    return {path: Template(text).substitute(values) for path, text in files.items()}


def _shown(path: Path) -> str:
    """`path` as the user would type it: relative to the working directory when inside it."""
    try:
        relative = path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return str(path)
    return str(relative) or "."


@click.command("new")
@click.argument("name")
@click.option("--store", type=click.Choice(STORE_KINDS), default="rocksdb", show_default=True,
              help="Where shards keep their state: RocksDB, SQLite, a SQL database "
                   "(SQLAlchemy) or a JSON document.")
@click.option("--dir", "parent", type=click.Path(file_okay=False, path_type=Path), default=".",
              show_default=True, metavar="PARENT", help="Folder to create the app folder in.")
def new(name: str, store: str, parent: Path) -> None:
    """Create the folder NAME holding a new application, ready to run and test.

    NAME is also the app's name in streamkit.yaml. The app counts events per
    key, keeps totals in the chosen store, publishes them and answers
    queries: a starting point to edit.
    """
    with reporting_errors():
        _check_name(name)
        folder = parent / name
        if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
            what = "a folder that is not empty" if folder.is_dir() else "a file"
            raise CliError(f"{folder} already exists and is {what}: choose another name "
                           "or --dir", DATA_ERROR)
        files = render_app(name, store)
        folder.mkdir(parents=True, exist_ok=True)
        for relative, text in files.items():
            (folder / relative).write_text(text, encoding="utf-8")
    shown = shlex.quote(_shown(folder))
    click.echo(f"Created {shown}{os.sep}: app {name!r} with a {_STORE_TITLES[store]} store.")
    publish = ("printf '%s\\n' '{\"key\": \"a\"}' '{\"key\": \"b\"}' | "
               f"streamkit publish -l {TOPIC_LABEL}=events --key key")
    steps = [
        (f"streamkit run {shown}",
         "creates its journals and shards, then processes events until Ctrl-C"),
        (publish, "in another terminal: publishes two events"),
        (f"streamkit journals read -l {TOPIC_LABEL}=totals --committed",
         "prints the totals it published"),
        (f"cd {shown} && python -m pytest",
         "runs test_app.py: the app in-process against a temporary broker; "
         "pytest is not installed with streamkit: pip install pytest"),
    ]
    click.echo("\nNext steps:")
    for command, what in steps:
        click.echo(f"  {command}\n      ({what})")
    click.echo(f"\nMore in {shlex.quote(str(Path(_shown(folder)) / 'README.md'))}.")
