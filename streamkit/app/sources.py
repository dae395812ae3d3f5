"""A shard's input: its source journals read uncommitted, sequenced into committed messages.

One reader task per source journal decodes batches of envelopes into a shared
queue, so reads and decoding overlap the transaction loop's consuming. The
loop takes committed envelopes with `poll()` (no I/O, no await: the per
message path) and awaits `fill()` only when nothing is buffered, or when the
Sequencer needs an earlier range of a journal replayed.

A frame of a source that doesn't decode is not dropped here: it comes out in
order, as an envelope of a `BadFrame`, and the transaction loop fails, skips
or dead-letters it as the source's policy says. Being in order and without a
UUID, it commits like any message, so the checkpoint of the transaction that
passed it is what moves the source's offset past it.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import ClassVar

from pydantic import ConfigDict

from streamkit.app.metrics import lag_gauge
from streamkit.app.producer import EnvelopeReader
from streamkit.client import BrokerClient
from streamkit.message.framing import DecoderBase, FrameDecoder, FrameError, Framing
from streamkit.message.message import Envelope, Message, MessageLike
from streamkit.message.reader import ReadUncommitted, journal_framing
from streamkit.message.sequencer import QueueOutcome, Sequencer

__all__ = ["BadFrame", "PassingBadFrames", "SourceInput"]

_REPLAY = QueueOutcome.ACK_COMMIT_REPLAY

# (journal, begin, end) -> a reader of that range, or None for the default one
ReplayFactory = Callable[[str, int, int], EnvelopeReader | None]


class SourceInput:
    """Committed envelopes of a shard's source journals, exactly once (see module docstring).

    `readers` replace the default ReadUncommitted of each journal of `offsets`
    (an application choosing its inputs); `replay` may supply the reader of a
    range the Sequencer needs again. Default readers pass bad frames on as
    BadFrame envelopes; custom ones are trusted to deal with bad frames themselves.
    """

    def __init__(
        self,
        client: BrokerClient,
        sequencer: Sequencer,
        offsets: Mapping[str, int],
        message_types: Mapping[str, type],
        *,
        max_batches: int = 64,
        file_root: Path | None = None,
        shard_id: str = "",
        readers: Sequence[EnvelopeReader] | None = None,
        replay: ReplayFactory | None = None,
    ) -> None:
        self.client = client
        self.sequencer = sequencer
        self._types = dict(message_types)
        self._file_root = file_root
        self._shard_id = shard_id
        # Journal -> its write head as the broker last told a reader (for lag, without RPCs).
        self.write_heads: dict[str, int] = {}
        self._queue: collections.deque[list[Envelope]] = collections.deque()
        self._max_batches = max_batches
        self._ready = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._error: BaseException | None = None
        self._batch: list[Envelope] = []
        self._pos = 0
        self._replay: EnvelopeReader | None = None
        self._replay_factory = replay
        custom = readers is not None
        self._readers: list[EnvelopeReader] = list(readers) if custom else [
            ReadUncommitted(
                client, journal, self._types[journal], offset, True, file_root=file_root
            )
            for journal, offset in sorted(offsets.items())
        ]
        self._tasks = [
            asyncio.create_task(self._read(reader, pass_bad_frames=not custom),
                                name=f"source:{reader.journal}")
            for reader in self._readers
        ]

    # --- the consuming side -------------------------------------------------------

    def poll_run(self, limit: int) -> list[Envelope]:
        """Up to `limit` committed envelopes from what is buffered; [] when I/O is needed.

        A run of messages that commit alone (a catch-up of committed input)
        comes out as one list, sequenced in bulk (`Sequencer.commit_run`);
        anything else comes out one envelope at a time, as `poll` gives it.
        All of them count as consumed.
        """
        if self._replay is None and self.sequencer.idle and self._next_batch():
            batch, pos = self._batch, self._pos
            end = self.sequencer.commit_run(batch, pos, min(len(batch), pos + limit))
            if end > pos:
                self._pos = end
                return batch if pos == 0 and end == len(batch) else batch[pos:end]
        env = self.poll()
        return [] if env is None else [env]

    def poll(self) -> Envelope | None:
        """The next committed envelope from what is buffered; None when I/O is needed."""
        seq = self.sequencer
        while True:
            env = seq.dequeue_committed()
            if env is not None:
                return env
            if self._replay is not None:
                return None
            if not self._next_batch():
                return None
            env = self._batch[self._pos]
            self._pos += 1
            if seq.queue_uncommitted(env) is _REPLAY:
                self._start_replay()

    def _next_batch(self) -> bool:
        """Whether envelopes remain in the current batch, taking the next one if need be."""
        if self._pos < len(self._batch):
            return True
        if not self._queue:
            if self._error is not None:
                raise self._error
            self._ready.clear()
            return False
        self._batch, self._pos = self._queue.popleft(), 0
        self._room.set()
        return True

    @property
    def ready(self) -> bool:
        """Whether `poll` may find an envelope without waiting for I/O."""
        return (
            self._pos < len(self._batch)
            or bool(self._queue)
            or self._error is not None
            or self._replay is not None
        )

    async def wait_ready(self) -> None:
        """Until input is buffered (or a reader failed, or a replay needs reading)."""
        if not self.ready:
            await self._ready.wait()

    async def fill(self) -> None:
        """Do the I/O `poll` is waiting for: a step of a replay, or wait for the next batch."""
        if self._replay is not None:
            replay = self._replay
            batch = await replay.read_batch()  # [] once the range's end is reached
            if not batch:
                replay.close()
                self._replay = None
            self.sequencer.feed_replay(batch, done=not batch)
        else:
            await self.wait_ready()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for reader in self._readers:
            reader.close()
        if self._replay is not None:
            self._replay.close()

    # --- internals ------------------------------------------------------------------

    def _start_replay(self) -> None:
        journal, begin, end = self.sequencer.replay_range()
        if self._replay_factory is not None:
            replay = self._replay_factory(journal, begin, end)
            if replay is not None:
                self._replay = replay
                return
        live = next((r for r in self._readers if r.journal == journal), None)
        self._replay = ReadUncommitted(
            self.client,
            journal,
            getattr(live, "message_type", None) or self._types.get(journal, dict),
            begin,
            True,
            getattr(live, "framing", None),
            end_offset=end,
            file_root=self._file_root,
        )

    async def _read(self, reader: EnvelopeReader, *, pass_bad_frames: bool) -> None:
        lag = None  # looked up once there is a head to report (metrics.py says why)
        try:
            if pass_bad_frames and isinstance(reader, ReadUncommitted):
                framing = reader.framing or await journal_framing(self.client, reader.journal)
                reader.framing = PassingBadFrames(framing)
            while True:
                batch = await reader.read_batch()
                head = getattr(reader, "write_head", None)
                offset = getattr(reader, "offset", None)
                if head is not None and offset is not None:
                    self.write_heads[reader.journal] = head
                    if lag is None:
                        lag = lag_gauge(self._shard_id, reader.journal)
                    lag.set(max(0, head - offset))
                if not batch:
                    await asyncio.sleep(0.01)  # the stream ended: the retry reader reopens
                    continue
                while len(self._queue) >= self._max_batches:
                    self._room.clear()
                    await self._room.wait()
                self._queue.append(batch)
                self._ready.set()
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            self._error = error
            self._ready.set()


class BadFrame(Message):
    """A frame of a source that could not be decoded, passed on for its policy to decide.

    It has no UUID, so the Sequencer commits it at once and checkpoints its end
    like any message's. `error` says where and why; when `error.skippable`, its
    `frame` holds the frame's bytes.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)
    uses_uuid: ClassVar[bool] = False

    error: FrameError


class PassingBadFrames:
    """A framing whose decoders pass bad frames on, in order, as BadFrame envelopes.

    Readers in general log a bad frame and skip it; a shard must not: its
    commits would silently leave the message out. The transaction loop gets
    it instead and fails (the default, naming the journal and the frame's
    offset, as Gazette's shards fail on a message they can't unmarshal),
    skips it or dead-letters it, as the source's policy says.
    """

    def __init__(self, framing: Framing) -> None:
        self.framing = framing
        self.content_type = framing.content_type

    def encode(self, message: MessageLike, out: bytearray) -> None:
        self.framing.encode(message, out)

    def new_decoder(self, journal: str, message_type: type) -> FrameDecoder:
        return _PassingDecoder(self.framing.new_decoder(journal, message_type))


class _PassingDecoder:
    def __init__(self, decoder: FrameDecoder) -> None:
        self.decoder = decoder
        self.errors = decoder.errors
        self._found: list[FrameError] = []
        if isinstance(decoder, DecoderBase):
            decoder.on_error = self._found.append  # misses none, however many a chunk holds

    def feed(self, chunk: bytes | memoryview, offset: int) -> list[Envelope]:
        batch = self.decoder.feed(chunk, offset)
        found = self._found
        if not isinstance(self.decoder, DecoderBase):  # a framing registered by the user
            found += self.errors
            self.errors.clear()
        if not found:
            return batch
        # A skippable frame spans [offset, end); another error marks where decoding broke.
        bad = [
            Envelope(e.journal, e.offset, e.offset if e.end is None else e.end,
                     BadFrame.model_construct(error=e))
            for e in found
        ]
        found.clear()
        return sorted([*bad, *batch], key=_begin)

    def reset(self, offset: int) -> None:
        self.decoder.reset(offset)


def _begin(env: Envelope) -> int:
    return env.begin
