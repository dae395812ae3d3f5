"""streamkit.yaml: validation messages, derived journal/shard specs, loading the Application."""

from __future__ import annotations

import copy
import sys
import textwrap
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from streamkit.app.application import Application
from streamkit.app.config import (
    TOPIC_LABEL,
    AppConfig,
    ConfigError,
    load_config,
)
from streamkit.app.loader import forget_app_modules
from streamkit.cli.main import cli
from streamkit.message.framing import content_type_of
from streamkit.message.mapping import fnv1a32
from streamkit.protocol.problems import SpecError
from streamkit.recoverylog import CONTENT_TYPE as RECOVERY_LOG_CONTENT_TYPE

BASE: dict[str, Any] = {
    "name": "wordcount",
    "application": "app:WordCount",
    "shards": 4,
    "sources": [
        {"topic": "lines", "partitions": 4, "content_type": "application/x-ndjson",
         "key": "user"},
        {"topic": "config", "partitions": 1, "read": "every-shard"},
    ],
    "outputs": [
        {"topic": "counts", "partitions": 3, "content_type": "application/x-ndjson",
         "key": "word"},
        {"topic": "audit", "partitions": 2},
    ],
    "store": {"kind": "rocksdb"},
    "transactions": {"min_duration": "250ms", "max_duration": "2s"},
    "standbys": 1,
}

APP_PY = '''
from streamkit.app.application import Application


class WordCount(Application):
    store = "json"

    def consume_message(self, shard, store, envelope, publisher):
        pass
'''


def write_app(folder: Path, document: Any = None, *, text: str | None = None,
              app_py: str | None = APP_PY) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if text is None:
        text = yaml.safe_dump(BASE if document is None else document, sort_keys=False)
    (folder / "streamkit.yaml").write_text(text)
    if app_py is not None:
        (folder / "app.py").write_text(app_py)
    return folder


def changed(path: str, value: Any) -> dict[str, Any]:
    """BASE with the setting at a dotted path ("sources.0.partitions") replaced or deleted."""
    document = copy.deepcopy(BASE)
    *parents, last = path.split(".")
    node: Any = document
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    key: Any = int(last) if last.isdigit() else last
    if value is _DELETE:
        del node[key]
    else:
        node[key] = value
    return document


_DELETE = object()


def problems_of(tmp_path: Path, document: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    write_app(tmp_path, document)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as caught:
        load_config(".")
    return str(caught.value).splitlines()


# --- validation ----------------------------------------------------------------------


def test_a_valid_file_loads(tmp_path: Path) -> None:
    config = load_config(write_app(tmp_path))
    assert config.name == "wordcount"
    assert config.shards == 4
    assert [s.topic for s in config.sources] == ["lines", "config"]
    assert config.transactions.min_duration == timedelta(milliseconds=250)
    assert config.transactions.max_duration == timedelta(seconds=2)
    assert config.standbys == config.hot_standbys == 1
    assert config.app_dir == tmp_path
    assert config.config_file == str(tmp_path / "streamkit.yaml")


def test_defaults_of_a_minimal_file(tmp_path: Path) -> None:
    config = load_config(write_app(tmp_path, {
        "name": "tiny", "application": "app:Tiny", "sources": [{"topic": "in"}],
    }))
    assert config.shards == 1
    assert config.outputs == []
    assert config.sources[0].partitions == 1
    assert config.sources[0].content_type == "application/x-ndjson"
    assert config.sources[0].key is None
    assert config.store.kind is None and config.store_kind == "rocksdb"
    assert config.transactions.min_duration == timedelta(0)
    assert config.transactions.max_duration == timedelta(seconds=1)
    assert config.standbys == 0


@pytest.mark.parametrize(("path", "value", "expected"), [
    ("name", "Word_Count", "name: must be lower-case letters, digits and '-'"),
    ("name", "9lives", "name: must be lower-case letters"),
    ("name", _DELETE, "name: is required"),
    ("application", "app.WordCount", 'application: must be "module:Class"'),
    ("application", "app:Word Count", 'application: must be "module:Class"'),
    ("shards", 0, "shards: must be ≥ 1 (got 0)"),
    ("shards", 1001, "shards: must be ≤ 1000 (got 1001)"),
    ("shards", "4", "shards: must be an integer (got '4')"),
    ("sources", [], "sources: at least one source topic is required"),
    ("sources", _DELETE, "sources: is required"),
    ("sources.0.partitions", 0, "sources[0].partitions: must be ≥ 1 (got 0)"),
    ("sources.0.partitions", 8, "sources[0].partitions: topic 'lines' has 8 partitions but the "
                                "app has 4 shards: partitions 4 and up would never be read"),
    ("sources.0.partitions", 2, "sources[0].partitions: topic 'lines' has 2 partitions but the "
                                "app has 4 shards: several shards would read each partition"),
    ("sources.1.read", "sometimes", "sources[1].read: input should be 'partition-per-shard' or "
                                    "'every-shard'"),
    ("sources.0.topic", "bad topic", "sources[0].topic: not usable as a prefix of journal names"),
    ("sources.0.topic", "lines/", "sources[0].topic: must not end in '/'"),
    ("sources.0.topic", "/lines", "sources[0].topic: not usable as a prefix of journal names"),
    ("sources.0.topic", "a/../b", "sources[0].topic: not usable as a prefix of journal names"),
    ("sources.0.topic", "=x", "sources[0].topic: not usable as a label value"),
    ("sources.0.content_type", "text/plain", "sources[0].content_type: no message framing"),
    ("outputs.1.content_type", "application/x-ndjson;;", "outputs[1].content_type:"),
    ("sources.0.key", " ", "sources[0].key: must name a field"),
    ("sources.0.partitons", 2, "sources[0].partitons: unknown field (did you mean 'partitions'?)"),
    ("outputs.0.partitions", -1, "outputs[0].partitions: must be ≥ 1 (got -1)"),
    ("outputs.0", "counts", "outputs[0]: must be a mapping of settings (got 'counts')"),
    ("outputs", {"topic": "x"}, "outputs: must be a list"),
    ("store.kind", "redis", "store.kind: must be one of rocksdb, sqlite, sql, json (got 'redis')"),
    ("store.url", "sqlite:///x.db", "store.url: only a sql store takes a url (set kind: sql)"),
    ("store", {"kind": "sql", "url": "not a url"}, "store.url: not a SQLAlchemy database URL"),
    ("store", {"kind": "sql", "url": "sqlite://"}, "store.url: an in-memory SQLite database"),
    ("store", {"kind": "sql", "url": "sqlite:///:memory:"},
     "store.url: an in-memory SQLite database loses the shards' state"),
    ("store", {"kind": "sql", "url": "sqlite:///file:x?mode=memory&uri=true"},
     "store.url: an in-memory SQLite database"),
    ("store", {"kind": "sql", "url": "sqlite:///file::memory:?cache=shared&uri=true"},
     "store.url: an in-memory SQLite database"),
    ("transactions.max_duration", "0s", "transactions.max_duration: must be more than 0s"),
    ("transactions.max_duration", "soon", "transactions.max_duration: not a duration"),
    ("transactions.min_duration", "-1s", "transactions.min_duration: must not be negative"),
    ("transactions.min_duration", "3s",
     "transactions.min_duration: 3s is more than max_duration 2s"),
    ("transactions.max_duration", True, "transactions.max_duration: expected a duration"),
    ("transactions.max_duraton", "1s",
     "transactions.max_duraton: unknown field (did you mean 'max_duration'?)"),
    ("transactions.timeout", "1s",
     "transactions.timeout: unknown field (did you mean 'hook_timeout'?)"),
    ("transactions.pace", "1s",
     "transactions.pace: unknown field (known: min_duration, max_duration, hook_timeout)"),
    ("transactions.hook_timeout", "0s", "transactions.hook_timeout: must be more than 0s"),
    ("standbys", -1, "standbys: must be ≥ 0 (got -1)"),
    ("shardz", 3, "shardz: unknown field (did you mean 'shards'?)"),
])
def test_each_bad_field_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str,
                                 value: Any, expected: str) -> None:
    lines = problems_of(tmp_path, changed(path, value), monkeypatch)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"streamkit.yaml: {expected}"), lines


def test_every_problem_is_reported_at_once(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    document = changed("shards", 0)
    document["sources"][1]["partitions"] = "two"
    document["colour"] = "blue"
    lines = problems_of(tmp_path, document, monkeypatch)
    assert lines == [
        "streamkit.yaml: shards: must be ≥ 1 (got 0)",
        "streamkit.yaml: sources[1].partitions: must be an integer (got 'two')",
        "streamkit.yaml: colour: unknown field (known: name, application, shards, sources, "
        "outputs, store, transactions, standbys, hot_standbys)",
    ]


def test_the_error_names_the_file_as_given(tmp_path: Path) -> None:
    write_app(tmp_path / "myapp", changed("sources.0.partitions", 0))
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path / "myapp")
    assert str(caught.value) == (
        f"{tmp_path}/myapp/streamkit.yaml: sources[0].partitions: must be ≥ 1 (got 0)"
    )
    # A SpecError, so the CLI reports it as bad input (exit code 2) like other spec files.
    assert isinstance(caught.value, SpecError)
    assert caught.value.problems[0].path == "sources[0].partitions"


def test_duplicate_and_conflicting_topics(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    document = copy.deepcopy(BASE)
    document["sources"].append({"topic": "lines"})
    document["outputs"].append({"topic": "config", "partitions": 2})
    document["outputs"].append({"topic": "counts", "partitions": 3})
    assert problems_of(tmp_path, document, monkeypatch) == [
        "streamkit.yaml: sources[2].topic: topic 'lines' is listed twice",
        "streamkit.yaml: outputs[2]: topic 'config' is also a source, with different settings:"
        " make them the same",
        "streamkit.yaml: outputs[3].topic: topic 'counts' is listed twice",
    ]


def test_a_topic_may_be_both_source_and_output_alike(tmp_path: Path) -> None:
    document = copy.deepcopy(BASE)
    document["outputs"].append(dict(document["sources"][0]))
    config = load_config(write_app(tmp_path, document))
    names = [spec.name for spec in config.journal_specs()]
    assert names.count("lines/part-000") == 1


@pytest.mark.parametrize(("value", "expected"), [
    ("250ms", timedelta(milliseconds=250)),
    ("1s", timedelta(seconds=1)),
    ("2m", timedelta(minutes=2)),
    ("1m30s", timedelta(seconds=90)),
    (3, timedelta(seconds=3)),
    (0.5, timedelta(milliseconds=500)),
    ("1.5", timedelta(seconds=1.5)),
])
def test_durations(tmp_path: Path, value: Any, expected: timedelta) -> None:
    document = changed("transactions", {"max_duration": value})
    assert load_config(write_app(tmp_path, document)).transactions.max_duration == expected


def test_hot_standbys_is_standbys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    document = changed("standbys", _DELETE)
    document["hot_standbys"] = 2
    assert load_config(write_app(tmp_path, document)).standbys == 2
    document["standbys"] = 2
    assert problems_of(tmp_path, document, monkeypatch) == [
        "streamkit.yaml: hot_standbys: give standbys or hot_standbys, not both"
    ]


def test_store_shorthand_and_sql_url(tmp_path: Path) -> None:
    config = load_config(write_app(tmp_path, changed("store", "sqlite")))
    assert config.store.kind == "sqlite"
    url = "postgresql://user@db.example/app"
    config = load_config(write_app(tmp_path, changed("store", {"kind": "sql", "url": url})))
    assert config.sql_url() == url
    no_url = load_config(write_app(tmp_path, changed("store", "sql")))
    assert no_url.sql_url() == f"sqlite:///{tmp_path.resolve()}/.streamkit/store.sqlite"


def test_a_relative_sqlite_file_is_in_the_apps_folder(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`sqlite:///state.db` names a file in the app's folder, wherever the command runs
    (`run` from the parent folder and `backfill` from the app's used two databases, the
    backfill consuming the whole history again into an empty one); absolute files and
    other databases are left as they are."""
    from sqlalchemy.engine import make_url

    app = tmp_path / "app"
    monkeypatch.chdir(tmp_path)
    for url, expected in (
            ("sqlite:///state.db?timeout=5", f"sqlite:///{app.resolve()}/state.db?timeout=5"),
            ("sqlite+pysqlite:///data/state.db", f"sqlite+pysqlite:///{app.resolve()}/data/state.db"),
            ("sqlite:///file:st.db?uri=true", f"sqlite:///file:{app.resolve()}/st.db?uri=true"),
            ("sqlite:////var/state.db", "sqlite:////var/state.db"),
            ("postgresql://user:secret@db/app", "postgresql://user:secret@db/app")):
        write_app(app, changed("store", {"kind": "sql", "url": url}))
        assert make_url(load_config("app").sql_url()) == make_url(expected)
        assert make_url(load_config(app).sql_url()) == make_url(expected)
    # A file without `?uri=true` is a plain name, "file:" and all.
    write_app(app, changed("store", {"kind": "sql", "url": "sqlite:///file::memory:"}))
    assert make_url(load_config(app).sql_url()).database == f"{app.resolve()}/file::memory:"

    # Where earlier versions put it (the current folder), with none in the app's folder: an
    # empty database would consume everything again, so the command stops and says so.
    write_app(app, changed("store", {"kind": "sql", "url": "sqlite:///state.db"}))
    (tmp_path / "state.db").write_bytes(b"")
    with pytest.raises(ConfigError, match=rf"store.url: sqlite:///state.db names "
                                          rf"{app.resolve()}/state.db .* while "
                                          rf"{tmp_path.resolve()}/state.db does"):
        load_config("app").sql_url()
    (app / "state.db").write_bytes(b"")  # moved (copied) in: the app's is used
    assert load_config("app").sql_url() == f"sqlite:///{app.resolve()}/state.db"


def _yaml_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> str:
    """The one line of the ConfigError of an app whose streamkit.yaml is `text`."""
    write_app(tmp_path, text=text)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as caught:
        load_config(".")
    (line,) = str(caught.value).splitlines()
    return line


def test_yaml_syntax_error_names_the_line(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    line = _yaml_error(tmp_path, monkeypatch, "name: wordcount\nsources:\n  - topic: [lines\n")
    assert line.startswith("streamkit.yaml: invalid YAML: line 4, column 1:"), line


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The last of two `shards:` used to win silently; exit 2 like other config errors."""
    text = "name: wordcount\napplication: app:WordCount\nshards: 4\nstandbys: 0\nshards: 2\n"
    line = _yaml_error(tmp_path, monkeypatch, text)
    assert line == ("streamkit.yaml: invalid YAML: line 5, column 1: "
                    "key 'shards' given twice (first on line 3)"), line

    result = CliRunner().invoke(cli, ["shards", "list", "--app", "."])
    assert result.exit_code == 2, result.output
    assert "key 'shards' given twice (first on line 3)" in result.stderr, result.stderr


def test_a_nested_duplicate_key_is_refused_but_merge_keys_may_override(tmp_path: Path) -> None:
    nested = yaml.safe_dump(BASE, sort_keys=False).replace(
        "  min_duration: 250ms\n", "  min_duration: 250ms\n  min_duration: 1s\n")
    write_app(tmp_path, text=nested)
    with pytest.raises(ConfigError, match="key 'min_duration' given twice"):
        load_config(tmp_path)
    # A key a `<<` merge brings in may be overridden: that is what merging is for.
    merged = yaml.safe_dump({k: v for k, v in BASE.items() if k != "transactions"},
                            sort_keys=False)
    merged += "transactions:\n  <<: {min_duration: 250ms, max_duration: 2s}\n" \
              "  max_duration: 3s\n"
    config = load_config(write_app(tmp_path, text=merged))
    assert config.transactions.max_duration == timedelta(seconds=3)


@pytest.mark.parametrize(("text", "expected"), [
    ("", "the file is empty"),
    ("- name: x\n", "the file is a list"),
])
def test_not_a_mapping(tmp_path: Path, text: str, expected: str) -> None:
    write_app(tmp_path, text=text)
    with pytest.raises(ConfigError, match=expected):
        load_config(tmp_path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path)
    assert str(caught.value) == (
        f"{tmp_path}/streamkit.yaml: no such file: is this an app folder? "
        "`streamkit new NAME` makes one"
    )
    with pytest.raises(ConfigError, match="is not a folder"):
        load_config(tmp_path / "nowhere")


# --- derived names and specs -------------------------------------------------------------


@pytest.fixture
def config(tmp_path: Path) -> AppConfig:
    return load_config(write_app(tmp_path))


def test_names(config: AppConfig) -> None:
    assert config.keyspace_root == "/gazette/consumers/wordcount"
    assert config.shard_ids() == ["shard-000", "shard-001", "shard-002", "shard-003"]
    assert config.topic_journals("counts") == [
        "counts/part-000", "counts/part-001", "counts/part-002"
    ]
    assert config.topic_journals("config") == ["config/part-000"]
    assert config.recovery_log("shard-002") == "recovery/wordcount/shard-002"
    with pytest.raises(ConfigError, match="topic 'nope' is neither a source nor an output"):
        config.topic_journals("nope")


def test_each_shard_reads_its_partition_of_every_source(config: AppConfig) -> None:
    assert [config.source_journals(i) for i in range(4)] == [
        ["lines/part-000", "config/part-000"],
        ["lines/part-001", "config/part-000"],  # read: every-shard
        ["lines/part-002", "config/part-000"],
        ["lines/part-003", "config/part-000"],
    ]
    with pytest.raises(IndexError):
        config.source_journals(4)


def test_journal_specs(config: AppConfig) -> None:
    specs = {spec.name: spec for spec in config.journal_specs()}
    assert list(specs) == [
        "lines/part-000", "lines/part-001", "lines/part-002", "lines/part-003",
        "config/part-000",
        "counts/part-000", "counts/part-001", "counts/part-002",
        "audit/part-000", "audit/part-001",
        "recovery/wordcount/shard-000", "recovery/wordcount/shard-001",
        "recovery/wordcount/shard-002", "recovery/wordcount/shard-003",
    ]
    labels = {(label.name, label.value) for label in specs["counts/part-001"].labels}
    assert labels == {("content-type", "application/x-ndjson"), (TOPIC_LABEL, "counts")}
    log = specs["recovery/wordcount/shard-001"]
    assert {(label.name, label.value) for label in log.labels} == {
        ("content-type", RECOVERY_LOG_CONTENT_TYPE), ("app", "wordcount"),
    }
    for spec in specs.values():
        assert spec.replication == 1
        assert spec.fragment.stores == ["file:///"]
        assert spec.to_proto().name == spec.name  # valid on the wire too
    assert specs["lines/part-000"].fragment.flush_interval > timedelta(0)


def test_shard_specs(config: AppConfig) -> None:
    specs = config.shard_specs()
    assert [spec.id for spec in specs] == config.shard_ids()
    spec = specs[1]
    assert [(s.journal, s.min_offset) for s in spec.sources] == [
        ("lines/part-001", 0), ("config/part-000", 0)
    ]
    assert spec.recovery_log_prefix == "recovery/wordcount"
    assert spec.hint_prefix == "/gazette/consumers/wordcount/hints"
    assert spec.hint_backups == 2
    assert spec.hot_standbys == 1
    assert spec.max_txn_duration.ToTimedelta() == timedelta(seconds=2)
    assert spec.min_txn_duration.ToTimedelta() == timedelta(milliseconds=250)
    assert [(label.name, label.value) for label in spec.labels.labels] == [
        ("app", "wordcount"), ("app.streamkit.dev/store", "rocksdb")]


def test_sql_stores_have_no_recovery_log(config: AppConfig) -> None:
    sql = config.with_store("sql")
    assert sql.recovery_log("shard-000") == ""
    assert all(not spec.recovery_log_prefix for spec in sql.shard_specs())
    assert not [s for s in sql.journal_specs() if s.name.startswith("recovery/")]


def test_with_store(tmp_path: Path, config: AppConfig) -> None:
    sqlite = config.with_store("sqlite")
    assert sqlite.store.kind == "sqlite" and config.store.kind == "rocksdb"
    assert sqlite.app_dir == config.app_dir
    url = "postgresql://db.example/x"
    with_url = load_config(write_app(tmp_path / "b", changed("store", {"kind": "sql",
                                                                          "url": url})))
    assert with_url.with_store("sql").store.url == url
    assert with_url.with_store("json").store.url is None  # a url is for sql only
    with pytest.raises(ConfigError, match="must be one of rocksdb, sqlite, sql, json"):
        config.with_store("redis")


def test_for_application_fills_in_the_store(tmp_path: Path) -> None:
    class Sqlite(Application):
        store = "sqlite"

    unset = load_config(write_app(tmp_path, changed("store", _DELETE)))
    assert unset.for_application(Sqlite).store_kind == "sqlite"
    assert unset.for_application(Application).store_kind == "rocksdb"
    named = unset.with_store("json")
    assert named.for_application(Sqlite).store_kind == "json"  # the file wins


def test_mapping_for_a_keyed_topic(config: AppConfig) -> None:
    mapping = config.mapping_for("counts")
    for word in ["a", "hello", "zebra", "7"]:
        journal, content_type = mapping({"word": word, "n": 1})
        assert journal == f"counts/part-{fnv1a32(word.encode()) % 3:03d}"
        assert content_type == "application/x-ndjson"
    assert mapping({"word": 7})[0] == mapping({"word": "7"})[0]
    with pytest.raises(ValueError, match="no field 'word'"):
        mapping({"n": 1})
    # Sources route the same way (what the test harness publishes with).
    assert config.mapping_for("lines")({"user": "u1"})[0] in config.topic_journals("lines")


def test_mapping_for_an_unkeyed_topic_is_random(config: AppConfig) -> None:
    mapping = config.mapping_for("audit")
    seen = {mapping({"anything": i})[0] for i in range(200)}
    assert seen == {"audit/part-000", "audit/part-001"}
    with pytest.raises(ConfigError, match="neither a source nor an output"):
        config.mapping_for("elsewhere")


def test_journal_labels_carry_the_content_type(config: AppConfig) -> None:
    (spec,) = [s for s in config.journal_specs() if s.name == "audit/part-000"]
    assert content_type_of(spec.to_proto().labels) == "application/x-ndjson"


# --- loading the application ------------------------------------------------------------


def test_load_application(tmp_path: Path) -> None:
    config = load_config(write_app(tmp_path / "one"))
    cls = config.load_application()
    assert issubclass(cls, Application) and cls.__name__ == "WordCount"
    assert cls.store == "json"
    assert config.for_application(cls).store_kind == "rocksdb"  # streamkit.yaml names one
    # Another app folder with a module of the same name gets its own module.
    other = APP_PY.replace('store = "json"', 'store = "sqlite"')
    config_two = load_config(write_app(tmp_path / "two", app_py=other))
    assert config_two.load_application().store == "sqlite"
    assert config.load_application().store == "json"  # and back


def test_forgotten_app_modules_are_read_again(tmp_path: Path) -> None:
    """What a backfill task does first in a reused worker: the app's modules, and those
    of an earlier copy of it in another folder, are read again from the files."""
    app_py = APP_PY + "\nimport helper\n\nWordCount.store = helper.STORE\n"
    one = load_config(write_app(tmp_path / "one", app_py=app_py))
    (one.app_dir / "helper.py").write_text('STORE = "json"\n')
    assert one.load_application().store == "json"
    (one.app_dir / "helper.py").write_text('STORE = "sqlite"  # edited\n')
    assert one.load_application().store == "json"  # a loaded module stays as it was
    forget_app_modules(one.app_dir)
    assert one.load_application().store == "sqlite"
    # A copy of the app in another folder (a job's shipped copy): its own sibling modules.
    two = load_config(write_app(tmp_path / "two", app_py=app_py))
    (two.app_dir / "helper.py").write_text('STORE = "rocksdb"\n')
    forget_app_modules(two.app_dir)
    assert two.load_application().store == "rocksdb"
    assert str(one.app_dir.resolve()) not in sys.path

    def loaded_here() -> set[str]:
        return {name for name, module in list(sys.modules.items())
                if str(getattr(module, "__file__", None)).startswith(str(tmp_path.resolve()))}

    assert loaded_here() == {"app", "helper"}
    # Libraries in a folder on sys.path inside the app's (its .venv, with streamkit in it
    # maybe) are not the app's: they stay.
    site = two.app_dir / ".venv" / "site-packages"
    site.mkdir(parents=True)
    (site / "some_library.py").write_text("VALUE = 1\n")
    sys.path.append(str(site.resolve()))
    try:
        import some_library  # noqa: F401
        forget_app_modules(two.app_dir)
        assert loaded_here() == {"some_library"}
    finally:
        sys.path.remove(str(site.resolve()))
        sys.modules.pop("some_library", None)


def load_error(tmp_path: Path, app_py: str | None, application: str = "app:WordCount",
               extra: dict[str, str] | None = None) -> str:
    folder = write_app(tmp_path, changed("application", application), app_py=app_py)
    for name, text in (extra or {}).items():
        (folder / name).write_text(text)
    config = load_config(folder)
    with pytest.raises(ConfigError) as caught:
        config.load_application()
    (line,) = str(caught.value).splitlines()
    prefix = f"{folder}/streamkit.yaml: application: "
    assert line.startswith(prefix), line
    return line.removeprefix(prefix)


def test_load_application_missing_module(tmp_path: Path) -> None:
    message = load_error(tmp_path, None, "wc_missing_mod:WordCount")
    assert message == f"no module 'wc_missing_mod' in {tmp_path.resolve()}"


def test_load_application_missing_class(tmp_path: Path) -> None:
    message = load_error(tmp_path, None, "wc_no_class:WordCount",
                         {"wc_no_class.py": "class Other:\n    pass\n"})
    assert message == (
        f"module 'wc_no_class' ({tmp_path.resolve()}/wc_no_class.py) has no 'WordCount'"
    )


@pytest.mark.parametrize(("module", "body", "what"), [
    ("wc_plain_class", "class WordCount:\n    pass\n", "class WordCount"),
    ("wc_function", "def WordCount():\n    pass\n", "function"),
    ("wc_base", "from streamkit.app.application import Application as WordCount\n",
     "is streamkit.Application itself"),
])
def test_load_application_not_an_application(tmp_path: Path, module: str, body: str,
                                             what: str) -> None:
    message = load_error(tmp_path, None, f"{module}:WordCount", {f"{module}.py": body})
    assert what in message
    assert message.startswith(f"{module}:WordCount is")


def test_load_application_import_fails(tmp_path: Path) -> None:
    body = textwrap.dedent("""\
        import os

        LIMIT = int(os.environ.get("NOPE", "ten"))
    """)
    message = load_error(tmp_path, None, "wc_raises:WordCount", {"wc_raises.py": body})
    assert message == (
        "importing module 'wc_raises' failed: ValueError: invalid literal for int() with "
        "base 10: 'ten' (at wc_raises.py:3)"
    )
    assert "Traceback" not in message


def test_load_application_exiting_at_import(tmp_path: Path) -> None:
    """sys.exit() in the app's module ended every command without a word."""
    message = load_error(tmp_path, None, "wc_exits:WordCount",
                         {"wc_exits.py": "import sys\n\nsys.exit(3)\n"})
    assert message == "importing module 'wc_exits' failed: SystemExit: 3 (at wc_exits.py:3)"


def test_load_application_missing_dependency(tmp_path: Path) -> None:
    message = load_error(tmp_path, None, "wc_dep:WordCount",
                         {"wc_dep.py": "import not_installed_anywhere_xyz\n"})
    assert message == (
        "importing module 'wc_dep' failed: ModuleNotFoundError: No module named "
        "'not_installed_anywhere_xyz' (at wc_dep.py:1)"
    )


def test_load_application_syntax_error(tmp_path: Path) -> None:
    message = load_error(tmp_path, None, "wc_syntax:WordCount",
                         {"wc_syntax.py": "class WordCount(\n    pass\n"})
    assert message.startswith("importing module 'wc_syntax' failed: SyntaxError: ")
    assert "wc_syntax.py, line" in message


def test_load_application_refuses_to_shadow_a_loaded_module(tmp_path: Path) -> None:
    message = load_error(tmp_path, None, "json:WordCount",
                         {"json.py": "class WordCount:\n    pass\n"})
    assert message.startswith("module 'json' is already imported from ")
    assert message.endswith("rename the app's module")


def test_partitions_left_out_follow_the_shard_count(tmp_path: Path) -> None:
    config = load_config(write_app(tmp_path, {
        "name": "tiny", "application": "app:Tiny", "shards": 2,
        "sources": [{"topic": "events", "key": "key"},
                    {"topic": "settings", "partitions": 1, "read": "every-shard"}],
        "outputs": [{"topic": "totals", "key": "key"}],
    }))
    assert [t.partitions for t in config.topics()] == [2, 1, 2]
    eight = config.with_settings(shards=8)
    assert [t.partitions for t in eight.topics()] == [8, 1, 8]
    assert eight.source_journals(7) == ["events/part-007", "settings/part-000"]
    assert [spec.name for spec in eight.journal_specs()][:8] == [
        f"events/part-{i:03d}" for i in range(8)]
    journal, _ = eight.mapping_for("totals")({"key": "a"})
    assert journal == f"totals/part-{fnv1a32(b'a') % 8:03d}"
    # The file is untouched: the next override starts from it again.
    assert config.document() == eight.document() | {"shards": 2}
    assert [t.partitions for t in eight.with_settings(shards=3).topics()] == [3, 1, 3]


def test_an_explicit_partition_count_that_does_not_fit_new_shards_is_refused(
        tmp_path: Path) -> None:
    config = load_config(write_app(tmp_path, {
        "name": "tiny", "application": "app:Tiny", "shards": 2,
        "sources": [{"topic": "events", "partitions": 2, "key": "key"}],
    }))
    with pytest.raises(ConfigError) as caught:
        config.with_settings(shards=8)
    assert str(caught.value) == (
        f"{tmp_path}/streamkit.yaml: sources[0].partitions: topic 'events' has 2 partitions but "
        "the app has 8 shards: several shards would read each partition and process its "
        "messages several times. Leave partitions out (it follows the shard count) or set it "
        "to 8; for a broadcast topic every shard reads whole, set read: every-shard")


async def test_deploy_keeps_a_retention_an_operator_gave(broker_proc: Any,
                                                         tmp_path: Path) -> None:
    """`journals apply` gives an app's topic a retention; the app's next start (a deploy)
    keeps it. It reset every journal's retention to none, so pruning never pruned."""
    from google.protobuf.duration_pb2 import Duration

    from streamkit.app.member import deploy
    from streamkit.client import BrokerClient
    from streamkit.client.listing import apply_journals, list_journals
    from streamkit.keyspace import open_keyspace
    from streamkit.protocol import pb
    from tests.e2e import copy_wordcount

    app = copy_wordcount(tmp_path / "app")
    config = load_config(app)
    config = config.for_application(config.load_application())
    async with (BrokerClient(broker_proc.address) as client,
                open_keyspace(str(tmp_path / "keyspace.db")) as keyspace):
        await deploy(config, client, keyspace)
        name = config.journal_specs()[0].name
        selector = pb.LabelSelector(include=pb.LabelSet(labels=[pb.Label(name="name",
                                                                         value=name)]))
        (listed,) = await list_journals(client, selector)
        spec = pb.JournalSpec()
        spec.CopyFrom(listed.spec)
        spec.fragment.retention.CopyFrom(Duration(seconds=3600))
        await apply_journals(client, [pb.ApplyRequest.Change(
            expect_mod_revision=listed.mod_revision, upsert=spec)])
        await deploy(config, client, keyspace)  # the app started again
        (listed,) = await list_journals(client, selector)
        assert listed.spec.fragment.retention.seconds == 3600


async def test_another_keyspaces_deployment_is_refused_the_apps_recovery_logs(
        broker_proc: Any, tmp_path: Path) -> None:
    """One app name deployed from two KeySpaces on one broker (staging beside production)
    would share the shards' recovery logs, each side fencing the other's primaries. Logs
    are labeled with their KeySpace's deployment id: a deploy from another KeySpace is
    refused, naming a log and how to go on, unless it adopts them (`streamkit deploy
    --adopt-recovery-logs`); logs from before the label are adopted silently by a KeySpace
    that deployed the app before, not by a new one."""
    from streamkit.app.config import DEPLOYMENT_LABEL
    from streamkit.app.deploy import DeploymentConflict
    from streamkit.app.layout import read_layout
    from streamkit.app.member import deploy
    from streamkit.backfill.reshard import next_layout
    from streamkit.client import BrokerClient
    from streamkit.client.listing import apply_journals, list_journals
    from streamkit.keyspace import open_keyspace
    from streamkit.protocol import pb
    from tests.e2e import cli, copy_wordcount

    app = copy_wordcount(tmp_path / "app", shards=2)
    config = load_config(app)
    config = config.for_application(config.load_application())
    production, staging = str(tmp_path / "production.db"), str(tmp_path / "staging.db")
    selector = pb.LabelSelector(include=pb.LabelSet(labels=[pb.Label(
        name="content-type", value="application/x-gazette-recoverylog")]))

    async def owners(client: BrokerClient) -> set[str]:
        return {label.value for listed in await list_journals(client, selector)
                for label in listed.spec.labels.labels if label.name == DEPLOYMENT_LABEL}

    async with BrokerClient(broker_proc.address) as client:
        async with open_keyspace(production) as keyspace:
            await deploy(config, client, keyspace)
            await deploy(config, client, keyspace)  # started again: the same deployment
        (ours,) = await owners(client)
        async with open_keyspace(staging) as keyspace:
            with pytest.raises(DeploymentConflict, match=(
                    rf"recovery log recovery/{config.name}/shard-000 \(and 1 more\) belongs to "
                    rf"another deployment .*id {ours};.*--adopt-recovery-logs")):
                await deploy(config, client, keyspace)
        assert await owners(client) == {ours}

        args = ["deploy", str(app), "--broker", broker_proc.address, "--keyspace"]
        refused = cli(*args, staging)
        assert refused.returncode == 1, refused.stderr
        assert "belongs to another deployment" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
        adopted = cli(*args, staging, "--adopt-recovery-logs")
        assert adopted.returncode == 0, adopted.stderr
        (theirs,) = await owners(client)
        assert theirs != ours
        async with open_keyspace(production) as keyspace:
            with pytest.raises(DeploymentConflict):
                await deploy(config, client, keyspace)
            # A reshard is refused before it changes anything (not half-way through).
            layout = await read_layout(keyspace, config.keyspace_root)
            with pytest.raises(DeploymentConflict):
                await next_layout(config.with_settings(shards=4), client, keyspace, layout)
            assert await read_layout(keyspace, config.keyspace_root) == layout

            # Logs labeled by no deployment (made before the label) are this one's, as a
            # KeySpace that deployed the app before sees it; a KeySpace deploying the app
            # for the first time must adopt them (they may be another KeySpace's).
            changes = []
            for listed in await list_journals(client, selector):
                spec = pb.JournalSpec()
                spec.CopyFrom(listed.spec)
                kept = [lbl for lbl in spec.labels.labels if lbl.name != DEPLOYMENT_LABEL]
                spec.labels.CopyFrom(pb.LabelSet(labels=kept))
                changes.append(pb.ApplyRequest.Change(expect_mod_revision=listed.mod_revision,
                                                      upsert=spec))
            await apply_journals(client, changes)
            assert await owners(client) == set()
            async with open_keyspace(str(tmp_path / "fresh.db")) as fresh:
                with pytest.raises(DeploymentConflict, match="made before deployments were "):
                    await deploy(config, client, fresh)
                assert await read_layout(fresh, config.keyspace_root) is None
            await deploy(config, client, keyspace)
        assert await owners(client) == {ours}


async def test_a_broker_without_the_recovery_logs_the_hints_name_is_refused(
        broker_proc: Any, tmp_path: Path) -> None:
    """`run --broker` at another broker (a typo, another app's): the KeySpace's hints say the
    shards recorded state in logs that broker lacks. Deploying there made empty logs, the
    shards started from nothing and overwrote their hints (back on the right broker they
    never recovered). It is refused, naming a log and its hinted end, unless adopted. So is
    a log shorter than its hints (content lost), adopted or not: adopting would play back
    what is left of it, an older state."""
    from streamkit.app.deploy import RecoveryLogMissing
    from streamkit.app.hints import load_hints, store_primary_hints
    from streamkit.app.member import deploy
    from streamkit.client import BrokerClient, append_bytes
    from streamkit.client.listing import list_journals
    from streamkit.keyspace import open_keyspace
    from streamkit.protocol import pb
    from streamkit.protocol import recoverylog_pb2 as rpb
    from tests.brokerproc import BrokerProcess
    from tests.e2e import copy_wordcount

    app = copy_wordcount(tmp_path / "app", shards=2)
    config = load_config(app)
    config = config.for_application(config.load_application())
    log = config.recovery_log("shard-000")
    hints = rpb.FSMHints(log=log, live_nodes=[rpb.FnodeSegments(fnode=1, segments=[
        rpb.Segment(author=7, first_seq_no=1, first_offset=0, last_seq_no=3,
                    last_offset=4096)])])
    other = BrokerProcess(tmp_path / "other").start()
    try:
        async with open_keyspace(str(tmp_path / "ks.db")) as keyspace:
            async with BrokerClient(broker_proc.address) as client:
                await deploy(config, client, keyspace)
                await store_primary_hints(keyspace, config.shard_specs()[0], hints)
                for adopt in (False, True):
                    with pytest.raises(RecoveryLogMissing, match=(
                            rf"recovery log {log} on broker .* ends at offset 0, but .*"
                            r"through offset 4,096: content is lost;.*`delete: true`")):
                        await deploy(config, client, keyspace, adopt=adopt)
                await append_bytes(client, log, b"x" * 4096)
                await deploy(config, client, keyspace)  # the app's broker: fine
                await deploy(config, client, keyspace, adopt=True)  # nothing lost
                assert await load_hints(keyspace, config.shard_specs()[0]) == [hints]
            async with BrokerClient(other.address) as client:
                with pytest.raises(RecoveryLogMissing, match=(
                        rf"recovery log {log} is not on broker .*through offset 4,096\).*"
                        r"--adopt-recovery-logs")):
                    await deploy(config, client, keyspace)
                assert await list_journals(client, pb.LabelSelector()) == []  # none made
                await deploy(config, client, keyspace, adopt=True)  # lost for good
                # The shard starts from an empty state: its hints name what the log lacks.
                assert await load_hints(keyspace, config.shard_specs()[0]) == []
    finally:
        other.kill()


async def test_deploying_at_a_silent_broker_says_so_before_giving_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`run --broker` at an address where nothing answers: it says so after a few seconds,
    while still trying (it was silent for the whole 30 s), then fails naming the broker."""
    from streamkit.cli import run as run_module
    from streamkit.cli.errors import CliError
    from streamkit.client import BrokerClient
    from streamkit.keyspace import open_keyspace
    from tests.brokerproc import free_port
    from tests.e2e import copy_wordcount

    monkeypatch.setattr(run_module, "_SAY_WAITING", 0.3)
    config = load_config(copy_wordcount(tmp_path / "app"))
    broker = f"127.0.0.1:{free_port()}"
    async with BrokerClient(broker) as client, open_keyspace(str(tmp_path / "ks.db")) as ks:
        with pytest.raises(CliError, match=f"cannot set up the app's journals at broker {broker}"):
            await run_module.deploy_when_ready(config, client, ks, broker, timeout=1.5)
    err = capsys.readouterr().err
    assert f"broker {broker} does not answer (UNAVAILABLE); still trying" in err, err
    assert err.count("does not answer") == 1
