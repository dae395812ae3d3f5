"""Does a response conform to Gazette's wire rules? The checks Gazette's clients apply.

Gazette's Go clients validate every response they receive (each protocol message
has a `Validate` method) and give up on one that fails. streamkit promises that
its broker and members answer in a form those clients accept; this module states
those rules once, for every response of the Journal service (List, Apply, Read,
Append, Replicate, ListFragments) and the Shard service (Stat, List, Apply,
GetHints, Unassign), and for the messages they carry (Header, Route, process ids,
JournalSpec, Fragment, label sets, ShardSpec, ReplicaStatus, recovery-log hints).

``problems_of(message)`` lists every finding as ``"<field path>: <rule>"`` with
the path in the proto's own field names (``journals[2].spec.fragment.length``);
``check(message)`` raises ``NonConformant`` listing them. A message type these
rules don't cover has no problems.

``streamkit.protocol.response_checks`` applies these rules to every response a
client channel receives, when STREAMKIT_CHECK_RESPONSES asks for it.

Where the rules are streamkit's own rather than Gazette's, it says so: label
values follow streamkit's alphabet (``labels.label_value_problem``), and a label
*set* may not use selector prefix matching.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from google.protobuf.message import Message

from streamkit.errors import StreamkitError
from streamkit.protocol import consumer_pb, pb
from streamkit.protocol import recoverylog_pb2 as recoverylog_pb
from streamkit.protocol.labels import label_name_problem, label_value_problem

__all__ = ["NonConformant", "check", "problems_of"]

# Tokens: letters and digits (any script) plus these symbols. Journal names, shard ids
# and fragment path postfixes also take "=", "%" and ":".
TOKEN_SYMBOLS = "-_+/."
PATH_SYMBOLS = TOKEN_SYMBOLS + "=%:"

MIN_ZONE_LEN, MAX_ZONE_LEN = 1, 32
MIN_SUFFIX_LEN, MAX_SUFFIX_LEN = 4, 128
MIN_JOURNAL_LEN, MAX_JOURNAL_LEN = 4, 512
MIN_SHARD_LEN, MAX_SHARD_LEN = 4, 512
MAX_REPLICATION = 5
MIN_FRAGMENT_LEN, MAX_FRAGMENT_LEN = 1 << 10, 1 << 34
MIN_REFRESH_NANOS, MAX_REFRESH_NANOS = 10**9, 24 * 3600 * 10**9
MIN_FLUSH_NANOS = 60 * 10**9
OBJECT_STORE_SCHEMES = frozenset({"s3", "gs", "azure", "azure-ad"})
JOURNAL_FLAGS = frozenset({0, 1, 2, 4})  # NOT_SPECIFIED, O_RDONLY, O_WRONLY, O_RDWR

CONTENT_TYPE = "content-type"
MESSAGE_TYPE = "app.gazette.dev/message-type"
MESSAGE_SUBTYPE = "app.gazette.dev/message-subtype"
# Labels a spec may give one value at most.
SINGLE_VALUE_LABELS = frozenset({
    CONTENT_TYPE,
    MESSAGE_TYPE,
    MESSAGE_SUBTYPE,
    "app.gazette.dev/instance",
    "app.gazette.dev/managed-by",
    "app.gazette.dev/region",
})

_MIME_TOKEN = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_MIME_RE = re.compile(
    rf"\s*{_MIME_TOKEN}/{_MIME_TOKEN}(\s*;\s*{_MIME_TOKEN}\s*=\s*({_MIME_TOKEN}|\"[^\"]*\"))*"
    r"\s*;?\s*"
)


class NonConformant(StreamkitError, ValueError):
    """A message that breaks Gazette's protocol rules; ``problems`` lists each finding."""

    def __init__(self, message: Message, problems: Iterable[str]) -> None:
        self.message_type = message.DESCRIPTOR.full_name
        self.problems = list(problems)
        super().__init__(
            f"{self.message_type} does not conform to Gazette's protocol: "
            + "; ".join(self.problems)
        )


# --- the findings collector ---------------------------------------------------------------


class _Found:
    """Problems found so far, each under the field path being checked."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def add(self, path: str, rule: str) -> None:
        self.problems.append(f"{path}: {rule}" if path else rule)


def _at(path: str, field: str | int) -> str:
    if isinstance(field, int):
        return f"{path}[{field}]"
    return f"{path}.{field}" if path else field


# --- strings: tokens, paths, URLs --------------------------------------------------------------


def _token_problem(text: str, symbols: str, low: int, high: int) -> str | None:
    """Why ``text`` is not a token of ``low``..``high`` characters over letters, digits and
    ``symbols`` (Gazette counts bytes of UTF-8), or None."""
    size = len(text.encode())
    if not low <= size <= high:
        return f"must be {low} to {high} characters long (got {size}: {text!r})"
    for char in text:
        if not (char.isalpha() or char.isdigit() or char in symbols):
            return f"may hold only letters, digits and {symbols} (got {text!r})"
    return None


def go_clean_path(text: str) -> str:
    """The shortest equivalent of a slash-separated path, as Go's ``path.Clean`` makes it."""
    rooted = text.startswith("/")
    parts: list[str] = []
    for part in text.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if parts and parts[-1] != "..":
                parts.pop()
            elif not rooted:
                parts.append("..")
            continue
        parts.append(part)
    cleaned = ("/" if rooted else "") + "/".join(parts)
    return cleaned or "."


def _path_problem(text: str, low: int, high: int) -> str | None:
    """Why ``text`` is not a relative, clean path token (journal names, path postfixes)."""
    if problem := _token_problem(text, PATH_SYMBOLS, low, high):
        return problem
    if text and go_clean_path(text) != text:
        return f"must be a clean path: no empty, '.' or inner '..' parts, no final '/' ({text!r})"
    if text.startswith("/"):
        return f"must not begin with '/' ({text!r})"
    return None


def journal_problem(name: str) -> str | None:
    """Why ``name`` is not a journal name Gazette accepts, or None."""
    return _path_problem(name, MIN_JOURNAL_LEN, MAX_JOURNAL_LEN)


def shard_id_problem(shard: str) -> str | None:
    """Why ``shard`` is not a shard id Gazette accepts, or None."""
    return _token_problem(shard, PATH_SYMBOLS, MIN_SHARD_LEN, MAX_SHARD_LEN)


def _url_parts(text: str) -> Any:
    """``urlsplit`` of ``text``, raising ValueError where Go's ``url.Parse`` refuses it."""
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in text):
        raise ValueError("holds a control character")
    parts = urlsplit(text)
    if " " in parts.netloc:
        raise ValueError("holds a space in its host")
    parts.port  # noqa: B018 -- raises ValueError for a port that is not a number
    return parts


def url_problem(text: str) -> str | None:
    """Why ``text`` does not parse as a URL (relative ones included), or None."""
    return _absolute_url(text, require_scheme=False)[1]


def _absolute_url(text: str, require_scheme: bool = True) -> tuple[Any, str | None]:
    """(the parsed URL, None), or (None, why ``text`` isn't a URL with a scheme)."""
    try:
        parts = _url_parts(text)
    except ValueError as err:
        return None, f"not a URL: {err} ({text!r})"
    if require_scheme and not parts.scheme:
        return None, f"must be an absolute URL, with a scheme ({text!r})"
    return parts, None


def endpoint_problem(endpoint: str) -> str | None:
    """Why ``endpoint`` is not an absolute URL with a host, as a route endpoint must be."""
    parts, problem = _absolute_url(endpoint)
    if problem is None and not parts.netloc:
        return f"must name a host ({endpoint!r})"
    return problem


def store_problem(store: str) -> str | None:
    """Why ``store`` is not a fragment store URL: s3/gs/azure with a bucket, or file:///."""
    parts, problem = _absolute_url(store)
    if problem is not None:
        return problem
    if parts.scheme in OBJECT_STORE_SCHEMES:
        if not parts.netloc:
            return f"must name a bucket ({store!r})"
    elif parts.scheme == "file":
        if parts.netloc:
            return f"a file:// store has no host ({store!r})"
    else:
        schemes = ", ".join(sorted(OBJECT_STORE_SCHEMES | {"file"}))
        return f"scheme must be one of {schemes} ({store!r})"
    if not parts.path.endswith("/"):
        return f"path must end in '/' ({store!r})"
    return None


# --- broker messages ---------------------------------------------------------------------------


def _status(found: _Found, path: str, value: int, enum: Any) -> None:
    if value not in enum.values():
        found.add(path, f"not a known status ({value})")


def _process_id(found: _Found, path: str, pid: pb.ProcessSpec.ID) -> None:
    if problem := _token_problem(pid.zone, TOKEN_SYMBOLS, MIN_ZONE_LEN, MAX_ZONE_LEN):
        found.add(_at(path, "zone"), problem)
    if problem := _token_problem(pid.suffix, TOKEN_SYMBOLS, MIN_SUFFIX_LEN, MAX_SUFFIX_LEN):
        found.add(_at(path, "suffix"), problem)


def _route(found: _Found, path: str, route: pb.Route) -> None:
    members = route.members
    for index, member in enumerate(members):
        _process_id(found, _at(_at(path, "members"), index), member)
        if index and (members[index - 1].zone, members[index - 1].suffix) >= (
            member.zone, member.suffix
        ):
            found.add(
                _at(_at(path, "members"), index),
                "members must be in unique order of (zone, suffix)",
            )
    if not -1 <= route.primary < len(members):
        expected = f"-1 (none) or 0 to {len(members) - 1}" if members else "-1 (no members)"
        found.add(_at(path, "primary"), f"must be {expected} (got {route.primary})")
    if route.endpoints and len(route.endpoints) != len(members):
        found.add(
            _at(path, "endpoints"),
            f"must be empty or one per member ({len(route.endpoints)} for {len(members)})",
        )
    for index, endpoint in enumerate(route.endpoints):
        if endpoint and (problem := endpoint_problem(endpoint)):
            found.add(_at(_at(path, "endpoints"), index), problem)


def _header(found: _Found, path: str, header: pb.Header) -> None:
    """A Header: process id (when set), route (always; an unrouted one has primary -1) and
    the Etcd fields, which must all be set."""
    if header.process_id.zone or header.process_id.suffix:
        _process_id(found, _at(path, "process_id"), header.process_id)
    _route(found, _at(path, "route"), header.route)
    etcd, at = header.etcd, _at(path, "etcd")
    for field in ("cluster_id", "member_id", "raft_term"):
        if not getattr(etcd, field):
            found.add(_at(at, field), "must not be zero")
    if etcd.revision <= 0:
        found.add(_at(at, "revision"), f"must be positive (got {etcd.revision})")


def _required_header(found: _Found, message: Message) -> None:
    if not message.HasField("header"):
        found.add("header", "is required")
    _header(found, "header", message.header)  # type: ignore[attr-defined]


def _label_set(found: _Found, path: str, labels: pb.LabelSet) -> None:
    """Valid names and values, sorted by (name, value) with each once; a name with an empty
    value has no other value."""
    items = labels.labels
    for index, label in enumerate(items):
        at = _at(_at(path, "labels"), index)
        if problem := label_name_problem(label.name):
            found.add(_at(at, "name"), problem)
        if problem := label_value_problem(label.value):
            found.add(_at(at, "value"), problem)
        if label.prefix:
            found.add(_at(at, "prefix"), "prefix matching is for selectors, not label sets")
        if not index:
            continue
        before = items[index - 1]
        if (before.name, before.value) >= (label.name, label.value):
            found.add(at, "labels must be in unique order of (name, value)")
        elif before.name == label.name and not before.value:
            found.add(at, f"label {label.name!r} has both an empty and a non-empty value")


def _values_of(labels: pb.LabelSet, name: str) -> list[str]:
    return [label.value for label in labels.labels if label.name == name]


def _single_values(found: _Found, path: str, labels: pb.LabelSet) -> None:
    for name in sorted(SINGLE_VALUE_LABELS):
        if len(_values_of(labels, name)) > 1:
            found.add(path, f"label {name!r} may have one value only")


def _duration_nanos(duration: Any) -> int:
    return int(duration.seconds) * 10**9 + int(duration.nanos)


def _template_problem(template: str) -> str | None:
    """A Go template's actions must open and close in pairs."""
    depth = 0
    for token in re.findall(r"\{\{|\}\}", template):
        depth += 1 if token == "{{" else -1
        if depth not in (0, 1):
            return f"unbalanced {{{{ }}}} in template ({template!r})"
    return None if depth == 0 else f"unbalanced {{{{ }}}} in template ({template!r})"


def _codec(found: _Found, path: str, codec: int) -> None:
    if codec == pb.INVALID or codec not in pb.CompressionCodec.values():
        found.add(path, f"not a valid compression codec ({codec})")


def _journal_fragment_spec(found: _Found, path: str, spec: pb.JournalSpec.Fragment) -> None:
    if not MIN_FRAGMENT_LEN <= spec.length <= MAX_FRAGMENT_LEN:
        found.add(
            _at(path, "length"),
            f"must be {MIN_FRAGMENT_LEN} to {MAX_FRAGMENT_LEN} (got {spec.length})",
        )
    _codec(found, _at(path, "compression_codec"), spec.compression_codec)
    for index, store in enumerate(spec.stores):
        at = _at(_at(path, "stores"), index)
        if problem := store_problem(store):
            found.add(at, problem)
        elif (
            index == 0
            and store.startswith("file:")
            and spec.compression_codec == pb.GZIP_OFFLOAD_DECOMPRESSION
        ):
            found.add(at, "GZIP_OFFLOAD_DECOMPRESSION needs an object store, not file://")
    refresh = _duration_nanos(spec.refresh_interval)
    if not MIN_REFRESH_NANOS <= refresh <= MAX_REFRESH_NANOS:
        found.add(_at(path, "refresh_interval"), f"must be 1s to 24h (got {refresh}ns)")
    flush = _duration_nanos(spec.flush_interval)
    if flush and flush < MIN_FLUSH_NANOS:
        found.add(_at(path, "flush_interval"), f"must be 0 or at least 1m (got {flush}ns)")
    if problem := _template_problem(spec.path_postfix_template):
        found.add(_at(path, "path_postfix_template"), problem)


def _journal_spec(found: _Found, path: str, spec: pb.JournalSpec) -> None:
    if problem := journal_problem(spec.name):
        found.add(_at(path, "name"), problem)
    if not 1 <= spec.replication <= MAX_REPLICATION:
        found.add(
            _at(path, "replication"), f"must be 1 to {MAX_REPLICATION} (got {spec.replication})"
        )
    labels, at = spec.labels, _at(path, "labels")
    _label_set(found, at, labels)
    for reserved in ("name", "prefix"):
        if _values_of(labels, reserved):
            found.add(at, f"{reserved!r} is a meta-label, not for specs")
    _single_values(found, at, labels)
    content_types = _values_of(labels, CONTENT_TYPE)
    if content_types and not _MIME_RE.fullmatch(content_types[0]):
        found.add(at, f"content-type must be a MIME type ({content_types[0]!r})")
    if _values_of(labels, MESSAGE_TYPE):
        if not content_types:
            found.add(at, f"{MESSAGE_TYPE} needs a content-type label too")
    elif _values_of(labels, MESSAGE_SUBTYPE):
        found.add(at, f"{MESSAGE_SUBTYPE} needs a {MESSAGE_TYPE} label too")
    _journal_fragment_spec(found, _at(path, "fragment"), spec.fragment)
    if spec.flags not in JOURNAL_FLAGS:
        found.add(_at(path, "flags"), f"must be 0, O_RDONLY, O_WRONLY or O_RDWR (got {spec.flags})")
    if spec.max_append_rate < 0:
        found.add(_at(path, "max_append_rate"), f"must not be negative ({spec.max_append_rate})")


def _fragment(found: _Found, path: str, fragment: pb.Fragment) -> None:
    if problem := journal_problem(fragment.journal):
        found.add(_at(path, "journal"), problem)
    if fragment.begin > fragment.end:
        found.add(_at(path, "begin"), f"must not exceed end ({fragment.begin} > {fragment.end})")
    _codec(found, _at(path, "compression_codec"), fragment.compression_codec)
    if problem := _path_problem(fragment.path_postfix, 0, MAX_JOURNAL_LEN):
        found.add(_at(path, "path_postfix"), problem)


def _offsets(found: _Found, path: str, offsets: Mapping[str, int]) -> None:
    for journal, offset in sorted(offsets.items()):
        at = f"{path}[{journal!r}]"
        if problem := journal_problem(journal):
            found.add(at, problem)
        elif offset < 0:
            found.add(at, f"offset must not be negative ({offset})")


def _read_response(found: _Found, r: pb.ReadResponse) -> None:
    """A content chunk carries nothing else; metadata describes a fragment that holds
    ``offset``, or (with no fragment) an OK status has offset 0."""
    _status(found, "status", r.status, pb.Status)
    if r.content:
        if r.status != pb.OK:
            found.add("status", "a content chunk must have status OK")
        for field, present in (
            ("header", r.HasField("header")),
            ("write_head", r.write_head != 0),
            ("fragment", r.HasField("fragment")),
            ("fragment_url", bool(r.fragment_url)),
        ):
            if present:
                found.add(field, "must be unset in a content chunk")
        return
    if r.HasField("header"):
        _header(found, "header", r.header)
    if r.write_head < 0:
        found.add("write_head", f"must not be negative ({r.write_head})")
    if r.HasField("fragment"):
        f = r.fragment
        _fragment(found, "fragment", f)
        if not f.begin <= r.offset < f.end:
            found.add("offset", f"must be within the fragment, {f.begin} <= offset < {f.end} "
                                f"(got {r.offset})")
        if r.write_head < f.end:
            found.add("write_head", f"must be at least the fragment's end {f.end} "
                                    f"(got {r.write_head})")
        if r.fragment_url and (problem := url_problem(r.fragment_url)):
            found.add("fragment_url", problem)
    else:
        if r.status == pb.OK and r.offset != 0:
            found.add("offset", f"must be 0 without a fragment or content (got {r.offset})")
        if r.fragment_url:
            found.add("fragment_url", "must be unset without a fragment")


def _append_response(found: _Found, r: pb.AppendResponse) -> None:
    _status(found, "status", r.status, pb.Status)
    _required_header(found, r)
    if r.status == pb.OK and not r.HasField("commit"):
        found.add("commit", "is required with status OK")
    if r.status in (pb.OK, pb.REGISTER_MISMATCH) and not r.HasField("registers"):
        found.add("registers", f"is required with status {pb.Status.Name(r.status)}")
    if r.HasField("commit"):
        _fragment(found, "commit", r.commit)
    if r.HasField("registers"):
        _label_set(found, "registers", r.registers)


def _replicate_response(found: _Found, r: pb.ReplicateResponse) -> None:
    _status(found, "status", r.status, pb.Status)
    if r.status == pb.WRONG_ROUTE:
        _required_header(found, r)
    elif r.HasField("header"):
        found.add("header", "must be unset unless status is WRONG_ROUTE")
    if r.status == pb.PROPOSAL_MISMATCH:
        for field in ("fragment", "registers"):
            if not r.HasField(field):
                found.add(field, "is required with status PROPOSAL_MISMATCH")
        _fragment(found, "fragment", r.fragment)
        _label_set(found, "registers", r.registers)
    else:
        for field in ("fragment", "registers"):
            if r.HasField(field):
                found.add(field, "must be unset unless status is PROPOSAL_MISMATCH")


def _journal_list_response(found: _Found, r: pb.ListResponse) -> None:
    _status(found, "status", r.status, pb.Status)
    _required_header(found, r)
    for index, journal in enumerate(r.journals):
        at = _at("journals", index)
        _journal_spec(found, _at(at, "spec"), journal.spec)
        if journal.mod_revision <= 0:
            found.add(_at(at, "mod_revision"), f"must be positive ({journal.mod_revision})")
        _route(found, _at(at, "route"), journal.route)


def _enum_of(r: Message) -> Any:
    return consumer_pb.Status if r.DESCRIPTOR.file.package == "consumer" else pb.Status


def _fragments_response(found: _Found, r: pb.FragmentsResponse) -> None:
    _status(found, "status", r.status, pb.Status)
    _required_header(found, r)
    for index, item in enumerate(r.fragments):
        at = _at("fragments", index)
        if not item.HasField("spec"):
            found.add(_at(at, "spec"), "is required")
        _fragment(found, _at(at, "spec"), item.spec)
        if problem := url_problem(item.signed_url):
            found.add(_at(at, "signed_url"), problem)


# --- shard messages ----------------------------------------------------------------------------


def _hint_prefix_problem(prefix: str) -> str | None:
    if not prefix.startswith("/") or go_clean_path(prefix) != prefix:
        return f"must be an absolute, clean path without a trailing '/' ({prefix!r})"
    return None


def _shard_spec(found: _Found, path: str, spec: consumer_pb.ShardSpec) -> None:
    if problem := shard_id_problem(spec.id):
        found.add(_at(path, "id"), problem)
    if spec.recovery_log_prefix:
        if problem := journal_problem(f"{spec.recovery_log_prefix}/{spec.id}"):
            found.add(_at(path, "recovery_log_prefix"), f"the recovery log {problem}")
        if problem := _hint_prefix_problem(spec.hint_prefix):
            found.add(_at(path, "hint_prefix"), problem)
    elif spec.hint_prefix:
        found.add(_at(path, "hint_prefix"), "must be empty without a recovery_log_prefix")
    if spec.hint_backups < 0:
        found.add(_at(path, "hint_backups"), f"must not be negative ({spec.hint_backups})")
    if _duration_nanos(spec.min_txn_duration) < 0:
        found.add(_at(path, "min_txn_duration"), "must not be negative")
    if _duration_nanos(spec.max_txn_duration) <= 0:
        found.add(_at(path, "max_txn_duration"), "must be positive")
    labels, at = spec.labels, _at(path, "labels")
    _label_set(found, at, labels)
    _single_values(found, at, labels)
    if _values_of(labels, "id"):
        found.add(at, "'id' is a meta-label, not for specs")
    for index, source in enumerate(spec.sources):
        source_at = _at(_at(path, "sources"), index)
        if problem := journal_problem(source.journal):
            found.add(_at(source_at, "journal"), problem)
        if source.min_offset < 0:
            found.add(_at(source_at, "min_offset"), f"must not be negative ({source.min_offset})")
        if index and spec.sources[index - 1].journal >= source.journal:
            found.add(source_at, "sources must be in unique order of journal")


def _replica_status(found: _Found, path: str, status: consumer_pb.ReplicaStatus) -> None:
    if status.code not in consumer_pb.ReplicaStatus.Code.values():
        found.add(_at(path, "code"), f"not a known code ({status.code})")
    failed = status.code == consumer_pb.ReplicaStatus.FAILED
    if failed and not status.errors:
        found.add(_at(path, "errors"), "a FAILED replica must say why")
    if status.errors and not failed:
        found.add(_at(path, "code"), "must be FAILED when there are errors")


def _shard_list_response(found: _Found, r: consumer_pb.ListResponse) -> None:
    _status(found, "status", r.status, consumer_pb.Status)
    _required_header(found, r)
    for index, shard in enumerate(r.shards):
        at = _at("shards", index)
        _shard_spec(found, _at(at, "spec"), shard.spec)
        if shard.mod_revision <= 0:
            found.add(_at(at, "mod_revision"), f"must be positive ({shard.mod_revision})")
        _route(found, _at(at, "route"), shard.route)
        if len(shard.status) != len(shard.route.members):
            found.add(
                _at(at, "status"),
                f"must hold one status per route member "
                f"({len(shard.status)} for {len(shard.route.members)})",
            )
        for i, status in enumerate(shard.status):
            _replica_status(found, _at(_at(at, "status"), i), status)


def _stat_response(found: _Found, r: consumer_pb.StatResponse) -> None:
    _status(found, "status", r.status, consumer_pb.Status)
    _required_header(found, r)
    _offsets(found, "read_through", r.read_through)
    _offsets(found, "publish_at", r.publish_at)


def _hints(found: _Found, path: str, hints: recoverylog_pb.FSMHints) -> None:
    """Each segment: an author, seq_no from 1, sane offsets, and a valid log (its own, or
    the hints' log, which it must not repeat)."""
    for n, node in enumerate(hints.live_nodes):
        for s, segment in enumerate(node.segments):
            at = _at(_at(_at(_at(path, "live_nodes"), n), "segments"), s)
            if segment.log and segment.log == hints.log:
                found.add(_at(at, "log"), "must be empty when it is the hints' own log")
            if not segment.author:
                found.add(_at(at, "author"), "must not be zero")
            if segment.first_seq_no <= 0:
                found.add(_at(at, "first_seq_no"), f"must be positive ({segment.first_seq_no})")
            if segment.first_offset < 0:
                found.add(_at(at, "first_offset"), f"must not be negative ({segment.first_offset})")
            if segment.last_seq_no < segment.first_seq_no:
                found.add(_at(at, "last_seq_no"), "must not precede first_seq_no")
            if segment.last_offset and segment.last_offset <= segment.first_offset:
                found.add(_at(at, "last_offset"), "must be 0 or beyond first_offset")
            if problem := journal_problem(segment.log or hints.log):
                found.add(_at(at, "log"), problem)


def _hints_response(found: _Found, r: consumer_pb.GetHintsResponse) -> None:
    _status(found, "status", r.status, consumer_pb.Status)
    if r.HasField("header"):
        _header(found, "header", r.header)
    if r.primary_hints.HasField("hints"):
        _hints(found, "primary_hints.hints", r.primary_hints.hints)
    for index, backup in enumerate(r.backup_hints):
        if backup.HasField("hints"):
            _hints(found, f"backup_hints[{index}].hints", backup.hints)


def _unassign_response(found: _Found, r: consumer_pb.UnassignResponse) -> None:
    _status(found, "status", r.status, consumer_pb.Status)
    for index, shard in enumerate(r.shards):
        if problem := shard_id_problem(shard):
            found.add(_at("shards", index), problem)


def _apply_response(found: _Found, r: Message) -> None:
    _status(found, "status", r.status, _enum_of(r))  # type: ignore[attr-defined]
    _required_header(found, r)


_RULES: dict[str, Callable[[_Found, Any], None]] = {
    pb.ListResponse.DESCRIPTOR.full_name: _journal_list_response,
    pb.ApplyResponse.DESCRIPTOR.full_name: _apply_response,
    pb.ReadResponse.DESCRIPTOR.full_name: _read_response,
    pb.AppendResponse.DESCRIPTOR.full_name: _append_response,
    pb.ReplicateResponse.DESCRIPTOR.full_name: _replicate_response,
    pb.FragmentsResponse.DESCRIPTOR.full_name: _fragments_response,
    consumer_pb.StatResponse.DESCRIPTOR.full_name: _stat_response,
    consumer_pb.ListResponse.DESCRIPTOR.full_name: _shard_list_response,
    consumer_pb.ApplyResponse.DESCRIPTOR.full_name: _apply_response,
    consumer_pb.GetHintsResponse.DESCRIPTOR.full_name: _hints_response,
    consumer_pb.UnassignResponse.DESCRIPTOR.full_name: _unassign_response,
    # The messages responses carry, checkable on their own.
    pb.Header.DESCRIPTOR.full_name: lambda f, m: _header(f, "", m),
    pb.Route.DESCRIPTOR.full_name: lambda f, m: _route(f, "", m),
    pb.ProcessSpec.ID.DESCRIPTOR.full_name: lambda f, m: _process_id(f, "", m),
    pb.LabelSet.DESCRIPTOR.full_name: lambda f, m: _label_set(f, "", m),
    pb.JournalSpec.DESCRIPTOR.full_name: lambda f, m: _journal_spec(f, "", m),
    pb.Fragment.DESCRIPTOR.full_name: lambda f, m: _fragment(f, "", m),
    consumer_pb.ShardSpec.DESCRIPTOR.full_name: lambda f, m: _shard_spec(f, "", m),
    consumer_pb.ReplicaStatus.DESCRIPTOR.full_name: lambda f, m: _replica_status(f, "", m),
    recoverylog_pb.FSMHints.DESCRIPTOR.full_name: lambda f, m: _hints(f, "", m),
}


def problems_of(message: Message) -> list[str]:
    """Every way ``message`` breaks Gazette's rules, each as "<field path>: <rule>"."""
    rules = _RULES.get(message.DESCRIPTOR.full_name)
    if rules is None:
        return []
    found = _Found()
    rules(found, message)
    return found.problems


def check(message: Message) -> None:
    """Raise NonConformant unless ``message`` follows Gazette's rules."""
    if problems := problems_of(message):
        raise NonConformant(message, problems)
