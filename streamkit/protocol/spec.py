"""Journal specs: validated pydantic models and their protobuf mapping.

The rules are Gazette's, so a spec accepted here is accepted by a Gazette
broker too (label values are a little more permissive: see ``labels``). Every
failure is a ``SpecError`` (see ``problems``) listing one readable line per
problem, each naming the journal, the field path and the rule; pydantic's own
errors never escape. gazctl's YAML form of these specs is in ``spec_tree``.
"""

from __future__ import annotations

import re
from dataclasses import replace
from datetime import timedelta
from typing import Annotated, Any, ClassVar, Self
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    field_validator,
    model_validator,
)

from streamkit.protocol import pb
from streamkit.protocol.durations import GoDuration, format_duration
from streamkit.protocol.journal_names import (
    MAX_JOURNAL_NAME_LEN,
    MIN_JOURNAL_NAME_LEN,
    journal_name_problem,
)
from streamkit.protocol.labels import (
    META_LABELS,
    label_name_problem,
    label_set,
    label_value_problem,
)
from streamkit.protocol.problems import FieldProblems, Problem, SpecError, validation_problems

__all__ = [
    "CODECS",
    "DEFAULT_FRAGMENT_LENGTH",
    "INT64",
    "MAX_FRAGMENT_LENGTH",
    "MAX_JOURNAL_NAME_LEN",
    "MAX_OFFSET",
    "MAX_REFRESH_INTERVAL",
    "MAX_REPLICATION",
    "MIN_FLUSH_INTERVAL",
    "MIN_FRAGMENT_LENGTH",
    "MIN_JOURNAL_NAME_LEN",
    "MIN_REFRESH_INTERVAL",
    "STORE_SCHEMES",
    "FragmentSpec",
    "JournalSpec",
    "Label",
    "SpecModel",
    "journal_name_problem",
    "label_set_problem",
    "validate_proto",
]

MAX_REPLICATION = 5
INT64 = 1 << 63  # protobuf int64 fields (revisions, offsets) hold [-INT64, INT64)
MAX_OFFSET = INT64 - 1  # the largest offset (or revision, or time) they hold
MIN_FRAGMENT_LENGTH, MAX_FRAGMENT_LENGTH = 1 << 10, 1 << 34
MIN_REFRESH_INTERVAL, MAX_REFRESH_INTERVAL = timedelta(seconds=1), timedelta(hours=24)
# A non-zero flush_interval shorter than this is rejected (Gazette's rule).
MIN_FLUSH_INTERVAL = timedelta(minutes=1)
STORE_SCHEMES = frozenset({"file", "s3", "gs", "azure"})
CODECS = ("NONE", "GZIP", "ZSTANDARD", "SNAPPY", "GZIP_OFFLOAD_DECOMPRESSION")
FLAGS = frozenset(pb.JournalSpec.Flag.values())
_FLAG_NAMES = tuple(pb.JournalSpec.Flag.keys())
DEFAULT_FRAGMENT_LENGTH = 1 << 29

# RFC 2045 media type: type "/" subtype *(";" attribute "=" value).
_MIME_TOKEN = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_MIME_RE = re.compile(
    rf"{_MIME_TOKEN}/{_MIME_TOKEN}(\s*;\s*{_MIME_TOKEN}=({_MIME_TOKEN}|\"[^\"]*\"))*\s*;?\s*"
)


# --- field checks ---------------------------------------------------------------


def _between(value: Any, low: Any, high: Any, show: Any = str) -> None:
    if not low <= value <= high:
        raise ValueError(f"must be between {show(low)} and {show(high)} (got {show(value)})")


def _codec_name(value: object) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        value = pb.CompressionCodec.Name(value) if value in pb.CompressionCodec.values() else value
    name = str(value).upper()
    if name not in CODECS:
        raise ValueError(f"must be one of {', '.join(CODECS)} (got {value!r})")
    return name


def _flag_value(value: object) -> int:
    if isinstance(value, str) and value in _FLAG_NAMES:
        return pb.JournalSpec.Flag.Value(value)
    if isinstance(value, int) and not isinstance(value, bool) and value in FLAGS:
        return value
    numbers = ", ".join(map(str, sorted(FLAGS)))
    raise ValueError(f"must be one of {', '.join(_FLAG_NAMES)} or {numbers} (got {value!r})")


def _flag_name(value: int) -> str | int:
    return pb.JournalSpec.Flag.Name(value) if value in FLAGS else value


def _store_problem(url: str) -> str | None:
    try:
        parts = urlsplit(url)
    except ValueError as err:
        return f"not a URL ({err})"
    if parts.scheme not in STORE_SCHEMES:
        return f"scheme must be one of {', '.join(sorted(STORE_SCHEMES))} (got {url!r})"
    if parts.scheme == "file" and parts.netloc:
        return f'a file store is written "file:///path/" (got {url!r})'
    if parts.scheme != "file" and not parts.netloc:
        return f"must name a bucket or container (got {url!r})"
    if not parts.path.endswith("/"):
        return f"path must end in '/' (got {url!r})"
    return None


Codec = Annotated[str, BeforeValidator(_codec_name)]
Flags = Annotated[int, BeforeValidator(_flag_value), PlainSerializer(_flag_name, when_used="json")]


# --- models ---------------------------------------------------------------------


class SpecModel(BaseModel):
    """Base of the spec models (journals, shards): a ValidationError becomes a SpecError.

    So that whoever builds a spec, from a file or the wire, reads our problems, not pydantic's.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    # Whether this model's `name` field is a journal name worth quoting in errors.
    _named_journal: ClassVar[bool] = False

    def _spec_error(self, err: ValidationError, name: object) -> SpecError:
        journal = name if self._named_journal and isinstance(name, str) else None
        return SpecError(validation_problems(err, journal=journal))

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise self._spec_error(err, data.get("name")) from None

    def __setattr__(self, field_name: str, value: Any) -> None:
        try:
            super().__setattr__(field_name, value)
        except ValidationError as err:
            raise self._spec_error(err, getattr(self, "name", None)) from None


class Label(SpecModel):
    """One name/value label of a journal."""

    model_config = ConfigDict(frozen=True)

    name: str
    value: str = ""

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        if problem := label_name_problem(name):
            raise ValueError(problem)
        return name

    @field_validator("value")
    @classmethod
    def _check_value(cls, value: str) -> str:
        if problem := label_value_problem(value):
            raise ValueError(problem)
        return value


class FragmentSpec(SpecModel):
    """How a journal is cut into fragment files, and where they are persisted."""

    length: int = DEFAULT_FRAGMENT_LENGTH
    compression_codec: Codec = "SNAPPY"
    stores: list[str] = Field(default_factory=lambda: ["file:///"])
    refresh_interval: GoDuration = timedelta(minutes=5)
    retention: GoDuration = timedelta(0)
    flush_interval: GoDuration = timedelta(0)
    path_postfix_template: str = ""

    @field_validator("length")
    @classmethod
    def _check_length(cls, length: int) -> int:
        _between(length, MIN_FRAGMENT_LENGTH, MAX_FRAGMENT_LENGTH)
        return length

    @field_validator("stores")
    @classmethod
    def _check_stores(cls, stores: list[str]) -> list[str]:
        for index, url in enumerate(stores):
            if problem := _store_problem(url):
                raise FieldProblems.at(problem, index)
        return stores

    @field_validator("refresh_interval")
    @classmethod
    def _check_refresh(cls, interval: timedelta) -> timedelta:
        _between(interval, MIN_REFRESH_INTERVAL, MAX_REFRESH_INTERVAL, format_duration)
        return interval

    @field_validator("retention")
    @classmethod
    def _check_retention(cls, retention: timedelta) -> timedelta:
        if retention < timedelta(0):
            raise ValueError(f"must not be negative (got {format_duration(retention)})")
        return retention

    @field_validator("flush_interval")
    @classmethod
    def _check_flush(cls, interval: timedelta) -> timedelta:
        if interval and interval < MIN_FLUSH_INTERVAL:
            raise ValueError(
                f"must be 0 or at least {format_duration(MIN_FLUSH_INTERVAL)} "
                f"(got {format_duration(interval)})"
            )
        return interval

    @field_validator("path_postfix_template")
    @classmethod
    def _check_template(cls, template: str) -> str:
        if template.count("{{") != template.count("}}"):
            raise ValueError(f"unbalanced {{{{ }}}} in template (got {template!r})")
        return template

    @model_validator(mode="after")
    def _check_offload_store(self) -> Self:
        offload = self.compression_codec == "GZIP_OFFLOAD_DECOMPRESSION"
        if offload and self.stores and self.stores[0].startswith("file:"):
            raise FieldProblems.at(
                "GZIP_OFFLOAD_DECOMPRESSION needs an object store, not file://, as first store",
                "compression_codec",
            )
        return self


def _check_content_type(labels: list[Label]) -> None:
    """Readers pick a framing by content-type, so it must be one parseable MIME type."""
    found = [(i, label.value) for i, label in enumerate(labels) if label.name == "content-type"]
    for index, value in found:
        if not _MIME_RE.fullmatch(value):
            raise FieldProblems.at(
                f"content-type must be a MIME type like type/subtype[;param=value] (got {value!r})",
                index,
                "value",
            )
    if len(found) > 1:
        raise FieldProblems.at("content-type may have only one value", found[1][0], "value")


class JournalSpec(SpecModel):
    """A journal's name and configuration. Omitted fields take one-machine defaults."""

    _named_journal: ClassVar[bool] = True
    name: str
    replication: int = 1
    labels: list[Label] = Field(default_factory=list)
    fragment: FragmentSpec = Field(default_factory=FragmentSpec)
    flags: Flags = 0
    max_append_rate: int = 0

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        if problem := journal_name_problem(name):
            raise ValueError(problem)
        return name

    @field_validator("replication")
    @classmethod
    def _check_replication(cls, replication: int) -> int:
        _between(replication, 1, MAX_REPLICATION)
        return replication

    @field_validator("labels")
    @classmethod
    def _check_labels(cls, labels: list[Label]) -> list[Label]:
        """Sort and de-duplicate (as a LabelSet is), refusing the reserved meta-labels."""
        labels = sorted(set(labels), key=lambda label: (label.name, label.value))
        for index, label in enumerate(labels):
            if label.name in META_LABELS:
                raise FieldProblems.at(f'"{label.name}" is a reserved meta-label', index, "name")
        _check_content_type(labels)
        return labels

    @field_validator("max_append_rate")
    @classmethod
    def _check_rate(cls, rate: int) -> int:
        if rate < 0:
            raise ValueError(f"must not be negative (got {rate})")
        return rate

    def to_proto(self) -> pb.JournalSpec:
        """The wire form, field for field."""
        fragment = self.fragment
        out = pb.JournalSpec(
            name=self.name,
            replication=self.replication,
            labels=label_set(*((label.name, label.value) for label in self.labels)),
            fragment=pb.JournalSpec.Fragment(
                length=fragment.length,
                compression_codec=pb.CompressionCodec.Value(fragment.compression_codec),
                stores=fragment.stores,
                path_postfix_template=fragment.path_postfix_template,
            ),
            flags=self.flags,
            max_append_rate=self.max_append_rate,
        )
        out.fragment.refresh_interval.FromTimedelta(fragment.refresh_interval)
        out.fragment.retention.FromTimedelta(fragment.retention)
        out.fragment.flush_interval.FromTimedelta(fragment.flush_interval)
        return out

    @classmethod
    def from_proto(cls, spec: pb.JournalSpec) -> JournalSpec:
        """Validate a wire spec as is: unset fields are zero, not the YAML defaults."""
        fragment = spec.fragment
        return cls(
            name=spec.name,
            replication=spec.replication,
            labels=[{"name": lbl.name, "value": lbl.value} for lbl in spec.labels.labels],
            fragment={
                "length": fragment.length,
                "compression_codec": fragment.compression_codec,
                "stores": list(fragment.stores),
                "refresh_interval": fragment.refresh_interval.ToTimedelta(),
                "retention": fragment.retention.ToTimedelta(),
                "flush_interval": fragment.flush_interval.ToTimedelta(),
                "path_postfix_template": fragment.path_postfix_template,
            },
            flags=spec.flags,
            max_append_rate=spec.max_append_rate,
        )


def label_set_problem(labels: pb.LabelSet) -> Problem | None:
    """Why a wire label set is not canonical (sorted, unique, no prefixes), or None."""
    triples = [(lbl.name, lbl.value) for lbl in labels.labels]
    if triples != sorted(set(triples)):
        return Problem("must be sorted by (name, value), each label once", "labels")
    if any(lbl.prefix for lbl in labels.labels):
        return Problem("prefix matching is for selectors, not journal labels", "labels")
    return None


def validate_proto(spec: pb.JournalSpec) -> None:
    """Raise SpecError unless ``spec`` is a valid, canonical journal spec (for Apply)."""
    JournalSpec.from_proto(spec)
    if problem := label_set_problem(spec.labels):
        raise SpecError([replace(problem, journal=spec.name)])
