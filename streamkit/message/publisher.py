"""Publisher: map, sequence, frame and append messages to journals.

Two ways to publish, as in Gazette:

* `publish_committed` gives a message an OUTSIDE_TXN UUID: read-committed
  readers process it as soon as they read it. Producers outside of consumer
  transactions (API servers, importers, the CLI) use this.
* `publish_uncommitted` gives it a CONTINUE_TXN UUID: readers hold it back
  until an ACK_TXN with a larger clock from the same producer arrives.
  `build_ack_intents` frames one such acknowledgement per journal written
  since its last call; whoever owns the transaction writes those intents to
  stable storage (the consumer's checkpoint) *before* appending them, and
  appends them again after a fault, so a transaction commits in every
  journal it touched or in none.

Ordering: the UUID's clock is ticked, the message framed and handed to the
AppendService without an `await` in between, so in each journal the clocks
of one Publisher's messages increase in append order even when many tasks
publish concurrently.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from streamkit.client.append_service import AppendService, OpFuture
from streamkit.message.framing import Framing, framing_for
from streamkit.message.mapping import MappingFunc
from streamkit.message.message import (
    UUID_FIELD,
    MessageLike,
    new_acknowledgement,
    set_uuid,
    uses_uuid,
)
from streamkit.message.message import validate as validate_message
from streamkit.message.uuid import Clock, Flags, UuidText, build_uuid, new_producer_id

__all__ = ["AckIntent", "Publisher"]

_UPDATE_EVERY_NS = 1_000_000  # how stale an owned Clock may get before it reads wall time
_OUTSIDE_TXN, _CONTINUE_TXN = int(Flags.OUTSIDE_TXN), int(Flags.CONTINUE_TXN)  # (the hot path's)


@dataclass(frozen=True, slots=True)
class AckIntent:
    """A framed ACK_TXN acknowledgement and the journal it commits the producer's messages in."""

    journal: str
    content: bytes


@dataclass(slots=True)
class _Pending:
    """A journal written uncommitted since the last build_ack_intents."""

    framing: Framing
    acknowledgement: MessageLike  # an empty message of the journal's kind, to carry the ACK


class Publisher:
    """Publishes messages to the journals a MappingFunc picks, through an AppendService.

    Without a `clock`, the Publisher owns one and moves it to wall time at
    most once a millisecond (ticks order messages in between). A shared
    `clock` is left to its owner to update, as a consumer shard does once
    per transaction. `producer` defaults to a fresh random ProducerID.
    """

    __slots__ = ("_buffer", "_framings", "_next_update", "_owns_clock", "_pending",
                 "_uuid_text", "clock", "producer", "service")

    def __init__(
        self, service: AppendService, clock: Clock | None = None, producer: bytes | None = None
    ) -> None:
        self.service = service
        self._owns_clock = clock is None
        self.clock = Clock() if clock is None else clock
        self.producer = new_producer_id() if producer is None else producer
        self._uuid_text = UuidText(self.producer)  # checks that it is 6 bytes
        self._next_update = 0  # monotonic ns after which an owned clock reads wall time again
        # Per content-type: its framing, and the framing's `frame_dict` if it has one.
        self._framings: dict[str, tuple[Framing, Callable[[dict[str, Any]], bytes] | None]] = {}
        self._pending: dict[str, _Pending] = {}
        self._buffer = bytearray()  # reused for every frame

    async def publish_committed(self, mapping: MappingFunc, message: MessageLike) -> OpFuture:
        """Append `message` as committed on its own; returns the append's OpFuture.

        Validation, mapping and framing errors are raised before anything is
        appended. Await the OpFuture (or `service.flush()`) for durability.
        """
        journal, _, frame = self._frame(mapping, message, _OUTSIDE_TXN)
        return await self.service.append(journal, frame)

    async def publish_uncommitted(self, mapping: MappingFunc, message: MessageLike) -> OpFuture:
        """Append `message` within the open transaction; `build_ack_intents` commits it."""
        future = self.publish_uncommitted_nowait(mapping, message)
        await self.service.yield_if_due()
        return future

    def publish_uncommitted_nowait(self, mapping: MappingFunc, message: MessageLike) -> OpFuture:
        """`publish_uncommitted` for synchronous callers, who yield to the loop regularly."""
        journal, framing, frame = self._frame(mapping, message, _CONTINUE_TXN)
        if journal not in self._pending and uses_uuid(message):
            # Without UUIDs readers can't tell an ACK from data: such types get none.
            self._pending[journal] = _Pending(framing, new_acknowledgement(message, journal))
        return self.service.append_nowait(journal, frame)

    def build_ack_intents(self) -> list[AckIntent]:
        """One framed ACK_TXN per journal written uncommitted since the last call.

        Each acknowledgement's clock is ticked after every message it
        acknowledges. The caller must persist the intents before appending
        them; this call forgets the journals.
        """
        intents = []
        for journal, pending in self._pending.items():
            frame = self._encode(pending.framing, pending.acknowledgement, self._tick(),
                                 Flags.ACK_TXN)
            intents.append(AckIntent(journal, frame))
        self._pending.clear()
        return intents

    # --- the hot path -------------------------------------------------------

    def _frame(self, mapping: MappingFunc, message: MessageLike, flags: int
               ) -> tuple[str, Framing, bytes]:
        """Validate, map, give the next UUID and frame: the journal, its framing and the
        frame (the caller appends it with no await between, which keeps clocks in order).

        The UUID is set after mapping, since it depends on the journal's order. Dicts
        (no validation of their own) are the common case and take the shortest way.
        """
        is_dict = type(message) is dict
        if not is_dict:
            validate_message(message)
        journal, content_type = mapping(message)
        framed = self._framings.get(content_type)
        if framed is None:
            framing = framing_for(content_type)
            framed = self._framings[content_type] = (framing, getattr(framing, "frame_dict", None))
        framing, frame_dict = framed
        clock = self._tick()
        if is_dict and frame_dict is not None:
            message[UUID_FIELD] = self._uuid_text(clock, flags)
            return journal, framing, frame_dict(message)
        return journal, framing, self._encode(framing, message, clock, flags)

    def _tick(self) -> int:
        """The next Clock value (an owned clock reads wall time at most once a millisecond)."""
        if self._owns_clock:
            now = time.monotonic_ns()
            if now >= self._next_update:
                self._next_update = now + _UPDATE_EVERY_NS
                self.clock.update()
        return self.clock.tick()

    def _encode(self, framing: Framing, message: MessageLike, clock: int, flags: int) -> bytes:
        """`message` with the UUID of `clock` and `flags`, framed."""
        if type(message) is dict:
            message[UUID_FIELD] = self._uuid_text(clock, flags)
        else:
            set_uuid(message, build_uuid(self.producer, clock, flags))
        buffer = self._buffer
        del buffer[:]  # also drops what a failed encode left behind
        framing.encode(message, buffer)
        return bytes(buffer)
