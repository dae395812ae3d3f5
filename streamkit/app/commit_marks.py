"""Commit marks: the KeySpace's record that a shard's external store has committed.

A store that keeps its checkpoint in a database of its own (SQLStore) restores
an empty checkpoint for a shard it has no row for, as it must for a new shard.
But a shard whose row was lost (its table dropped or emptied, or `store.url`
pointing at another database) looks new as well, and would count its sources
again from the start on top of the app's tables. The KeySpace is the witness
that tells the two apart: once such a shard has committed, `<root>/committed/<id>`
holds where, and a restore that finds nothing where the mark says a
commit was is refused, naming what is missing and how to start over on purpose
(`streamkit shards forget`).
"""

from __future__ import annotations

import json
import time

from streamkit.keyspace.keyspace import KeySpace
from streamkit.protocol import consumer_pb
from streamkit.stores.store import StoreError

__all__ = ["CheckpointLost", "check_restored", "forget_commits", "mark_committed", "mark_key"]


class CheckpointLost(StoreError):
    """A shard that committed to its database before restored no checkpoint from it."""


def mark_key(root: str, shard_id: str) -> str:
    return f"{root}/committed/{shard_id}"


async def check_restored(keyspace: KeySpace, root: str, shard_id: str,
                         cp: consumer_pb.Checkpoint, where: str) -> None:
    """Raise CheckpointLost if `cp` is empty although the shard committed before."""
    if cp.ByteSize():
        return
    kv = await keyspace.get(mark_key(root, shard_id))
    if kv is None:
        return
    try:
        mark = json.loads(kv.value)
        before = "there" if mark["database"] == where else f"to {mark['database']}"
        before += f" (first at {mark['since']})"
    except (ValueError, KeyError, TypeError):
        before = "before"
    raise CheckpointLost(
        f"shard {shard_id}: no checkpoint for it in {where}, yet it committed {before}: "
        f"its checkpoint table was dropped or emptied, or the store's url now names "
        f"another database. Starting from nothing would count its sources again on top "
        f"of the app's tables. Restore the database, or, to start the shard over on "
        f"purpose (its tables emptied), run `streamkit shards forget {shard_id}`")


async def mark_committed(keyspace: KeySpace, root: str, shard_id: str, where: str) -> None:
    """Record that the shard committed to `where` (once: an existing mark is kept)."""
    key = mark_key(root, shard_id)
    if await keyspace.get(key) is not None:
        return
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    await keyspace.put(key, json.dumps({"database": where, "since": since}).encode())


async def forget_commits(keyspace: KeySpace, root: str, shard_ids: list[str]) -> list[str]:
    """Delete the shards' marks; the ids that had one."""
    had = [sid for sid in shard_ids if await keyspace.get(mark_key(root, sid)) is not None]
    for sid in had:
        await keyspace.delete(mark_key(root, sid))
    return had
