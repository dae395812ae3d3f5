"""Sequencer: turns read-uncommitted envelopes into read-committed ones, exactly once.

Messages carry v1 UUIDs (see `uuid.py`) naming a producer, a Clock and flags.
Per (journal, producer) the Sequencer keeps the Clock of the last
acknowledgement and the span of pending CONTINUE_TXN messages since then:

* an OUTSIDE_TXN message with a larger Clock commits on its own;
* CONTINUE_TXN messages wait; an ACK_TXN commits those whose Clock is at most
  its own (those above it are dropped);
* an ACK_TXN whose Clock is not above the last acknowledged one rolls the
  pending span back: it is never delivered, and the producer may re-use clocks;
* a message whose Clock is at or below the last acknowledgement is a duplicate;
* a message without a UUID (or with a zero Clock) commits at once, untracked.

Pending messages are held in a ring of the last `buffer` CONTINUE_TXN
envelopes. When an ACK commits messages the ring has already evicted (or that
were read before a restart from a checkpoint), `queue_uncommitted` answers
QUEUE_ACK_COMMIT_REPLAY: the caller re-reads `replay_range()` and feeds the
envelopes back with `feed_replay` / `start_replay` before dequeuing.

Usage, after every `queue_uncommitted`: call `dequeue_committed()` until it
returns None. Dequeuing an envelope counts as consuming it: a `checkpoint()`
taken afterwards records it as processed, so a Sequencer restored from that
checkpoint (reading again from `offsets`) will not deliver it again.

The per-message path is kept to a handful of int operations and one dict
lookup: UUIDs are handled as ints, producers as 48-bit ints, and the ring is
four parallel lists.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from uuid import UUID

from streamkit.errors import StreamkitError
from streamkit.message.message import Envelope, MessageLike, get_uuid
from streamkit.message.uuid import Flags

__all__ = [
    "PRODUCER_PRUNE_HORIZON",
    "ProducerState",
    "QueueOutcome",
    "ReplayError",
    "Sequencer",
    "uuid_int",
]

log = logging.getLogger(__name__)

# How long a producer with nothing pending is remembered after it was last
# heard from, relative to the journal's most recent producer (as Gazette does).
PRODUCER_PRUNE_HORIZON = timedelta(hours=24)

_PRODUCER_MASK = 0xFFFF_FFFF_FFFF
_CONTINUE = int(Flags.CONTINUE_TXN)
_ACK = int(Flags.ACK_TXN)
_OUTSIDE = int(Flags.OUTSIDE_TXN)

try:  # the bulk path's inner loop in C, where it was built (see _runscan.c)
    from streamkit.message._runscan import scan as _scan
except ImportError:  # no compiler at install time: the same loop in Python
    _scan = None


class QueueOutcome(enum.IntEnum):
    """What `Sequencer.queue_uncommitted` decided about an envelope (Gazette's set)."""

    OUTSIDE_ALREADY_ACKED = 0  # duplicate OUTSIDE_TXN: ignored
    OUTSIDE_COMMIT = 1  # OUTSIDE_TXN (or no UUID) committed: dequeue it
    CONTINUE_ALREADY_ACKED = 2  # duplicate CONTINUE_TXN of an acknowledged span: ignored
    CONTINUE_TXN_CLOCK_LARGER = 3  # CONTINUE_TXN re-sent within the pending span: ignored
    CONTINUE_BEGIN_SPAN = 4  # CONTINUE_TXN opening a pending span
    CONTINUE_EXTEND_SPAN = 5  # CONTINUE_TXN extending the pending span
    ACK_ROLLBACK = 6  # ACK_TXN at or below the last ACK: the pending span is discarded
    ACK_EMPTY = 7  # ACK_TXN with nothing pending
    ACK_COMMIT_RING = 8  # ACK_TXN committing a span held wholly in the ring: dequeue it
    ACK_COMMIT_REPLAY = 9  # ACK_TXN committing a span partly evicted: replay, then dequeue


class ReplayError(StreamkitError, ValueError):
    """Replayed envelopes don't belong to the requested replay range."""


@dataclass(frozen=True, slots=True)
class ProducerState:
    """What a checkpoint remembers of one producer of one journal.

    `last_ack` is the Clock of its last ACK_TXN or OUTSIDE_TXN (or of the last
    message consumed from a span being dequeued); `begin` is the offset of its
    first pending CONTINUE_TXN after that, or -1 when nothing is pending.
    """

    journal: str
    producer: bytes
    last_ack: int
    begin: int


class _Partial:
    """The sequencing state of one (journal, producer)."""

    __slots__ = ("begin", "journal", "max_clock", "min_clock", "producer", "ring_start",
                 "ring_stop")

    def __init__(self, journal: str, producer: int, clock: int, begin: int = -1) -> None:
        self.journal = journal
        self.producer = producer
        self.min_clock = clock  # exclusive lower bound: the last acknowledged (or consumed) Clock
        self.max_clock = clock  # inclusive upper bound of the pending span
        self.begin = begin  # offset of the span's first message, or -1
        self.ring_start = -1  # ring index of the span's first held message, or -1
        self.ring_stop = -1  # ring index of its last held message, or -1

    def reset(self, clock: int) -> None:
        """Nothing pending; `clock` is the last acknowledgement."""
        self.min_clock = self.max_clock = clock
        self.begin = self.ring_start = self.ring_stop = -1


def uuid_int(message: MessageLike) -> int:
    """The message's UUID as a 128-bit int, 0 if it has none (or an unparsable one).

    A dict's string UUID is parsed without building a `uuid.UUID`: this is the
    hottest line of a read-committed reader.
    """
    if type(message) is dict:
        raw = message.get("uuid")
        if not raw:
            return 0
        if type(raw) is str and len(raw) == 36:
            try:
                return int(raw.replace("-", ""), 16)
            except ValueError:
                pass
        try:
            return raw.int if isinstance(raw, UUID) else UUID(raw).int
        except (TypeError, ValueError, AttributeError):
            log.warning("ignoring a message with a malformed uuid %r", raw)
            return 0
    found = get_uuid(message)
    return 0 if found is None else found.int


def _clock(value: int) -> int:
    """The Clock of a UUID int: `uuid.clock_of` without building a UUID (hot path)."""
    return (
        (value >> 96) & 0xFFFFFFFF
        | ((value >> 80) & 0xFFFF) << 32
        | ((value >> 64) & 0x0FFF) << 48
    ) << 4 | (value >> 58) & 0xF


class Sequencer:
    """Sequences read-uncommitted envelopes of one or more journals into committed ones.

    `states` and `offsets` come from an earlier `checkpoint()` / `offsets`;
    reading must then resume at `offsets`. `deliver_acks` makes the ACK_TXN
    envelope that commits a span come out of `dequeue_committed` after it (as in
    Gazette, whose consumers skip it); by default acknowledgements are consumed
    silently.
    """

    def __init__(
        self,
        states: Iterable[ProducerState] = (),
        buffer: int = 8192,
        *,
        offsets: Mapping[str, int] | None = None,
        deliver_acks: bool = False,
    ) -> None:
        size = max(buffer, 1)
        self.deliver_acks = deliver_acks
        self._offsets: dict[str, int] = dict(offsets or {})
        self._last_offsets: dict[str, int] = dict(self._offsets)
        self._partials: dict[tuple[str, int], _Partial] = {}
        for state in states:
            producer = int.from_bytes(state.producer, "big")
            self._partials[state.journal, producer] = _Partial(
                state.journal, producer, state.last_ack, state.begin
            )
        # The ring: envelope, next index of the same span (-1: none), Clock, owning span.
        self._ring_env: list[Envelope | None] = [None] * size
        self._ring_next: list[int] = [-1] * size
        self._ring_clock: list[int] = [0] * size
        self._ring_owner: list[_Partial | None] = [None] * size
        self._head = 0
        # A committed envelope standing alone (OUTSIDE_TXN, no UUID, empty ACK).
        self._single: Envelope | None = None
        self._single_owner: _Partial | None = None
        self._single_clock = 0
        # A committed span being dequeued, closed by the ACK_TXN `_ack`.
        self._emit: _Partial | None = None
        self._ack: Envelope | None = None
        self._ack_clock = 0
        # Replay of the part of `_emit` the ring no longer holds.
        self._replaying = False
        self._replay_end = 0
        self._replay_it: Iterator[Envelope] | None = None
        self._replay_done = False

    # --- queueing -----------------------------------------------------------------

    def queue_uncommitted(self, env: Envelope) -> QueueOutcome:
        """Apply the next envelope read from its journal, in journal order.

        Raises RuntimeError if committed envelopes remain to be dequeued.
        """
        if self._emit is not None or self._single is not None:
            raise RuntimeError("committed messages remain to dequeue")
        value = uuid_int(env.message)
        clock = _clock(value)
        journal = env.journal
        if clock == 0:  # no UUID: committed as is, and not tracked
            self._single, self._single_owner = env, None
            return QueueOutcome.OUTSIDE_COMMIT

        producer = value & _PRODUCER_MASK
        flags = (value >> 48) & 0x3FF
        partial = self._partials.get((journal, producer))
        if partial is None:
            partial = self._partials[journal, producer] = _Partial(journal, producer, clock - 1)

        if flags == _CONTINUE:
            if clock <= partial.min_clock:
                outcome = QueueOutcome.CONTINUE_ALREADY_ACKED
            elif clock <= partial.max_clock:
                outcome = QueueOutcome.CONTINUE_TXN_CLOCK_LARGER
            else:
                if partial.begin == -1:
                    partial.begin = env.begin
                    outcome = QueueOutcome.CONTINUE_BEGIN_SPAN
                else:
                    outcome = QueueOutcome.CONTINUE_EXTEND_SPAN
                self._add_at_head(env, clock, partial)
                partial.max_clock = clock
            self._offsets[journal] = env.end
            return outcome

        if flags == _ACK:
            if clock <= partial.min_clock:
                if clock < partial.min_clock:
                    # The producer recovered an older checkpoint than one it had
                    # acknowledged: later messages may re-send earlier ones under
                    # new UUIDs (exactly-once degrades to at-least-once for them).
                    self._log(env, partial, "ACK_TXN older than the last acknowledgement")
                partial.reset(clock)
                self._offsets[journal] = env.end
                return QueueOutcome.ACK_ROLLBACK
            if partial.begin == -1:
                if self.deliver_acks:
                    self._single, self._single_owner, self._single_clock = env, partial, clock
                else:
                    partial.reset(clock)
                    self._offsets[journal] = env.end
                return QueueOutcome.ACK_EMPTY
            partial.max_clock = clock  # commit through `clock`; later clocks are dropped
            self._emit, self._ack, self._ack_clock = partial, env, clock
            first = self._ring_env[partial.ring_start] if partial.ring_start != -1 else None
            if first is not None and first.begin == partial.begin:
                return QueueOutcome.ACK_COMMIT_RING
            # The ring lost the span's start: re-read it up to what the ring still holds.
            self._replaying, self._replay_it, self._replay_done = True, None, False
            self._replay_end = env.begin if first is None else first.begin
            return QueueOutcome.ACK_COMMIT_REPLAY

        if flags != _OUTSIDE:
            self._log(env, partial, f"unexpected UUID flags {flags:#x}, taken as OUTSIDE_TXN")
        if clock <= partial.min_clock:
            self._offsets[journal] = env.end
            return QueueOutcome.OUTSIDE_ALREADY_ACKED
        if partial.begin != -1:
            # The pending span is dropped, as if rolled back.
            self._log(env, partial, "OUTSIDE_TXN after pending CONTINUE_TXNs (mixed committed "
                                    "and uncommitted publishing to one journal?)")
        self._single, self._single_owner, self._single_clock = env, partial, clock
        return QueueOutcome.OUTSIDE_COMMIT

    @property
    def idle(self) -> bool:
        """Whether nothing committed waits to be dequeued (the next envelope may be queued)."""
        return self._emit is None and self._single is None

    def commit_run(self, envelopes: list[Envelope], start: int, stop: int) -> int:
        """Commit `envelopes[start:stop]` while each one commits alone; the index after them.

        The bulk path of a catch-up over committed input: dict messages with an
        OUTSIDE_TXN UUID whose Clock is above their producer's last one, from
        a producer with nothing pending, commit in one tight loop (and, as with
        `dequeue_committed`, count as consumed). It stops before the first
        envelope that needs `queue_uncommitted` (other flags, a duplicate, a
        pending span, no UUID, another message kind); outcomes are exactly
        those of queueing and dequeuing each envelope one by one.
        """
        if self._emit is not None or self._single is not None:
            raise RuntimeError("committed messages remain to dequeue")
        partials, offsets = self._partials, self._offsets
        partial: _Partial | None = None
        journal, producer = "", -1
        clock_before = last_clock = 0  # the partial's clock before the run, and now
        scan = _scan
        index = start
        # Per message: as few big-int operations as the checks allow. The partial's
        # clocks are written back when the producer changes and at the end. With the C
        # scanner, this loop sees only the first message of each producer's stretch (and
        # the one that ends the run): `scan` goes over the rest.
        while index < stop:
            handing_on, resume = False, index
            for index in range(resume, stop):
                env = envelopes[index]
                message = env.message
                if type(message) is not dict:
                    break
                raw = message.get("uuid")
                if type(raw) is not str or len(raw) != 36:
                    break
                try:
                    value = int(raw.replace("-", ""), 16)
                except ValueError:
                    break
                if value >> 128:  # more than 32 digits (a hyphen's place taken by one)
                    break
                low = value >> 48  # the time fields, then the clock sequence's 16 bits
                if low & 0x3FF != _OUTSIDE:
                    break
                stamp = low >> 16  # time_low (32 bits), time_mid (16), version (4), time_hi
                clock = ((stamp >> 32) | (stamp & 0xFFFF0000) << 16 | (stamp & 0x0FFF) << 48
                         ) << 4 | (low >> 10) & 0xF
                if value & _PRODUCER_MASK != producer or env.journal is not journal:
                    if partial is not None and last_clock != clock_before:
                        partial.min_clock = partial.max_clock = last_clock
                    partial = None
                    if clock == 0:
                        break
                    journal, producer = env.journal, value & _PRODUCER_MASK
                    partial = partials.get((journal, producer))
                    if partial is None:
                        partial = partials[journal, producer] = _Partial(journal, producer,
                                                                         clock - 1)
                    elif partial.begin != -1:
                        partial = None
                        break
                    clock_before = last_clock = partial.min_clock
                if clock <= last_clock:
                    break
                last_clock = clock
                if scan is not None:
                    handing_on = True
                    break
            else:
                index = stop
            if not handing_on:
                break
            index, last_clock = scan(envelopes, index + 1, stop, journal, producer, last_clock)
        if partial is not None and last_clock != clock_before:
            partial.min_clock = partial.max_clock = last_clock
        if index > start:
            last = envelopes[index - 1]
            offsets[last.journal] = last.end
        return index

    def _add_at_head(self, env: Envelope, clock: int, partial: _Partial) -> None:
        head = self._head
        owner = self._ring_owner[head]
        if owner is not None and owner.ring_start == head:
            # Evicting the first held message of a pending span: it now starts
            # (in the ring) at its next message, if any is still held.
            following = self._ring_next[head]
            if following == -1:
                owner.ring_start = owner.ring_stop = -1
            else:
                owner.ring_start = following
        self._ring_env[head] = env
        self._ring_next[head] = -1
        self._ring_clock[head] = clock
        self._ring_owner[head] = partial
        if partial.ring_stop == -1:
            partial.ring_start = head
        else:
            self._ring_next[partial.ring_stop] = head
        partial.ring_stop = head
        head += 1
        self._head = 0 if head == len(self._ring_env) else head

    # --- dequeuing ----------------------------------------------------------------

    def dequeue_committed(self) -> Envelope | None:
        """The next committed envelope, or None when none remain (or a replay is awaited).

        The returned envelope counts as consumed. While `awaiting_replay`, feed
        the replay first.
        """
        single = self._single
        if single is not None:
            owner = self._single_owner
            self._single = self._single_owner = None
            if owner is not None:
                owner.reset(self._single_clock)
            self._offsets[single.journal] = single.end
            return single

        partial = self._emit
        if partial is None:
            return None
        if self._replaying:
            env = self._next_replayed(partial)
            if env is not None or self._replaying:
                return env
        start = partial.ring_start
        ring_next, ring_clock = self._ring_next, self._ring_clock
        while start != -1:
            clock = ring_clock[start]
            index, start = start, ring_next[start]
            if partial.min_clock < clock <= partial.max_clock:
                partial.ring_start = start
                env = self._ring_env[index]
                assert env is not None
                partial.min_clock, partial.begin = clock, env.begin
                return env
        # The span is done: the ACK_TXN that committed it goes last.
        ack = self._ack
        assert ack is not None
        partial.reset(self._ack_clock)
        self._offsets[ack.journal] = ack.end
        self._emit = self._ack = None
        return ack if self.deliver_acks else None

    def _next_replayed(self, partial: _Partial) -> Envelope | None:
        """The next replayed envelope of the span; None when the batch ran out."""
        it = self._replay_it
        if it is not None:
            for env in it:
                if env.journal != partial.journal:
                    raise ReplayError(
                        f"replay of the wrong journal ({env.journal}; expected {partial.journal})"
                    )
                if env.begin < partial.begin:
                    raise ReplayError(
                        f"replay has a wrong begin ({env.begin}; expected >= {partial.begin})"
                    )
                if env.end > self._replay_end:
                    raise ReplayError(
                        f"replay has a wrong end ({env.end}; expected <= {self._replay_end})"
                    )
                value = uuid_int(env.message)
                if value & _PRODUCER_MASK != partial.producer:
                    continue  # other producers' messages share the replayed bytes
                clock = _clock(value)
                if partial.min_clock < clock <= partial.max_clock:
                    partial.min_clock, partial.begin = clock, env.begin
                    return env
            self._replay_it = None
        if self._replay_done:
            self._replaying = False
        return None

    # --- replays ------------------------------------------------------------------

    @property
    def awaiting_replay(self) -> bool:
        """Whether dequeuing waits for replayed envelopes (see `feed_replay`)."""
        return self._replaying and self._replay_it is None and not self._replay_done

    def replay_range(self) -> tuple[str, int, int]:
        """(journal, begin, end): the bytes to re-read after QUEUE_ACK_COMMIT_REPLAY."""
        if not self._replaying or self._emit is None:
            raise RuntimeError("no replay is needed")
        return self._emit.journal, self._emit.begin, self._replay_end

    def feed_replay(self, envelopes: Iterable[Envelope], *, done: bool) -> None:
        """Hand over replayed envelopes of `replay_range()`, in order, maybe in batches.

        `done` says the range has been read to its end. Envelopes of other
        producers, duplicates and rolled-back messages are skipped here.
        """
        if not self._replaying:
            raise RuntimeError("no replay is needed")
        self._replay_it = iter(envelopes)
        self._replay_done = done

    def start_replay(self, envelopes: Iterable[Envelope]) -> None:
        """Replay the whole range from one iterable (Gazette's StartReplay)."""
        self.feed_replay(envelopes, done=True)

    # --- state --------------------------------------------------------------------

    @property
    def offsets(self) -> dict[str, int]:
        """Where to resume reading each journal, consistent with `checkpoint()`."""
        return dict(self._offsets)

    def offset(self, journal: str, default: int = 0) -> int:
        """Where to resume reading `journal` (see `offsets`)."""
        return self._offsets.get(journal, default)

    def producer_state(self, journal: str, producer: bytes) -> ProducerState | None:
        """The current state of one producer (without taking a checkpoint)."""
        p = self._partials.get((journal, int.from_bytes(producer, "big")))
        return None if p is None else ProducerState(journal, producer, p.min_clock, p.begin)

    def has_pending(self) -> bool:
        """Whether a producer opened or extended a pending span since the last checkpoint.

        Before any checkpoint: whether anything is pending at all. Assuming
        live producers, it hints that an acknowledgement is on its way.
        """
        last = self._last_offsets
        return any(p.begin != -1 and p.begin >= last.get(p.journal, 0)
                   for p in self._partials.values())

    def checkpoint(self, prune_horizon: timedelta | int | None = None) -> list[ProducerState]:
        """Snapshot the producers' states, forgetting long-silent producers first.

        A producer with nothing pending is dropped when its last ACK is older
        than the horizon: a `timedelta` is taken relative to the newest
        acknowledgement seen in the same journal (Gazette's rule, typically
        PRODUCER_PRUNE_HORIZON); an int is an absolute Clock. None prunes nothing.
        Pair the states with `offsets` to restore a Sequencer.
        """
        horizon: dict[str, int] = {}
        if isinstance(prune_horizon, timedelta):
            span = (int(prune_horizon.total_seconds() * 10_000_000)) << 4
            for p in self._partials.values():
                horizon[p.journal] = max(horizon.get(p.journal, 0), p.min_clock - span)
        states = []
        for key, p in list(self._partials.items()):
            limit = prune_horizon if isinstance(prune_horizon, int) else horizon.get(p.journal, 0)
            if p.begin == -1 and p.max_clock < limit and p is not self._single_owner:
                del self._partials[key]
                continue
            states.append(ProducerState(p.journal, p.producer.to_bytes(6, "big"),
                                        p.min_clock, p.begin))
        self._last_offsets = dict(self._offsets)
        return states

    def _log(self, env: Envelope, partial: _Partial, problem: str) -> None:
        log.warning(
            "%s: journal %s [%d, %d) producer %012x (last ack clock %d, pending from %d)",
            problem, env.journal, env.begin, env.end, partial.producer, partial.min_clock,
            partial.begin,
        )
