"""Message iterators over a journal: read-uncommitted, and read-committed.

`ReadUncommitted` decodes every frame of a journal, as written: duplicates,
messages of transactions never acknowledged, rolled-back ones.
`ReadCommitted` runs those through a `Sequencer`, so each committed message
comes out exactly once, in commit order, and acknowledgements are consumed;
when the Sequencer needs bytes its ring no longer holds, the iterator re-reads
that range itself with a second, bounded reader.

Both read through a `RetryReader` (restarting RPCs as needed). With
`block=False` iteration ends at the journal's write head. Offset jumps (a
deleted range of the journal) are logged and the decoder starts over at the
new offset.

For checkpoints: `ReadCommitted.offset` and `ReadCommitted.sequencer.checkpoint()`
describe exactly the messages yielded so far, so a new ReadCommitted built with
`offset=` and `states=` from them goes on where this one stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Self

from streamkit.client import BrokerClient, OffsetJump, OffsetNotYetAvailable, RetryReader
from streamkit.client.closing import AsyncClosing
from streamkit.client.listing import get_journal
from streamkit.message.framing import FrameDecoder, Framing, content_type_of, framing_for
from streamkit.message.message import Envelope
from streamkit.message.sequencer import ProducerState, QueueOutcome, Sequencer
from streamkit.protocol import pb

__all__ = ["ReadCommitted", "ReadUncommitted", "journal_framing"]

log = logging.getLogger(__name__)


async def journal_framing(client: BrokerClient, journal: str) -> Framing:
    """The framing named by the journal's content-type label (UnknownFraming if none fits)."""
    spec = await get_journal(client, journal)
    return framing_for(content_type_of(spec.labels))


class ReadUncommitted(AsyncClosing):
    """Async iterator of every message Envelope of a journal, from `offset` on.

    `offset=-1` starts at the write head; `end_offset` (if not 0) stops there.
    `framing` defaults to the one of the journal's content-type label.
    `offset` is the end of the last envelope returned.
    """

    def __init__(
        self,
        client: BrokerClient,
        journal: str,
        message_type: type = dict,
        offset: int = 0,
        block: bool = True,
        framing: Framing | None = None,
        *,
        end_offset: int = 0,
        file_root: Path | None = None,
    ) -> None:
        self.client = client
        self.journal = journal
        self.message_type = message_type
        self.framing = framing
        self.offset = offset
        request = pb.ReadRequest(journal=journal, offset=offset, block=block,
                                 end_offset=end_offset)
        self._reader = RetryReader(client, request, file_root=file_root)
        self._decoder: FrameDecoder | None = None
        self._batch: list[Envelope] = []
        self._pos = 0

    async def read_batch(self) -> list[Envelope]:
        """The envelopes of the next chunk(s) read; [] at the end of the stream.

        This is the efficient interface: one call per broker chunk, not per message.
        """
        decoder = self._decoder or await self._start()
        reader = self._reader
        while True:
            try:
                chunk = await reader.read()
            except OffsetJump as jump:
                log.warning("journal %s: skipping a gap of offsets %d..%d (content deleted?)",
                            self.journal, jump.from_offset, jump.to_offset)
                decoder.reset(jump.to_offset)
                continue
            except OffsetNotYetAvailable:
                return []  # a non-blocking read reached the write head
            if not chunk:
                return []
            batch = decoder.feed(chunk, reader.offset - len(chunk))
            if batch:
                self.offset = batch[-1].end
                return batch

    async def _start(self) -> FrameDecoder:
        if self.framing is None:
            self.framing = await journal_framing(self.client, self.journal)
        self._decoder = self.framing.new_decoder(self.journal, self.message_type)
        return self._decoder

    @property
    def write_head(self) -> int:
        """The journal's write head as of the broker's last metadata response (0 if none yet)."""
        return self._reader.response.write_head

    @property
    def buffered(self) -> int:
        """Envelopes decoded but not yet returned: the next ones need no broker read."""
        return len(self._batch) - self._pos

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Envelope:
        if self._pos == len(self._batch):
            self._batch, self._pos = await self.read_batch(), 0
            if not self._batch:
                raise StopAsyncIteration
        env = self._batch[self._pos]
        self._pos += 1
        return env

    def close(self) -> None:
        self._reader.close()


class ReadCommitted(AsyncClosing):
    """Async iterator of the committed message Envelopes of a journal, exactly once.

    Restart from a checkpoint with `offset=` (the earlier `.offset`) and
    `states=` (the earlier `.sequencer.checkpoint()`). `buffer` is the size of
    the Sequencer's ring; `include_acks` also yields the ACK_TXN envelope that
    ends each committed transaction (Gazette's behaviour).
    """

    def __init__(
        self,
        client: BrokerClient,
        journal: str,
        message_type: type = dict,
        offset: int = 0,
        block: bool = True,
        states: Iterable[ProducerState] = (),
        buffer: int = 8192,
        framing: Framing | None = None,
        *,
        include_acks: bool = False,
        file_root: Path | None = None,
    ) -> None:
        self.journal = journal
        self._file_root = file_root
        self.uncommitted = ReadUncommitted(client, journal, message_type, offset, block,
                                           framing, file_root=file_root)
        self.sequencer = Sequencer(states, buffer, offsets={journal: offset} if offset >= 0
                                   else None, deliver_acks=include_acks)
        self._replay: ReadUncommitted | None = None
        self._batch: list[Envelope] = []
        self._pos = 0

    @property
    def offset(self) -> int:
        """Where a restart must begin reading to continue after the last yielded message.

        The end of the last envelope sequenced, except while a committed
        transaction is only partly yielded: then its ACK is before this offset.
        """
        offset = self.sequencer.offset(self.journal, -1)
        if offset >= 0:
            return offset
        # Nothing sequenced yet (a read from the write head learns where it is).
        if self._pos < len(self._batch):
            return self._batch[self._pos].begin
        return self.uncommitted.offset

    @property
    def buffered(self) -> int:
        """Envelopes read but not yet sequenced (while 0, the next message may wait on I/O)."""
        return len(self._batch) - self._pos

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Envelope:
        seq = self.sequencer
        while True:
            env = seq.dequeue_committed()
            if env is not None:
                return env
            if seq.awaiting_replay:
                await self._continue_replay()
                continue
            if self._pos == len(self._batch):
                self._batch, self._pos = await self.uncommitted.read_batch(), 0
                if not self._batch:
                    raise StopAsyncIteration
            env = self._batch[self._pos]
            self._pos += 1
            if seq.queue_uncommitted(env) is QueueOutcome.ACK_COMMIT_REPLAY:
                self._start_replay()

    def _start_replay(self) -> None:
        journal, begin, end = self.sequencer.replay_range()
        log.debug("journal %s: replaying [%d, %d) for a committed transaction",
                  journal, begin, end)
        live = self.uncommitted
        self._replay = ReadUncommitted(live.client, journal, live.message_type, begin,
                                       True, live.framing, end_offset=end,
                                       file_root=self._file_root)

    async def _continue_replay(self) -> None:
        replay = self._replay
        assert replay is not None
        batch = await replay.read_batch()  # [] once the range's end is reached
        if not batch:
            replay.close()
            self._replay = None
        self.sequencer.feed_replay(batch, done=not batch)

    def close(self) -> None:
        self.uncommitted.close()
        if self._replay is not None:
            self._replay.close()
            self._replay = None
