"""Recovery-log hints of shards, kept in the KeySpace.

A primary writes its hints to `{hint_prefix}/{id}.primary` now and then, and
after recovering it pushes the hints it recovered with to `.backup.0`
(shifting older backups down), in case the primary hints turn out to be
bad. Recovery tries the primary hints, then the backups, newest first. Values
are FSMHints as protobuf JSON, as Gazette keeps them.
"""

from __future__ import annotations

import logging

from streamkit.keyspace.keyspace import Compare, KeySpace, Put
from streamkit.protocol import consumer_pb
from streamkit.protocol import recoverylog_pb2 as rpb
from streamkit.recoverylog.fsm import hints_from_json, hints_to_json

__all__ = ["decode_hints", "encode_hints", "load_hints", "push_backup_hints", "store_primary_hints"]

log = logging.getLogger(__name__)


def primary_key(spec: consumer_pb.ShardSpec) -> str:
    return f"{spec.hint_prefix}/{spec.id}.primary"


def backup_key(spec: consumer_pb.ShardSpec, index: int) -> str:
    return f"{spec.hint_prefix}/{spec.id}.backup.{index}"


def encode_hints(hints: rpb.FSMHints) -> bytes:
    return hints_to_json(hints).encode()


def decode_hints(data: bytes) -> rpb.FSMHints:
    """Hints from JSON (as written here and by Gazette) or from serialized protobuf."""
    if data.lstrip().startswith(b"{"):
        return hints_from_json(data)
    return rpb.FSMHints.FromString(data)


async def load_hints(keyspace: KeySpace, spec: consumer_pb.ShardSpec) -> list[rpb.FSMHints]:
    """Hints to try in order: the primary's, then the backups, newest first."""
    keys = [primary_key(spec)] + [backup_key(spec, i) for i in range(spec.hint_backups)]
    found = []
    for key in keys:
        kv = await keyspace.get(key)
        if kv is None or not kv.value:
            continue
        try:
            found.append(decode_hints(kv.value))
        except Exception as error:
            log.warning("shard %s: ignoring unreadable hints at %s: %s", spec.id, key, error)
    return found


async def store_primary_hints(
    keyspace: KeySpace, spec: consumer_pb.ShardSpec, hints: rpb.FSMHints
) -> None:
    await keyspace.put(primary_key(spec), encode_hints(hints))


async def push_backup_hints(
    keyspace: KeySpace, spec: consumer_pb.ShardSpec, hints: rpb.FSMHints
) -> None:
    """Make `hints` backup 0, shifting the older backups one down (the last falls off)."""
    if spec.hint_backups <= 0:
        return
    for _ in range(10):  # another writer racing us is rare: retry on its revisions
        current = [await keyspace.get(backup_key(spec, i)) for i in range(spec.hint_backups)]
        compares = [
            Compare(backup_key(spec, i), mod_revision=kv.mod_revision if kv else 0)
            for i, kv in enumerate(current)
        ]
        ops = [Put(backup_key(spec, 0), encode_hints(hints))]
        ops += [
            Put(backup_key(spec, i + 1), kv.value)
            for i, kv in enumerate(current[:-1])
            if kv is not None
        ]
        result = await keyspace.txn(compares, ops)
        if result.succeeded:
            return
    log.warning("shard %s: gave up writing backup hints (kept changing)", spec.id)
