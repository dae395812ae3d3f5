"""Journal specs: validated pydantic models, their protobuf mapping, and gazctl's YAML form.

The rules are Gazette's, so a spec accepted here is accepted by a Gazette
broker too (label values are a little more permissive: see ``labels``). Every
failure is a ``SpecError`` listing one readable line per problem, each naming
the journal, the field path and the rule; pydantic's own errors never escape.

YAML files use gazctl's hierarchical form. A node whose name ends in "/" is a
directory: its ``children`` inherit its settings (labels merge by name, fragment
fields one by one), and their names must start with its name. Other nodes are
journals. Nodes may also carry ``revision`` (the expected mod revision for
Apply; 0 creates, -1 skips the check), ``delete: true`` and ``comment``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from fractions import Fraction
from typing import Annotated, Any, ClassVar, Self
from urllib.parse import urlsplit

import yaml
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
from streamkit.protocol.labels import (
    META_LABELS,
    label_name_problem,
    label_set,
    label_value_problem,
)

__all__ = [
    "CODECS",
    "DEFAULT_FRAGMENT_LENGTH",
    "MAX_FRAGMENT_LENGTH",
    "MAX_JOURNAL_NAME_LEN",
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
    "Problem",
    "SpecEntry",
    "SpecError",
    "dump_specs",
    "format_duration",
    "journal_name_problem",
    "load_specs",
    "parse_duration",
    "validate_proto",
]

MIN_JOURNAL_NAME_LEN, MAX_JOURNAL_NAME_LEN = 4, 512
MAX_REPLICATION = 5
MIN_FRAGMENT_LENGTH, MAX_FRAGMENT_LENGTH = 1 << 10, 1 << 34
MIN_REFRESH_INTERVAL, MAX_REFRESH_INTERVAL = timedelta(seconds=1), timedelta(hours=24)
# A non-zero flush_interval shorter than this is rejected (Gazette's rule).
MIN_FLUSH_INTERVAL = timedelta(minutes=1)
STORE_SCHEMES = frozenset({"file", "s3", "gs", "azure"})
CODECS = ("NONE", "GZIP", "ZSTANDARD", "SNAPPY", "GZIP_OFFLOAD_DECOMPRESSION")
FLAGS = frozenset(pb.JournalSpec.Flag.values())
_FLAG_NAMES = tuple(pb.JournalSpec.Flag.keys())
DEFAULT_FRAGMENT_LENGTH = 1 << 29

_JOURNAL_NAME_RE = re.compile(r"[\w\-+/.=%]*")
# RFC 2045 media type: type "/" subtype *(";" attribute "=" value).
_MIME_TOKEN = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_MIME_RE = re.compile(
    rf"{_MIME_TOKEN}/{_MIME_TOKEN}(\s*;\s*{_MIME_TOKEN}=({_MIME_TOKEN}|\"[^\"]*\"))*\s*;?\s*"
)


# --- errors ---------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec, and where."""

    message: str
    path: str = ""
    journal: str | None = None
    source: str | None = None

    def __str__(self) -> str:
        parts = [self.source] if self.source else []
        if self.journal is not None:
            kind = "directory" if self.journal.endswith("/") or not self.journal else "journal"
            parts.append(f'{kind} "{self.journal}"')
        if self.path:
            parts.append(self.path)
        return ": ".join([*parts, self.message])


class SpecError(ValueError):
    """An invalid spec or spec file; ``problems`` holds each finding, the message one per line."""

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))

    def located(self, source: str) -> SpecError:
        """The same problems, attributed to a file."""
        return SpecError(replace(p, source=source) for p in self.problems)


class _Problem(ValueError):
    """Raised inside validators to point below the validated field (e.g. ``[2].name``)."""

    def __init__(self, message: str, *path: str | int) -> None:
        super().__init__(message)
        self.path = path


_PYDANTIC_MESSAGES = {
    "extra_forbidden": "unknown field",
    "missing": "is required",
}


def _render_path(loc: Iterable[str | int], below: str = "") -> str:
    """("fragment", "stores", 0) -> "fragment.stores[0]", then ``below`` appended."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    if below:
        out += below if below.startswith("[") or not out else f".{below}"
    return out


def _problems_from(error: Mapping[str, Any], journal: str | None) -> list[Problem]:
    """Readable problems for one pydantic error entry."""
    loc = tuple(error["loc"])
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, SpecError):
        # A nested model's own __init__ failed (pydantic calls custom __init__s).
        return [Problem(p.message, _render_path(loc, p.path), journal) for p in cause.problems]
    if isinstance(cause, _Problem):
        loc += cause.path
    if isinstance(cause, ValueError):
        message = str(cause)
    elif error["type"] in _PYDANTIC_MESSAGES:
        message = _PYDANTIC_MESSAGES[error["type"]]
    else:
        message = f"{error['msg'][0].lower()}{error['msg'][1:]} (got {error['input']!r})"
    return [Problem(message, _render_path(loc), journal)]


# --- durations -------------------------------------------------------------------

_DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_NANOS = {"ns": 1, "us": 10**3, "µs": 10**3, "μs": 10**3, "ms": 10**6, "s": 10**9}
_NANOS |= {"m": 60 * 10**9, "h": 3600 * 10**9}


def _parse_go_duration(text: str) -> timedelta:
    sign, body = (-1, text[1:]) if text.startswith("-") else (1, text.removeprefix("+"))
    nanos, at = Fraction(0), 0
    while at < len(body) and (m := _DURATION_PART.match(body, at)):
        nanos += Fraction(m[1]) * _NANOS[m[2]]
        at = m.end()
    if not body or at != len(body):
        raise ValueError(f'not a duration like "1m30s", "500ms" or a number of seconds ({text!r})')
    return timedelta(microseconds=round(sign * nanos / 1000))


def parse_duration(value: object) -> timedelta:
    """A timedelta from a Go duration string ("1h30m", "500ms"), seconds, or a timedelta."""
    if isinstance(value, timedelta):
        return value
    try:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return timedelta(seconds=value)
        if isinstance(value, str):
            text = value.strip()
            if re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)", text):
                return timedelta(seconds=float(text))
            return _parse_go_duration(text)
    except OverflowError:
        raise ValueError(f"duration out of range (got {value!r})") from None
    raise ValueError(f"expected a duration string or a number of seconds (got {value!r})")


def _decimal(value: int, unit: int) -> str:
    """``value / unit`` in decimal, without trailing zeros, as Go prints durations."""
    whole, frac = divmod(value, unit)
    if not frac:
        return str(whole)
    digits = len(str(unit)) - 1
    return f"{whole}.{frac:0{digits}d}".rstrip("0")


def format_duration(delta: timedelta) -> str:
    """Go's spelling of a duration: "0s", "500ms", "30s", "1m0s", "1h30m0s"."""
    micros = delta // timedelta(microseconds=1)
    sign, micros = ("-" if micros < 0 else ""), abs(micros)
    if micros == 0:
        return "0s"
    if micros < 1000:
        return f"{sign}{micros}µs"
    if micros < 10**6:
        return f"{sign}{_decimal(micros, 1000)}ms"
    hours, rest = divmod(micros, 3600 * 10**6)
    minutes, rest = divmod(rest, 60 * 10**6)
    head = f"{hours}h{minutes}m" if hours else f"{minutes}m" if minutes else ""
    return f"{sign}{head}{_decimal(rest, 10**6)}s"


GoDuration = Annotated[
    timedelta,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str, when_used="json"),
]


# --- field checks ---------------------------------------------------------------


def _between(value: Any, low: Any, high: Any, show: Any = str) -> None:
    if not low <= value <= high:
        raise ValueError(f"must be between {show(low)} and {show(high)} (got {show(value)})")


def journal_name_problem(name: str) -> str | None:
    """Why ``name`` is not a valid journal name, or None. Also for brokers checking requests."""
    if not MIN_JOURNAL_NAME_LEN <= len(name) <= MAX_JOURNAL_NAME_LEN:
        return (
            f"must be {MIN_JOURNAL_NAME_LEN} to {MAX_JOURNAL_NAME_LEN} characters (got {len(name)})"
        )
    if not _JOURNAL_NAME_RE.fullmatch(name):
        return f"may hold only letters, digits and -_+/.=% (got {name!r})"
    if name.startswith("/") or name.endswith("/") or "//" in name:
        return f"must be a relative path without empty segments or a trailing '/' (got {name!r})"
    if any(segment in (".", "..") for segment in name.split("/")):
        return f"must not contain '.' or '..' segments (got {name!r})"
    return None


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


class _SpecModel(BaseModel):
    """Base that turns pydantic's ValidationError into SpecError."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    # Whether this model's `name` field is a journal name worth quoting in errors.
    _named_journal: ClassVar[bool] = False

    def _spec_error(self, err: ValidationError, name: object) -> SpecError:
        journal = name if self._named_journal and isinstance(name, str) else None
        return SpecError(p for e in err.errors() for p in _problems_from(e, journal))

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


class Label(_SpecModel):
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


class FragmentSpec(_SpecModel):
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
                raise _Problem(problem, index)
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
            raise _Problem(
                "GZIP_OFFLOAD_DECOMPRESSION needs an object store, not file://, as first store",
                "compression_codec",
            )
        return self


def _check_content_type(labels: list[Label]) -> None:
    """Readers pick a framing by content-type, so it must be one parseable MIME type."""
    found = [(i, label.value) for i, label in enumerate(labels) if label.name == "content-type"]
    for index, value in found:
        if not _MIME_RE.fullmatch(value):
            raise _Problem(
                f"content-type must be a MIME type like type/subtype[;param=value] (got {value!r})",
                index,
                "value",
            )
    if len(found) > 1:
        raise _Problem("content-type may have only one value", found[1][0], "value")


class JournalSpec(_SpecModel):
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
                raise _Problem(f'"{label.name}" is a reserved meta-label', index, "name")
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


def _label_set_problem(labels: pb.LabelSet) -> Problem | None:
    triples = [(lbl.name, lbl.value) for lbl in labels.labels]
    if triples != sorted(set(triples)):
        return Problem("must be sorted by (name, value), each label once", "labels")
    if any(lbl.prefix for lbl in labels.labels):
        return Problem("prefix matching is for selectors, not journal labels", "labels")
    return None


def validate_proto(spec: pb.JournalSpec) -> None:
    """Raise SpecError unless ``spec`` is a valid, canonical journal spec (for Apply)."""
    JournalSpec.from_proto(spec)
    if problem := _label_set_problem(spec.labels):
        raise SpecError([replace(problem, journal=spec.name)])


# --- YAML: loading -----------------------------------------------------------------

_SETTING_KEYS = ("replication", "labels", "fragment", "flags", "max_append_rate")
_NODE_KEYS = frozenset({"name", "children", "revision", "delete", "comment", *_SETTING_KEYS})


@dataclass(frozen=True)
class SpecEntry:
    """A journal from a spec file, with the Apply options its node gave."""

    spec: JournalSpec
    # Expected mod revision: 0 means "create", -1 means "don't check".
    revision: int = 0
    delete: bool = False


def _merge_labels(parent: Any, child: Any) -> Any:
    """Child labels replace the parent's labels of the same name."""
    if not isinstance(parent, list) or not isinstance(child, list):
        return child
    names = {item.get("name") for item in child if isinstance(item, dict)}
    kept = [item for item in parent if not (isinstance(item, dict) and item.get("name") in names)]
    return kept + child


def _merge_settings(parent: dict[str, Any], node: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(parent)
    for key in _SETTING_KEYS:
        if key not in node:
            continue
        value, above = node[key], parent.get(key)
        if key == "labels":
            value = _merge_labels(above, value)
        elif key == "fragment" and isinstance(above, dict) and isinstance(value, dict):
            value = {**above, **value}
        merged[key] = value
    return merged


@dataclass(frozen=True)
class _Scope:
    """What a node inherits from its ancestors."""

    name: str = ""
    settings: Mapping[str, Any] = field(default_factory=dict)
    revision: int = 0
    delete: bool = False


class _TreeLoader:
    """Walks a node tree, collecting SpecEntries and every problem found on the way."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.entries: list[SpecEntry] = []
        self.problems: list[Problem] = []
        self.seen: set[str] = set()

    def fail(self, name: str | None, path: str, message: str) -> None:
        self.problems.append(Problem(message, path, name, self.source))

    def typed(self, node: Mapping[str, Any], name: str, key: str, kind: type, default: Any) -> Any:
        value = node.get(key, default)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            self.fail(name, key, f"must be {'true or false' if kind is bool else 'an integer'}")
            return default
        return value

    def walk(self, node: object, scope: _Scope) -> None:
        if not isinstance(node, dict):
            self.fail(scope.name, "children", f"each node must be a mapping (got {node!r})")
            return
        name = node.get("name", "")
        if not isinstance(name, str):
            self.fail(scope.name, "name", f"must be a string (got {name!r})")
            return
        for key in sorted(set(node) - _NODE_KEYS, key=str):
            self.fail(name, str(key), "unknown field")
        if not name.startswith(scope.name):
            self.fail(name, "name", f'must start with its parent\'s name "{scope.name}"')
        inner = _Scope(
            name=name,
            settings=_merge_settings(dict(scope.settings), node),
            revision=self.typed(node, name, "revision", int, scope.revision),
            delete=self.typed(node, name, "delete", bool, scope.delete),
        )
        if name == "" or name.endswith("/"):
            self.walk_directory(node, inner)
        else:
            self.add_journal(node, inner)

    def walk_directory(self, node: Mapping[str, Any], scope: _Scope) -> None:
        children = node.get("children")
        if not isinstance(children, list) or not children:
            self.fail(scope.name, "children", "a directory node needs a list of children")
            return
        if scope.revision not in (0, -1):
            self.fail(scope.name, "revision", "a directory may only carry revision -1")
        for child in children:
            self.walk(child, scope)

    def add_journal(self, node: Mapping[str, Any], scope: _Scope) -> None:
        if "children" in node:
            self.fail(
                scope.name, "children", "only directories (names ending in '/') have children"
            )
        if scope.name in self.seen:
            self.fail(scope.name, "name", "journal appears more than once")
        self.seen.add(scope.name)
        try:
            spec = JournalSpec(name=scope.name, **scope.settings)
        except SpecError as err:
            self.problems.extend(err.located(self.source).problems)
            return
        self.entries.append(SpecEntry(spec, scope.revision, scope.delete))


def _yaml_problem(err: yaml.YAMLError, source: str) -> Problem:
    mark = getattr(err, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    reason = getattr(err, "problem", None) or str(err)
    return Problem(f"invalid YAML: {where}{reason}", source=source)


def load_specs(text: str, source: str = "<specs>") -> list[SpecEntry]:
    """Journals of a gazctl-style spec file, in file order.

    The document is one root node, or a list of root nodes. Raises SpecError
    listing every problem, each naming ``source``, the node and the field.
    """
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise SpecError([_yaml_problem(err, source)]) from None
    if document is None:
        return []
    loader = _TreeLoader(source)
    for root in document if isinstance(document, list) else [document]:
        loader.walk(root, _Scope())
    if loader.problems:
        raise SpecError(loader.problems)
    return loader.entries


# --- YAML: dumping -------------------------------------------------------------------

# A spec's settings as one flat mapping, so that the settings common to a group of
# journals are a plain intersection: ("fragment", "length") -> 1024,
# ("labels", "app") -> ("wordcount",), ("replication",) -> 1.
_Flat = dict[tuple[str, ...], Any]
_MISSING = object()


def _flatten(spec: JournalSpec) -> _Flat:
    flat: _Flat = {}
    for key, value in spec.model_dump(mode="json", exclude={"name"}).items():
        if key == "labels":
            for label in value:
                slot = ("labels", label["name"])
                flat[slot] = (*flat.get(slot, ()), label["value"])
        elif key == "fragment":
            flat.update({("fragment", field): v for field, v in value.items()})
        else:
            flat[(key,)] = value
    return flat


def _unflatten(flat: _Flat) -> dict[str, Any]:
    node: dict[str, Any] = {}
    for key, value in flat.items():
        if key[0] == "labels":
            node.setdefault("labels", []).extend({"name": key[1], "value": v} for v in value)
        elif key[0] == "fragment":
            node.setdefault("fragment", {})[key[1]] = value
        else:
            node[key[0]] = value
    return node


def _common(flats: list[_Flat]) -> _Flat:
    first, *rest = flats
    return {k: v for k, v in first.items() if all(f.get(k, _MISSING) == v for f in rest)}


def _beyond(flat: _Flat, scope: _Flat) -> _Flat:
    """Settings of ``flat`` that ``scope`` does not already provide."""
    return {k: v for k, v in flat.items() if scope.get(k, _MISSING) != v}


def _directory_of(names: list[str]) -> str:
    """The longest directory ("…/" or "") holding every name."""
    shared = ""
    for segments in zip(*(name.split("/")[:-1] for name in names), strict=False):
        if any(segment != segments[0] for segment in segments):
            break
        shared += segments[0] + "/"
    return shared


def _leaf_node(entry: SpecEntry, flat: _Flat, scope: _Flat) -> dict[str, Any]:
    node = {"name": entry.spec.name, **_unflatten(_beyond(flat, scope))}
    if entry.revision:
        node["revision"] = entry.revision
    if entry.delete:
        node["delete"] = True
    return node


_Member = tuple[SpecEntry, _Flat]


def _directory_node(name: str, members: list[_Member], scope: _Flat) -> dict[str, Any]:
    """A directory node hoisting its members' common settings, grouping subdirectories."""
    own = _beyond(_common([flat for _, flat in members]), scope)
    scope = {**scope, **own}
    groups: dict[str, list[_Member]] = {}
    for member in members:
        rest = member[0].spec.name[len(name) :]
        key = name + rest[: rest.find("/") + 1] if "/" in rest else member[0].spec.name
        groups.setdefault(key, []).append(member)
    children = []
    for group in groups.values():
        if len(group) == 1:
            children.append(_leaf_node(*group[0], scope))
        else:
            subdir = _directory_of([entry.spec.name for entry, _ in group])
            children.append(_directory_node(subdir, group, scope))
    children.sort(key=lambda child: child["name"])
    return {"name": name, **_unflatten(own), "children": children}


def dump_specs(entries: Iterable[SpecEntry | JournalSpec]) -> str:
    """Specs as a gazctl-style tree whose directories hoist shared settings.

    Journals come out sorted by name; ``load_specs`` reads them back as equal entries.
    """
    listed = [e if isinstance(e, SpecEntry) else SpecEntry(e) for e in entries]
    names = [entry.spec.name for entry in listed]
    repeated = sorted(name for name, count in Counter(names).items() if count > 1)
    if repeated:
        raise SpecError(Problem("journal appears more than once", "", name) for name in repeated)
    if not listed:
        return ""
    members = [(entry, _flatten(entry.spec)) for entry in listed]
    if len(members) == 1:
        root = _leaf_node(*members[0], scope={})
    else:
        root = _directory_node(_directory_of(names), members, scope={})
    return yaml.safe_dump(root, sort_keys=False, allow_unicode=True, default_flow_style=False)
