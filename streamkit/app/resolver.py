"""Resolver: from a key to its journal, its shard, and the process serving that shard.

Keys are routed as publishers route them: by the mapping of the first source
topic read partition-per-shard (its `key` field, modulo over the
partitions); the shard is the one reading that partition; the process is the
member holding the shard's primary assignment in the KeySpace, reached at the
endpoint its member spec advertises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from streamkit.app.assignment import parse_assignment_key, parse_member_key
from streamkit.app.config import PARTITION_PER_SHARD, AppConfig
from streamkit.app.member_http import http_url
from streamkit.keyspace.keyspace import KeySpace
from streamkit.protocol import consumer_pb

__all__ = ["Primary", "Resolver"]


@dataclass(frozen=True, slots=True)
class Primary:
    """Where a shard's primary runs."""

    shard: str
    member: str
    endpoint: str  # grpc:// or https://host:port of its Shard API (HTTP on port + 1)
    status: consumer_pb.ReplicaStatus

    @property
    def http_url(self) -> str:
        return http_url(self.endpoint)


class Resolver:
    def __init__(self, config: AppConfig, keyspace: KeySpace) -> None:
        self.config = config
        self.keyspace = keyspace

    def journal_of(self, key: Any) -> str:
        keyed = [s for s in self.config.sources if s.read == PARTITION_PER_SHARD]
        if not keyed:
            raise LookupError("every source is read by every shard: no shard owns a key")
        source = keyed[0]
        journal, _ = self.config.mapping_for(source.topic)({source.key or "key": key})
        return journal

    def shard_of(self, key: Any) -> str:
        """The shard whose sources include the partition `key` maps to."""
        journal = self.journal_of(key)
        for index, shard_id in enumerate(self.config.shard_ids()):
            if journal in self.config.source_journals(index):
                return shard_id
        raise LookupError(f"no shard reads {journal}")

    async def members(self) -> dict[str, str]:
        """Member name -> its Shard API endpoint."""
        root = self.config.keyspace_root
        kvs, _ = await self.keyspace.range(f"{root}/members/")
        endpoints = {}
        for kv in kvs:
            member = parse_member_key(root, kv.key)
            if member is not None:
                spec = consumer_pb.ConsumerSpec.FromString(kv.value)
                endpoints[str(member)] = spec.process_spec.endpoint
        return endpoints

    async def primaries(self) -> dict[str, Primary]:
        """Shard id -> its primary, for shards that have one."""
        root = self.config.keyspace_root
        endpoints = await self.members()
        kvs, _ = await self.keyspace.range(f"{root}/assign/")
        found = {}
        for kv in kvs:
            parsed = parse_assignment_key(root, kv.key)
            if parsed is None or parsed[2] != 0 or str(parsed[1]) not in endpoints:
                continue
            item, member, _ = parsed
            found[item] = Primary(
                item,
                str(member),
                endpoints[str(member)],
                consumer_pb.ReplicaStatus.FromString(kv.value),
            )
        return found
