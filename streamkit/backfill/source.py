"""Reading a shard's planned journal bytes as batches of envelopes (read-uncommitted).

Persisted fragments are opened directly (every codec, via
`streamkit.client.open_fragment`); other segments are read through the
broker. Either way the bytes go through the journal's framing, exactly as a
live reader decodes them, and come out as lists of Envelopes with their
offsets. Several source journals are merged batch by batch in the order
their messages were written (by UUID clock), which is close to the order a
live shard would have seen them in.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from pathlib import Path
from uuid import UUID

from streamkit.app.sources import PassingBadFrames
from streamkit.backfill.errors import BackfillError
from streamkit.backfill.plan import JournalPlan, Segment
from streamkit.client import BrokerClient, BrokerError, FragmentError, RetryReader, open_fragment
from streamkit.message.framing import framing_for
from streamkit.message.message import Envelope
from streamkit.message.sequencer import uuid_int
from streamkit.message.uuid import clock_of
from streamkit.protocol import pb

__all__ = ["READ_CHUNK", "JournalReader", "merge_by_time"]

log = logging.getLogger(__name__)

READ_CHUNK = 1 << 20  # decompressed bytes decoded at a time


class JournalReader:
    """One planned journal of a shard, read as envelope batches over any sub-range."""

    def __init__(
        self,
        plan: JournalPlan,
        message_type: type,
        client: BrokerClient | None,
        fragment_root: Path | None,
    ) -> None:
        self.plan = plan
        self.journal = plan.journal
        self.message_type = message_type
        self.client = client
        self.fragment_root = fragment_root
        # Bad frames come out as BadFrame envelopes, for the shard's policy to fail, skip or
        # dead-letter them as a live shard does (a plain decoder would log and drop them).
        self.framing = PassingBadFrames(framing_for(plan.content_type))
        self.bytes_direct = 0
        self.bytes_via_broker = 0

    async def batches(self, begin: int, end: int | None = None
                      ) -> AsyncGenerator[list[Envelope], None]:
        """Envelopes of the frames within [begin, end) (default: to the plan's end)."""
        end = self.plan.end if end is None else end
        decoder = self.framing.new_decoder(self.journal, self.message_type)
        expected: int | None = None
        for segment in self.plan.segments:
            lo, hi = max(segment.begin, begin), min(segment.end, end)
            if lo >= hi:
                continue
            if expected is not None and lo != expected:
                log.warning("journal %s: skipping offsets %d..%d (no fragment holds them)",
                            self.journal, expected, lo)
                decoder.reset(lo)
            chunks = self._direct(segment, lo, hi) if segment.direct else self._via_broker(
                segment, lo, hi)
            async for chunk, offset in chunks:
                batch = decoder.feed(chunk, offset)
                if batch:
                    yield batch
            expected = hi

    async def _direct(self, segment: Segment, lo: int, hi: int
                      ) -> AsyncIterator[tuple[bytes, int]]:
        fragment = pb.Fragment.FromString(segment.fragment)
        offset = lo
        try:
            reader = open_fragment(fragment, segment.url, self.fragment_root, lo)
        except (OSError, ValueError, FragmentError) as error:
            raise self._unreadable(segment, error) from error
        try:
            while offset < hi:
                try:
                    data = reader.read(min(READ_CHUNK, hi - offset))
                except (OSError, ValueError, FragmentError) as error:
                    raise self._unreadable(segment, error, offset) from error
                if not data:
                    raise self._unreadable(segment, EOFError("the file ended early"), offset)
                self.bytes_direct += len(data)
                yield data, offset
                offset += len(data)
        finally:
            reader.close()

    async def _via_broker(self, segment: Segment, lo: int, hi: int
                          ) -> AsyncIterator[tuple[bytes, int]]:
        if self.client is None:
            raise BackfillError(f"reading {segment.describe(self.journal)} needs the broker")
        request = pb.ReadRequest(journal=self.journal, offset=lo, end_offset=hi, block=True)
        reader = RetryReader(self.client, request, skip_jumps=True)
        try:
            while True:
                try:
                    data = await reader.read()
                except BrokerError as error:
                    raise self._unreadable(segment, error, reader.offset) from error
                if not data:
                    return
                self.bytes_via_broker += len(data)
                yield data, reader.offset - len(data)
        finally:
            reader.close()

    def _unreadable(self, segment: Segment, error: BaseException, at: int | None = None
                    ) -> BackfillError:
        where = f" at offset {at}" if at is not None else ""
        return BackfillError(
            f"fragment {segment.describe(self.journal)} is unreadable{where}: "
            f"{type(error).__name__}: {error}"
        )


def _time(batch: Sequence[Envelope]) -> int:
    """The UUID clock of a batch's first message (0 without one: it goes first)."""
    value = uuid_int(batch[0].message)
    return clock_of(UUID(int=value)) if value else 0


async def merge_by_time(
    sources: Sequence[AsyncIterator[list[Envelope]]],
) -> AsyncIterator[list[Envelope]]:
    """Batches of several journals, the one whose next message is oldest first."""
    if len(sources) == 1:
        async for batch in sources[0]:
            yield batch
        return
    heads: dict[int, list[Envelope]] = {}
    for i, source in enumerate(sources):
        batch = await anext(source, None)
        if batch is not None:
            heads[i] = batch
    while heads:
        i = min(heads, key=lambda k: _time(heads[k]))
        yield heads[i]
        following = await anext(sources[i], None)
        if following is None:
            del heads[i]
        else:
            heads[i] = following
