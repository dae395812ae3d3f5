"""Shard specs: a validated pydantic model of consumer.ShardSpec, its protobuf form, gazctl YAML.

The rules are those Gazette's consumers apply to a ShardSpec, so a spec that
passes here is accepted by a Gazette consumer too. Two are stricter: the
minimum transaction duration may not exceed the maximum, and a hint prefix may
not be "/" alone. Failures are ``SpecError``s (see ``problems``, shared with
journal specs), one line per problem naming the shard id and the field.

Files use the layout of ``gazctl shards apply`` / ``shards list``: a ``common``
mapping of settings every shard inherits, and a ``shards`` list whose entries
carry an ``id``, their own settings (labels merge by name with the common ones;
any other setting replaces the common value), and optionally ``revision`` (the
expected mod revision: 0 creates, -1 skips the check), ``delete: true`` and a
``comment``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Self

import yaml
from pydantic import Field, field_validator, model_validator

from streamkit.protocol import consumer_pb
from streamkit.protocol.durations import GoDuration, format_duration
from streamkit.protocol.inheritance import (
    FlatSettings,
    flatten_labels,
    merge_labels,
    settings_beyond,
    shared_settings,
)
from streamkit.protocol.labels import label_set
from streamkit.protocol.problems import FieldProblems, Problem, SpecError, yaml_problem
from streamkit.protocol.spec import (
    INT64,
    Label,
    SpecModel,
    journal_name_problem,
    label_set_problem,
)
from streamkit.yaml_loading import load_yaml

__all__ = [
    "DEFAULT_MAX_TXN_DURATION",
    "DEFAULT_READ_CHANNEL_SIZE",
    "DEFAULT_RING_BUFFER_SIZE",
    "MAX_SHARD_ID_LEN",
    "MIN_SHARD_ID_LEN",
    "ShardEntry",
    "ShardProblem",
    "ShardSource",
    "ShardSpecModel",
    "dump_shard_specs",
    "hint_prefix_problem",
    "load_shard_entries",
    "load_shard_specs",
    "shard_id_problem",
    "validate_shard_proto",
]

MIN_SHARD_ID_LEN, MAX_SHARD_ID_LEN = 4, 512
# Gazette reads a zero size as "use the default"; we store the default itself.
DEFAULT_RING_BUFFER_SIZE = DEFAULT_READ_CHANNEL_SIZE = 8192
# Gazette has no default (zero is invalid); a YAML file that omits it gets this.
DEFAULT_MAX_TXN_DURATION = timedelta(seconds=1)
_INT32_MAX, _UINT32_MAX = 2**31 - 1, 2**32 - 1

# A shard id is a Gazette token over the path alphabet: letters, digits, -_+/.=%
# (no path-shape rules, unlike journal names).
_SHARD_ID_RE = re.compile(r"[\w\-+/.=%]*")


# --- errors ---------------------------------------------------------------------


@dataclass(frozen=True)
class ShardProblem(Problem):
    """A Problem located on a shard (by id) rather than on a journal."""

    shard: str | None = None

    def __str__(self) -> str:
        parts = [self.source] if self.source else []
        if self.shard is not None:
            parts.append(f'shard "{self.shard}"')
        if self.path:
            parts.append(self.path)
        return ": ".join([*parts, self.message])


def _on_shard(err: SpecError, shard: object) -> SpecError:
    """The problems of ``err`` re-attributed to shard ``shard``."""
    shard_id = shard if isinstance(shard, str) else None
    return SpecError(
        ShardProblem(p.message, p.path, source=p.source, shard=shard_id) for p in err.problems
    )


# --- field checks ---------------------------------------------------------------


def shard_id_problem(shard_id: str) -> str | None:
    """Why ``shard_id`` is not a valid shard id, or None."""
    if not MIN_SHARD_ID_LEN <= len(shard_id) <= MAX_SHARD_ID_LEN:
        return f"must be {MIN_SHARD_ID_LEN} to {MAX_SHARD_ID_LEN} characters (got {len(shard_id)})"
    if not _SHARD_ID_RE.fullmatch(shard_id):
        return f"may hold only letters, digits and -_+/.=% (got {shard_id!r})"
    return None


def hint_prefix_problem(prefix: str) -> str | None:
    """Why ``prefix`` can't prefix hint keys: it must be an absolute, clean, non-directory path."""
    if not prefix.startswith("/") or prefix.endswith("/"):
        return f"must start with '/' and not end with '/' (got {prefix!r})"
    if any(segment in ("", ".", "..") for segment in prefix[1:].split("/")):
        return f"must be a clean path, without empty, '.' or '..' segments (got {prefix!r})"
    return None


def _check_range(value: int, low: int, high: int) -> int:
    if not low <= value <= high:
        raise ValueError(f"must be between {low} and {high} (got {value})")
    return value


# --- models ---------------------------------------------------------------------


class ShardSource(SpecModel):
    """A journal the shard reads, and where to start when no checkpoint says otherwise."""

    journal: str
    min_offset: int = 0

    @field_validator("journal")
    @classmethod
    def _check_journal(cls, journal: str) -> str:
        if problem := journal_name_problem(journal):
            raise ValueError(problem)
        return journal

    @field_validator("min_offset")
    @classmethod
    def _check_offset(cls, offset: int) -> int:
        if offset < 0:
            raise ValueError(f"must not be negative (got {offset})")
        return _check_range(offset, 0, INT64 - 1)  # (an int64 on the wire)


class ShardSpecModel(SpecModel):
    """A shard's id and configuration. Omitted fields take Gazette's usual values."""

    id: str
    sources: list[ShardSource] = Field(default_factory=list)
    recovery_log_prefix: str = ""
    hint_prefix: str = ""
    hint_backups: int = 0
    max_txn_duration: GoDuration = DEFAULT_MAX_TXN_DURATION
    min_txn_duration: GoDuration = timedelta(0)
    disable: bool = False
    hot_standbys: int = 0
    labels: list[Label] = Field(default_factory=list)
    disable_wait_for_ack: bool = False
    ring_buffer_size: int = DEFAULT_RING_BUFFER_SIZE
    read_channel_size: int = DEFAULT_READ_CHANNEL_SIZE

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except SpecError as err:
            raise _on_shard(err, data.get("id")) from None

    def __setattr__(self, field_name: str, value: Any) -> None:
        try:
            super().__setattr__(field_name, value)
        except SpecError as err:
            raise _on_shard(err, self.id) from None

    @field_validator("id")
    @classmethod
    def _check_id(cls, shard_id: str) -> str:
        if problem := shard_id_problem(shard_id):
            raise ValueError(problem)
        return shard_id

    @field_validator("sources")
    @classmethod
    def _check_sources(cls, sources: list[ShardSource]) -> list[ShardSource]:
        """Sort by journal (Gazette wants them ordered), refusing a journal read twice."""
        ordered = sorted(sources, key=lambda source: source.journal)
        for index in range(1, len(ordered)):
            if ordered[index].journal == ordered[index - 1].journal:
                journal = ordered[index].journal
                raise FieldProblems.at(
                    f"journal {journal!r} is listed more than once", index, "journal"
                )
        return ordered

    @field_validator("hint_backups")
    @classmethod
    def _check_backups(cls, backups: int) -> int:
        return _check_range(backups, 0, _INT32_MAX)

    @field_validator("hot_standbys")
    @classmethod
    def _check_standbys(cls, standbys: int) -> int:
        # No upper bound here: like Gazette, the runtime caps the standbys it assigns.
        return _check_range(standbys, 0, _UINT32_MAX)

    @field_validator("max_txn_duration")
    @classmethod
    def _check_max_txn(cls, duration: timedelta) -> timedelta:
        if duration <= timedelta(0):
            raise ValueError(f"must be greater than 0s (got {format_duration(duration)})")
        return duration

    @field_validator("min_txn_duration")
    @classmethod
    def _check_min_txn(cls, duration: timedelta) -> timedelta:
        if duration < timedelta(0):
            raise ValueError(f"must not be negative (got {format_duration(duration)})")
        return duration

    @field_validator("labels")
    @classmethod
    def _check_labels(cls, labels: list[Label]) -> list[Label]:
        """Sort and de-duplicate, as a LabelSet is; "id" is the shard's meta-label."""
        labels = sorted(set(labels), key=lambda label: (label.name, label.value))
        for index, label in enumerate(labels):
            if label.name == "id":
                raise FieldProblems.at(
                    '"id" is reserved (it matches the shard id in selectors)', index
                )
        return labels

    @field_validator("ring_buffer_size", "read_channel_size")
    @classmethod
    def _check_size(cls, size: int) -> int:
        return _check_range(size, 0, _UINT32_MAX) or DEFAULT_RING_BUFFER_SIZE

    @model_validator(mode="after")
    def _check_log_and_hints(self) -> Self:
        if self.recovery_log_prefix:
            if problem := journal_name_problem(self.recovery_log):
                raise FieldProblems.at(
                    f"makes an invalid recovery log {self.recovery_log!r}: {problem}",
                    "recovery_log_prefix",
                )
            if not self.hint_prefix:
                raise FieldProblems.at("is required when recovery_log_prefix is set", "hint_prefix")
            if problem := hint_prefix_problem(self.hint_prefix):
                raise FieldProblems.at(problem, "hint_prefix")
        elif self.hint_prefix:
            raise FieldProblems.at("must be empty when recovery_log_prefix is empty", "hint_prefix")
        return self

    @model_validator(mode="after")
    def _check_txn_bounds(self) -> Self:
        if self.min_txn_duration > self.max_txn_duration:
            low, high = map(format_duration, (self.min_txn_duration, self.max_txn_duration))
            raise FieldProblems.at(
                f"must not exceed max_txn_duration ({low} > {high})", "min_txn_duration"
            )
        return self

    # --- derived names (Gazette's layout) ---

    @property
    def recovery_log(self) -> str:
        """The recovery log journal, "{recovery_log_prefix}/{id}", or "" without one."""
        return f"{self.recovery_log_prefix}/{self.id}" if self.recovery_log_prefix else ""

    @property
    def hint_primary_key(self) -> str:
        """Key the primary writes its recovery-log hints to."""
        return f"{self.hint_prefix}/{self.id}.primary"

    def hint_backup_keys(self) -> list[str]:
        """Keys of the verified backup hints, newest first."""
        return [f"{self.hint_prefix}/{self.id}.backup.{i}" for i in range(self.hint_backups)]

    def desired_replication(self, max_hot_standbys: int | None = None) -> int:
        """Processes to assign: none when disabled, else a primary plus its (capped) standbys."""
        if self.disable:
            return 0
        standbys = self.hot_standbys
        return 1 + (standbys if max_hot_standbys is None else min(standbys, max_hot_standbys))

    # --- protobuf ---

    def to_proto(self) -> consumer_pb.ShardSpec:
        """The wire form, field for field."""
        out = consumer_pb.ShardSpec(
            id=self.id,
            sources=[
                consumer_pb.ShardSpec.Source(journal=s.journal, min_offset=s.min_offset)
                for s in self.sources
            ],
            recovery_log_prefix=self.recovery_log_prefix,
            hint_prefix=self.hint_prefix,
            hint_backups=self.hint_backups,
            disable=self.disable,
            hot_standbys=self.hot_standbys,
            labels=label_set(*((label.name, label.value) for label in self.labels)),
            disable_wait_for_ack=self.disable_wait_for_ack,
            ring_buffer_size=self.ring_buffer_size,
            read_channel_size=self.read_channel_size,
        )
        out.max_txn_duration.FromTimedelta(self.max_txn_duration)
        out.min_txn_duration.FromTimedelta(self.min_txn_duration)
        return out

    @classmethod
    def from_proto(cls, spec: consumer_pb.ShardSpec) -> ShardSpecModel:
        """Validate a wire spec as is: an unset max_txn_duration is an error, not 1s.

        Zero buffer sizes become the default they stand for.
        """
        return cls(
            id=spec.id,
            sources=[{"journal": s.journal, "min_offset": s.min_offset} for s in spec.sources],
            recovery_log_prefix=spec.recovery_log_prefix,
            hint_prefix=spec.hint_prefix,
            hint_backups=spec.hint_backups,
            max_txn_duration=spec.max_txn_duration.ToTimedelta(),
            min_txn_duration=spec.min_txn_duration.ToTimedelta(),
            disable=spec.disable,
            hot_standbys=spec.hot_standbys,
            labels=[{"name": lbl.name, "value": lbl.value} for lbl in spec.labels.labels],
            disable_wait_for_ack=spec.disable_wait_for_ack,
            ring_buffer_size=spec.ring_buffer_size,
            read_channel_size=spec.read_channel_size,
        )


def validate_shard_proto(spec: consumer_pb.ShardSpec) -> None:
    """Raise SpecError unless ``spec`` is valid and canonical (for the Apply RPC).

    ``from_proto`` quietly sorts sources and labels; here unsorted input is an error.
    """
    ShardSpecModel.from_proto(spec)
    problems: list[ShardProblem] = []
    journals = [source.journal for source in spec.sources]
    if journals != sorted(set(journals)):
        problems.append(ShardProblem("must be in unique, sorted order of journal", "sources"))
    if problem := label_set_problem(spec.labels):
        problems.append(ShardProblem(problem.message, problem.path))
    if problems:
        raise SpecError(ShardProblem(p.message, p.path, shard=spec.id) for p in problems)


# --- YAML: loading -----------------------------------------------------------------

_SETTING_KEYS = tuple(name for name in ShardSpecModel.model_fields if name != "id")
_ENTRY_KEYS = frozenset({"id", "revision", "delete", "comment", *_SETTING_KEYS})
_DOCUMENT_KEYS = frozenset({"common", "shards"})


@dataclass(frozen=True)
class ShardEntry:
    """A shard from a spec file, with the Apply options its entry gave."""

    spec: ShardSpecModel
    # Expected mod revision: 0 means "create", -1 means "don't check".
    revision: int = 0
    delete: bool = False
    comment: str = ""


def _top_field(path: str) -> str:
    """ "labels[0].name" -> "labels"."""
    return re.split(r"[.\[]", path, maxsplit=1)[0]


class _FileLoader:
    """Reads a ``common`` + ``shards`` document, collecting every problem on the way."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.entries: list[ShardEntry] = []
        self.problems: list[Problem] = []
        self.seen: set[str] = set()
        self.common: dict[str, Any] = {}

    def fail(self, shard: str | None, path: str, message: str) -> None:
        problem = ShardProblem(message, path, source=self.source, shard=shard)
        if problem not in self.problems:  # a bad common setting fails every shard alike
            self.problems.append(problem)

    def load(self, document: object) -> None:
        if not isinstance(document, dict):
            self.fail(None, "", "a shard file is a mapping with `common` and `shards` keys")
            return
        for key in sorted(set(document) - _DOCUMENT_KEYS, key=str):
            self.fail(None, str(key), "unknown field (expected `common` and `shards`)")
        self.load_common(document.get("common") or {})
        shards = document.get("shards") or []
        if not isinstance(shards, list):
            self.fail(None, "shards", "must be a list of shards")
            return
        for index, node in enumerate(shards):
            self.load_shard(index, node)

    def load_common(self, common: object) -> None:
        if not isinstance(common, dict):
            self.fail(None, "common", "must be a mapping of shard settings")
            return
        for key in sorted(set(common) - set(_SETTING_KEYS), key=str):
            message = "belongs to a shard, not to common settings" if key == "id" else None
            self.fail(None, f"common.{key}", message or "unknown field")
        self.common = {key: common[key] for key in _SETTING_KEYS if key in common}

    def typed(self, node: Mapping[str, Any], shard: str, key: str, kind: type, default: Any) -> Any:
        value = node.get(key, default)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            names = {bool: "true or false", int: "an integer", str: "a string"}
            self.fail(shard, key, f"must be {names[kind]} (got {value!r})")
            return default
        if kind is int and not -INT64 <= value < INT64:  # (the protobuf field's range)
            self.fail(shard, key, f"must be a 64-bit integer (got {value})")
            return default
        return value

    def load_shard(self, index: int, node: object) -> None:
        if not isinstance(node, dict):
            self.fail(None, f"shards[{index}]", f"each shard must be a mapping (got {node!r})")
            return
        shard = node.get("id")
        if not isinstance(shard, str):
            missing = shard is None
            self.fail(None, f"shards[{index}].id", "is required" if missing else "must be a string")
            return
        for key in sorted(set(node) - _ENTRY_KEYS, key=str):
            self.fail(shard, str(key), "unknown field")
        if shard in self.seen:
            self.fail(shard, "id", "shard appears more than once")
        self.seen.add(shard)
        revision = self.typed(node, shard, "revision", int, 0)
        delete = self.typed(node, shard, "delete", bool, False)
        comment = self.typed(node, shard, "comment", str, "")
        settings = dict(self.common)
        for key in _SETTING_KEYS:
            if key in node:
                above = self.common.get(key)
                settings[key] = merge_labels(above, node[key]) if key == "labels" else node[key]
        try:
            spec = ShardSpecModel(id=shard, **settings)
        except SpecError as err:
            for problem in err.problems:
                field = _top_field(problem.path)
                if field in self.common and field not in node:
                    self.fail(None, f"common.{problem.path}", problem.message)
                else:
                    self.fail(shard, problem.path, problem.message)
            return
        self.entries.append(ShardEntry(spec, revision, delete, comment))


def load_shard_entries(text: str, source: str = "<shards>") -> list[ShardEntry]:
    """Shards of a gazctl-style file, in file order, with their revision/delete/comment.

    Raises SpecError listing every problem, each naming ``source``, the shard id
    (or ``common``) and the field.
    """
    try:
        document = load_yaml(text)
    except yaml.YAMLError as err:
        raise SpecError([yaml_problem(err, source)]) from None
    if document is None:
        return []
    loader = _FileLoader(source)
    loader.load(document)
    if loader.problems:
        raise SpecError(loader.problems)
    return loader.entries


def load_shard_specs(text: str, source: str = "<shards>") -> list[ShardSpecModel]:
    """The shards a file wants to exist: its entries minus those marked ``delete``."""
    return [entry.spec for entry in load_shard_entries(text, source) if not entry.delete]


# --- YAML: dumping -------------------------------------------------------------------

# A spec's settings as FlatSettings (labels one slot per name), without the
# settings at their default: ("hot_standbys",) -> 1, ("labels", "app") -> ("wordcount",).
_DEFAULTS = ShardSpecModel(id="defaults").model_dump(mode="json")


def _flatten(spec: ShardSpecModel) -> FlatSettings:
    flat: FlatSettings = {}
    for key, value in spec.model_dump(mode="json", exclude={"id"}).items():
        if key == "labels":
            flatten_labels(flat, value)
        elif key == "sources":
            if value:
                flat[(key,)] = [{k: v for k, v in s.items() if v or k == "journal"} for s in value]
        elif value != _DEFAULTS[key]:
            flat[(key,)] = value
    return flat


def _unflatten(flat: FlatSettings) -> dict[str, Any]:
    node: dict[str, Any] = {}
    for key in _SETTING_KEYS:  # in the model's field order
        if key == "labels":
            labels = [(k[1], values) for k, values in flat.items() if k[0] == "labels"]
            if labels:
                node["labels"] = [{"name": n, "value": v} for n, vs in labels for v in vs]
        elif (key,) in flat:
            node[key] = flat[(key,)]
    return node


def dump_shard_specs(specs: Iterable[ShardSpecModel | ShardEntry]) -> str:
    """Shards as a gazctl-style file: shared settings hoisted into ``common``, sorted by id.

    Settings at their default are left out; ``load_shard_entries`` reads the
    text back as equal entries.
    """
    entries = [s if isinstance(s, ShardEntry) else ShardEntry(s) for s in specs]
    ids = Counter(entry.spec.id for entry in entries)
    if repeated := sorted(shard for shard, count in ids.items() if count > 1):
        raise SpecError(
            ShardProblem("shard appears more than once", "id", shard=s) for s in repeated
        )
    if not entries:
        return ""
    entries.sort(key=lambda entry: entry.spec.id)
    flats = [_flatten(entry.spec) for entry in entries]
    common = shared_settings(flats) if len(flats) > 1 else {}
    shards = []
    for entry, flat in zip(entries, flats, strict=True):
        node = {"id": entry.spec.id, **_unflatten(settings_beyond(flat, common))}
        if entry.revision:
            node["revision"] = entry.revision
        if entry.delete:
            node["delete"] = True
        if entry.comment:
            node["comment"] = entry.comment
        shards.append(node)
    document = {"common": _unflatten(common)} if common else {}
    document["shards"] = shards
    return yaml.safe_dump(document, sort_keys=False, allow_unicode=True, default_flow_style=False)
