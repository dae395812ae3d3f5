"""Resharding: moving a stopped app's state to another shard count, by a backfill.

Keys are routed to partitions by hashing modulo the partition count, so a
new count moves most keys to another partition, and their state to another
shard. The state for the new layout is recomputed from the whole history
(a re-keyed backfill, see `plan.ShardPlan`); this module does the rest:

* `next_layout` checks that resharding is possible and says what the layout
  will be: the old one becomes history, ending at its journals' write heads
  now (the cut);
* `apply_layout` records it (marked unfinished, so no command runs shards
  meanwhile), retires partitions the new layout has no more (relabeled and
  read-only: a publisher still routing to them fails loudly instead of
  writing where no shard reads), creates the new partitions, recovery logs
  and shard specs, and removes the specs of shards that no longer exist;
* `finish_layout` marks it finished once every shard was handed over.

The app must be stopped, and publishers paused, from the cut until they
route over the new partitions (docs/concepts/backfills.md#resharding).
"""

from __future__ import annotations

from streamkit.app.assignment import item_key, members_prefix
from streamkit.app.config import PARTITION_PER_SHARD, TOPIC_LABEL, AppConfig
from streamkit.app.deploy import (
    check_recovery_logs,
    deployment_id,
    ensure_journals,
    ensure_shard_specs,
)
from streamkit.app.hints import backup_key, primary_key
from streamkit.app.layout import Epoch, Layout, write_layout
from streamkit.app.store_kinds import records_to_log
from streamkit.backfill.errors import BackfillError
from streamkit.client import BrokerClient, list_journals, write_head
from streamkit.client.listing import apply_journals
from streamkit.keyspace.keyspace import KeySpace
from streamkit.protocol import consumer_pb, pb
from streamkit.protocol.labels import label_set

__all__ = ["RETIRED_LABEL", "apply_layout", "finish_layout", "next_layout"]

RETIRED_LABEL = "app.streamkit.dev/retired-topic"  # replaces TOPIC_LABEL on a retired partition


async def _topic_journals(client: BrokerClient, topic: str) -> list[pb.ListResponse.Journal]:
    return list(await list_journals(client, f"{TOPIC_LABEL}={topic}"))


async def next_layout(config: AppConfig, client: BrokerClient, keyspace: KeySpace,
                      layout: Layout) -> Layout:
    """The layout after resharding to `config.shards`; nothing is changed yet."""
    name, app = config.name, config.app_dir
    if not records_to_log(config.store_kind):
        raise BackfillError(
            f"app {name} keeps its state in a {config.store_kind} store, whose tables belong "
            "to the app: resharding recomputes state only for rocksdb, sqlite and json stores"
        )
    for source in config.sources:
        if source.read == PARTITION_PER_SHARD and source.key is None:
            raise BackfillError(
                f"source topic {source.topic!r} has no key: its messages were routed at "
                "random, so nothing says which new shard each belongs to (set key: FIELD, "
                f"or read: every-shard if every shard should read all of it)"
            )
    members, _ = await keyspace.range(members_prefix(config.keyspace_root))
    if members:
        raise BackfillError(
            f"app {name} is running ({len(members)} member(s) joined): stop it (Ctrl-C its "
            f"`streamkit run {app}`) and pause its publishers before resharding"
        )
    # Another KeySpace's recovery logs refuse the reshard now, not half-way through it.
    await check_recovery_logs(client, config.journal_specs(
        await deployment_id(keyspace, config.keyspace_root)))
    if layout.resharding:  # an unfinished reshard: its cut stands, only the target changes
        return Layout(config.shards, list(layout.history), resharding=True)
    heads = {}
    for source in config.sources:
        for journal in await _topic_journals(client, source.topic):
            heads[journal.spec.name] = await write_head(client, journal.spec.name)
    return Layout(config.shards, [*layout.history, Epoch(layout.shards, heads)],
                  resharding=True)


async def apply_layout(config: AppConfig, client: BrokerClient, keyspace: KeySpace,
                       layout: Layout) -> list[str]:
    """Record `layout` (unfinished) and make the broker and KeySpace match it; the
    partitions retired."""
    root = config.keyspace_root
    await write_layout(keyspace, root, layout)
    retired = await _retire_partitions(config, client)
    await ensure_journals(client, config.journal_specs(
        await deployment_id(keyspace, root)))
    await ensure_shard_specs(keyspace, root, config.shard_specs())
    kept = set(config.shard_ids())
    items, _ = await keyspace.range(item_key(root, ""))
    for kv in items:
        spec = consumer_pb.ShardSpec.FromString(kv.value)
        if spec.id not in kept:
            for key in (kv.key, primary_key(spec),
                        *(backup_key(spec, i) for i in range(spec.hint_backups))):
                await keyspace.delete(key)
    return retired


async def _retire_partitions(config: AppConfig, client: BrokerClient) -> list[str]:
    wanted = {journal for topic in config.topics() for journal in topic.journals()}
    changes, retired = [], []
    for topic in config.topics():
        for journal in await _topic_journals(client, topic.topic):
            if journal.spec.name in wanted:
                continue
            spec = pb.JournalSpec()
            spec.CopyFrom(journal.spec)
            labels = [(lbl.name, lbl.value) for lbl in spec.labels.labels
                      if lbl.name != TOPIC_LABEL]
            spec.labels.CopyFrom(label_set(*labels, (RETIRED_LABEL, topic.topic)))
            spec.flags = pb.JournalSpec.O_RDONLY
            changes.append(pb.ApplyRequest.Change(expect_mod_revision=journal.mod_revision,
                                                  upsert=spec))
            retired.append(spec.name)
    if changes:
        await apply_journals(client, changes)
    return sorted(retired)


async def finish_layout(keyspace: KeySpace, root: str, layout: Layout) -> None:
    layout.resharding = False
    await write_layout(keyspace, root, layout)
