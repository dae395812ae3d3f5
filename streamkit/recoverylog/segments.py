"""Segments: runs of one author's ops in one log, and ordered sets of them.

A Recorder cannot know where its appends land (other writers may interleave),
so the segments it hints carry only a lower-bound `first_offset` and an
unknown (zero) `last_offset`. A Player sees exact offsets. A SegmentSet
merges both kinds while keeping the invariants a Player relies on to seek:

* entries have strictly increasing, non-overlapping seq_no ranges (so any
  seq_no has at most one author);
* within one log, first_offset never decreases;
* within one log, last_offset never decreases, except that a suffix of the
  set may have last_offset 0 (unknown, i.e. unbounded).
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

from streamkit.errors import StreamkitError
from streamkit.protocol import recoverylog_pb2 as rpb

__all__ = ["Segment", "SegmentError", "SegmentSet"]


class SegmentError(StreamkitError, ValueError):
    """A Segment is malformed, or would break a SegmentSet's invariants."""


@dataclass(frozen=True, slots=True)
class Segment:
    """Ops first_seq_no..last_seq_no (inclusive) of `author`, in `log`."""

    author: int
    first_seq_no: int
    first_offset: int
    first_checksum: int
    last_seq_no: int
    last_offset: int = 0  # exclusive; 0 = not known
    log: str = ""

    def validate(self) -> None:
        """Raise SegmentError if the fields contradict each other."""
        if self.author == 0:
            raise SegmentError(f"segment author is zero: {self}")
        if self.first_seq_no <= 0:
            raise SegmentError(f"segment first_seq_no <= 0: {self}")
        if self.first_offset < 0:
            raise SegmentError(f"segment first_offset < 0: {self}")
        if self.last_seq_no < self.first_seq_no:
            raise SegmentError(f"segment last_seq_no < first_seq_no: {self}")
        if self.last_offset and self.last_offset <= self.first_offset:
            raise SegmentError(f"segment last_offset <= first_offset: {self}")

    def to_proto(self) -> rpb.Segment:
        return rpb.Segment(
            author=self.author,
            first_seq_no=self.first_seq_no,
            first_offset=self.first_offset,
            first_checksum=self.first_checksum,
            last_seq_no=self.last_seq_no,
            last_offset=self.last_offset,
            log=self.log,
        )

    @classmethod
    def from_proto(cls, msg: rpb.Segment, default_log: str = "") -> Segment:
        """The Segment of `msg`; an empty log means `default_log` (FSMHints.log)."""
        return cls(
            author=msg.author,
            first_seq_no=msg.first_seq_no,
            first_offset=msg.first_offset,
            first_checksum=msg.first_checksum,
            last_seq_no=msg.last_seq_no,
            last_offset=msg.last_offset,
            log=msg.log or default_log,
        )


class _NotReducible(Exception):
    """Two segments are consistent but cannot merge into one (disjoint, or new author)."""


def _reduce(a: Segment, b: Segment) -> Segment:
    """Merge two consistent, overlapping or adjacent segments into one.

    Raises _NotReducible when they stay separate, SegmentError when they
    contradict each other.
    """
    if a.first_seq_no > b.first_seq_no or (
        a.first_seq_no == b.first_seq_no and a.last_seq_no < b.last_seq_no
    ):
        a, b = b, a
    same_log = a.log == b.log
    if a.first_seq_no < b.first_seq_no and same_log and a.first_offset > b.first_offset:
        raise SegmentError(f"first_offset must not decrease: {a} vs {b}")
    if a.first_seq_no < b.first_seq_no and a.last_offset == 0 and b.last_offset != 0:
        raise SegmentError(f"a segment with unknown last_offset precedes a known one: {a} vs {b}")
    if a.last_offset == 0 and not same_log:
        raise SegmentError(f"unbounded segment followed by another log's: {a} vs {b}")
    if same_log and (
        (a.last_seq_no <= b.last_seq_no and 0 < b.last_offset < a.last_offset)
        or (a.last_seq_no >= b.last_seq_no and 0 < a.last_offset < b.last_offset)
    ):
        raise SegmentError(f"last_offset must not decrease: {a} vs {b}")
    if a.first_seq_no == b.first_seq_no and a.first_checksum != b.first_checksum:
        raise SegmentError(f"first_checksum differs for one seq_no: {a} vs {b}")
    if a.last_seq_no + 1 < b.first_seq_no:
        raise _NotReducible
    if a.last_seq_no + 1 == b.first_seq_no and (a.author != b.author or not same_log):
        raise _NotReducible
    if a.author != b.author or not same_log:
        raise SegmentError(f"overlapping segments of different authors or logs: {a} vs {b}")

    first_offset, last_seq_no, last_offset = a.first_offset, a.last_seq_no, a.last_offset
    if a.first_seq_no == b.first_seq_no:
        first_offset = max(first_offset, b.first_offset)  # a tighter lower bound
    if a.last_seq_no == b.last_seq_no and last_offset == 0:
        last_offset = b.last_offset
    if a.last_seq_no < b.last_seq_no:
        last_seq_no, last_offset = b.last_seq_no, b.last_offset
    return replace(a, first_offset=first_offset, last_seq_no=last_seq_no, last_offset=last_offset)


class SegmentSet:
    """An ordered set of Segments kept under the module's invariants."""

    __slots__ = ("_items",)

    def __init__(self, segments: Iterable[Segment] = ()) -> None:
        self._items: list[Segment] = []
        for segment in segments:
            self.add(segment)

    def __iter__(self) -> Iterator[Segment]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> Segment:
        return self._items[index]

    def __repr__(self) -> str:
        return f"SegmentSet({self._items!r})"

    def add(self, segment: Segment) -> None:
        """Insert `segment`, merging it with neighbours it overlaps or extends."""
        segment.validate()
        items = self._items
        begin = bisect.bisect_left([s.first_seq_no for s in items], segment.first_seq_no)
        if begin > 0:
            with contextlib.suppress(_NotReducible):
                segment, begin = _reduce(items[begin - 1], segment), begin - 1
        end = begin
        while end < len(items):
            try:
                segment = _reduce(items[end], segment)
            except _NotReducible:
                break
            end += 1
        items[begin:end] = [segment]

    def intersect(self, log: str, first_offset: int, last_offset: int) -> list[Segment]:
        """Segments of `log` that may hold bytes of [first_offset, last_offset)."""
        if last_offset < first_offset:
            raise ValueError(f"invalid range [{first_offset}, {last_offset})")
        return [
            s
            for s in self._items
            if s.log == log
            and s.first_offset < last_offset
            and (s.last_offset == 0 or s.last_offset > first_offset)
        ]
