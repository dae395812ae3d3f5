"""Planning a backfill: which bytes of which journals each shard reads, and from where.

A plan is made once, on the driver, and shipped to the executors: it is a
tree of small dataclasses holding only str, int and bytes, so it pickles for
Spark and prints as JSON for `--plan`.

For every shard, each source journal is read from the shard's start (its
spec's min_offset) to the plan's end: the write head when planning started,
unless an end offset was given. The bytes in between are covered by the
journal's fragments, as ListFragments lists them:

* a persisted fragment whose file the executors can reach (a `file://` store
  under the fragment root, or a signed http(s) URL) is read directly, with no
  broker in the path;
* anything else (the still-open spool at the head of a journal, or a store
  the executors can't reach) is read through the broker's Read RPC.

Where two fragments cover the same bytes (a spool and its persisted copy),
the one readable directly wins. Bytes no fragment covers (removed by
retention) are skipped, as a live reader skips them.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from streamkit.app.config import PARTITION_PER_SHARD, AppConfig
from streamkit.auth.keys import ALLOW_MISSING_KEY, parse_keys
from streamkit.auth.settings import Security
from streamkit.auth.tls import ClientTls
from streamkit.backfill.errors import BackfillError
from streamkit.client import (
    BrokerClient,
    JournalNotFound,
    get_journal,
    list_fragments,
    list_journals,
    write_head,
)
from streamkit.message.framing import UnknownFraming, content_type_of, framing_for
from streamkit.protocol import consumer_pb, pb
from streamkit.protocol.fragments import content_name

__all__ = [
    "BackfillPlan",
    "JournalPlan",
    "Segment",
    "ShardPlan",
    "config_document",
    "cover",
    "make_plan",
    "parse_ends",
]

URL_TTL = timedelta(hours=12)  # how long signed fragment URLs must stay valid


@dataclass(frozen=True)
class Segment:
    """Journal bytes [begin, end), all within one fragment.

    `fragment` is the serialized pb.Fragment. `url` is where an executor
    reads it directly; "" means through the broker.
    """

    begin: int
    end: int
    fragment: bytes
    url: str = ""

    @property
    def direct(self) -> bool:
        return bool(self.url)

    def describe(self, journal: str) -> str:
        """The fragment's file name (or spool) and this segment's offsets, for messages."""
        f = pb.Fragment.FromString(self.fragment)
        try:
            name = content_name(f) if f.backing_store else "its open spool"
        except ValueError:
            name = f"fragment [{f.begin}, {f.end})"
        return f"{name} of journal {journal}, offsets [{self.begin}, {self.end})"


@dataclass(frozen=True)
class JournalPlan:
    """One source journal of a shard: bytes [begin, end), covered by `segments` in order."""

    journal: str
    content_type: str
    begin: int
    end: int
    segments: list[Segment] = field(default_factory=list)

    @property
    def bytes_direct(self) -> int:
        return sum(s.end - s.begin for s in self.segments if s.direct)

    @property
    def bytes_via_broker(self) -> int:
        return sum(s.end - s.begin for s in self.segments if not s.direct)

    @property
    def bytes_missing(self) -> int:
        return self.end - self.begin - self.bytes_direct - self.bytes_via_broker


@dataclass(frozen=True)
class ShardPlan:
    """A shard to backfill: its spec (serialized consumer_pb.ShardSpec) and its journals.

    A resharded app's shard reads every partition its source topics ever had
    (`journals`), one earlier layout after another: `epochs` holds where each
    earlier layout ended in each journal, and the last layout runs to each
    journal's end. Of the journals in `rekey` (journal -> source topic) it
    keeps the messages whose key routes to its own partition of that topic,
    exactly as publishers route them over the app's partitions now.
    """

    shard_id: str
    spec: bytes
    journals: list[JournalPlan]
    epochs: list[dict[str, int]] = field(default_factory=list)
    rekey: dict[str, str] = field(default_factory=dict)

    def shard_spec(self) -> consumer_pb.ShardSpec:
        return consumer_pb.ShardSpec.FromString(self.spec)


@dataclass(frozen=True)
class BackfillPlan:
    """Everything an executor needs to backfill any shard of the app."""

    app_dir: str  # the app folder (streamkit.yaml and the Application's module)
    config: dict[str, Any]  # streamkit.yaml as validated, with the store kind settled
    broker: str  # host:port of a broker serving the app's journals
    keyspace: str  # URL or path of the app's KeySpace (shard hints are stored there)
    fragment_root: str | None  # the broker's file:// fragment store root, if reachable
    txn_size: int  # messages per transaction; 0: as many as the shard's max_txn_duration allows
    shards: list[ShardPlan]
    # How executors dial the broker, as plain data (see `security_data`): it travels to
    # Spark's Python workers with the plan. Holds the keys: never printed (`summary`).
    security: dict[str, str] = field(default_factory=dict)
    # Where tasks on the command's machine report how far they have read (progress.py).
    progress_dir: str | None = None

    def client_security(self) -> Security:
        """The driver's Security for dialling the broker, rebuilt on an executor."""
        data = self.security
        ca, cert, key = (data.get(name) for name in ("tls_ca", "tls_client_cert",
                                                      "tls_client_key"))
        client_tls = None
        if ca or cert:
            client_tls = ClientTls(ca=Path(ca) if ca else None, cert=Path(cert) if cert else None,
                                   key=Path(key) if key else None)
        keys = parse_keys(data["auth_keys"], "the backfill's auth keys") \
            if data.get("auth_keys") else None
        return Security(keys=keys, client_tls=client_tls)

    @property
    def store_kind(self) -> str:
        return str((self.config.get("store") or {}).get("kind") or "rocksdb")

    def app_config(self, app_dir: str | Path | None = None) -> AppConfig:
        folder = Path(app_dir or self.app_dir)
        return AppConfig.parse(self.config, str(folder / "streamkit.yaml"), folder)

    def summary(self) -> dict[str, Any]:
        """What `--plan` prints: shards, journals, byte ranges and fragment counts."""
        return {
            "app_dir": self.app_dir,
            "store": self.store_kind,
            "broker": self.broker,
            "keyspace": self.keyspace,
            "fragment_root": self.fragment_root,
            "txn_size": self.txn_size,
            "shards": [
                {
                    "shard": shard.shard_id,
                    "journals": [
                        {
                            "journal": j.journal,
                            "begin": j.begin,
                            "end": j.end,
                            "fragments": len({s.fragment for s in j.segments}),
                            "direct_fragments": len({s.fragment for s in j.segments if s.direct}),
                            "bytes_direct": j.bytes_direct,
                            "bytes_via_broker": j.bytes_via_broker,
                            "bytes_missing": j.bytes_missing,
                        }
                        for j in shard.journals
                    ],
                }
                for shard in self.shards
            ],
        }

    def to_json(self) -> str:
        """The whole plan (fragments included, as hex) as JSON, but not its keys."""

        def encode(value: Any) -> Any:
            if isinstance(value, bytes):
                return value.hex()
            raise TypeError(type(value).__name__)

        document = asdict(self)
        document.pop("security", None)
        return json.dumps(document, default=encode)


def config_document(config: AppConfig) -> dict[str, Any]:
    """streamkit.yaml as plain JSON-able data that `AppConfig.parse` reads back the same."""
    document = config.model_dump()
    document["transactions"] = {
        name: value.total_seconds() for name, value in document["transactions"].items()
    }
    return document


def parse_ends(values: Iterable[str]) -> dict[str, int]:
    """`JOURNAL=OFFSET` arguments as a mapping (BackfillError on a malformed one)."""
    ends: dict[str, int] = {}
    for value in values:
        journal, sep, offset = value.rpartition("=")
        if not sep or not journal:
            raise BackfillError(f"--end {value!r}: expected JOURNAL=OFFSET")
        try:
            ends[journal] = int(offset)
        except ValueError:
            raise BackfillError(f"--end {value!r}: {offset!r} is not an offset") from None
        if ends[journal] < 0:
            raise BackfillError(f"--end {value!r}: offsets are not negative")
    return ends


def _direct_url(listed: pb.FragmentsResponse._Fragment, fragment_root: Path | None) -> str:
    """Where an executor can read a persisted fragment itself, or "" (through the broker)."""
    if not listed.spec.backing_store or not listed.signed_url:
        return ""
    scheme = urlsplit(listed.signed_url).scheme
    if scheme == "file":
        return listed.signed_url if fragment_root is not None else ""
    return listed.signed_url if scheme in ("http", "https") else ""


def cover(
    listed: Sequence[pb.FragmentsResponse._Fragment],
    begin: int,
    end: int,
    fragment_root: Path | None = None,
) -> list[Segment]:
    """Segments reading [begin, end) from the listed fragments (see the module docstring)."""
    candidates = sorted(
        ((f.spec, _direct_url(f, fragment_root)) for f in listed if f.spec.end > f.spec.begin),
        key=lambda c: c[0].begin,
    )
    segments: list[Segment] = []
    offset, i = begin, 0
    while offset < end:
        best: tuple[pb.Fragment, str] | None = None
        while i < len(candidates) and candidates[i][0].end <= offset:
            i += 1  # wholly behind us (sorted by begin, so it never covers again)
        j = i
        while j < len(candidates) and candidates[j][0].begin <= offset:
            spec, url = candidates[j]
            if spec.end > offset and (
                best is None or (bool(url), spec.end) > (bool(best[1]), best[0].end)
            ):
                best = candidates[j]
            j += 1
        if best is None:
            following = [c[0].begin for c in candidates[j:] if c[0].begin > offset]
            if not following or following[0] >= end:
                break  # nothing covers the rest: it was removed
            offset = following[0]  # a gap (removed content) is skipped
            continue
        spec, url = best
        stop = min(spec.end, end)
        segments.append(Segment(offset, stop, spec.SerializeToString(), url))
        offset = stop
    return segments


def _check_fragment_root(root: Path, journal: str, segments: Sequence[Segment]) -> None:
    """Fail early, on the driver, if file fragments are not where the root says."""
    for segment in segments:
        if segment.url.startswith("file:"):
            path = root / unquote(urlsplit(segment.url).path).lstrip("/")
            if not path.exists():
                raise BackfillError(
                    f"fragment {segment.describe(journal)} is not at {path}: is "
                    f"{root} the broker's fragment store (--fragment-root)?"
                )
            return


async def _content_type(client: BrokerClient, journal: str) -> str:
    try:
        spec = await get_journal(client, journal)
    except JournalNotFound:
        raise BackfillError(
            f"source journal {journal} does not exist: publish to it, or create the app's "
            "journals with `streamkit run` (or `streamkit journals apply`)"
        ) from None
    content_type = content_type_of(spec.labels)
    try:
        framing_for(content_type)
    except UnknownFraming as error:
        raise BackfillError(f"journal {journal}: {error}") from None
    return content_type


def _rekeyed_sources(
    config: AppConfig, epochs: Sequence[Mapping[str, int]], heads: Mapping[str, int]
) -> tuple[dict[str, int], dict[str, str]]:
    """Every journal of the app's source topics, past and present, and where each ends;
    and the journals whose messages are re-routed by key (journal -> topic)."""
    ends: dict[str, int] = {}
    for epoch in epochs:
        ends.update(epoch)
    ends.update(heads)
    rekey = {}
    for source in config.sources:
        prefix = f"{source.topic}/part-"
        for journal in ends:
            if journal.startswith(prefix) and source.read == PARTITION_PER_SHARD:
                rekey[journal] = source.topic
    return ends, rekey


async def make_plan(
    config: AppConfig,
    client: BrokerClient,
    specs: Sequence[consumer_pb.ShardSpec],
    *,
    broker: str,
    keyspace: str,
    fragment_root: Path | None = None,
    ends: Mapping[str, int] | None = None,
    txn_size: int = 0,
    epochs: Sequence[Mapping[str, int]] = (),
) -> BackfillPlan:
    """Plan the backfill of `specs` (the app's shards) against the broker `client` talks to.

    Transactions last what the shards' max_txn_duration allows, as live
    ones do, or exactly `txn_size` messages if that is given. `epochs` are a
    resharded app's earlier layouts (`Layout.history` ends): then every
    shard reads all of them, re-keyed (see ShardPlan).
    """
    if txn_size < 0:
        raise BackfillError(f"a transaction can't have {txn_size} messages")
    if epochs:
        return await _make_rekeyed_plan(config, client, specs, broker=broker,
                                        keyspace=keyspace, fragment_root=fragment_root,
                                        txn_size=txn_size, epochs=epochs)
    ends = dict(ends or {})
    journals = sorted({source.journal for spec in specs for source in spec.sources})
    unknown = sorted(set(ends) - set(journals))
    if unknown:
        raise BackfillError(
            f"--end names {', '.join(unknown)}, which no shard reads "
            f"(the app's source journals: {', '.join(journals)})"
        )
    content_types = {journal: await _content_type(client, journal) for journal in journals}
    heads = {journal: await write_head(client, journal) for journal in journals}
    for journal, end in ends.items():
        if end > heads[journal]:
            raise BackfillError(
                f"--end {journal}={end} is past the journal's write head {heads[journal]}"
            )
    heads.update(ends)
    root = fragment_root.resolve() if fragment_root is not None else None
    planner = _JournalPlanner(client, content_types, root)
    shards = []
    for spec in specs:
        plans = []
        for source in spec.sources:
            journal = source.journal
            begin = min(source.min_offset, heads[journal])
            plans.append(await planner.plan(journal, begin, heads[journal]))
        shards.append(ShardPlan(spec.id, spec.SerializeToString(deterministic=True), plans))
    return _backfill_plan(config, broker, keyspace, root, txn_size, shards)


class _JournalPlanner:
    """JournalPlans over each journal's fragments, listed once per journal."""

    def __init__(self, client: BrokerClient, content_types: Mapping[str, str],
                 root: Path | None) -> None:
        self.client, self.content_types, self.root = client, content_types, root
        self._listed: dict[str, Sequence[pb.FragmentsResponse._Fragment]] = {}

    async def plan(self, journal: str, begin: int, end: int) -> JournalPlan:
        if journal not in self._listed:
            response = await list_fragments(self.client, journal, signature_ttl=URL_TTL)
            self._listed[journal] = response.fragments
        segments = cover(self._listed[journal], begin, end, self.root)
        if self.root is not None:
            _check_fragment_root(self.root, journal, segments)
        return JournalPlan(journal, self.content_types[journal], begin, end, segments)


async def _make_rekeyed_plan(
    config: AppConfig,
    client: BrokerClient,
    specs: Sequence[consumer_pb.ShardSpec],
    *,
    broker: str,
    keyspace: str,
    fragment_root: Path | None,
    txn_size: int,
    epochs: Sequence[Mapping[str, int]],
) -> BackfillPlan:
    """Every shard reads every partition its source topics ever had (see ShardPlan)."""
    current = sorted({source.journal for spec in specs for source in spec.sources})
    existing = {j.spec.name for j in await list_journals(client)}
    # Partitions of the present layout are read to their write heads; those only an
    # earlier layout had (retired, read-only) to where that layout ended.
    heads = {j: await write_head(client, j) for j in current if j in existing}
    ends, rekey = _rekeyed_sources(config, epochs, heads)
    content_types = {journal: await _content_type(client, journal) for journal in ends}
    root = fragment_root.resolve() if fragment_root is not None else None
    planner = _JournalPlanner(client, content_types, root)
    plans = [await planner.plan(journal, 0, end) for journal, end in sorted(ends.items())]
    shards = [
        ShardPlan(spec.id, spec.SerializeToString(deterministic=True), plans,
                  [dict(epoch) for epoch in epochs], rekey)
        for spec in specs
    ]
    return _backfill_plan(config, broker, keyspace, root, txn_size, shards)


def security_data(security: Security) -> dict[str, str]:
    """What `BackfillPlan.client_security` rebuilds: the keys as text and the client TLS
    files as absolute paths (executors on this machine, or seeing the same files)."""
    data: dict[str, str] = {}
    if security.keys is not None:
        words = [base64.b64encode(k).decode() for k in security.keys.verifying]
        data["auth_keys"] = " ".join(words + [ALLOW_MISSING_KEY] * security.keys.allow_missing)
    tls = security.client_tls
    if tls is not None:
        for name, path in (("tls_ca", tls.ca), ("tls_client_cert", tls.cert),
                           ("tls_client_key", tls.key)):
            if path is not None:
                data[name] = str(Path(path).resolve())
    return data


def _backfill_plan(config: AppConfig, broker: str, keyspace: str, root: Path | None,
                   txn_size: int, shards: list[ShardPlan]) -> BackfillPlan:
    return BackfillPlan(
        app_dir=str(config.app_dir.resolve()),
        config=config_document(config),
        broker=broker,
        keyspace=keyspace,
        fragment_root=str(root) if root is not None else None,
        txn_size=txn_size,
        shards=shards,
    )


def largest_first(plan: BackfillPlan) -> list[int]:
    """The shards' indexes, those with the most bytes to read first.

    Executors start tasks in this order as slots free up: with the longest
    tasks first, the last ones to start are short, and no core idles at the
    end while one long task started late runs on.
    """
    def size(index: int) -> int:
        return sum(j.end - j.begin for j in plan.shards[index].journals)

    return sorted(range(len(plan.shards)), key=size, reverse=True)
