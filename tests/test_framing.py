"""Framings: round trips, exact offsets under any chunking, bad frames, the registry."""

from __future__ import annotations

import logging
import pickle
import random
import uuid as _uuid
from typing import Any

import orjson
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from hypothesis import given, settings
from hypothesis import strategies as st

from streamkit.message.framing import (
    MAX_ERRORS,
    FrameDecoder,
    FrameError,
    Framing,
    UnknownFraming,
    content_type_of,
    framing_for,
    register_framing,
    registered_content_types,
)
from streamkit.message.framings import CsvFraming, FixedFraming, JsonLinesFraming
from streamkit.message.framings.fixed import MAGIC
from streamkit.message.message import Envelope, Message
from streamkit.message.uuid import Flags, build_uuid, new_producer_id
from streamkit.protocol import pb

JSON, CSV, FIXED = "application/x-ndjson", "text/csv", "application/x-protobuf-fixed"
JOURNAL = "test/journal"


def _make_proto_class() -> type:
    """A protobuf message type {uuid: string, payload: string, n: int64}, built at runtime."""
    file = descriptor_pb2.FileDescriptorProto(name="framing_test.proto", package="framingtest")
    msg = file.message_type.add(name="Record")
    for number, (name, kind) in enumerate(
        [("uuid", "TYPE_STRING"), ("payload", "TYPE_STRING"), ("n", "TYPE_INT64")], start=1
    ):
        msg.field.add(
            name=name,
            number=number,
            type=getattr(descriptor_pb2.FieldDescriptorProto, kind),
            label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
        )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("framingtest.Record"))


Record = _make_proto_class()


class Event(Message):
    name: str
    count: int
    ok: bool = False
    note: str | None = None


PRODUCER = new_producer_id()


def _uuid_at(i: int, flags: int = Flags.OUTSIDE_TXN) -> _uuid.UUID:
    return build_uuid(PRODUCER, (1_000_000 + i) << 4, flags)


def _dicts(n: int) -> list[dict[str, Any]]:
    return [{"uuid": str(_uuid_at(i)), "name": f"item {i}", "n": i} for i in range(n)]


def _events(n: int) -> list[Event]:
    return [
        Event(uuid=_uuid_at(i), name=f'e,"{i}"\nline two' if i % 2 else f"e{i}", count=i)
        for i in range(n)
    ]


def _records(n: int) -> list[Any]:
    return [Record(uuid=str(_uuid_at(i)), payload="p" * i, n=i) for i in range(n)]


CASES = {
    "json-dict": (JSON, dict, _dicts),
    "json-model": (JSON, Event, _events),
    "json-proto": (JSON, Record, _records),
    "csv-model": (CSV, Event, _events),
    "fixed-proto": (FIXED, Record, _records),
}


def _encode_all(framing: Framing, messages: list[Any]) -> tuple[bytes, list[tuple[int, int]]]:
    """The stream of frames and each frame's [begin, end)."""
    out = bytearray()
    spans = []
    for message in messages:
        begin = len(out)
        framing.encode(message, out)
        spans.append((begin, len(out)))
    return bytes(out), spans


def _feed_split(decoder: FrameDecoder, data: bytes, cuts: list[int], base: int) -> list[Envelope]:
    got: list[Envelope] = []
    previous = 0
    for cut in [*sorted(cuts), len(data)]:
        got += decoder.feed(data[previous:cut], base + previous)
        previous = cut
    return got


def _comparable(message: Any) -> Any:
    if isinstance(message, Message):
        return message.model_dump()
    if isinstance(message, dict):
        return message
    return message.SerializeToString()


# --- round trips and chunking ----------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_round_trip_in_one_chunk(case: str) -> None:
    content_type, message_type, make = CASES[case]
    framing = framing_for(content_type)
    messages = make(20)
    data, spans = _encode_all(framing, messages)
    decoder = framing.new_decoder(JOURNAL, message_type)
    got = decoder.feed(data, 1000)
    assert [(e.begin - 1000, e.end - 1000) for e in got] == spans
    assert [_comparable(e.message) for e in got] == [_comparable(m) for m in messages]
    assert all(e.journal == JOURNAL for e in got)
    assert decoder.errors == []


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_split_point_and_byte_by_byte(case: str) -> None:
    content_type, message_type, make = CASES[case]
    framing = framing_for(content_type)
    messages = make(4)
    data, spans = _encode_all(framing, messages)
    expected = [_comparable(m) for m in messages]
    for cut in range(len(data) + 1):
        decoder = framing.new_decoder(JOURNAL, message_type)
        got = _feed_split(decoder, data, [cut], 7)
        assert [(e.begin - 7, e.end - 7) for e in got] == spans, cut
        assert [_comparable(e.message) for e in got] == expected
    decoder = framing.new_decoder(JOURNAL, message_type)
    got = _feed_split(decoder, data, list(range(len(data))), 0)
    assert [(e.begin, e.end) for e in got] == spans
    assert decoder.errors == []


@pytest.mark.parametrize("case", sorted(CASES))
def test_random_splits_and_memoryviews(case: str) -> None:
    content_type, message_type, make = CASES[case]
    framing = framing_for(content_type)
    messages = make(50)
    data, spans = _encode_all(framing, messages)
    rng = random.Random(case)
    for _ in range(30):
        cuts = rng.sample(range(len(data)), rng.randint(0, 40))
        decoder = framing.new_decoder(JOURNAL, message_type)
        got: list[Envelope] = []
        previous = 0
        view = memoryview(data)
        for cut in [*sorted(cuts), len(data)]:
            got += decoder.feed(view[previous:cut], previous)
            previous = cut
        assert [(e.begin, e.end) for e in got] == spans


@pytest.mark.parametrize("case", sorted(CASES))
def test_truncated_tail_stays_buffered(case: str) -> None:
    content_type, message_type, make = CASES[case]
    framing = framing_for(content_type)
    data, spans = _encode_all(framing, make(3))
    decoder = framing.new_decoder(JOURNAL, message_type)
    cut = spans[2][1] - 1  # all but the last byte of the last frame
    got = decoder.feed(data[:cut], 0)
    assert [(e.begin, e.end) for e in got] == spans[:2]
    assert decoder.feed(b"", cut) == []
    assert [(e.begin, e.end) for e in decoder.feed(data[cut:], cut)] == spans[2:]
    assert decoder.errors == []


def test_dict_uuid_objects_encode_as_strings() -> None:
    u = _uuid_at(1)
    out = bytearray()
    framing_for(JSON).encode({"uuid": u, "x": 1}, out)
    assert out == b'{"uuid":"' + str(u).encode() + b'","x":1}\n'


def test_json_model_uses_aliases() -> None:
    from pydantic import Field

    class Aliased(Message):
        ts: int = Field(alias="timestamp")

    out = bytearray()
    framing_for(JSON).encode(Aliased(uuid=_uuid_at(0), timestamp=5), out)
    assert b'"timestamp":5' in out
    (env,) = framing_for(JSON).new_decoder(JOURNAL, Aliased).feed(bytes(out), 0)
    assert env.message.ts == 5


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.dictionaries(
            st.text(min_size=1, max_size=8),
            st.one_of(st.integers(-(2**60), 2**60), st.text(max_size=20), st.booleans(), st.none()),
            max_size=5,
        ),
        min_size=1,
        max_size=8,
    ),
    st.data(),
)
def test_json_dicts_property(messages: list[dict[str, Any]], data: st.DataObject) -> None:
    framing = framing_for(JSON)
    stream, spans = _encode_all(framing, messages)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=10))
    got = _feed_split(framing.new_decoder(JOURNAL, dict), stream, cuts, 3)
    assert [e.message for e in got] == messages
    assert [(e.begin - 3, e.end - 3) for e in got] == spans


_cells = st.text(
    alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"), max_size=12
)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(_cells, max_size=4), min_size=1, max_size=6), st.data())
def test_csv_dicts_property(rows: list[list[str]], data: st.DataObject) -> None:
    framing = framing_for(CSV)
    messages = [
        {"uuid": str(_uuid_at(i)), **{f"c{j + 1}": v for j, v in enumerate(row)}}
        for i, row in enumerate(rows)
    ]
    stream, spans = _encode_all(framing, messages)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=10))
    decoder = framing.new_decoder(JOURNAL, dict)
    got = _feed_split(decoder, stream, cuts, 0)
    assert [e.message for e in got] == messages
    assert [(e.begin, e.end) for e in got] == spans
    assert decoder.errors == []


def test_csv_dict_encoding_puts_uuid_first() -> None:
    u = str(_uuid_at(0))
    out = bytearray()
    framing_for(CSV).encode({"a": "x", "uuid": u, "b": 2}, out)
    assert out == f"{u},x,2\r\n".encode()
    (env,) = framing_for(CSV).new_decoder(JOURNAL, dict).feed(bytes(out), 0)
    assert env.message == {"uuid": u, "c1": "x", "c2": "2"}


def test_csv_model_none_and_bool_cells() -> None:
    event = Event(uuid=_uuid_at(0), name="", count=-3, ok=True, note=None)
    out = bytearray()
    framing_for(CSV).encode(event, out)
    assert out.endswith(b",,-3,true,\r\n")
    (env,) = framing_for(CSV).new_decoder(JOURNAL, Event).feed(bytes(out), 0)
    assert env.message == event


# --- acknowledgements ------------------------------------------------------------


@pytest.mark.parametrize("content_type", [JSON, CSV])
def test_bare_model_acknowledgements_decode(content_type: str) -> None:
    """model_construct() ACKs lack required fields, yet readers must see them."""
    framing = framing_for(content_type)
    ack = Event.new_acknowledgement(JOURNAL)
    ack.uuid = _uuid_at(9, Flags.ACK_TXN)
    out = bytearray()
    framing.encode(ack, out)
    decoder = framing.new_decoder(JOURNAL, Event)
    (env,) = decoder.feed(bytes(out), 0)
    assert env.message.uuid == ack.uuid
    assert decoder.errors == []

    # The same shape without the ACK_TXN flag is just an invalid message.
    ack.uuid = _uuid_at(9, Flags.CONTINUE_TXN)
    out = bytearray()
    framing.encode(ack, out)
    assert decoder.feed(bytes(out), env.end) == []
    assert len(decoder.errors) == 1


# --- bad frames -------------------------------------------------------------------


def test_invalid_json_lines_are_reported_and_skipped(caplog: pytest.LogCaptureFixture) -> None:
    good = [orjson.dumps(m) + b"\n" for m in _dicts(3)]
    bad = [b"{not json\n", b"[1, 2]\n", b"\n", b'"str"\n']
    stream = good[0] + bad[0] + bad[1] + good[1] + bad[2] + bad[3] + good[2]
    decoder = framing_for(JSON).new_decoder(JOURNAL, dict)
    with caplog.at_level(logging.WARNING):
        got = decoder.feed(stream, 500)
    assert [e.message for e in got] == _dicts(3)
    bad_offsets = [
        500 + len(good[0]),
        500 + len(good[0] + bad[0]),
        500 + len(good[0] + bad[0] + bad[1] + good[1]),
        500 + len(good[0] + bad[0] + bad[1] + good[1] + bad[2]),
    ]
    assert [e.offset for e in decoder.errors] == bad_offsets
    assert all(e.journal == JOURNAL for e in decoder.errors)
    assert f"offset {bad_offsets[0]}" in str(decoder.errors[0])
    assert JOURNAL in caplog.text and str(bad_offsets[0]) in caplog.text
    assert got[1].begin == bad_offsets[1] + len(bad[1])


def test_invalid_model_json_is_reported() -> None:
    line = orjson.dumps({"uuid": str(_uuid_at(0)), "name": "x", "count": "many"}) + b"\n"
    decoder = framing_for(JSON).new_decoder(JOURNAL, Event)
    assert decoder.feed(line, 10) == []
    (error,) = decoder.errors
    assert error.offset == 10 and "count" in error.reason


def test_invalid_csv_records_are_reported_and_skipped() -> None:
    framing = framing_for(CSV)
    good, _ = _encode_all(framing, _events(2))
    first = good.split(b"\r\n", 1)[0] + b"\r\n"
    stream = (
        first
        + b"not-a-uuid,a,1,false,\r\n"  # bad UUID
        + str(_uuid_at(5)).encode()
        + b",a,1\r\n"  # wrong column count
        + b"\r\n"  # blank line: skipped silently
        + str(_uuid_at(6)).encode()
        + b",a,\xff\xfe,false,\r\n"  # invalid UTF-8
        + good[len(first) :]
    )
    decoder = framing.new_decoder(JOURNAL, Event)
    got = decoder.feed(stream, 0)
    assert [e.message for e in got] == _events(2)
    assert len(decoder.errors) == 3
    assert decoder.errors[0].offset == len(first)
    assert "UUID" in decoder.errors[0].reason or "uuid" in decoder.errors[0].reason
    assert "columns" in decoder.errors[1].reason
    assert "UTF-8" in decoder.errors[2].reason
    assert got[1].end == len(stream)

    dict_decoder = framing.new_decoder(JOURNAL, dict)
    dict_decoder.feed(b'oops,"x\ny"\r\n' + stream[: len(first)], 0)
    assert dict_decoder.errors[0].offset == 0
    assert "not a UUID" in dict_decoder.errors[0].reason


def test_csv_bare_quote_in_unquoted_field_ends_at_newline() -> None:
    """Like Python's csv reader, a quote inside an unquoted field is literal."""
    u = str(_uuid_at(0))
    stream = f'{u},a"b\n{u},"c""d",e"f\n'.encode()
    got = framing_for(CSV).new_decoder(JOURNAL, dict).feed(stream, 0)
    assert [e.message["c1"] for e in got] == ['a"b', 'c"d']


def _frame(payload: bytes) -> bytes:
    return MAGIC + len(payload).to_bytes(4, "little") + payload


def test_garbage_between_fixed_frames_resyncs() -> None:
    framing = framing_for(FIXED)
    records = _records(3)
    frames = [_frame(r.SerializeToString()) for r in records]
    garbage = b"\x00garbage\x66\x33 more"
    stream = frames[0] + garbage + frames[1] + b"\n" + frames[2]
    for cuts in ([], list(range(len(stream)))):
        decoder = framing.new_decoder(JOURNAL, Record)
        got = _feed_split(decoder, stream, cuts, 100)
        assert [e.message for e in got] == records
        assert [e.offset for e in decoder.errors] == [
            100 + len(frames[0]),
            100 + len(frames[0] + garbage + frames[1]),
        ]
        assert got[1].begin == 100 + len(frames[0] + garbage)


def test_oversize_and_unparseable_fixed_frames() -> None:
    framing = FixedFraming(max_frame_size=1000)
    records = _records(2)
    oversize = MAGIC + (5000).to_bytes(4, "little") + b"x" * 20
    unparseable = _frame(b"\xff\xff\xff")
    stream = oversize + _frame(records[0].SerializeToString()) + unparseable
    stream += _frame(records[1].SerializeToString())
    decoder = framing.new_decoder(JOURNAL, Record)
    got = decoder.feed(stream, 0)
    assert [e.message for e in got] == records
    assert [e.offset for e in decoder.errors] == [0, got[0].end]
    assert "oversize" in decoder.errors[0].reason
    assert "Record" in decoder.errors[1].reason
    with pytest.raises(ValueError, match="frame limit"):
        framing.encode(Record(payload="y" * 2000), bytearray())


def test_fixed_desync_with_no_magic_keeps_memory_bounded() -> None:
    decoder = framing_for(FIXED).new_decoder(JOURNAL, Record)
    for i in range(100):
        assert decoder.feed(b"z" * 10_000, i * 10_000) == []
    assert len(decoder._buf) <= 3  # type: ignore[attr-defined]
    assert len(decoder.errors) == 1  # one report per garbage run
    frame = _frame(_records(1)[0].SerializeToString())
    (env,) = decoder.feed(frame, 1_000_000)
    assert env.begin == 1_000_000


def test_errors_are_bounded() -> None:
    decoder = framing_for(JSON).new_decoder(JOURNAL, dict)
    decoder.feed(b"x\n" * (MAX_ERRORS + 50), 0)
    assert len(decoder.errors) == MAX_ERRORS
    assert decoder.errors[-1].offset == 2 * (MAX_ERRORS + 49)


def test_frame_error_pickles() -> None:
    error = FrameError(JOURNAL, 42, "bad")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.journal, copy.offset, copy.reason, str(copy)) == (
        JOURNAL,
        42,
        "bad",
        str(error),
    )
    assert isinstance(error, ValueError)


# --- reset and offset jumps -------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_reset_after_jump_discards_partial(case: str) -> None:
    content_type, message_type, make = CASES[case]
    framing = framing_for(content_type)
    data, spans = _encode_all(framing, make(3))
    decoder = framing.new_decoder(JOURNAL, message_type)
    half = spans[0][1] // 2
    assert decoder.feed(data[:half], 0) == []
    decoder.reset(5000)
    got = decoder.feed(data[spans[1][0] :], 5000)
    assert [(e.begin - 5000, e.end - 5000) for e in got] == [
        (b - spans[1][0], e - spans[1][0]) for b, e in spans[1:]
    ]
    assert decoder.errors == []


def test_unannounced_jump_drops_partial_and_reports() -> None:
    decoder = framing_for(JSON).new_decoder(JOURNAL, dict)
    assert decoder.feed(b'{"a":', 0) == []
    (env,) = decoder.feed(b'{"b":1}\n', 100)
    assert (env.begin, env.end, env.message) == (100, 108, {"b": 1})
    (error,) = decoder.errors
    assert error.offset == 0 and "dropped" in error.reason
    # With nothing buffered, a jump is silently accepted.
    (env,) = decoder.feed(b'{"c":1}\n', 900)
    assert env.begin == 900 and len(decoder.errors) == 1


# --- registry ---------------------------------------------------------------------


def test_registry_lookups() -> None:
    assert isinstance(framing_for(JSON), JsonLinesFraming)
    assert isinstance(framing_for(CSV), CsvFraming)
    assert isinstance(framing_for(FIXED), FixedFraming)
    assert framing_for("application/jsonl") is framing_for(JSON)
    assert framing_for("Text/CSV; charset=utf-8") is framing_for(CSV)
    assert {JSON, CSV, FIXED} <= set(registered_content_types())
    for framing in (framing_for(JSON), framing_for(CSV), framing_for(FIXED)):
        assert isinstance(framing, Framing)
        assert isinstance(
            framing.new_decoder(JOURNAL, Record if framing is framing_for(FIXED) else dict),
            FrameDecoder,
        )


def test_unknown_framing() -> None:
    with pytest.raises(UnknownFraming, match="application/x-gazette-recoverylog"):
        framing_for("application/x-gazette-recoverylog")
    with pytest.raises(UnknownFraming, match="''"):
        framing_for("")


def test_register_framing_replaces_and_aliases() -> None:
    class Upper(JsonLinesFraming):
        content_type = "application/x-test-upper"

    upper = Upper()
    register_framing(upper, "application/x-test-alias")
    assert framing_for("application/x-test-upper") is upper
    assert framing_for("application/x-test-alias") is upper
    replacement = Upper()
    register_framing(replacement)
    assert framing_for("application/x-test-upper") is replacement


def test_content_type_of() -> None:
    labels = pb.LabelSet(
        labels=[pb.Label(name="app", value="x"), pb.Label(name="content-type", value=CSV)]
    )
    assert content_type_of(labels) == CSV
    assert content_type_of(pb.LabelSet()) == ""


def test_wrong_message_kinds_are_type_errors() -> None:
    with pytest.raises(TypeError):
        framing_for(FIXED).encode({"uuid": "x"}, bytearray())
    with pytest.raises(TypeError):
        framing_for(FIXED).new_decoder(JOURNAL, dict)
    with pytest.raises(TypeError):
        framing_for(CSV).encode(Record(), bytearray())
    with pytest.raises(TypeError):
        framing_for(CSV).new_decoder(JOURNAL, Record)
    with pytest.raises(TypeError):
        framing_for(JSON).new_decoder(JOURNAL, list)
    with pytest.raises(TypeError):
        framing_for(JSON).encode([1, 2], bytearray())  # type: ignore[arg-type]
