"""Between a Sequencer's state and the consumer Checkpoint a store commits."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from streamkit.message.publisher import AckIntent
from streamkit.message.sequencer import PRODUCER_PRUNE_HORIZON, ProducerState, Sequencer
from streamkit.protocol import consumer_pb

__all__ = ["build_checkpoint", "producer_states", "start_offsets"]


def build_checkpoint(sequencer: Sequencer, intents: Iterable[AckIntent]) -> consumer_pb.Checkpoint:
    """Where each source was read through, each producer's state, and the ACKs to write."""
    cp = consumer_pb.Checkpoint()
    for journal, offset in sequencer.offsets.items():
        cp.sources[journal].read_through = offset
    for state in sequencer.checkpoint(PRODUCER_PRUNE_HORIZON):
        entry = cp.sources[state.journal].producers.add()
        entry.id = state.producer
        entry.state.last_ack = state.last_ack
        entry.state.begin = state.begin
    for intent in intents:
        cp.ack_intents[intent.journal] = intent.content
    return cp


def producer_states(cp: consumer_pb.Checkpoint) -> list[ProducerState]:
    """The producers' sequencing states a checkpoint recorded."""
    return [
        ProducerState(journal, entry.id, entry.state.last_ack, entry.state.begin)
        for journal, source in cp.sources.items()
        for entry in source.producers
    ]


def start_offsets(cp: consumer_pb.Checkpoint, min_offsets: Mapping[str, int]) -> dict[str, int]:
    """Where to resume each source: its checkpointed offset, at least the spec's minimum."""
    return {
        journal: max(cp.sources[journal].read_through if journal in cp.sources else 0, minimum)
        for journal, minimum in min_offsets.items()
    }
