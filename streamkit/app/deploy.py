"""Making an application's journals and shard specs exist as its config describes them."""

from __future__ import annotations

from collections.abc import Iterable

from streamkit.app.assignment import item_key
from streamkit.client import BrokerClient
from streamkit.client.listing import apply_journals, list_journals
from streamkit.keyspace.keyspace import KeySpace
from streamkit.protocol import consumer_pb, pb
from streamkit.protocol.labels import label_set
from streamkit.protocol.spec import JournalSpec

__all__ = ["ensure_journals", "ensure_shard_specs"]


async def ensure_journals(client: BrokerClient, specs: Iterable[JournalSpec]) -> int:
    """Create missing journals and update changed ones, in one Apply; how many changed.
    Lists just these journals, by name: not every journal of the broker.

    A retention an operator gave an existing journal (`journals apply`) is kept where the
    spec sets none: streamkit.yaml has no say in it, and each start reset it to none."""
    specs = list(specs)
    if not specs:
        return 0
    named = pb.LabelSelector(include=label_set(*(("name", spec.name) for spec in specs)))
    existing = {j.spec.name: j for j in await list_journals(client, named)}
    changes = []
    for spec in specs:
        proto = spec.to_proto()
        current = existing.get(spec.name)
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
