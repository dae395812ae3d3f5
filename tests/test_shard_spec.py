"""Shard spec model: Gazette's validation rules, protobuf mapping and gazctl's shards YAML."""

from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamkit.protocol import consumer_pb
from streamkit.protocol.labels import label_set
from streamkit.protocol.problems import SpecError
from streamkit.protocol.shard_spec import (
    DEFAULT_RING_BUFFER_SIZE,
    ShardEntry,
    ShardSpecModel,
    dump_shard_specs,
    hint_prefix_problem,
    load_shard_entries,
    load_shard_specs,
    shard_id_problem,
    validate_shard_proto,
)

LOGGED = {"recovery_log_prefix": "recovery/wordcount", "hint_prefix": "/gazette/hints"}


def spec_error(**fields: Any) -> str:
    """The message of building shard "shard-000" from ``fields``."""
    with pytest.raises(SpecError) as caught:
        ShardSpecModel(**{"id": "shard-000", **fields})
    return str(caught.value)


def full_spec() -> ShardSpecModel:
    return ShardSpecModel(
        id="shard-003",
        sources=[
            {"journal": "lines/part-003", "min_offset": 1024},
            {"journal": "clicks/part-003"},
        ],
        hint_backups=2,
        max_txn_duration="2s",
        min_txn_duration="250ms",
        disable=True,
        hot_standbys=1,
        labels=[{"name": "app", "value": "wordcount"}, {"name": "stage", "value": "count"}],
        disable_wait_for_ack=True,
        ring_buffer_size=1024,
        read_channel_size=64,
        **LOGGED,
    )


# --- validation -------------------------------------------------------------------------


def test_defaults_and_accepted_shapes() -> None:
    spec = ShardSpecModel(id="shard-000")
    assert spec.max_txn_duration == timedelta(seconds=1)
    assert spec.min_txn_duration == timedelta(0)
    assert spec.ring_buffer_size == spec.read_channel_size == DEFAULT_RING_BUFFER_SIZE
    assert spec.recovery_log == ""
    # Durations: Go strings, or numbers of seconds.
    for given_, seconds in [("250ms", 0.25), ("1s", 1), ("2m", 120), ("1h", 3600), (3, 3)]:
        assert ShardSpecModel(id="shard-000", max_txn_duration=given_).max_txn_duration == (
            timedelta(seconds=seconds)
        )
    # Ids are tokens over the path alphabet, shorter or longer path shapes included.
    for shard_id in ["abcd", "a/b/c=d%20", "x" * 512, "shard_ä-1.2+3"]:
        assert shard_id_problem(shard_id) is None
    # Zero sizes are Gazette's "use the default".
    assert ShardSpecModel(id="shard-000", ring_buffer_size=0).ring_buffer_size == 8192
    # Many standbys are fine: the runtime, not the spec, caps them.
    assert ShardSpecModel(id="shard-000", hot_standbys=7).desired_replication(3) == 4


def test_sources_are_sorted_and_labels_canonical() -> None:
    spec = full_spec()
    assert [s.journal for s in spec.sources] == ["clicks/part-003", "lines/part-003"]
    labels = [{"name": "bb"}, {"name": "a1"}, {"name": "bb"}]
    again = ShardSpecModel(id="shard-000", labels=labels)
    assert [label.name for label in again.labels] == ["a1", "bb"]


def test_derived_names() -> None:
    spec = full_spec()
    assert spec.recovery_log == "recovery/wordcount/shard-003"
    assert spec.hint_primary_key == "/gazette/hints/shard-003.primary"
    assert spec.hint_backup_keys() == [
        "/gazette/hints/shard-003.backup.0",
        "/gazette/hints/shard-003.backup.1",
    ]
    assert spec.desired_replication() == 0  # disabled
    assert ShardSpecModel(id="shard-000", hot_standbys=2).desired_replication() == 3


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"id": "abc"}, 'shard "abc": id: must be 4 to 512 characters (got 3)'),
        ({"id": "shard 1"}, "id: may hold only letters, digits and -_+/.=% (got 'shard 1')"),
        ({"id": "sh#rd"}, "id: may hold only"),
        (
            {"sources": [{"journal": "/lines/part-000"}]},
            'shard "shard-000": sources[0].journal: must be a relative path',
        ),
        (
            {"sources": [{"journal": "lines/part-000", "min_offset": -1}]},
            "sources[0].min_offset: must not be negative (got -1)",
        ),
        (
            {"sources": [{"journal": "lines/part-001"}, {"journal": "lines/part-001"}]},
            "sources[1].journal: journal 'lines/part-001' is listed more than once",
        ),
        ({"sources": [{"min_offset": 3}]}, "sources[0].journal: is required"),
        (
            {"recovery_log_prefix": "recovery/", "hint_prefix": "/hints"},
            "recovery_log_prefix: makes an invalid recovery log 'recovery//shard-000'",
        ),
        ({"recovery_log_prefix": "recovery"}, "hint_prefix: is required when recovery_log_prefix"),
        ({"hint_prefix": "/hints"}, "hint_prefix: must be empty when recovery_log_prefix is empty"),
        (
            {"recovery_log_prefix": "recovery", "hint_prefix": "hints"},
            "hint_prefix: must start with '/' and not end with '/' (got 'hints')",
        ),
        ({"recovery_log_prefix": "recovery", "hint_prefix": "/hints/"}, "hint_prefix: must start"),
        (
            {"recovery_log_prefix": "recovery", "hint_prefix": "/a//b"},
            "hint_prefix: must be a clean path",
        ),
        ({"hint_backups": -1}, "hint_backups: must be between 0 and 2147483647 (got -1)"),
        ({"max_txn_duration": "0s"}, "max_txn_duration: must be greater than 0s (got 0s)"),
        ({"max_txn_duration": "-1s"}, "max_txn_duration: must be greater than 0s (got -1s)"),
        ({"max_txn_duration": "soon"}, "max_txn_duration: not a duration"),
        ({"min_txn_duration": "-5ms"}, "min_txn_duration: must not be negative (got -5ms)"),
        (
            {"min_txn_duration": "2s", "max_txn_duration": "1s"},
            "min_txn_duration: must not exceed max_txn_duration (2s > 1s)",
        ),
        ({"hot_standbys": -1}, "hot_standbys: must be between 0 and 4294967295 (got -1)"),
        ({"labels": [{"name": "id", "value": "x"}]}, 'labels[0]: "id" is reserved'),
        ({"labels": [{"name": "a b"}]}, "labels[0].name: label name may hold only"),
        ({"ring_buffer_size": 2**32}, "ring_buffer_size: must be between 0 and 4294967295"),
        ({"read_channel_size": -2}, "read_channel_size: must be between 0 and 4294967295"),
        ({"disable": "maybe"}, "disable: input should be a valid boolean"),
        ({"replication": 3}, 'shard "shard-000": replication: unknown field'),
    ],
)
def test_each_rule_names_shard_and_field(fields: dict[str, Any], expected: str) -> None:
    message = spec_error(**fields)
    if expected.startswith("shard "):
        assert message.startswith(expected)
    else:
        assert message.startswith('shard "'), message
        assert expected in message


def test_every_problem_gets_a_line_and_assignment_is_checked() -> None:
    lines = spec_error(hot_standbys=-1, hint_backups=-1, bogus=1).splitlines()
    assert len(lines) == 3
    assert all(line.startswith('shard "shard-000": ') for line in lines)
    spec = ShardSpecModel(id="shard-000")
    with pytest.raises(SpecError, match=r'shard "shard-000": max_txn_duration: must be greater'):
        spec.max_txn_duration = 0


def test_hint_prefix_problem_alone() -> None:
    assert hint_prefix_problem("/gazette/consumers/app/hints") is None
    assert hint_prefix_problem("/") is not None
    assert "clean" in (hint_prefix_problem("/a/./b") or "")


# --- protobuf ---------------------------------------------------------------------------


def test_proto_round_trip_maps_every_field() -> None:
    spec = full_spec()
    wire = spec.to_proto()
    assert isinstance(wire, consumer_pb.ShardSpec)
    assert wire.id == "shard-003"
    assert [(s.journal, s.min_offset) for s in wire.sources] == [
        ("clicks/part-003", 0),
        ("lines/part-003", 1024),
    ]
    assert (wire.recovery_log_prefix, wire.hint_prefix) == ("recovery/wordcount", "/gazette/hints")
    assert wire.hint_backups == 2
    assert wire.max_txn_duration.seconds == 2
    assert wire.min_txn_duration.nanos == 250_000_000
    assert (wire.disable, wire.disable_wait_for_ack, wire.hot_standbys) == (True, True, 1)
    assert wire.labels == label_set(("app", "wordcount"), ("stage", "count"))
    assert (wire.ring_buffer_size, wire.read_channel_size) == (1024, 64)
    # Every field of the message was set, so none was forgotten.
    assert {f.name for f, _ in wire.ListFields()} == {
        f.name for f in consumer_pb.ShardSpec.DESCRIPTOR.fields
    }
    decoded = consumer_pb.ShardSpec.FromString(wire.SerializeToString())
    assert ShardSpecModel.from_proto(decoded) == spec


def test_from_proto_validates_the_wire_values() -> None:
    wire = consumer_pb.ShardSpec(id="shard-000")  # no max_txn_duration: invalid in Gazette too
    with pytest.raises(SpecError, match="max_txn_duration: must be greater than 0s"):
        ShardSpecModel.from_proto(wire)
    wire.max_txn_duration.FromTimedelta(timedelta(seconds=1))
    spec = ShardSpecModel.from_proto(wire)
    assert spec.ring_buffer_size == 8192  # zero on the wire means the default


def test_validate_shard_proto_wants_canonical_order() -> None:
    wire = full_spec().to_proto()
    validate_shard_proto(wire)
    wire.sources[0].journal, wire.sources[1].journal = "zeta/part-0", "alpha/part-0"
    with pytest.raises(SpecError, match=r'shard "shard-003": sources: must be in unique, sorted'):
        validate_shard_proto(wire)
    wire = full_spec().to_proto()
    wire.labels.labels.reverse()
    with pytest.raises(SpecError, match=r'shard "shard-003": labels: must be sorted'):
        validate_shard_proto(wire)


# --- YAML -------------------------------------------------------------------------------

FILE = """
common:
  recovery_log_prefix: recovery/wordcount
  hint_prefix: /gazette/consumers/wordcount/hints
  max_txn_duration: 2s
  hot_standbys: 1
  labels:
    - {name: app, value: wordcount}
    - {name: tier, value: gold}
shards:
  - id: shard-000
    sources: [{journal: lines/part-000}]
  - id: shard-001
    sources: [{journal: lines/part-001, min_offset: 512}]
    hot_standbys: 0
    labels: [{name: tier, value: silver}, {name: zone, value: b}]
    revision: 42
    comment: moved to silver
  - id: shard-002
    delete: true
    revision: -1
"""


def test_common_settings_merge_into_shards() -> None:
    entries = load_shard_entries(FILE, "shards.yaml")
    assert [e.spec.id for e in entries] == ["shard-000", "shard-001", "shard-002"]
    first, second, third = entries
    assert first.spec.recovery_log == "recovery/wordcount/shard-000"
    assert first.spec.max_txn_duration == timedelta(seconds=2)
    assert first.spec.hot_standbys == 1
    assert [(lbl.name, lbl.value) for lbl in first.spec.labels] == [
        ("app", "wordcount"),
        ("tier", "gold"),
    ]
    assert (first.revision, first.delete) == (0, False)
    # The shard's own settings win; its labels replace common labels of the same name.
    assert second.spec.hot_standbys == 0
    assert second.spec.sources[0].min_offset == 512
    assert [(lbl.name, lbl.value) for lbl in second.spec.labels] == [
        ("app", "wordcount"),
        ("tier", "silver"),
        ("zone", "b"),
    ]
    assert (second.revision, second.comment) == (42, "moved to silver")
    assert (third.revision, third.delete) == (-1, True)
    # load_shard_specs: the shards that should exist.
    assert [s.id for s in load_shard_specs(FILE, "shards.yaml")] == ["shard-000", "shard-001"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "shards: [{id: shard-000, hot_standbys: -2}]",
            'f.yaml: shard "shard-000": hot_standbys: must be between 0 and 4294967295 (got -2)',
        ),
        (
            "shards: [{id: shard-000, recovery_log_prefix: rec}]",
            'f.yaml: shard "shard-000": hint_prefix: is required when recovery_log_prefix is set',
        ),
        ("shards: [{sources: []}]", "f.yaml: shards[0].id: is required"),
        ("shards: [{id: 7}]", "f.yaml: shards[0].id: must be a string"),
        ("shards: [oops]", "f.yaml: shards[0]: each shard must be a mapping (got 'oops')"),
        ("shards: {id: x}", "f.yaml: shards: must be a list of shards"),
        ("shards: [{id: shard-000, bogus: 1}]", 'f.yaml: shard "shard-000": bogus: unknown field'),
        (
            "shards: [{id: shard-000, revision: later}]",
            "f.yaml: shard \"shard-000\": revision: must be an integer (got 'later')",
        ),
        (
            "shards: [{id: shard-000, delete: 1}]",
            'f.yaml: shard "shard-000": delete: must be true or false (got 1)',
        ),
        (
            "shards: [{id: shard-000}, {id: shard-000}]",
            'f.yaml: shard "shard-000": id: shard appears more than once',
        ),
        ("common: {id: shard-000}", "f.yaml: common.id: belongs to a shard, not to common"),
        ("common: {replication: 3}", "f.yaml: common.replication: unknown field"),
        ("journals: []", "f.yaml: journals: unknown field (expected `common` and `shards`)"),
        ("- id: shard-000", "f.yaml: a shard file is a mapping with `common` and `shards` keys"),
        ("shards: [id: {]", "f.yaml: invalid YAML: line 1"),
        (
            "common: {hot_standbys: 1}\nshards:\n- id: shard-000\n  hot_standbys: 2\n"
            "  hot_standbys: 0",
            "f.yaml: invalid YAML: line 5, column 3: key 'hot_standbys' given twice "
            "(first on line 4)",
        ),
    ],
)
def test_file_errors_name_source_shard_and_field(text: str, expected: str) -> None:
    with pytest.raises(SpecError) as caught:
        load_shard_entries(text, "f.yaml")
    assert str(caught.value).startswith(expected), str(caught.value)


def test_a_bad_common_setting_is_reported_once_on_common() -> None:
    text = "common: {max_txn_duration: 0s}\nshards: [{id: shard-000}, {id: shard-001}]"
    with pytest.raises(SpecError) as caught:
        load_shard_entries(text, "f.yaml")
    assert str(caught.value) == "f.yaml: common.max_txn_duration: must be greater than 0s (got 0s)"
    # A shard overriding it is fine.
    fixed = text.replace("{id: shard-001}", "{id: shard-001, max_txn_duration: 1s}")
    with pytest.raises(SpecError) as caught:
        load_shard_entries(fixed, "f.yaml")
    assert len(caught.value.problems) == 1


def test_all_problems_of_a_file_are_reported_together() -> None:
    text = "shards: [{id: ab}, {id: shard-001, hint_backups: -1}, {nope: 1}]"
    with pytest.raises(SpecError) as caught:
        load_shard_entries(text, "f.yaml")
    assert [str(p) for p in caught.value.problems] == [
        'f.yaml: shard "ab": id: must be 4 to 512 characters (got 2)',
        'f.yaml: shard "shard-001": hint_backups: must be between 0 and 2147483647 (got -1)',
        "f.yaml: shards[2].id: is required",
    ]


def test_empty_files() -> None:
    assert load_shard_entries("") == []
    assert load_shard_entries("common: {hot_standbys: 1}") == []
    assert dump_shard_specs([]) == ""


def test_dump_hoists_common_settings_and_round_trips() -> None:
    entries = load_shard_entries(FILE, "shards.yaml")
    text = dump_shard_specs(entries)
    assert load_shard_entries(text) == sorted(entries, key=lambda e: e.spec.id)
    assert text.startswith("common:\n")
    assert "hint_prefix: /gazette/consumers/wordcount/hints" in text
    assert "max_txn_duration: 2s" in text
    # Defaults are left out, shared settings appear once.
    assert "ring_buffer_size" not in text
    assert text.count("recovery_log_prefix") == 1
    assert "delete: true" in text and "revision: 42" in text


def test_dump_of_one_shard_keeps_settings_on_it() -> None:
    text = dump_shard_specs([full_spec()])
    assert not text.startswith("common")
    assert load_shard_specs(text) == [full_spec()]
    with pytest.raises(SpecError, match='shard "shard-003": id: shard appears more than once'):
        dump_shard_specs([full_spec(), full_spec()])


_ids = st.integers(0, 40).map(lambda n: f"shard-{n:03d}")
_shards = st.builds(
    lambda shard_id, standbys, backups, logged, txn_ms, labels, parts: ShardEntry(
        ShardSpecModel(
            id=shard_id,
            hot_standbys=standbys,
            hint_backups=backups,
            max_txn_duration=timedelta(milliseconds=txn_ms),
            labels=[{"name": name, "value": value} for name, value in labels],
            sources=[{"journal": f"lines/part-{p:03d}", "min_offset": p * 10} for p in parts],
            **(LOGGED if logged else {}),
        )
    ),
    _ids,
    st.integers(0, 2),
    st.integers(0, 2),
    st.booleans(),
    st.sampled_from([250, 1000, 2000]),
    st.lists(st.tuples(st.sampled_from(["app", "tier"]), st.sampled_from(["a", "b", ""]))),
    st.sets(st.integers(0, 3), max_size=2),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_shards, max_size=5, unique_by=lambda e: e.spec.id))
def test_dump_load_round_trip_property(entries: list[ShardEntry]) -> None:
    assert load_shard_entries(dump_shard_specs(entries)) == sorted(entries, key=lambda e: e.spec.id)


def test_a_revision_beyond_64_bits_is_named() -> None:
    """(It reached protobuf, whose "Value out of range" came out as an unexpected error.)"""
    text = "shards:\n- id: shard-000\n  revision: 9223372036854775808\n"
    with pytest.raises(SpecError, match=r"revision: must be a 64-bit integer"):
        load_shard_entries(text, "f.yaml")
    text = ("shards:\n- id: shard-000\n  sources:\n  - {journal: a/b, min_offset: "
            "9223372036854775808}\n")
    with pytest.raises(SpecError, match=r"min_offset"):
        load_shard_entries(text, "f.yaml")
