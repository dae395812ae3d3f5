"""Journal spec models: validation messages, protobuf mapping, durations and YAML files."""

import re
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streamkit.protocol import pb
from streamkit.protocol.durations import format_duration, parse_duration
from streamkit.protocol.labels import label_set
from streamkit.protocol.problems import SpecError
from streamkit.protocol.spec import (
    MIN_FLUSH_INTERVAL,
    FragmentSpec,
    JournalSpec,
    journal_name_problem,
    validate_proto,
)
from streamkit.protocol.spec_tree import SpecEntry, dump_specs, load_specs


def spec_error(**fields: Any) -> str:
    """The message of building a JournalSpec named "a/b/c" from ``fields``."""
    with pytest.raises(SpecError) as caught:
        JournalSpec(**{"name": "a/b/c", **fields})
    return str(caught.value)


# --- durations ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "seconds", "spelled"),
    [
        ("1m0s", 60, "1m0s"),
        ("30s", 30, "30s"),
        ("24h", 86400, "24h0m0s"),
        ("1h30m", 5400, "1h30m0s"),
        ("500ms", 0.5, "500ms"),
        ("1.5s", 1.5, "1.5s"),
        ("1h0m0.25s", 3600.25, "1h0m0.25s"),
        ("250us", 0.00025, "250µs"),
        ("0", 0, "0s"),
        ("5", 5, "5s"),  # A bare number is seconds, as a YAML number is.
        (90, 90, "1m30s"),
        (2.5, 2.5, "2.5s"),
        ("-5m", -300, "-5m0s"),
    ],
)
def test_go_durations(given: Any, seconds: float, spelled: str) -> None:
    delta = parse_duration(given)
    assert delta == timedelta(seconds=seconds)
    assert format_duration(delta) == spelled
    assert parse_duration(spelled) == delta


@pytest.mark.parametrize("bad", ["", "1x", "m", "1h 2m", "1.2.3s", True, None, [1]])
def test_bad_durations(bad: Any) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(bad)


@given(st.integers(min_value=-(10**15), max_value=10**15))
def test_durations_round_trip(micros: int) -> None:
    delta = timedelta(microseconds=micros)
    assert parse_duration(format_duration(delta)) == delta


# --- defaults and validation -------------------------------------------------------------


def test_defaults_suit_one_machine() -> None:
    spec = JournalSpec(name="a/b/c")
    assert spec.replication == 1
    assert spec.fragment == FragmentSpec(
        length=1 << 29,
        compression_codec="SNAPPY",
        stores=["file:///"],
        refresh_interval=timedelta(minutes=5),
        retention=timedelta(0),
        flush_interval=timedelta(0),
    )
    assert (spec.flags, spec.max_append_rate, spec.labels) == (0, 0, [])


def test_accepts_every_legal_shape() -> None:
    spec = JournalSpec(
        name="logs/clicks/part=00_1.x+y%20",
        replication=5,
        labels=[
            {"name": "zz", "value": "b"},
            {"name": "app", "value": "wc"},
            {"name": "zz", "value": "a"},
            {"name": "app", "value": "wc"},
            {"name": "content-type", "value": "text/csv;charset=utf-8"},
        ],
        fragment={
            "length": 1 << 34,
            "compression_codec": "gzip_offload_decompression",
            "stores": [
                "s3://bucket/pre/fix/?endpoint=http%3A%2F%2Flocalhost%3A9000&region=x",
                "file:///",
            ],
            "refresh_interval": "24h",
            "retention": "720h",
            "flush_interval": "1m",
            "path_postfix_template": 'date={{ .Spool.FirstAppendTime.Format "2006-01-02" }}',
        },
        flags="O_RDONLY",
        max_append_rate=1 << 20,
    )
    assert [(lbl.name, lbl.value) for lbl in spec.labels] == [
        ("app", "wc"),
        ("content-type", "text/csv;charset=utf-8"),
        ("zz", "a"),
        ("zz", "b"),
    ]
    assert spec.fragment.compression_codec == "GZIP_OFFLOAD_DECOMPRESSION"
    assert spec.flags == pb.JournalSpec.O_RDONLY
    assert JournalSpec(name="abcd", flags=4).flags == pb.JournalSpec.O_RDWR


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"name": "abc"}, 'journal "abc": name: must be 4 to 512 characters (got 3)'),
        ({"name": "a" * 513}, "name: must be 4 to 512 characters (got 513)"),
        ({"name": "/a/b/c"}, "name: must be a relative path"),
        ({"name": "a/b/c/"}, "name: must be a relative path"),
        ({"name": "a//b/c"}, "name: must be a relative path"),
        ({"name": "a/./b"}, "name: must not contain '.' or '..' segments"),
        ({"name": "a/../b"}, "name: must not contain '.' or '..' segments"),
        ({"name": "a b/c"}, "name: may hold only letters, digits and -_+/.=%"),
        ({"replication": 0}, 'journal "a/b/c": replication: must be between 1 and 5 (got 0)'),
        ({"replication": 6}, "replication: must be between 1 and 5 (got 6)"),
        ({"replication": "x"}, "replication: input should be a valid integer"),
        ({"labels": [{"name": "a", "value": "x"}]}, "labels[0].name: label name must be 2 to 64"),
        ({"labels": [{"name": "a b", "value": "x"}]}, "labels[0].name: label name may hold only"),
        (
            {"labels": [{"name": "app", "value": "x" * 513}]},
            "labels[0].value: label value must be at most 512",
        ),
        (
            {"labels": [{"name": "app", "value": "a,b"}]},
            "labels[0].value: label value may hold only",
        ),
        (
            {"labels": [{"name": "name", "value": "x"}]},
            'labels[0].name: "name" is a reserved meta-label',
        ),
        (
            {"labels": [{"name": "app"}, {"name": "prefix", "value": "x/"}]},
            'labels[1].name: "prefix" is a reserved',
        ),
        (
            {"labels": [{"name": "content-type", "value": "json"}]},
            "labels[0].value: content-type must be a MIME type",
        ),
        ({"labels": [{"value": "x"}]}, "labels[0].name: is required"),
        (
            {"labels": [{"name": "content-type", "value": v} for v in ("a/b", "a/c")]},
            "labels[1].value: content-type may have only one value",
        ),
        (
            {"fragment": {"length": 10}},
            'journal "a/b/c": fragment.length: must be between 1024 and 17179869184 (got 10)',
        ),
        (
            {"fragment": {"length": (1 << 34) + 1}},
            "fragment.length: must be between 1024 and 17179869184",
        ),
        (
            {"fragment": {"compression_codec": "LZ4"}},
            "fragment.compression_codec: must be one of NONE, GZIP, ZSTANDARD, SNAPPY, "
            "GZIP_OFFLOAD_DECOMPRESSION (got 'LZ4')",
        ),
        ({"fragment": {"compression_codec": 0}}, "fragment.compression_codec: must be one of"),
        (
            {"fragment": {"stores": ["http://host/x/"]}},
            "fragment.stores[0]: scheme must be one of azure, file, gs, s3",
        ),
        (
            {"fragment": {"stores": ["file:///", "s3://bucket"]}},
            "fragment.stores[1]: path must end in '/'",
        ),
        ({"fragment": {"stores": ["s3:///prefix/"]}}, "fragment.stores[0]: must name a bucket"),
        (
            {"fragment": {"stores": ["file://host/x/"]}},
            "fragment.stores[0]: a file store is written",
        ),
        ({"fragment": {"stores": ["file:///data"]}}, "fragment.stores[0]: path must end in '/'"),
        (
            {"fragment": {"refresh_interval": "500ms"}},
            "fragment.refresh_interval: must be between 1s and 24h0m0s (got 500ms)",
        ),
        (
            {"fragment": {"refresh_interval": "25h"}},
            "fragment.refresh_interval: must be between 1s and 24h0m0s (got 25h0m0s)",
        ),
        ({"fragment": {"refresh_interval": "soon"}}, "fragment.refresh_interval: not a duration"),
        ({"fragment": {"retention": "-1s"}}, "fragment.retention: must not be negative (got -1s)"),
        (
            {"fragment": {"flush_interval": "59s"}},
            "fragment.flush_interval: must be 0 or at least 1m0s (got 59s)",
        ),
        (
            {"fragment": {"path_postfix_template": "{{ .Spool"}},
            "fragment.path_postfix_template: unbalanced",
        ),
        (
            {"fragment": {"compression_codec": "GZIP_OFFLOAD_DECOMPRESSION"}},
            "fragment.compression_codec: GZIP_OFFLOAD_DECOMPRESSION needs an object store",
        ),
        ({"fragment": {"size": 1}}, "fragment.size: unknown field"),
        (
            {"flags": 3},
            "flags: must be one of NOT_SPECIFIED, O_RDONLY, O_WRONLY, O_RDWR or 0, 1, 2, 4 (got 3)",
        ),
        ({"flags": "RDONLY"}, "flags: must be one of"),
        ({"max_append_rate": -1}, "max_append_rate: must not be negative (got -1)"),
        ({"colour": "red"}, 'journal "a/b/c": colour: unknown field'),
    ],
)
def test_each_rule_names_its_field(fields: dict[str, Any], expected: str) -> None:
    assert expected in spec_error(**fields)


def test_every_problem_gets_its_own_line() -> None:
    lines = spec_error(replication=9, fragment={"length": 1, "retention": "-1s"}).splitlines()
    assert lines == [
        'journal "a/b/c": replication: must be between 1 and 5 (got 9)',
        'journal "a/b/c": fragment.length: must be between 1024 and 17179869184 (got 1)',
        'journal "a/b/c": fragment.retention: must not be negative (got -1s)',
    ]


def test_assignment_is_validated_too() -> None:
    spec = JournalSpec(name="a/b/c")
    with pytest.raises(SpecError, match=r'journal "a/b/c": replication: must be between'):
        spec.replication = 0
    with pytest.raises(SpecError, match=r"^length: must be between"):
        FragmentSpec(length=1)


def test_flush_interval_floor_is_exposed() -> None:
    assert timedelta(minutes=1) == MIN_FLUSH_INTERVAL
    JournalSpec(name="a/b/c", fragment={"flush_interval": MIN_FLUSH_INTERVAL})
    JournalSpec(name="a/b/c", fragment={"flush_interval": 0})


def test_journal_name_problem_is_usable_alone() -> None:
    assert journal_name_problem("logs/part-000") is None
    assert "relative path" in journal_name_problem("logs/")


# --- protobuf mapping --------------------------------------------------------------------


def full_spec() -> JournalSpec:
    return JournalSpec(
        name="logs/clicks/part-000",
        replication=3,
        labels=[{"name": "app", "value": "wc"}, {"name": "content-type", "value": "text/csv"}],
        fragment={
            "length": 1 << 20,
            "compression_codec": "ZSTANDARD",
            "stores": ["gs://bucket/fragments/", "file:///"],
            "refresh_interval": "30s",
            "retention": "1h30m",
            "flush_interval": "6h",
            "path_postfix_template": "p={{ .Spool.Begin }}",
        },
        flags="O_WRONLY",
        max_append_rate=4096,
    )


def test_to_proto_maps_every_field() -> None:
    wire = full_spec().to_proto()
    assert wire.name == "logs/clicks/part-000"
    assert wire.replication == 3
    assert wire.labels == label_set(("app", "wc"), ("content-type", "text/csv"))
    assert wire.fragment.length == 1 << 20
    assert wire.fragment.compression_codec == pb.ZSTANDARD
    assert list(wire.fragment.stores) == ["gs://bucket/fragments/", "file:///"]
    assert wire.fragment.refresh_interval.ToTimedelta() == timedelta(seconds=30)
    assert wire.fragment.retention.ToTimedelta() == timedelta(hours=1, minutes=30)
    assert wire.fragment.flush_interval.ToTimedelta() == timedelta(hours=6)
    assert wire.fragment.path_postfix_template == "p={{ .Spool.Begin }}"
    assert wire.flags == pb.JournalSpec.O_WRONLY
    assert wire.max_append_rate == 4096


def test_from_proto_inverts_to_proto_and_validates() -> None:
    spec = full_spec()
    assert JournalSpec.from_proto(spec.to_proto()) == spec
    validate_proto(spec.to_proto())
    with pytest.raises(SpecError, match=r'journal "abcd": replication: must be between 1 and 5'):
        validate_proto(pb.JournalSpec(name="abcd"))  # Zero values are not defaults.


def test_validate_proto_wants_canonical_labels() -> None:
    wire = full_spec().to_proto()
    wire.labels.labels.reverse()
    with pytest.raises(SpecError, match=r"labels: must be sorted by \(name, value\)"):
        validate_proto(wire)
    assert JournalSpec.from_proto(wire) == full_spec()  # from_proto sorts instead.
    wire = full_spec().to_proto()
    wire.labels.labels[0].prefix = True
    with pytest.raises(SpecError, match="prefix matching is for selectors"):
        validate_proto(wire)
    wire = full_spec().to_proto()
    wire.fragment.compression_codec = pb.INVALID
    with pytest.raises(SpecError, match=r"fragment.compression_codec: must be one of .*'INVALID'"):
        validate_proto(wire)


# --- YAML files --------------------------------------------------------------------------

TREE = """
name: examples/
labels:
- {name: app, value: wordcount}
- {name: content-type, value: application/x-ndjson}
fragment:
  length: 1048576
  stores: ["s3://bucket/data/?region=eu-west-1"]
  refresh_interval: 30s
children:
- name: examples/wordcount/
  labels: [{name: app, value: wc2}, {name: stage, value: count}]
  fragment: {compression_codec: ZSTANDARD, flush_interval: 1h}
  children:
  - name: examples/wordcount/lines
    revision: 4
  - name: examples/wordcount/counts
    replication: 2
    fragment: {retention: 0}
- name: examples/old/
  delete: true
  revision: -1
  children:
  - {name: examples/old/one}
  - {name: examples/old/two, revision: 7, delete: false}
- name: examples/plain
"""


def by_name(entries: list[SpecEntry]) -> dict[str, SpecEntry]:
    return {entry.spec.name: entry for entry in entries}


def test_children_inherit_and_override() -> None:
    entries = by_name(load_specs(TREE, "journals.yaml"))
    lines = entries["examples/wordcount/lines"].spec
    assert [(lbl.name, lbl.value) for lbl in lines.labels] == [
        ("app", "wc2"),  # The directory's label replaced the root's.
        ("content-type", "application/x-ndjson"),
        ("stage", "count"),
    ]
    assert lines.fragment.length == 1 << 20
    assert lines.fragment.stores == ["s3://bucket/data/?region=eu-west-1"]
    assert lines.fragment.refresh_interval == timedelta(seconds=30)
    assert lines.fragment.compression_codec == "ZSTANDARD"
    assert lines.fragment.flush_interval == timedelta(hours=1)
    assert lines.replication == 1  # Default, not set anywhere.
    counts = entries["examples/wordcount/counts"].spec
    assert counts.replication == 2
    assert counts.fragment.compression_codec == "ZSTANDARD"
    plain = entries["examples/plain"].spec
    assert plain.fragment.compression_codec == "SNAPPY"
    assert [lbl.value for lbl in plain.labels] == ["wordcount", "application/x-ndjson"]


def test_revision_and_delete_entries() -> None:
    entries = by_name(load_specs(TREE))
    got = {name: (entry.revision, entry.delete) for name, entry in entries.items()}
    assert got == {
        "examples/wordcount/lines": (4, False),
        "examples/wordcount/counts": (0, False),
        "examples/old/one": (-1, True),  # Both inherited from the directory.
        "examples/old/two": (7, False),
        "examples/plain": (0, False),
    }


def test_file_order_is_kept_and_plain_forms_load() -> None:
    names = [entry.spec.name for entry in load_specs(TREE)]
    assert names[:2] == ["examples/wordcount/lines", "examples/wordcount/counts"]
    assert load_specs("") == []
    assert load_specs("[{name: abcd}, {name: efgh}]")[1].spec.name == "efgh"
    assert load_specs("name: abcd\nreplication: 2")[0].spec.replication == 2


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("name: [", "f.yaml: invalid YAML: line 1, column 8"),
        (
            "name: ex/abcd\nreplication: 3\nreplication: 1",
            "f.yaml: invalid YAML: line 3, column 1: key 'replication' given twice "
            "(first on line 2)",
        ),
        (
            "name: ex/\nchildren:\n- name: ex/abcd\n  fragment: {length: 4096, length: 1024}",
            "f.yaml: invalid YAML: line 4, column 28: key 'length' given twice "
            "(first on line 4)",
        ),
        (
            "name: ex/\nchildren:\n- name: other/abcd",
            'f.yaml: journal "other/abcd": name: must start with its parent\'s name "ex/"',
        ),
        (
            "name: ex/",
            'f.yaml: directory "ex/": children: a directory node needs a list of children',
        ),
        (
            "name: ex/abc\nchildren: [{name: ex/abc/d}]",
            'f.yaml: journal "ex/abc": children: only directories',
        ),
        (
            "name: ex/\nrevision: 3\nchildren: [{name: ex/abcd}]",
            'f.yaml: directory "ex/": revision: a directory may only carry revision -1',
        ),
        ("name: ex/abcd\nrevision: soon", 'journal "ex/abcd": revision: must be an integer'),
        ("name: ex/abcd\ndelete: 1", 'journal "ex/abcd": delete: must be true or false'),
        ("name: ex/abcd\ncolour: red", 'f.yaml: journal "ex/abcd": colour: unknown field'),
        (
            "name: ex/\nchildren: [5]",
            'f.yaml: directory "ex/": children: each node must be a mapping',
        ),
        (
            "- {name: abcd}\n- {name: abcd}",
            'f.yaml: journal "abcd": name: journal appears more than once',
        ),
        (
            "name: ex/\nfragment: {length: 5}\nchildren: [{name: ex/abcd}]",
            'f.yaml: journal "ex/abcd": fragment.length: must be between 1024',
        ),
        (
            "name: ex/\nlabels: [{name: name, value: x}]\nchildren: [{name: ex/abcd}]",
            'f.yaml: journal "ex/abcd": labels[0].name: "name" is a reserved',
        ),
    ],
)
def test_file_errors_name_source_node_and_field(text: str, expected: str) -> None:
    with pytest.raises(SpecError) as caught:
        load_specs(text, "f.yaml")
    assert expected in str(caught.value)


def test_all_problems_of_a_file_are_reported_together() -> None:
    text = "name: ex/\nchildren:\n- {name: ex/abcd, replication: 0}\n- {name: ex/efgh, flags: 9}"
    with pytest.raises(SpecError) as caught:
        load_specs(text, "f.yaml")
    assert [(p.journal, p.path) for p in caught.value.problems] == [
        ("ex/abcd", "replication"),
        ("ex/efgh", "flags"),
    ]
    assert all(p.source == "f.yaml" for p in caught.value.problems)


def test_dump_round_trips_and_hoists_shared_settings() -> None:
    entries = load_specs(TREE)
    text = dump_specs(entries)
    assert sorted(load_specs(text), key=lambda e: e.spec.name) == sorted(
        entries, key=lambda e: e.spec.name
    )
    # Settings every journal shares appear once, at the root.
    assert text.count("s3://bucket/data/?region=eu-west-1") == 1
    assert text.startswith("name: examples/\n")
    assert re.search(r"^- name: examples/wordcount/$", text, re.MULTILINE)


def test_dump_of_one_journal_and_of_none() -> None:
    spec = full_spec()
    assert load_specs(dump_specs([spec])) == [SpecEntry(spec)]
    assert dump_specs([]) == ""
    with pytest.raises(SpecError, match="appears more than once"):
        dump_specs([spec, spec])


_SEGMENTS = st.sampled_from(["aa", "bb", "cc-1", "d.e"])
_ENTRIES = st.builds(
    lambda path, replication, app, codec, revision, delete: SpecEntry(
        JournalSpec(
            name="/".join(path),
            replication=replication,
            labels=[{"name": "app", "value": app}] if app else [],
            fragment={"compression_codec": codec},
        ),
        revision,
        delete,
    ),
    st.lists(_SEGMENTS, min_size=2, max_size=4),
    st.integers(1, 5),
    st.sampled_from(["", "wc", "other"]),
    st.sampled_from(["NONE", "GZIP", "SNAPPY"]),
    st.integers(-1, 3),
    st.booleans(),
)


@given(st.lists(_ENTRIES, max_size=8, unique_by=lambda entry: entry.spec.name))
def test_dump_load_round_trip_property(entries: list[SpecEntry]) -> None:
    loaded = load_specs(dump_specs(entries))
    assert sorted(loaded, key=lambda e: e.spec.name) == sorted(entries, key=lambda e: e.spec.name)


def test_a_revision_beyond_64_bits_is_named() -> None:
    """(It reached protobuf, whose "Value out of range" came out as an unexpected error.)"""
    with pytest.raises(SpecError, match=r"revision: must be a 64-bit integer"):
        load_specs("name: a/b\nrevision: 99999999999999999999999\n", "f.yaml")
