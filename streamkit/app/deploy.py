"""Making an application's journals and shard specs exist as its config describes them.

Recovery logs carry the deployment they belong to. An app's journals are
named from its name alone (`recovery/<app>/<shard>`), while its shards' specs,
hints and layout live in a KeySpace. Two KeySpaces deploying one app name on
one broker (a staging copy under another etcd prefix beside production, say)
would share recovery logs: each one's primaries would fence the other's, and
a playback would read the other's state. So each KeySpace holds an id for its
deployment of the app (`<root>/deployment`, made at its first deploy), every
recovery log is labeled with the id of the deployment that made it, and a
deploy from another KeySpace is refused, unless told to adopt the logs (the
KeySpace that wrote them was lost and this one replaces it). Logs from before
the label carry none: a KeySpace that has deployed the app before labels them
as its own (an upgrade); one deploying it for the first time must adopt them,
as they may be another KeySpace's.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from streamkit.app.assignment import item_key
from streamkit.app.config import DEPLOYMENT_LABEL
from streamkit.app.hints import decode_hints
from streamkit.client import BrokerClient
from streamkit.client.listing import apply_journals, list_journals
from streamkit.client.reader import write_heads
from streamkit.errors import StreamkitError
from streamkit.keyspace.keyspace import Compare, DeletePrefix, KeySpace, Put
from streamkit.protocol import consumer_pb, pb
from streamkit.protocol.labels import label_set
from streamkit.protocol.spec import JournalSpec

__all__ = ["DeploymentConflict", "RecoveryLogMissing", "check_recovery_logs", "deployment_id",
           "ensure_journals", "ensure_shard_specs", "forget_lost_logs", "lost_logs",
           "recorded_logs"]


async def ensure_journals(client: BrokerClient, specs: Iterable[JournalSpec],
                          adopt: bool = False, adopt_unlabeled: bool = True) -> int:
    """Create missing journals and update changed ones, in one Apply; how many changed.
    Lists just these journals, by name: not every journal of the broker.

    A retention an operator gave an existing journal (`journals apply`) is kept where the
    spec sets none: streamkit.yaml has no say in it, and each start reset it to none.
    A recovery log of another deployment is a DeploymentConflict, unless `adopt`, and
    so is one labeled by no deployment, unless `adopt_unlabeled`."""
    protos = [spec.to_proto() for spec in specs]
    if not protos:
        return 0
    existing = await _listed(client, protos)
    if not adopt:
        _check_deployment(protos, {name: j.spec for name, j in existing.items()},
                          adopt_unlabeled)
    changes = []
    for proto in protos:
        current = existing.get(proto.name)
        if current is not None and not proto.fragment.retention.ToNanoseconds():
            proto.fragment.retention.CopyFrom(current.spec.fragment.retention)
        if current is None:
            changes.append(pb.ApplyRequest.Change(expect_mod_revision=0, upsert=proto))
        elif current.spec != proto:
            changes.append(
                pb.ApplyRequest.Change(expect_mod_revision=current.mod_revision, upsert=proto)
            )
    if changes:
        await apply_journals(client, changes)
    return len(changes)


async def check_recovery_logs(client: BrokerClient, specs: Iterable[JournalSpec]) -> None:
    """Raise DeploymentConflict where `ensure_journals` (of an app deployed before) would:
    before a change that must not start unless that one can finish (a reshard)."""
    protos = [spec.to_proto() for spec in specs]
    if protos:
        existing = await _listed(client, protos)
        _check_deployment(protos, {name: j.spec for name, j in existing.items()}, True)


async def _listed(client: BrokerClient, specs: list[pb.JournalSpec]
                  ) -> dict[str, pb.ListResponse.Journal]:
    """The journals of `specs` that exist, by name: listed by name, not all the broker's."""
    named = pb.LabelSelector(include=label_set(*(("name", spec.name) for spec in specs)))
    return {j.spec.name: j for j in await list_journals(client, named)}


async def ensure_shard_specs(
    keyspace: KeySpace, root: str, specs: Iterable[consumer_pb.ShardSpec]
) -> int:
    """Write shard specs that are missing or differ under `{root}/items/`; how many changed."""
    changed = 0
    for spec in specs:
        key = item_key(root, spec.id)
        data = spec.SerializeToString(deterministic=True)
        current = await keyspace.get(key)
        if current is None or current.value != data:
            await keyspace.put(key, data)
            changed += 1
    return changed


class DeploymentConflict(StreamkitError):
    """The app's recovery logs on the broker belong to a deployment from another KeySpace."""

    def __init__(self, logs: dict[str, str], ours: str) -> None:
        first, other = next(iter(sorted(logs.items())))
        more = f" (and {len(logs) - 1} more)" if len(logs) > 1 else ""
        super().__init__(
            f"recovery log {first}{more} belongs to another deployment of its app "
            f"on this broker (id {other}; this KeySpace's is {ours}): two KeySpaces running "
            f"one app on one broker would share its shards' state, and its topics. Run this "
            f"copy on a broker of its own; if this KeySpace replaces the lost one that "
            f"deployed it, adopt its logs with `streamkit deploy --adopt-recovery-logs`")
        self.logs = logs


class RecoveryLogMissing(StreamkitError):
    """Recovery logs the KeySpace's hints say hold shards' state are not on this broker,
    or hold less there than the hints name."""

    def __init__(self, lost: dict[str, int | None], recorded: dict[str, int], broker: str,
                 adopting: bool = False) -> None:
        first, head = min(lost.items())
        end = recorded[first]
        more = f" (and {len(lost) - 1} more)" if len(lost) > 1 else ""
        if head is None:
            super().__init__(
                f"recovery log {first}{more} is not on broker {broker}, but this KeySpace's "
                f"hints say its shard recorded its state there (through offset {end:,}): is "
                f"this the app's broker? Its shards would start from an empty state here, "
                f"and overwrite their hints. If the logs were lost for good, stop the app's "
                f"members, then `streamkit deploy --adopt-recovery-logs` makes them anew "
                f"(the shards then start from nothing)")
        else:
            way_out = (
                "a shard can't start from what is left of it. Delete the log (`streamkit "
                "journals apply` of its spec with `delete: true`), then deploy with "
                "--adopt-recovery-logs again: its shard starts from nothing"
                if adopting else
                "is this the app's broker? If its content was lost for good, stop the "
                "app's members, delete the log (`streamkit journals apply` of its spec with "
                "`delete: true`), then `streamkit deploy --adopt-recovery-logs` makes it "
                "anew (its shard then starts from nothing)")
            super().__init__(
                f"recovery log {first}{more} on broker {broker} ends at offset {head:,}, "
                f"but this KeySpace's hints say its shard recorded its state there through "
                f"offset {end:,}: content is lost; {way_out}")
        self.lost = lost


async def lost_logs(client: BrokerClient, recorded: dict[str, int]) -> dict[str, int | None]:
    """The recorded logs (`recorded_logs`) the broker lacks (None), or whose write head is
    short of the end their hints name (that head). Heads are asked together, each given a
    few seconds: a log whose head can't be had is left to recovery to judge."""
    if not recorded:
        return {}
    existing = await _listed(client, [pb.JournalSpec(name=log) for log in recorded])
    lost: dict[str, int | None] = {log: None for log in recorded if log not in existing}
    heads = await write_heads(client, sorted(set(recorded) & set(existing)), _HEAD_TIMEOUT)
    lost.update({log: head for log, head in heads.items() if head < recorded[log]})
    return lost


_HEAD_TIMEOUT = 10.0


async def forget_lost_logs(keyspace: KeySpace, specs: Iterable[consumer_pb.ShardSpec],
                           lost: Iterable[str]) -> None:
    """Delete the hints of the shards whose logs are `lost` (missing from the broker): for
    an adopting deploy, which makes those logs anew, their shards then starting from an
    empty state (recovery refuses hints a log falls short of)."""
    lost = set(lost)
    for spec in specs:
        if spec.recovery_log_prefix and f"{spec.recovery_log_prefix}/{spec.id}" in lost:
            await keyspace.txn((), (DeletePrefix(f"{spec.hint_prefix}/{spec.id}."),))


async def recorded_logs(keyspace: KeySpace, specs: Iterable[consumer_pb.ShardSpec]
                        ) -> dict[str, int]:
    """The shards' recovery logs their hints name content of: log -> the furthest offset any
    of its hints names (a log without hints, or with empty ones, holds no state yet). One
    range read per hint prefix (not a read per shard and backup: this runs at each start)."""
    specs = list(specs)
    logs = {f"{s.recovery_log_prefix}/{s.id}" for s in specs if s.recovery_log_prefix}
    recorded: dict[str, int] = {}
    for prefix in sorted({s.hint_prefix for s in specs if s.recovery_log_prefix}):
        kvs, _ = await keyspace.range(f"{prefix}/")
        for kv in kvs:
            try:
                hints = decode_hints(kv.value)
            except Exception:  # (unreadable hints are skipped by recovery too, saying so)
                continue
            ends = [seg.last_offset or seg.first_offset for node in hints.live_nodes
                    for seg in node.segments]
            if hints.log in logs and ends:
                recorded[hints.log] = max(recorded.get(hints.log, 0), *ends)
    return recorded


def _key(root: str) -> str:
    return f"{root}/deployment"


async def deployment_id(keyspace: KeySpace, root: str) -> str:
    """The id of the app's deployment in `keyspace` (app root `root`), made if it has none."""
    key = _key(root)
    while True:
        if (kv := await keyspace.get(key)) is not None:
            return kv.value.decode()
        made = uuid.uuid4().hex  # (another deploy may be making one at the same time)
        if (await keyspace.txn((Compare(key, create_revision=0),),
                               (Put(key, made.encode()),))).succeeded:
            return made


def _check_deployment(specs: list[pb.JournalSpec], existing: dict[str, pb.JournalSpec],
                      adopt_unlabeled: bool) -> None:
    """Raise DeploymentConflict if a journal of `specs` labeled with one deployment exists
    (`existing`, by name) labeled with another, or with none unless `adopt_unlabeled`."""
    foreign, ours = {}, ""
    for spec in specs:
        mine, current = _deployment_of(spec), existing.get(spec.name)
        if not mine or current is None:
            continue
        ours, theirs = mine, _deployment_of(current)
        if theirs != mine and (theirs or not adopt_unlabeled):
            foreign[spec.name] = theirs or "none: made before deployments were labeled"
    if foreign:
        raise DeploymentConflict(foreign, ours)


def _deployment_of(spec: pb.JournalSpec) -> str:
    return next((label.value for label in spec.labels.labels
                 if label.name == DEPLOYMENT_LABEL), "")
