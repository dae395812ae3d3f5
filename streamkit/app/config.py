"""streamkit.yaml: what an application reads and writes, how it is sharded, where state lives.

`load_config(app_dir)` parses and validates the file into an `AppConfig`.
Everything the runtime creates is derived from it, so nobody else has to
spell names out:

* topics are sets of journals `<topic>/part-000` … (`partitions` of them,
  as many as the app has shards unless set), labeled
  `app.streamkit.dev/topic=<topic>` and with their content-type;
* shards are `shard-000` …; shard i reads partition i of every source, so a
  source must have exactly one partition per shard: fewer would have several
  shards process the same messages, more would leave some unread. A source
  with `read: every-shard` (a small broadcast topic, such as configuration)
  is instead read whole by every shard;
* each shard's store is recorded into the recovery log
  `recovery/<name>/<shard id>` (except SQL stores, whose database is durable
  on its own); shard specs live under the keyspace root
  `/gazette/consumers/<name>`, as a Gazette consumer's do in Etcd.

Every mistake becomes a `ConfigError` listing one line per problem, naming
the file and the field path ("streamkit.yaml: sources[0].partitions: must be
≥ 1"). Unknown fields are refused with a suggestion, so typos are not
silently ignored. ConfigError is a SpecError, so the command line reports it
like any other bad input file. Importing the Application class the file names
(the user's code) is `loader`'s job; `AppConfig.load_application` asks it.
"""

from __future__ import annotations

import difflib
import re
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal, Self, get_args

import yaml
from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from streamkit.app.app_folder import CONFIG_FILE, data_dir_of
from streamkit.app.application import Application
from streamkit.app.loader import ApplicationLoadError, import_application
from streamkit.app.store_kinds import STORE_KINDS, records_to_log
from streamkit.message.framing import UnknownFraming, framing_for
from streamkit.message.mapping import (
    MappingFunc,
    StaticPartitions,
    field_key,
    modulo_mapping,
    random_mapping,
)
from streamkit.protocol import consumer_pb, pb
from streamkit.protocol.durations import format_duration, parse_duration
from streamkit.protocol.labels import label_set, label_value_problem
from streamkit.protocol.problems import (
    FieldProblems,
    Problem,
    SpecError,
    validation_problems,
    yaml_problem,
)
from streamkit.protocol.spec import FragmentSpec, JournalSpec, Label, journal_name_problem
from streamkit.recoverylog.fsm import CONTENT_TYPE as RECOVERY_LOG_CONTENT_TYPE
from streamkit.yaml_loading import load_yaml

__all__ = [
    "APP_LABEL",
    "CONFIG_FILE",
    "DEAD_LETTER",
    "DEAD_LETTERS_LABEL",
    "DEFAULT_STORE",
    "EVERY_SHARD",
    "FAIL",
    "ON_CONSUME_ERROR_LABEL",
    "ON_UNDECODABLE_LABEL",
    "PARTITION_PER_SHARD",
    "SKIP",
    "STORE_KINDS",
    "STORE_LABEL",
    "TOPIC_LABEL",
    "AppConfig",
    "ConfigError",
    "StoreConfig",
    "TopicConfig",
    "TransactionsConfig",
    "load_config",
]

DEFAULT_STORE = "rocksdb"  # when neither streamkit.yaml nor the Application names one
TOPIC_LABEL = "app.streamkit.dev/topic"  # on every partition of a topic
APP_LABEL = "app"  # on shard specs and recovery logs: the app's name
# On recovery logs: the id of the deployment (KeySpace) whose shards write them.
DEPLOYMENT_LABEL = "app.streamkit.dev/deployment"
NAME_RE = re.compile(r"[a-z][a-z0-9-]*")
MAX_NAME_LEN = 63
MAX_SHARDS = 1000  # shard ids and partition names keep three digits
MAX_PARTITIONS = 1000
MAX_STANDBYS = 8
HINT_BACKUPS = 2

_APPLICATION_RE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")

# Topics: large fragments for throughput, rolled at least every 15 minutes so
# that readers of fragment files (backfills) see data that recent.
_TOPIC_FRAGMENT = FragmentSpec(
    length=1 << 27, compression_codec="SNAPPY", flush_interval=timedelta(minutes=15)
)
# Recovery logs: smaller fragments, so playback and pruning work in finer steps.
_RECOVERY_LOG_FRAGMENT = FragmentSpec(length=1 << 26, compression_codec="SNAPPY")


# --- errors -----------------------------------------------------------------------


class ConfigError(SpecError):
    """A bad streamkit.yaml (or application it names): one readable line per problem."""


def _model_at(loc: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The model whose fields sit at `loc` (list indexes skipped), to suggest field names."""
    model: Any = AppConfig
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if isinstance(model, type) else None
        if field is None:
            return None
        model = field.annotation
        while not (isinstance(model, type) and issubclass(model, BaseModel)):
            args = [a for a in get_args(model) if a is not type(None)]
            if not args:
                return None
            model = args[0]
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _unknown_field(loc: tuple[str | int, ...]) -> str:
    model = _model_at(loc[:-1])
    if model is None or not isinstance(loc[-1], str):
        return "unknown field"
    known = list(model.model_fields)
    for field in model.model_fields.values():
        if isinstance(field.validation_alias, AliasChoices):
            known += [a for a in field.validation_alias.choices if isinstance(a, str)]
    known = list(dict.fromkeys(known))
    close = difflib.get_close_matches(loc[-1], known, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(known)}"
    return f"unknown field ({hint})"


_TYPE_WORDS = {
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "string_type": "must be a string",
    "model_type": "must be a mapping of settings",
    "dict_type": "must be a mapping of settings",
    "list_type": "must be a list",
}


def _wording(error: ErrorDetails) -> str | None:
    """streamkit.yaml's words for pydantic's errors (None: the shared default words).

    Its readers are app authors, not gazctl users: unknown fields get a suggestion.
    """
    ctx = error.get("ctx", {})
    kind = error["type"]
    if kind == "extra_forbidden":
        return _unknown_field(tuple(error["loc"]))
    if kind == "greater_than_equal":
        return f"must be ≥ {ctx['ge']} (got {error['input']!r})"
    if kind == "less_than_equal":
        return f"must be ≤ {ctx['le']} (got {error['input']!r})"
    if kind in _TYPE_WORDS:
        return f"{_TYPE_WORDS[kind]} (got {error['input']!r})"
    return None


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _config_error(message: str, source: str, path: str = "") -> ConfigError:
    return ConfigError([Problem(message, path, source=source)])


# --- field types ----------------------------------------------------------------------


def _duration(value: object) -> timedelta:
    if isinstance(value, bool):
        raise ValueError(f'expected a duration like "250ms", "1s", "2m" (got {value!r})')
    return parse_duration(value)


Duration = Annotated[timedelta, BeforeValidator(_duration)]


def _store_shorthand(value: object) -> object:
    """`store: sqlite` means `store: {kind: sqlite}`."""
    return {"kind": value} if isinstance(value, str) else value


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


PARTITION_PER_SHARD = "partition-per-shard"  # shard i reads partition i
EVERY_SHARD = "every-shard"  # every shard reads every partition (a broadcast)
READ_MODES = (PARTITION_PER_SHARD, EVERY_SHARD)

# What a shard does with a source message it can't decode, or whose consume_message raises.
FAIL = "fail"  # the shard fails, naming the message (the default, as in Gazette)
SKIP = "skip"  # the transaction passes over it, with a warning and a metric
DEAD_LETTER = "dead-letter"  # ... and appends it to the app's dead-letter journal
Policy = Literal["fail", "skip", "dead-letter"]
# Shard spec labels carrying the sources' policies other than fail, as values
# "<topic>:<policy>", and the journal dead letters go to: `streamkit run` writes
# them from streamkit.yaml, the shard's transaction loop reads them.
ON_UNDECODABLE_LABEL = "app.streamkit.dev/on-undecodable"
# On shard specs: the store kind the shards' state is kept in (members must run it).
STORE_LABEL = "app.streamkit.dev/store"
ON_CONSUME_ERROR_LABEL = "app.streamkit.dev/on-consume-error"
DEAD_LETTERS_LABEL = "app.streamkit.dev/dead-letters"


class TopicConfig(_Model):
    """A topic the app reads (a source) or publishes to (an output).

    `partitions` null (left out) means one per shard: AppConfig fills the
    app's shard count in before validating, so a topic of an AppConfig
    always has its count. `read`, `on_undecodable` and `on_consume_error`
    matter for sources only: a poison message fails its shard unless the
    source says to skip it or dead-letter it (see AppConfig.dead_letter_journal).
    """

    topic: str
    partitions: int | None = Field(None, strict=True, ge=1, le=MAX_PARTITIONS)
    content_type: str = "application/x-ndjson"
    key: str | None = None
    read: Literal["partition-per-shard", "every-shard"] = PARTITION_PER_SHARD
    on_undecodable: Policy = FAIL
    on_consume_error: Policy = FAIL

    @field_validator("topic")
    @classmethod
    def _check_topic(cls, topic: str) -> str:
        if topic.endswith("/"):
            raise ValueError(f"must not end in '/': partitions are named {topic}part-000 …")
        if problem := journal_name_problem(f"{topic}/part-000"):
            raise ValueError(f"not usable as a prefix of journal names: {problem}")
        if problem := label_value_problem(topic):
            raise ValueError(f"not usable as a label value: {problem}")
        return topic

    @field_validator("content_type")
    @classmethod
    def _check_content_type(cls, content_type: str) -> str:
        try:
            framing_for(content_type)
        except UnknownFraming as err:
            raise ValueError(str(err)) from None
        try:  # and as a journal would have it (MIME syntax, label characters)
            JournalSpec(
                name="topic/part-000", labels=[Label(name="content-type", value=content_type)]
            )
        except SpecError as err:
            raise ValueError("; ".join(p.message for p in err.problems)) from None
        return content_type

    @field_validator("key")
    @classmethod
    def _check_key(cls, key: str | None) -> str | None:
        if key is not None and not key.strip():
            raise ValueError("must name a field (or be left out for random partitioning)")
        return key

    def journals(self) -> list[str]:
        """The topic's partitions: `<topic>/part-000` …, in order."""
        if self.partitions is None:
            raise ValueError(f"topic {self.topic!r}: its partitions follow an app's shards")
        return [f"{self.topic}/part-{i:03d}" for i in range(self.partitions)]

    def journal_spec(self, journal: str) -> JournalSpec:
        return JournalSpec(
            name=journal,
            labels=[
                Label(name="content-type", value=self.content_type),
                Label(name=TOPIC_LABEL, value=self.topic),
            ],
            fragment=_TOPIC_FRAGMENT,
        )


class StoreConfig(_Model):
    """Where shards keep state. `kind` None: the Application's `store`, else rocksdb."""

    kind: str | None = None
    url: str | None = None

    @field_validator("kind")
    @classmethod
    def _check_kind(cls, kind: str | None) -> str | None:
        if kind is not None and kind not in STORE_KINDS:
            raise ValueError(f"must be one of {', '.join(STORE_KINDS)} (got {kind!r})")
        return kind

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str | None) -> str | None:
        if url is None:
            return url
        from sqlalchemy.engine import make_url  # heavy: only when a URL is given
        from sqlalchemy.exc import ArgumentError

        try:
            parsed = make_url(url)
        except ArgumentError as err:
            raise ValueError(f"not a SQLAlchemy database URL ({err})") from None
        from streamkit.stores.sql import (  # a missing driver fails here, once
            driver_problem,
            sqlite_file,
        )

        if (problem := driver_problem(url)) is not None:
            raise ValueError(problem)
        if sqlite_file(parsed) in ("", ":memory:"):
            raise ValueError("an in-memory SQLite database loses the shards' state and their "
                             "checkpoints at every stop (a restart would consume everything "
                             "again): name a file, e.g. sqlite:///state.db (in the app's folder)")
        return url

    @model_validator(mode="after")
    def _url_only_for_sql(self) -> Self:
        if self.url is not None and self.kind != "sql":
            raise FieldProblems.at("only a sql store takes a url (set kind: sql)", "url")
        return self


class TransactionsConfig(_Model):
    """How long a consumer transaction may (min) and must at most (max) run, and how long
    one call of an application hook may run before the watchdog names it (a query to the
    member's HTTP API gets as long, then a 503)."""

    min_duration: Duration = timedelta(0)
    max_duration: Duration = timedelta(seconds=1)
    hook_timeout: Duration = timedelta(seconds=30)

    @field_validator("min_duration")
    @classmethod
    def _check_min(cls, value: timedelta) -> timedelta:
        if value < timedelta(0):
            raise ValueError(f"must not be negative (got {format_duration(value)})")
        return value

    @field_validator("max_duration", "hook_timeout")
    @classmethod
    def _check_max(cls, value: timedelta) -> timedelta:
        if value <= timedelta(0):
            raise ValueError(f"must be more than 0s (got {format_duration(value)})")
        return value

    @model_validator(mode="after")
    def _min_below_max(self) -> Self:
        if self.min_duration > self.max_duration:
            raise FieldProblems.at(
                f"{format_duration(self.min_duration)} is more than max_duration "
                f"{format_duration(self.max_duration)}",
                "min_duration",
            )
        return self


def shard_id(index: int) -> str:
    """The id of an app's shard `index` (0-based): shard-000, shard-001, ..."""
    return f"shard-{index:03d}"


# --- the application's configuration ---------------------------------------------------


class AppConfig(_Model):
    """A validated streamkit.yaml, and everything derived from it."""

    name: str
    application: str
    shards: int = Field(1, strict=True, ge=1, le=MAX_SHARDS)
    sources: list[TopicConfig]
    outputs: list[TopicConfig] = Field(default_factory=list)
    store: Annotated[StoreConfig, BeforeValidator(_store_shorthand)] = StoreConfig()
    transactions: TransactionsConfig = TransactionsConfig()
    standbys: int = Field(
        0,
        strict=True,
        ge=0,
        le=MAX_STANDBYS,
        validation_alias=AliasChoices("standbys", "hot_standbys"),
    )

    _app_dir: Path | None = PrivateAttr(default=None)
    _document: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _one_standbys_spelling(cls, data: Any) -> Any:
        if isinstance(data, dict) and "standbys" in data and "hot_standbys" in data:
            raise FieldProblems.at("give standbys or hot_standbys, not both", "hot_standbys")
        return data

    @model_validator(mode="before")
    @classmethod
    def _partitions_follow_shards(cls, data: Any) -> Any:
        """A topic without `partitions` gets one per shard (the document is not changed)."""
        if not isinstance(data, dict):
            return data
        shards = data.get("shards", 1)
        if isinstance(shards, bool) or not isinstance(shards, int) or not shards >= 1:
            return data  # the shards field reports its own problem
        filled = dict(data)
        for field in ("sources", "outputs"):
            topics = data.get(field)
            if isinstance(topics, list):
                filled[field] = [
                    {**t, "partitions": shards}
                    if isinstance(t, dict) and t.get("partitions") is None
                    else t
                    for t in topics
                ]
        return filled

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        if not NAME_RE.fullmatch(name) or len(name) > MAX_NAME_LEN:
            raise ValueError(
                f"must be lower-case letters, digits and '-', starting with a letter, at most "
                f"{MAX_NAME_LEN} characters (got {name!r})"
            )
        return name

    @field_validator("application")
    @classmethod
    def _check_application(cls, application: str) -> str:
        if not _APPLICATION_RE.fullmatch(application):
            raise ValueError(f'must be "module:Class", e.g. "app:WordCount" (got {application!r})')
        return application

    @field_validator("sources")
    @classmethod
    def _check_sources(cls, sources: list[TopicConfig]) -> list[TopicConfig]:
        if not sources:
            raise ValueError("at least one source topic is required")
        return sources

    @model_validator(mode="after")
    def _check_topics(self) -> Self:
        found: list[tuple[tuple[str | int, ...], str]] = []
        for i, source in enumerate(self.sources):
            if problem := self._partition_problem(source):
                found.append((("sources", i, "partitions"), problem))
        listed: set[tuple[str, str]] = set()
        as_source = {source.topic: source for source in self.sources}
        for field in ("sources", "outputs"):
            for i, topic in enumerate(getattr(self, field)):
                if (field, topic.topic) in listed:
                    found.append(((field, i, "topic"), f"topic {topic.topic!r} is listed twice"))
                elif field == "outputs" and as_source.get(topic.topic, topic) != topic:
                    found.append(
                        (
                            (field, i),
                            f"topic {topic.topic!r} is also a source, "
                            "with different settings: make them the same",
                        )
                    )
                listed.add((field, topic.topic))
        if found:
            raise FieldProblems(found)
        return self

    def _partition_problem(self, source: TopicConfig) -> str | None:
        """Why a source's partitions don't fit the shards (None: they do)."""
        partitions = source.partitions or self.shards  # always filled in (see TopicConfig)
        if source.read == EVERY_SHARD or partitions == self.shards:
            return None
        if partitions < self.shards:
            effect = (
                "several shards would read each partition and process its messages several times"
            )
        else:
            effect = f"partitions {self.shards} and up would never be read"
        return (
            f"topic {source.topic!r} has {_count(partitions, 'partition')} but the app "
            f"has {_count(self.shards, 'shard')}: {effect}. Leave partitions out (it follows "
            f"the shard count) or set it to {self.shards}; for a broadcast topic every shard "
            f"reads whole, set read: {EVERY_SHARD}"
        )

    # --- loading ------------------------------------------------------------------

    @classmethod
    def parse(
        cls, document: Any, source: str = CONFIG_FILE, app_dir: Path | None = None
    ) -> AppConfig:
        """Validate a parsed document; problems raise ConfigError naming `source`."""
        if not isinstance(document, dict):
            kind = "empty" if document is None else f"a {type(document).__name__}"
            raise _config_error(
                f"expected a mapping of settings (name, application, "
                f"sources, ...), but the file is {kind}",
                source,
            )
        try:
            config = cls.model_validate(document)
        except ValidationError as err:
            raise ConfigError(validation_problems(err, source=source, wording=_wording)) from None
        config._app_dir = app_dir
        config._document = document
        return config

    def with_settings(self, **settings: Any) -> AppConfig:
        """The file's settings with some replaced (as `--shards N` asks), validated again.

        Topics whose partitions the file leaves out follow a new shard count.
        """
        document = {**self._document, **settings}
        return AppConfig.parse(document, self.config_file, self._app_dir)

    def document(self) -> dict[str, Any]:
        """The settings as given (before defaults were filled in)."""
        return dict(self._document)

    @property
    def app_dir(self) -> Path:
        """The folder streamkit.yaml was loaded from (the current one if not from a file)."""
        return self._app_dir if self._app_dir is not None else Path(".")

    @property
    def config_file(self) -> str:
        return str(self.app_dir / CONFIG_FILE)

    @property
    def data_dir(self) -> Path:
        """Where the app keeps local data (broker, keyspace, shard directories)."""
        return data_dir_of(self.app_dir)

    def with_store(self, kind: str) -> AppConfig:
        """A copy using store `kind` (as `streamkit run --store` asks); a url stays only for sql."""
        if kind not in STORE_KINDS:
            raise _config_error(
                f"must be one of {', '.join(STORE_KINDS)} (got {kind!r})", "store kind"
            )
        store = StoreConfig(kind=kind, url=self.store.url if kind == "sql" else None)
        return self.model_copy(update={"store": store})

    def for_application(self, app_class: type[Application]) -> AppConfig:
        """The config with the Application's `store` filled in when streamkit.yaml names none."""
        if self.store.kind is not None:
            return self
        return self.with_store(app_class.store or DEFAULT_STORE)

    @property
    def store_kind(self) -> str:
        return self.store.kind or DEFAULT_STORE

    def sql_url(self) -> str:
        """The SQL store's database: `store.url`, or an SQLite file in the data dir. A
        relative SQLite file is in the app's folder, as other paths of the file are (not
        in the folder a command happens to run from: `run` and `backfill` run from two
        would use two databases)."""
        if self.store.url is None:
            return f"sqlite:///{(self.data_dir / 'store.sqlite').resolve()}"
        from sqlalchemy.engine import make_url

        from streamkit.stores.sql import sqlite_file

        url = make_url(self.store.url)
        path = sqlite_file(url)
        if path in (None, "", ":memory:") or Path(path).is_absolute():
            return self.store.url
        here, there = (self.app_dir / path).resolve(), Path(path).resolve()
        if not here.exists() and there.exists() and here != there:
            raise ConfigError([Problem(
                f"{self.store.url} names {here} (a relative SQLite file is in the app's "
                f"folder), which doesn't exist, while {there} does: where streamkit before "
                "2026-11-27 put it, relative to the folder the command ran from. Move it into "
                "the app's folder (or give its absolute path), so the shards keep their state",
                "store.url", source=self.config_file)])
        resolved = url.set(database=("file:" if path != url.database else "") + str(here))
        return resolved.render_as_string(hide_password=False)

    # --- names --------------------------------------------------------------------

    @property
    def keyspace_root(self) -> str:
        return f"/gazette/consumers/{self.name}"

    @property
    def hint_prefix(self) -> str:
        return f"{self.keyspace_root}/hints"

    @property
    def hot_standbys(self) -> int:
        return self.standbys

    def shard_ids(self) -> list[str]:
        return [shard_id(i) for i in range(self.shards)]

    def _topic(self, topic: str) -> TopicConfig:
        for candidate in (*self.outputs, *self.sources):
            if candidate.topic == topic:
                return candidate
        raise _config_error(
            f"topic {topic!r} is neither a source nor an output (add it to outputs)",
            self.config_file,
        )

    def topics(self) -> list[TopicConfig]:
        """Every topic once: sources, then outputs that are not also sources."""
        seen = {source.topic for source in self.sources}
        return [*self.sources, *(t for t in self.outputs if t.topic not in seen)]

    def topic_journals(self, topic: str) -> list[str]:
        return self._topic(topic).journals()

    def source_journals(self, shard_index: int) -> list[str]:
        """The journals shard `shard_index` reads: partition `shard_index` of each source,
        and every partition of an every-shard source."""
        if not 0 <= shard_index < self.shards:
            raise IndexError(f"shard index {shard_index} out of range (0..{self.shards - 1})")
        journals: list[str] = []
        for source in self.sources:
            partitions = source.journals()
            journals += partitions if source.read == EVERY_SHARD else [partitions[shard_index]]
        return journals

    @property
    def recovery_log_prefix(self) -> str:
        """Empty for sql stores: their database is durable on its own, no log is recorded."""
        return f"recovery/{self.name}" if records_to_log(self.store_kind) else ""

    def recovery_log(self, shard_id: str) -> str:
        prefix = self.recovery_log_prefix
        return f"{prefix}/{shard_id}" if prefix else ""

    @property
    def dead_letter_journal(self) -> str:
        """Where shards append the source messages a `dead-letter` policy passes over.

        One journal for the app, `<name>/dead-letters` (never a topic's partition,
        which ends in `/part-NNN`); it exists only if some source dead-letters.
        """
        return f"{self.name}/dead-letters"

    def dead_letters(self) -> bool:
        """Whether a source's policy dead-letters (so the dead-letter journal is needed)."""
        return any(DEAD_LETTER in (s.on_undecodable, s.on_consume_error) for s in self.sources)

    def _policy_labels(self) -> list[tuple[str, str]]:
        """Shard spec labels saying which sources skip or dead-letter, and where to."""
        labels = [
            (label, f"{source.topic}:{policy}")
            for source in self.sources
            for label, policy in (
                (ON_UNDECODABLE_LABEL, source.on_undecodable),
                (ON_CONSUME_ERROR_LABEL, source.on_consume_error),
            )
            if policy != FAIL
        ]
        if self.dead_letters():
            labels.append((DEAD_LETTERS_LABEL, self.dead_letter_journal))
        return labels

    # --- specs --------------------------------------------------------------------

    def journal_specs(self, deployment: str = "") -> list[JournalSpec]:
        """Every journal the app needs: topic partitions, its dead-letter journal if a
        source dead-letters, then the shards' recovery logs (labeled with `deployment`,
        the id of the KeySpace's deployment of the app, when given: app/deployment.py)."""
        specs = [
            topic.journal_spec(journal) for topic in self.topics() for journal in topic.journals()
        ]
        if self.dead_letters():
            specs.append(
                JournalSpec(
                    name=self.dead_letter_journal,
                    labels=[
                        Label(name="content-type", value="application/x-ndjson"),
                        Label(name=DEAD_LETTERS_LABEL, value=self.name),
                    ],
                    fragment=_TOPIC_FRAGMENT,
                )
            )
        for shard_id in self.shard_ids():
            if log := self.recovery_log(shard_id):
                specs.append(
                    JournalSpec(
                        name=log,
                        labels=[
                            Label(name="content-type", value=RECOVERY_LOG_CONTENT_TYPE),
                            Label(name=APP_LABEL, value=self.name),
                            *([Label(name=DEPLOYMENT_LABEL, value=deployment)]
                              if deployment else []),
                        ],
                        fragment=_RECOVERY_LOG_FRAGMENT,
                    )
                )
        return specs

    def shard_specs(self) -> list[consumer_pb.ShardSpec]:
        specs = []
        for index, shard_id in enumerate(self.shard_ids()):
            spec = consumer_pb.ShardSpec(
                id=shard_id,
                sources=[
                    consumer_pb.ShardSpec.Source(journal=journal, min_offset=0)
                    for journal in self.source_journals(index)
                ],
                recovery_log_prefix=self.recovery_log_prefix,
                hint_prefix=self.hint_prefix,
                hint_backups=HINT_BACKUPS,
                hot_standbys=self.standbys,
                labels=label_set((APP_LABEL, self.name), (STORE_LABEL, self.store_kind),
                                 *self._policy_labels()),
            )
            spec.max_txn_duration.FromTimedelta(self.transactions.max_duration)
            spec.min_txn_duration.FromTimedelta(self.transactions.min_duration)
            specs.append(spec)
        return specs

    def mapping_for(self, topic: str) -> MappingFunc:
        """How messages are routed to the topic's partitions: by its key, else at random."""
        config = self._topic(topic)
        journals = [
            pb.ListResponse.Journal(spec=config.journal_spec(name).to_proto())
            for name in config.journals()
        ]
        partitions = StaticPartitions(journals, selector=f"{TOPIC_LABEL}={topic}")
        if config.key is None:
            return random_mapping(partitions)
        return modulo_mapping(field_key(config.key), partitions)

    # --- the application class --------------------------------------------------------

    def load_application(self, app_dir: Path | None = None) -> type[Application]:
        """Import the `module:Class` named by `application`, with the app folder on sys.path."""
        folder = Path(app_dir if app_dir is not None else self.app_dir).resolve()
        try:
            return import_application(self.application, folder, self.config_file)
        except ApplicationLoadError as err:
            raise ConfigError(err.problems) from None


def load_config(app_dir: Path | str) -> AppConfig:
    """Read and validate `<app_dir>/streamkit.yaml`; any problem raises ConfigError."""
    folder = Path(app_dir)
    path = folder / CONFIG_FILE
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        hint = "" if folder.is_dir() else f" ({folder} is not a folder)"
        raise _config_error(
            f"no such file{hint}: is this an app folder? `streamkit new NAME` makes one", source
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise _config_error(f"cannot read: {err}", source) from None
    try:
        document = load_yaml(text)
    except yaml.YAMLError as err:
        raise ConfigError([yaml_problem(err, source)]) from None
    return AppConfig.parse(document, source, folder)
