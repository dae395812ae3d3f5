"""A restored checkpoint that read a source past the journal's write head.

A shard resumes each source where its checkpoint says it read through. If that
is past the journal's write head on the broker, a reader there blocks until
appends reach the offset, and what is appended meanwhile is skipped without
a word: the shard shows no lag and counts nothing. It happens when the broker
is not the one the shard read (an SQL store's backfill at another app's
broker, whose journals have the same names) or lost committed content. Either
way the shard must stop and say so rather than skip.
"""

from __future__ import annotations

from streamkit.client import BrokerClient
from streamkit.client.reader import write_heads
from streamkit.protocol import consumer_pb
from streamkit.stores.store import StoreError

__all__ = ["CheckpointAhead", "check_read_through"]

_HEAD_TIMEOUT = 10.0  # seconds to learn the write heads; the reads meet a broker that fails


class CheckpointAhead(StoreError):
    """The checkpoint read a source past the journal's write head on this broker."""


async def check_read_through(client: BrokerClient, shard_id: str,
                             cp: consumer_pb.Checkpoint) -> None:
    """Raise CheckpointAhead if `cp` read a source past its journal's write head. A head
    that can't be learned (no journal, the broker failing) is left to the reads."""
    read = {journal: s.read_through for journal, s in cp.sources.items() if s.read_through > 0}
    if not read:
        return
    heads = await write_heads(client, read, _HEAD_TIMEOUT)
    for journal, head in heads.items():
        offset = read[journal]
        if offset > head:
            raise CheckpointAhead(
                f"shard {shard_id}: its checkpoint read journal {journal} through offset "
                f"{offset:,}, past its write head {head:,} on broker {client.address}: is this "
                f"the broker it read (a backfill pointed at another broker?), or did the "
                f"journal lose content? Reading on would skip what is appended up to "
                f"{offset:,}. If it was lost for good, the shard can only start over from "
                f"nothing: `streamkit shards forget` for an SQL store; for a recorded one, "
                f"delete its recovery log, then `streamkit deploy --adopt-recovery-logs`")
