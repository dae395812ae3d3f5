"""FSM, Segment/SegmentSet and hints: pure unit tests (no broker)."""

from __future__ import annotations

import json

import google_crc32c
import pytest

from streamkit.recoverylog import (
    FSM,
    FSMError,
    Outcome,
    Segment,
    SegmentError,
    SegmentSet,
    author_fence,
    author_value,
    hints_from_json,
    hints_to_json,
    rpb,
)
from streamkit.recoverylog.fsm import encode_frame

LOG = "a/log"
A, B = 0x11111111, 0x22222222


def make_op(fsm: FSM, author: int = A, **kind: object) -> tuple[rpb.RecordedOp, bytes]:
    op = rpb.RecordedOp(seq_no=fsm.next_seq_no, checksum=fsm.next_checksum, author=author,
                        **kind)
    return op, encode_frame(op)[1]


def apply(fsm: FSM, author: int = A, offset: int = 0, **kind: object) -> Outcome:
    op, payload = make_op(fsm, author, **kind)
    return fsm.apply(op, payload, LOG, offset, offset + 10)


def create(path: str) -> dict[str, object]:
    return {"create": rpb.RecordedOp.Create(path=path)}


def link(fnode: int, path: str, *, unlink: bool = False) -> dict[str, object]:
    return {"unlink" if unlink else "link": rpb.RecordedOp.Link(fnode=fnode, path=path)}


def write(fnode: int, length: int = 1) -> dict[str, object]:
    return {"write": rpb.RecordedOp.Write(fnode=fnode, length=length)}


def test_author_register_matches_gazette_format() -> None:
    assert author_value(1) == "1"
    assert author_value(31) == "v"
    assert author_value(32) == "10"
    assert author_value(0xFFFFFFFF) == "3vvvvvv"
    assert int(author_value(1636857676), 32) == 1636857676
    fence = author_fence(32)
    assert [(lbl.name, lbl.value) for lbl in fence.labels] == [("author", "10")]


def test_checksums_chain_over_op_bytes() -> None:
    fsm = FSM(rpb.FSMHints(log=LOG))
    op, payload = make_op(fsm, **create("/a"))
    assert fsm.apply(op, payload, LOG, 0) is Outcome.APPLIED
    assert (fsm.next_seq_no, fsm.next_checksum) == (2, google_crc32c.value(payload))
    assert fsm.links == {"/a": 1}

    stale = fsm.apply(op, payload, LOG, 0)
    assert stale is Outcome.STALE
    bad, payload = make_op(fsm, **create("/b"))
    bad.checksum ^= 1
    with pytest.raises(FSMError, match="checksum mismatch"):
        fsm.apply(bad, payload, LOG, 0)
    bad.checksum ^= 1
    bad.seq_no += 1
    with pytest.raises(FSMError, match="wrong seq_no"):
        fsm.apply(bad, payload, LOG, 0)
    assert fsm.next_seq_no == 2  # nothing changed


def test_links_and_unknown_fnodes() -> None:
    fsm = FSM(rpb.FSMHints(log=LOG))
    apply(fsm, **create("/a"))
    apply(fsm, **link(1, "/b"))
    with pytest.raises(FSMError, match="already linked"):
        apply(fsm, **link(1, "/b"))
    with pytest.raises(FSMError, match="lacks"):
        apply(fsm, **link(1, "/zz", unlink=True))
    with pytest.raises(FSMError, match="unknown fnode 7"):
        apply(fsm, **write(7))
    with pytest.raises(FSMError, match="not a clean path"):
        apply(fsm, **create("/../etc/passwd"))
    apply(fsm, **link(1, "/a", unlink=True))
    apply(fsm, **link(1, "/b", unlink=True))
    assert fsm.live_nodes == {} and fsm.links == {}
    with pytest.raises(FSMError, match="unknown fnode 1"):
        apply(fsm, **write(1))
    assert apply(fsm) is Outcome.APPLIED  # a no-op


def record(ops: list[tuple[int, dict[str, object]]]) -> FSM:
    fsm = FSM(rpb.FSMHints(log=LOG))
    for offset, (author, kind) in enumerate(ops):
        assert apply(fsm, author, offset * 100, **kind).applied
    return fsm


def test_hints_list_only_live_fnodes_and_replay() -> None:
    history = [
        (A, create("/dead")),  # 1
        (A, create("/live")),  # 2
        (A, write(1)),  # 3
        (A, write(2)),  # 4
        (A, link(1, "/dead", unlink=True)),  # 5
        (B, write(2)),  # 6: a new author took over
    ]
    fsm = record(history)
    hints = fsm.build_hints(LOG)
    assert [n.fnode for n in hints.live_nodes] == [2]
    segments = [(s.author, s.first_seq_no, s.last_seq_no) for s in hints.live_nodes[0].segments]
    assert segments == [(A, 2, 4), (B, 6, 6)]
    assert hints.live_nodes[0].segments[0].log == ""  # implied by hints.log

    # A player of these hints skips seq 1 (before the segment), treats ops on
    # the dead fnode inside the segment as untracked, and skips seq 5 (by A,
    # while the next hinted segment is B's).
    replay = FSM(hints)
    assert (replay.next_seq_no, replay.next_checksum) == (2, hints.live_nodes[0].segments[0]
                                                          .first_checksum)
    full = FSM(rpb.FSMHints(log=LOG))
    outcomes = []
    for author, kind in history:
        op, payload = make_op(full, author, **kind)
        full.apply(op, payload, LOG, 0)
        outcomes.append(replay.apply(op, payload, LOG, 0))
    assert outcomes == [Outcome.STALE, Outcome.APPLIED, Outcome.UNTRACKED, Outcome.APPLIED,
                        Outcome.NOT_HINTED_AUTHOR, Outcome.APPLIED]
    assert not replay.has_remaining_hints
    assert replay.links == {"/live": 2}
    assert (replay.next_seq_no, replay.next_checksum) == (full.next_seq_no, full.next_checksum)


def test_fnode_created_after_the_last_hinted_create_but_dead_is_untracked() -> None:
    """A file created and deleted between a live file's writes (SQLite's rollback journal).

    Its create lies inside a hinted segment, after every hinted fnode was seen;
    its unlink lies in a range the hints skip. Playback must not track it, or
    the next create of the same path collides with the stale link.
    """
    history = [
        (A, create("/db")),  # 1
        (A, write(1)),  # 2
        (A, create("/db-journal")),  # 3: dead by the time hints are taken
        (A, write(1)),  # 4
        (B, link(3, "/db-journal", unlink=True)),  # 5: B took over, outside the hints
        (B, write(1)),  # 6
        (B, create("/db-journal")),  # 7: the same path again, after the hints
    ]
    fsm = record(history[:6])
    hints = fsm.build_hints(LOG)
    assert [n.fnode for n in hints.live_nodes] == [1]
    replay = FSM(hints)
    full = FSM(rpb.FSMHints(log=LOG))
    outcomes = []
    for author, kind in history:
        op, payload = make_op(full, author, **kind)
        full.apply(op, payload, LOG, 0)
        outcomes.append(replay.apply(op, payload, LOG, 0))
    assert outcomes[2] is Outcome.UNTRACKED
    assert outcomes[6] is Outcome.APPLIED
    assert replay.links == full.links == {"/db": 1, "/db-journal": 7}


def test_dead_branch_authors_are_skipped_while_hints_remain() -> None:
    fsm = record([(A, create("/x")), (A, write(1))])
    replay = FSM(fsm.build_hints(LOG))
    op, payload = make_op(replay, author=B, **create("/other"))
    assert replay.apply(op, payload, LOG, 0) is Outcome.NOT_HINTED_AUTHOR


def test_hints_json_is_gazette_shaped() -> None:
    fsm = record([(A, create("/x")), (A, write(1))])
    hints = fsm.build_hints(LOG)
    hints.properties.add(path="/IDENTITY", content="id")
    text = hints_to_json(hints)
    doc = json.loads(text)
    segment = doc["live_nodes"][0]["segments"][0]
    assert segment["first_seq_no"] == 1 and isinstance(segment["last_offset"], int)
    assert "log" not in segment  # omitempty, as Go writes it
    assert hints_from_json(text) == hints
    # Gazette writes null for empty lists; protobuf's JSON mapping also parses.
    assert hints_from_json('{"log":"a/log","live_nodes":null}') == rpb.FSMHints(log=LOG)
    assert hints_from_json('{"log":"a/log","liveNodes":[]}') == rpb.FSMHints(log=LOG)


def seg(first: int, last: int, author: int = A, first_offset: int = 0, last_offset: int = 0,
        log: str = LOG) -> Segment:
    return Segment(author=author, first_seq_no=first, first_offset=first_offset,
                   first_checksum=first * 7, last_seq_no=last, last_offset=last_offset, log=log)


def test_segment_set_merges_and_orders() -> None:
    s = SegmentSet([seg(5, 6, first_offset=50, last_offset=70), seg(1, 2, last_offset=20)])
    s.add(seg(3, 4, first_offset=20, last_offset=50))  # adjacent, same author: merges
    assert [(x.first_seq_no, x.last_seq_no, x.last_offset) for x in s] == [(1, 6, 70)]
    s.add(seg(7, 9, author=B, first_offset=70))  # new author: separate, unbounded suffix
    s.add(seg(8, 8, author=B, first_offset=80))  # covered: tighter nothing, no change
    assert len(s) == 2 and s[1].last_seq_no == 9
    assert [x.first_seq_no for x in s.intersect(LOG, 60, 65)] == [1]
    assert [x.first_seq_no for x in s.intersect(LOG, 75, 76)] == [7]


@pytest.mark.parametrize("bad", [
    seg(3, 4, author=B),  # overlaps author A
    seg(3, 3, first_offset=1, last_offset=2),  # first_offset decreases vs (1..2 @ 10)
    seg(0, 1),  # invalid seq_no
    seg(2, 1),  # last < first
])
def test_segment_set_rejects_inconsistencies(bad: Segment) -> None:
    s = SegmentSet([seg(1, 4, first_offset=10, last_offset=40)])
    with pytest.raises(SegmentError):
        s.add(bad)
