"""The JSON-lines decoder's loop in C (streamkit/message/_lines.c) decides nothing
the Python loop would decide differently: same envelopes, same reported lines."""

from __future__ import annotations

import dataclasses
import gc
import pickle
import shutil
import sys
from typing import Any
from unittest import mock

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import streamkit.message.framings.json_lines as json_lines
from streamkit.message.framing import framing_for
from streamkit.message.message import Envelope

C_DECODE = json_lines._decode_in_c  # None where the extension was not built
JOURNAL = "test/journal"
needs_c = pytest.mark.skipif(C_DECODE is None, reason="the C extension is not built here")


def test_the_c_decoder_is_built_where_a_compiler_is() -> None:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here")
    assert C_DECODE is not None


def _decode(stream: bytes, cuts: list[int], start: int, in_c: bool
            ) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    decoder = framing_for("application/x-ndjson").new_decoder(JOURNAL, dict)
    got: list[Envelope] = []
    with mock.patch.object(json_lines, "_decode_in_c", C_DECODE if in_c else None):
        offset = 0
        for cut in [*sorted(set(cuts)), len(stream)]:
            if cut > offset:
                got += decoder.feed(stream[offset:cut], start + offset)
                offset = cut
    envelopes = [(e.journal, e.begin, e.end, e.message) for e in got]
    errors = [(e.offset, e.end, e.reason, e.frame) for e in decoder.errors]
    return envelopes, errors


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                 max_size=3),
    max_leaves=8,
)
_lines = st.one_of(
    st.dictionaries(st.text(max_size=6), _values, max_size=4).map(orjson.dumps),
    _values.map(orjson.dumps),  # arrays, numbers, strings: not objects
    st.binary(max_size=12).map(lambda b: b.replace(b"\n", b" ")),  # mostly not JSON
    st.sampled_from([b"", b" ", b"{", b"{}", b" {} ", b'{"a":1}x', b"\xff{}", b"[]", b"null",
                     b'{"n": 123456789012345678901234567890}', b'{"a": 1, "a": 2}']),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_lines, max_size=12), st.data())
def test_c_and_python_decode_the_same(lines: list[bytes], data: st.DataObject) -> None:
    stream = b"".join(line + b"\n" for line in lines)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=6))
    # (offsets near and beyond a C long long are left to the Python loop)
    start = data.draw(st.sampled_from([0, 7, 2**40, 2**63 - 30, 2**63 - 1, 2**64]))
    in_python = _decode(stream, cuts, start, in_c=False)
    assert _decode(stream, cuts, start, in_c=True) == in_python
    if not any(in_python[1]):  # all good lines: every byte is in an envelope
        assert sum(end - begin for _, begin, end, _ in in_python[0]) == len(stream)


@needs_c
def test_envelopes_made_in_c_are_ordinary_envelopes() -> None:
    out: list[Envelope] = []
    index, begin = C_DECODE([b'{"a": 1}', b'{"b": [2]}'], 0, 10, JOURNAL, out, orjson.loads,
                            Envelope)
    assert (index, begin) == (2, 10 + 9 + 11)
    assert out == [Envelope(JOURNAL, 10, 19, {"a": 1}), Envelope(JOURNAL, 19, 30, {"b": [2]})]
    assert type(out[0]) is Envelope and type(out[0].begin) is int
    assert repr(out[1]) == repr(Envelope(JOURNAL, 19, 30, {"b": [2]}))
    assert pickle.loads(pickle.dumps(out[0])) == out[0]
    assert dataclasses.replace(out[0], end=20).end == 20
    out[0].message = None
    assert out[0].message is None


@needs_c
def test_the_c_decoder_stops_at_what_is_not_an_object() -> None:
    lines = [b"{}", b"[1]", b"{}", b"{oops", b"{}"]
    out: list[Envelope] = []
    assert C_DECODE(lines, 0, 0, JOURNAL, out, orjson.loads, Envelope) == (1, 3)
    assert C_DECODE(lines, 2, 7, JOURNAL, out, orjson.loads, Envelope) == (3, 10)
    assert C_DECODE(lines, 4, 16, JOURNAL, out, orjson.loads, Envelope) == (5, 19)
    assert C_DECODE(lines, 9, 0, JOURNAL, out, orjson.loads, Envelope) == (9, 0)
    assert [(e.begin, e.end) for e in out] == [(0, 3), (7, 10), (16, 19)]


@needs_c
def test_odd_calls_are_errors_not_crashes() -> None:
    out: list[Envelope] = []

    @dataclasses.dataclass
    class NoSlots:
        journal: str
        begin: int
        end: int
        message: Any

    @dataclasses.dataclass(slots=True)
    class Fewer:
        journal: str
        begin: int
        end: int

    for bad in ((b"{}",), [b"{}", "{}"], [bytearray(b"{}")]):
        with pytest.raises(TypeError):
            C_DECODE(bad, 0, 0, JOURNAL, out, orjson.loads, Envelope)
    out.clear()  # (the list's first line was taken before its second failed)

    class Borrowed:  # another class's slot under one of the four names
        __slots__ = ("begin", "end", "journal", "message")

    Borrowed.journal = Fewer.__dict__["journal"]

    class SameSlot:  # two names, one slot
        __slots__ = ("begin", "end", "journal", "message")

    SameSlot.end = SameSlot.__dict__["begin"]

    for kind in (NoSlots, Fewer, Borrowed, SameSlot, dict, list, int):
        with pytest.raises(TypeError, match="not a slotted"):
            C_DECODE([b"{}"], 0, 0, JOURNAL, out, orjson.loads, kind)
    with pytest.raises(ValueError):
        C_DECODE([b"{}"], -1, 0, JOURNAL, out, orjson.loads, Envelope)
    with pytest.raises(TypeError, match="must be a class"):
        C_DECODE([b"{}"], 0, 0, JOURNAL, out, orjson.loads, "Envelope")
    # An offset that is not an int, or beyond a C long long, is handed back untouched.
    for begin in ("0", 2**63, -1):
        assert C_DECODE([b"{}"], 0, begin, JOURNAL, out, orjson.loads, Envelope) == (0, begin)
    assert C_DECODE([b"{}"], 0, 2**63 - 3, JOURNAL, out, orjson.loads, Envelope) == (0, 2**63 - 3)
    assert out == []

    def raises(line: bytes) -> Any:
        raise KeyError(line)  # not a ValueError: not a bad line, an error

    with pytest.raises(KeyError):
        C_DECODE([b"{}"], 0, 0, JOURNAL, out, raises, Envelope)

    lines = [b"{}"] * 5

    def shrinking(line: bytes) -> Any:
        lines.pop()
        return {}

    assert C_DECODE(lines, 0, 0, JOURNAL, out, shrinking, Envelope) == (3, 9)
    out.clear()
    assert C_DECODE([b"{}"], 0, True, JOURNAL, out, orjson.loads, Envelope) == (1, 4)
    assert out[0].begin is True  # as the Python loop has it


@needs_c
def test_the_c_decoder_holds_no_references_it_should_not() -> None:
    journal = "".join(["refcount/", "journal"])  # a str of its own
    begin = 2**40 + 1  # an int of its own
    lines = [b'{"a": 1}'] * 100 + [b"[]"]
    before = sys.getrefcount(journal), sys.getrefcount(begin)
    for _ in range(50):
        out: list[Envelope] = []
        assert C_DECODE(lines, 0, begin, journal, out, orjson.loads, Envelope)[0] == 100
        del out

    def failing(line: bytes) -> Any:
        raise RuntimeError("no")

    for _ in range(50):
        with pytest.raises(RuntimeError):
            C_DECODE(lines, 0, begin, journal, [], failing, Envelope)
    assert (sys.getrefcount(journal), sys.getrefcount(begin)) == before


@needs_c
def test_envelopes_hold_one_reference_to_each_message_and_end() -> None:
    message: dict[str, Any] = {}
    out: list[Envelope] = []
    C_DECODE([b"x"] * 3, 0, 2**40, JOURNAL, out, lambda line: message, Envelope)
    assert sys.getrefcount(message) == 2 + 3
    assert [sys.getrefcount(e.end) for e in out] == [3, 3, 2]  # shared with the next begin
    assert gc.is_tracked(out[0])
