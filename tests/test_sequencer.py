"""Sequencer: de-duplication, transactions, rollbacks, ring replays and checkpoints.

The example cases follow Gazette's sequencer tests (adapted where this ring,
which holds only CONTINUE_TXN envelopes, evicts later than Gazette's); the
property test checks random producer histories against a simple model.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import timedelta
from uuid import UUID

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamkit.message import sequencer as sequencer_module
from streamkit.message.message import Envelope
from streamkit.message.sequencer import (
    ProducerState,
    QueueOutcome,
    ReplayError,
    Sequencer,
    uuid_int,
)
from streamkit.message.uuid import Flags, build_uuid, clock_at, new_producer_id, parse_uuid

JOURNAL = "test/journal"
CONT, ACK, OUT = Flags.CONTINUE_TXN, Flags.ACK_TXN, Flags.OUTSIDE_TXN
Q = QueueOutcome


class Gen:
    """Envelopes at increasing offsets, 100 bytes each with 2 bytes of dead space between."""

    def __init__(self, journal: str = JOURNAL) -> None:
        self.journal = journal
        self.offset = 0

    def __call__(self, producer: bytes, clock: int, flags: int) -> Envelope:
        message = {"uuid": str(build_uuid(producer, clock, flags)), "clock": clock}
        env = Envelope(self.journal, self.offset, self.offset + 100, message)
        self.offset += 102
        return env

    def plain(self) -> Envelope:
        """An envelope of a message without a UUID."""
        env = Envelope(self.journal, self.offset, self.offset + 100, {})
        self.offset += 102
        return env


def queue(seq: Sequencer, *envs: Envelope) -> list[QueueOutcome]:
    return [seq.queue_uncommitted(e) for e in envs]


def drain(seq: Sequencer) -> list[Envelope]:
    out = []
    while (env := seq.dequeue_committed()) is not None:
        out.append(env)
    return out


def expect_dequeue(seq: Sequencer, *expect: Envelope) -> None:
    """Exactly `expect` comes out; its producer then has nothing pending.

    The span's ACK (read last) is what the producer's state and the offset end at.
    """
    assert drain(seq) == list(expect)
    last = expect[-1]
    producer = parse_uuid(UUID(last.message["uuid"]))[0]
    state = seq.producer_state(last.journal, producer)
    assert state is not None and state.begin == -1 and state.last_ack > last.message["clock"]
    assert seq.offset(last.journal) > last.end


def expect_replay(seq: Sequencer, begin: int, end: int, *envs: Envelope) -> None:
    assert seq.awaiting_replay
    assert seq.replay_range() == (envs[0].journal, begin, end)
    seq.start_replay(envs)


def by_producer(states: list[ProducerState]) -> list[ProducerState]:
    return sorted(states, key=lambda s: (s.journal, s.producer))


@pytest.fixture
def AB() -> tuple[bytes, bytes]:
    return new_producer_id(), new_producer_id()


# --- example cases ------------------------------------------------------------------


def test_ring_add_and_evict(AB: tuple[bytes, bytes]) -> None:
    A, B = AB
    gen, seq = Gen(), Sequencer(buffer=3)
    a1, b2, a3, b4, b5 = (gen(A, 1, CONT), gen(B, 2, CONT), gen(A, 3, CONT), gen(B, 4, CONT),
                          gen(B, 5, CONT))
    assert not seq.has_pending()
    assert queue(seq, a1, b2, a3) == [Q.CONTINUE_BEGIN_SPAN, Q.CONTINUE_BEGIN_SPAN,
                                      Q.CONTINUE_EXTEND_SPAN]
    assert seq.has_pending()
    assert seq.offset(JOURNAL) == a3.end  # continuations update read-through at once
    assert queue(seq, b4, b5) == [Q.CONTINUE_EXTEND_SPAN] * 2  # evicts a1, then b2
    # A's span now starts in the ring at a3; B's is held only from b4.
    assert queue(seq, gen(A, 4, ACK)) == [Q.ACK_COMMIT_REPLAY]
    expect_replay(seq, a1.begin, a3.begin, a1, b2)
    expect_dequeue(seq, a1, a3)
    assert queue(seq, gen(B, 6, ACK)) == [Q.ACK_COMMIT_REPLAY]
    expect_replay(seq, b2.begin, b4.begin, b2, a3)
    expect_dequeue(seq, b2, b4, b5)
    assert not seq.has_pending()


def test_txn_sequence_cases(AB: tuple[bytes, bytes]) -> None:
    A, B = AB
    gen, seq = Gen(), Sequencer(buffer=2)

    # Internal duplicates served from the ring.
    a1, a2 = gen(A, 1, CONT), gen(A, 2, CONT)
    assert queue(seq, a1, a2, gen(A, 1, CONT), gen(A, 2, CONT), gen(A, 3, ACK)) == [
        Q.CONTINUE_BEGIN_SPAN, Q.CONTINUE_EXTEND_SPAN, Q.CONTINUE_TXN_CLOCK_LARGER,
        Q.CONTINUE_TXN_CLOCK_LARGER, Q.ACK_COMMIT_RING]
    expect_dequeue(seq, a1, a2)
    assert not seq.has_pending()

    # An ACK without preceding CONTINUE_TXN: unusual, allowed, nothing to deliver.
    assert queue(seq, gen(A, 4, ACK)) == [Q.ACK_EMPTY]
    assert drain(seq) == []

    # A partial ACK: a7 has a larger clock than the ACK and is dropped.
    a5 = gen(A, 5, CONT)
    assert queue(seq, a5, gen(A, 7, CONT), gen(A, 6, ACK)) == [
        Q.CONTINUE_BEGIN_SPAN, Q.CONTINUE_EXTEND_SPAN, Q.ACK_COMMIT_RING]
    expect_dequeue(seq, a5)

    # A rollback, with producer B interleaved: A's span is discarded.
    b1, a7r, a8r, b2 = gen(B, 1, CONT), gen(A, 7, CONT), gen(A, 8, CONT), gen(B, 2, CONT)
    assert queue(seq, a7r, b1, a7r, a8r, b2, gen(A, 6, ACK)) == [
        Q.CONTINUE_BEGIN_SPAN, Q.CONTINUE_BEGIN_SPAN, Q.CONTINUE_TXN_CLOCK_LARGER,
        Q.CONTINUE_EXTEND_SPAN, Q.CONTINUE_EXTEND_SPAN, Q.ACK_ROLLBACK]
    assert drain(seq) == []
    assert by_producer(seq.checkpoint()) == by_producer([
        ProducerState(JOURNAL, A, 6, -1), ProducerState(JOURNAL, B, 0, b1.begin)])

    # B's ACK needs a replay: b1 was evicted (the ring holds a8r, b2).
    assert queue(seq, gen(B, 3, ACK)) == [Q.ACK_COMMIT_REPLAY]
    expect_replay(seq, b1.begin, b2.begin, b1, a7r, a8r)
    expect_dequeue(seq, b1, b2)

    # A replayed span with duplicates inside it and from before it.
    b4, b1d, b4d, b5 = gen(B, 4, CONT), gen(B, 1, CONT), gen(B, 4, CONT), gen(B, 5, CONT)
    b6, b2d, b7 = gen(B, 6, CONT), gen(B, 2, CONT), gen(B, 7, CONT)
    assert queue(seq, b4, b1d, b4d, b5, b6, b2d, b7, gen(B, 8, ACK)) == [
        Q.CONTINUE_BEGIN_SPAN, Q.CONTINUE_ALREADY_ACKED, Q.CONTINUE_TXN_CLOCK_LARGER,
        Q.CONTINUE_EXTEND_SPAN, Q.CONTINUE_EXTEND_SPAN, Q.CONTINUE_ALREADY_ACKED,
        Q.CONTINUE_EXTEND_SPAN, Q.ACK_COMMIT_REPLAY]
    expect_replay(seq, b4.begin, b6.begin, b4, b1d, b4d, b5)
    expect_dequeue(seq, b4, b5, b6, b7)

    # Reset to an earlier ACK, then re-use of clocks.
    b9 = gen(B, 9, CONT)
    assert queue(seq, gen(B, 8, ACK), b9, gen(B, 10, ACK)) == [
        Q.ACK_ROLLBACK, Q.CONTINUE_BEGIN_SPAN, Q.ACK_COMMIT_RING]
    expect_dequeue(seq, b9)


def test_older_ack_resets_the_clock(caplog: pytest.LogCaptureFixture) -> None:
    A = new_producer_id()
    gen, seq = Gen(), Sequencer()
    queue(seq, gen(A, 10, OUT))
    drain(seq)
    a11 = gen(A, 11, CONT)
    assert queue(seq, a11, gen(A, 5, ACK)) == [Q.CONTINUE_BEGIN_SPAN, Q.ACK_ROLLBACK]
    assert "older than the last acknowledgement" in caplog.text
    assert drain(seq) == []
    # Clocks after 5 are accepted again (at-least-once until the producer catches up).
    a8 = gen(A, 8, OUT)
    assert queue(seq, a8) == [Q.OUTSIDE_COMMIT]
    assert drain(seq) == [a8]


def test_interleaved_acks_needing_two_replays(AB: tuple[bytes, bytes]) -> None:
    A, B = AB
    gen, seq = Gen(), Sequencer(buffer=2)
    b11, a7, a8, b12 = gen(B, 11, CONT), gen(A, 7, CONT), gen(A, 8, CONT), gen(B, 12, CONT)
    assert queue(seq, b11, a7, a8, b12, gen(A, 9, ACK)) == [
        Q.CONTINUE_BEGIN_SPAN, Q.CONTINUE_BEGIN_SPAN, Q.CONTINUE_EXTEND_SPAN,
        Q.CONTINUE_EXTEND_SPAN, Q.ACK_COMMIT_REPLAY]
    expect_replay(seq, a7.begin, a8.begin, a7)
    expect_dequeue(seq, a7, a8)
    assert seq.has_pending()
    assert queue(seq, gen(B, 13, ACK)) == [Q.ACK_COMMIT_REPLAY]
    expect_replay(seq, b11.begin, b12.begin, b11, a7, a8)
    expect_dequeue(seq, b11, b12)
    assert not seq.has_pending()


def test_smallest_ring_replays_all_but_the_last(AB: tuple[bytes, bytes]) -> None:
    A, B = AB
    gen, seq = Gen(), Sequencer(buffer=0)  # taken as 1
    a1, a2, b1 = gen(A, 1, CONT), gen(A, 2, CONT), gen(B, 1, CONT)
    a1d, a2d, a3ack = gen(A, 1, CONT), gen(A, 2, CONT), gen(A, 3, ACK)
    assert queue(seq, a1, a2, b1, a1d, a2d, a3ack) == [
        Q.CONTINUE_BEGIN_SPAN, Q.CONTINUE_EXTEND_SPAN, Q.CONTINUE_BEGIN_SPAN,
        Q.CONTINUE_TXN_CLOCK_LARGER, Q.CONTINUE_TXN_CLOCK_LARGER, Q.ACK_COMMIT_REPLAY]
    expect_replay(seq, a1.begin, a3ack.begin, a1, a2, b1, a1d, a2d)
    expect_dequeue(seq, a1, a2)
    b2 = gen(B, 2, CONT)
    assert queue(seq, b2, gen(B, 3, ACK)) == [Q.CONTINUE_EXTEND_SPAN, Q.ACK_COMMIT_REPLAY]
    expect_replay(seq, b1.begin, b2.begin, b1, a1d, a2d, a3ack)
    expect_dequeue(seq, b1, b2)


def test_outside_txn_cases(caplog: pytest.LogCaptureFixture) -> None:
    A = new_producer_id()
    gen, seq = Gen(), Sequencer(buffer=0)

    # OUTSIDE_TXN messages commit at once; duplicates are ignored but read through.
    a1, a2 = gen(A, 1, OUT), gen(A, 2, OUT)
    assert queue(seq, a1) == [Q.OUTSIDE_COMMIT]
    assert drain(seq) == [a1]
    assert queue(seq, a2) == [Q.OUTSIDE_COMMIT]
    assert drain(seq) == [a2]
    a2d = gen(A, 2, OUT)
    assert queue(seq, gen(A, 1, OUT), a2d) == [Q.OUTSIDE_ALREADY_ACKED] * 2
    assert drain(seq) == []
    assert seq.offset(JOURNAL) == a2d.end

    # Pending CONTINUE_TXNs before an OUTSIDE_TXN are discarded (and logged).
    a5 = gen(A, 5, OUT)
    assert queue(seq, gen(A, 3, CONT), gen(A, 4, CONT), a5) == [
        Q.CONTINUE_BEGIN_SPAN, Q.CONTINUE_EXTEND_SPAN, Q.OUTSIDE_COMMIT]
    assert drain(seq) == [a5]
    assert seq.checkpoint() == [ProducerState(JOURNAL, A, 5, -1)]
    assert "OUTSIDE_TXN after pending" in caplog.text

    # Unknown flags are taken as OUTSIDE_TXN.
    a7 = gen(A, 7, 0x100)
    assert queue(seq, gen(A, 6, CONT), a7) == [Q.CONTINUE_BEGIN_SPAN, Q.OUTSIDE_COMMIT]
    assert drain(seq) == [a7]
    assert queue(seq, gen(A, 7, 0x100)) == [Q.OUTSIDE_ALREADY_ACKED]
    assert drain(seq) == []


def test_messages_without_uuid_commit_untracked() -> None:
    A = new_producer_id()
    gen, seq = Gen(), Sequencer()
    a1 = gen(A, 1, OUT)
    queue(seq, a1)
    drain(seq)
    plain = [gen.plain(),
             Envelope(JOURNAL, gen.offset, gen.offset + 10,
                      {"uuid": "00000000-0000-0000-0000-000000000000"}),
             Envelope(JOURNAL, gen.offset + 10, gen.offset + 20, {"uuid": None})]
    for env in plain:
        assert queue(seq, env) == [Q.OUTSIDE_COMMIT]
        assert drain(seq) == [env]
    assert queue(seq, plain[0]) == [Q.OUTSIDE_COMMIT]  # never de-duplicated
    assert drain(seq) == [plain[0]]
    assert seq.checkpoint() == [ProducerState(JOURNAL, A, 1, -1)]


def test_producers_are_keyed_by_journal() -> None:
    A = new_producer_id()
    one, two, seq = Gen("j/one"), Gen("j/two"), Sequencer()
    x1, y1 = one(A, 1, CONT), two(A, 1, CONT)
    assert queue(seq, x1, y1, one(A, 2, ACK)) == [
        Q.CONTINUE_BEGIN_SPAN, Q.CONTINUE_BEGIN_SPAN, Q.ACK_COMMIT_RING]
    expect_dequeue(seq, x1)
    assert seq.offsets == {"j/one": 202, "j/two": 100}
    assert queue(seq, two(A, 2, ACK)) == [Q.ACK_COMMIT_RING]
    expect_dequeue(seq, y1)


def test_deliver_acks_like_gazette() -> None:
    A = new_producer_id()
    gen, seq = Gen(), Sequencer(deliver_acks=True)
    a1, a2ack, a3ack = gen(A, 1, CONT), gen(A, 2, ACK), gen(A, 3, ACK)
    assert queue(seq, a1, a2ack) == [Q.CONTINUE_BEGIN_SPAN, Q.ACK_COMMIT_RING]
    assert drain(seq) == [a1, a2ack]
    assert queue(seq, a3ack) == [Q.ACK_EMPTY]
    assert drain(seq) == [a3ack]
    assert seq.checkpoint() == [ProducerState(JOURNAL, A, 3, -1)]
    assert seq.offsets == {JOURNAL: a3ack.end}


def test_misuse_is_refused() -> None:
    A = new_producer_id()
    gen, seq = Gen(), Sequencer()
    with pytest.raises(RuntimeError):
        seq.replay_range()  # no replay was asked for
    queue(seq, gen(A, 1, CONT), gen(A, 2, ACK))
    with pytest.raises(RuntimeError):
        seq.queue_uncommitted(gen(A, 3, CONT))  # the span must be dequeued first


def test_checkpoint_round_trip() -> None:
    A, B, C = new_producer_id(), new_producer_id(), new_producer_id()
    gen, seq1 = Gen(), Sequencer(buffer=12)
    a1, a2, b1, b2, c1ack = (gen(A, 1, CONT), gen(A, 2, CONT), gen(B, 1, CONT),
                             gen(B, 2, CONT), gen(C, 1, ACK))
    z1 = gen.plain()
    assert queue(seq1, a1, a2, b1, b2, c1ack, z1) == [
        Q.CONTINUE_BEGIN_SPAN, Q.CONTINUE_EXTEND_SPAN, Q.CONTINUE_BEGIN_SPAN,
        Q.CONTINUE_EXTEND_SPAN, Q.ACK_EMPTY, Q.OUTSIDE_COMMIT]
    assert drain(seq1) == [z1]

    # Spans count as pending only if they began since the last checkpoint.
    assert seq1.has_pending()
    states = seq1.checkpoint()
    assert not seq1.has_pending()
    assert by_producer(states) == by_producer([
        ProducerState(JOURNAL, A, 0, a1.begin), ProducerState(JOURNAL, B, 0, b1.begin),
        ProducerState(JOURNAL, C, 1, -1)])
    seq2 = Sequencer(states, 12, offsets=seq1.offsets)
    assert by_producer(seq2.checkpoint()) == by_producer(states)
    assert seq2.offsets == {JOURNAL: z1.end}

    # Both produce the same output from here, though seq2 needs replays.
    b3ack = gen(B, 3, ACK)
    assert queue(seq1, b3ack) == [Q.ACK_COMMIT_RING]
    assert queue(seq2, b3ack) == [Q.ACK_COMMIT_REPLAY]
    expect_replay(seq2, b1.begin, b3ack.begin, b1, b2, c1ack)
    expect_dequeue(seq1, b1, b2)
    expect_dequeue(seq2, b1, b2)

    c2, c1rollback, a3ack = gen(C, 2, CONT), gen(C, 1, ACK), gen(A, 3, ACK)
    for seq in (seq1, seq2):
        assert queue(seq, c2, c1rollback) == [Q.CONTINUE_BEGIN_SPAN, Q.ACK_ROLLBACK]
        assert drain(seq) == []
    assert queue(seq1, a3ack) == [Q.ACK_COMMIT_RING]
    assert queue(seq2, a3ack) == [Q.ACK_COMMIT_REPLAY]
    expect_replay(seq2, a1.begin, a3ack.begin, a1, a2, b1, b2, c1ack)
    expect_dequeue(seq1, a1, a2)
    expect_dequeue(seq2, a1, a2)


def test_checkpoint_during_dequeue() -> None:
    A = new_producer_id()
    gen, seq1 = Gen(), Sequencer(buffer=12)
    a1, a2, a3ack, a4, a5, a6ack = (gen(A, 1, CONT), gen(A, 2, CONT), gen(A, 3, ACK),
                                    gen(A, 4, CONT), gen(A, 5, CONT), gen(A, 6, ACK))
    assert queue(seq1, a1, a2, a3ack) == [
        Q.CONTINUE_BEGIN_SPAN, Q.CONTINUE_EXTEND_SPAN, Q.ACK_COMMIT_RING]
    # Before anything is dequeued, the state is that of just before a3ack.
    states = seq1.checkpoint()
    assert states == [ProducerState(JOURNAL, A, 0, a1.begin)]
    assert seq1.offsets == {JOURNAL: a2.end}

    # seq2 restarts there: it reads a3ack again and replays the span.
    seq2 = Sequencer(states, 12, offsets=seq1.offsets)
    assert queue(seq2, a3ack) == [Q.ACK_COMMIT_REPLAY]
    expect_replay(seq2, a1.begin, a3ack.begin, a1, a2)
    expect_dequeue(seq1, a1, a2)
    expect_dequeue(seq2, a1, a2)

    # A checkpoint after consuming a4 (but not a5) of the next span; restored twice.
    assert queue(seq1, a4, a5, a6ack)[-1] == Q.ACK_COMMIT_RING
    assert seq1.dequeue_committed() == a4
    states = seq1.checkpoint()
    assert states == [ProducerState(JOURNAL, A, 4, a4.begin)]
    assert seq1.offsets == {JOURNAL: a5.end}
    seq2 = Sequencer(Sequencer(states, offsets=seq1.offsets).checkpoint(), 12,
                     offsets=seq1.offsets)
    assert queue(seq2, a6ack) == [Q.ACK_COMMIT_REPLAY]
    expect_replay(seq2, a4.begin, a6ack.begin, a4, a5)
    expect_dequeue(seq2, a5)  # and not a4 again
    expect_dequeue(seq1, a5)


def test_producer_pruning() -> None:
    A, B, C = new_producer_id(), new_producer_id(), new_producer_id()
    gen, seq = Gen(), Sequencer(buffer=12)
    # Clock units are 100 ns, above 4 bits of counter: C acks 10 µs after B.
    queue(seq, gen(A, 100 << 4, CONT), gen(B, 190 << 4, CONT), gen(B, 200 << 4, ACK))
    drain(seq)
    queue(seq, gen(C, 300 << 4, OUT))
    drain(seq)

    def producers(horizon: timedelta | int | None) -> set[bytes]:
        return {s.producer for s in seq.checkpoint(horizon)}

    assert producers(None) == {A, B, C}
    assert producers(timedelta(microseconds=10)) == {A, B, C}
    assert producers(timedelta(microseconds=9)) == {A, C}  # A is pending: never pruned
    assert producers(301 << 4) == {A}  # an absolute Clock horizon
    assert producers(None) == {A}


def test_replay_errors() -> None:
    A, B = new_producer_id(), new_producer_id()

    def setup() -> tuple[Sequencer, Envelope]:
        gen, seq = Gen(), Sequencer(buffer=0)
        b1, a2, b2, a3ack = gen(B, 1, CONT), gen(A, 2, CONT), gen(B, 2, CONT), gen(A, 3, ACK)
        assert queue(seq, b1, a2, b2, a3ack) == [
            Q.CONTINUE_BEGIN_SPAN, Q.CONTINUE_BEGIN_SPAN, Q.CONTINUE_EXTEND_SPAN,
            Q.ACK_COMMIT_REPLAY]
        assert seq.replay_range() == (JOURNAL, a2.begin, a3ack.begin)
        return seq, a2

    seq, a2 = setup()
    seq.start_replay([a2])
    assert drain(seq) == [a2]

    for change, problem in [({"journal": "wrong/journal"}, "wrong journal"),
                            ({"begin": a2.begin - 1}, "wrong begin"),
                            ({"end": a2.end + 200}, "wrong end")]:
        seq, a2 = setup()
        seq.start_replay([replace(a2, **change)])  # type: ignore[arg-type]
        with pytest.raises(ReplayError, match=problem):
            seq.dequeue_committed()


def test_replay_fed_in_batches() -> None:
    A, B = new_producer_id(), new_producer_id()
    gen, seq = Gen(), Sequencer(buffer=1)
    a1, b1, a2, b2, a3 = (gen(A, 1, CONT), gen(B, 1, CONT), gen(A, 2, CONT), gen(B, 2, CONT),
                          gen(A, 3, CONT))
    queue(seq, a1, b1, a2, b2, a3)
    assert queue(seq, gen(A, 4, ACK)) == [Q.ACK_COMMIT_REPLAY]
    assert seq.replay_range() == (JOURNAL, a1.begin, a3.begin)
    assert seq.awaiting_replay and seq.dequeue_committed() is None
    seq.feed_replay([a1, b1], done=False)
    assert seq.dequeue_committed() == a1
    assert seq.dequeue_committed() is None and seq.awaiting_replay
    seq.feed_replay([a2, b2], done=False)
    assert seq.dequeue_committed() == a2
    seq.feed_replay([], done=True)
    assert not seq.awaiting_replay
    expect_dequeue(seq, a3)


def test_uuid_int_forms(caplog: pytest.LogCaptureFixture) -> None:
    u = build_uuid(new_producer_id(), 12345, 1)
    assert uuid_int({"uuid": str(u)}) == u.int
    assert uuid_int({"uuid": u}) == u.int
    assert uuid_int({"uuid": "{" + str(u) + "}"}) == u.int
    assert uuid_int({"uuid": str(u).upper()}) == u.int
    assert uuid_int({}) == 0
    with caplog.at_level(logging.WARNING):
        assert uuid_int({"uuid": "not-a-uuid"}) == 0
    assert "malformed uuid" in caplog.text


# --- property: random histories against a model -------------------------------------


@dataclass
class Producer:
    id: bytes
    clock: int = 100
    last_ack: int | None = None
    pending: list[int] = field(default_factory=list)  # clocks of the open span
    written: list[tuple[int, int, dict]] = field(default_factory=list)  # (clock, flags, msg)


def build_history(actions: list[tuple[str, int, int]], n_producers: int
                  ) -> tuple[list[Envelope], list[int]]:
    """The journal the actions write, and the message ids a reader must commit, in order."""
    producers = [Producer(new_producer_id()) for _ in range(n_producers)]
    journal: list[Envelope] = []
    expected: list[int] = []
    pending_ids: dict[bytes, list[int]] = {p.id: [] for p in producers}
    offset = 0

    def write(message: dict) -> None:
        nonlocal offset
        size = 90 + len(journal) % 7  # envelopes of varied size, with gaps between some
        journal.append(Envelope(JOURNAL, offset, offset + size, message))
        offset += size + len(journal) % 2

    for kind, which, pick in actions:
        p = producers[which % n_producers]
        if kind == "dup":
            # A re-delivered earlier message (a retried append): an acknowledged
            # one, or one of the open span.
            candidates = [m for c, f, m in p.written
                          if (f != ACK and p.last_ack is not None and c <= p.last_ack)
                          or (f == CONT and c in p.pending)]
            if candidates:
                write(candidates[pick % len(candidates)])
            continue
        uid = len(journal)
        if kind == "restart":
            # The producer recovers its last checkpoint and re-sends its last ACK:
            # what it wrote since is rolled back. It goes on with new clocks.
            if p.last_ack is None:
                continue
            clock, flags = p.last_ack, ACK
            p.pending.clear()
            pending_ids[p.id].clear()
        else:
            p.clock += 1 + pick % 3
            clock = p.clock
            flags = {"continue": CONT, "ack": ACK, "outside": OUT}[kind]
            if flags == CONT:
                p.pending.append(clock)
                pending_ids[p.id].append(uid)
            else:
                # An OUTSIDE_TXN drops an open span (as a rollback) and commits itself.
                expected.extend(pending_ids[p.id] if flags == ACK else [uid])
                p.pending.clear()
                pending_ids[p.id].clear()
                p.last_ack = clock
        message = {"uuid": str(build_uuid(p.id, clock, flags)), "id": uid, "ack": flags == ACK}
        p.written.append((clock, flags, message))
        write(message)
    return journal, expected


def read_committed(journal: list[Envelope], buffer: int, cuts: set[int], batch: int,
                   deliver_acks: bool) -> list[int]:
    """Read `journal` read-committed. At each event number in `cuts` (an event is a
    queue or a dequeue), restart the reader from a checkpoint: a new Sequencer from
    the producer states, reading again from its offsets."""
    out: list[int] = []
    seq = Sequencer(buffer=buffer, deliver_acks=deliver_acks)
    events = 0

    def tick() -> bool:
        nonlocal events
        events += 1
        return events in cuts

    def replay(begin: int, end: int) -> Iterator[list[Envelope]]:
        span = [e for e in journal if e.begin >= begin and e.end <= end]
        for i in range(0, len(span), batch):
            yield span[i:i + batch]

    index = 0
    while index < len(journal):
        env = journal[index]
        index += 1
        batches: Iterator[list[Envelope]] = iter(())
        if seq.queue_uncommitted(env) == Q.ACK_COMMIT_REPLAY:
            _, begin, end = seq.replay_range()
            batches = replay(begin, end)
        cut = tick()  # a restart may come before, during or after the dequeue
        while not cut:
            got = seq.dequeue_committed()
            if got is None and seq.awaiting_replay:
                more = next(batches, None)
                seq.feed_replay(more or [], done=more is None)
                continue
            if got is None:
                break
            if not got.message["ack"]:
                out.append(got.message["id"])
            cut = tick()
        if cut:
            offsets = seq.offsets
            seq = Sequencer(seq.checkpoint(), buffer, offsets=offsets, deliver_acks=deliver_acks)
            resume = offsets.get(JOURNAL, 0)
            index = next((i for i, e in enumerate(journal) if e.begin >= resume), len(journal))
    return out


# Weighted: long open spans make the small rings evict, so ACKs need replays.
KINDS = ["continue"] * 6 + ["ack"] * 2 + ["dup"] * 2 + ["outside", "restart"]
ACTIONS = st.lists(
    st.tuples(st.sampled_from(KINDS), st.integers(0, 2), st.integers(0, 1000)),
    min_size=20, max_size=120,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=ACTIONS, n_producers=st.integers(1, 3),
       buffer=st.sampled_from([1, 2, 3, 5, 1000]), batch=st.integers(1, 4),
       cuts=st.sets(st.integers(1, 300), max_size=6), deliver_acks=st.booleans())
def test_read_committed_matches_model(actions: list[tuple[str, int, int]], n_producers: int,
                                      buffer: int, batch: int, cuts: set[int],
                                      deliver_acks: bool) -> None:
    journal, expected = build_history(actions, n_producers)
    assert read_committed(journal, buffer, cuts, batch, deliver_acks) == expected


# --- the bulk path: commit_run is queueing and dequeuing one by one -----------------


def sequence(journal: list[Envelope], run_limit: int) -> tuple[list[int], Sequencer]:
    """Read `journal` committed (no replays: a large ring), in runs of at most `run_limit`
    through `commit_run` (0: one by one only); the ids read and the Sequencer."""
    seq = Sequencer(buffer=1000, deliver_acks=True)
    out: list[int] = []
    index = 0
    while index < len(journal):
        if run_limit:
            end = seq.commit_run(journal, index, min(len(journal), index + run_limit))
            out += [e.message["id"] for e in journal[index:end]]
            if end > index:
                index = end
                continue
        seq.queue_uncommitted(journal[index])
        index += 1
        out += [e.message["id"] for e in drain(seq) if not e.message.get("ack")]
    return out, seq


# Mostly committed messages, as a catch-up reads them, with the other kinds among them.
BULK_KINDS = ["outside"] * 8 + ["continue", "ack", "dup", "restart"]


C_SCAN = sequencer_module._scan  # the C scanner (streamkit/message/_runscan.c), if built


@contextlib.contextmanager
def scanning(in_c: bool) -> Iterator[None]:
    """commit_run with its inner loop in C, or all in Python (as without a compiler)."""
    if in_c and C_SCAN is None:
        pytest.skip("streamkit.message._runscan is not built (no C compiler at install)")
    saved = sequencer_module._scan
    sequencer_module._scan = C_SCAN if in_c else None
    try:
        yield
    finally:
        sequencer_module._scan = saved


def test_the_c_scanner_is_built_where_a_compiler_is() -> None:
    """setup.py builds it optionally: a failed build would only show as a slower catch-up."""
    if shutil.which("cc") or shutil.which("gcc"):
        assert C_SCAN is not None, "reinstall (pip install -e .) to build _runscan.c"


@pytest.mark.skipif(C_SCAN is None, reason="streamkit.message._runscan is not built")
def test_the_c_scanner_hands_what_it_does_not_take_back(AB: tuple[bytes, bytes]) -> None:
    """Calls the Python loop would take differently (a tuple, a negative index, a Clock out
    of 64 bits) come back untouched rather than raising."""
    A, _ = AB
    envs = [Gen()(A, 5, OUT)]
    producer = int.from_bytes(A, "big")  # the UUID's node: its low 48 bits
    assert C_SCAN(envs, 0, 1, JOURNAL, producer, 0)[0] == 1  # (taken)
    assert C_SCAN(tuple(envs), 0, 1, JOURNAL, producer, 0) == (0, 0)
    assert C_SCAN(envs, -1, 1, JOURNAL, producer, 0) == (-1, 0)
    assert C_SCAN(envs, 0, 1 << 70, JOURNAL, producer, 1 << 70) == (0, 1 << 70)


@pytest.mark.parametrize("in_c", [True, False], ids=["c", "python"])
@settings(max_examples=300, deadline=None)
@given(actions=st.lists(st.tuples(st.sampled_from(BULK_KINDS), st.integers(0, 2),
                                  st.integers(0, 1000)), min_size=5, max_size=150),
       n_producers=st.integers(1, 3), run_limit=st.integers(1, 40))
def test_commit_run_matches_one_by_one(in_c: bool, actions: list[tuple[str, int, int]],
                                       n_producers: int, run_limit: int) -> None:
    journal, expected = build_history(actions, n_producers)
    with scanning(in_c):
        bulk, bulk_seq = sequence(journal, run_limit)
    single, single_seq = sequence(journal, 0)
    assert bulk == single == expected
    assert bulk_seq.offsets == single_seq.offsets
    assert by_producer(bulk_seq.checkpoint()) == by_producer(single_seq.checkpoint())


@pytest.mark.parametrize("in_c", [True, False], ids=["c", "python"])
def test_commit_run_stops_where_the_per_message_path_is_needed(
        in_c: bool, AB: tuple[bytes, bytes]) -> None:
    with scanning(in_c):
        _stops_where_needed(AB)


def _stops_where_needed(AB: tuple[bytes, bytes]) -> None:
    A, _ = AB
    gen = Gen()
    a1, a2, dup, plain, a3 = gen(A, 10, OUT), gen(A, 11, OUT), gen(A, 11, OUT), gen.plain(), \
        gen(A, 12, OUT)
    seq = Sequencer()
    journal = [a1, a2, dup, plain, a3]
    assert seq.commit_run(journal, 0, 5) == 2  # the duplicate needs queue_uncommitted
    assert seq.offset(JOURNAL) == a2.end
    assert seq.queue_uncommitted(dup) == Q.OUTSIDE_ALREADY_ACKED
    assert seq.commit_run(journal, 3, 5) == 3  # no UUID: the per-message path
    assert seq.queue_uncommitted(plain) == Q.OUTSIDE_COMMIT
    with pytest.raises(RuntimeError):
        seq.commit_run(journal, 4, 5)
    assert drain(seq) == [plain]
    assert seq.commit_run(journal, 4, 5) == 5 and seq.offset(JOURNAL) == a3.end


# Ways a UUID string may differ from the canonical form that int(..., 16) may still read.
_MUTATIONS = ["none", "none", "none", "upper", "char", "hyphen", "prefix", "short", "digit"]


def _mutated(text: str, how: str, at: int, char: str) -> str:
    if how == "upper":
        return text.upper()
    if how == "char":  # any character in place of one
        return text[:at] + char + text[at + 1:]
    if how == "hyphen":  # the first hyphen moved: 36 characters still
        rest = text[:8] + text[9:]
        return rest[:at] + "-" + rest[at:]
    if how == "prefix":  # int() takes "0x" and underscores
        return "0x" + text.replace("-", "_")[2:]
    if how == "short":
        return text[:at]
    if how == "digit":  # a non-ASCII digit, which int() reads as well
        return text[:at] + "\u0663" + text[at + 1:]
    return text


@pytest.mark.skipif(C_SCAN is None, reason="streamkit.message._runscan is not built")
@settings(max_examples=400, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 1), st.integers(-2, 5), st.sampled_from(_MUTATIONS),
                                st.integers(0, 35), st.sampled_from("-_ xgG0fF9"),
                                st.sampled_from([0, 0, 0, 1, 2]), st.booleans()),
                      min_size=1, max_size=30),
       run_limit=st.integers(1, 40))
def test_the_c_scanner_changes_no_outcome(steps: list[tuple], run_limit: int) -> None:
    """UUID strings off the canonical form (which int() may still read, some as more than 128
    bits), equal journal names that are not the same object, clocks going back: commit_run
    commits what queueing one by one does, with the C scanner and without it (the scanner
    stops at anything it does not read itself)."""
    producers = [new_producer_id(), new_producer_id()]
    clock = clock_at(1_764_000_000 * 10**9)  # a real time: UUIDs without leading zeros
    journal: list[Envelope] = []
    for k, (who, step, how, at, char, flags, same_name) in enumerate(steps):
        clock += step
        text = _mutated(str(build_uuid(producers[who], max(clock, 1), flags)), how, at, char)
        name = JOURNAL if same_name else "".join(list(JOURNAL))  # equal, not identical
        journal.append(Envelope(name, 100 * k, 100 * k + 90, {"uuid": text, "id": k}))
    results = []
    for in_c, limit in ((True, run_limit), (False, run_limit), (False, 0)):
        with scanning(in_c):
            ids, seq = sequence(journal, limit)
        results.append((ids, seq.offsets, by_producer(seq.checkpoint())))
    assert results[0] == results[1] == results[2]
