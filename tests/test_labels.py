"""Label sets, selectors (text and matching), meta-labels and register rules."""

import re
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streamkit.protocol import pb
from streamkit.protocol.labels import (
    LabelLike,
    SelectorError,
    format_selector,
    journal_meta_labels,
    label_set,
    labels_with_meta,
    matches,
    parse_selector,
    registers_match,
    subtract,
    union,
    validate_selector,
)


def pairs(labels: pb.LabelSet) -> list[tuple[str, str]]:
    return [(lbl.name, lbl.value) for lbl in labels.labels]


def selector(
    include: Sequence[LabelLike] = (), exclude: Sequence[LabelLike] = ()
) -> pb.LabelSelector:
    out = pb.LabelSelector()
    if include:
        out.include.CopyFrom(label_set(*include))
    if exclude:
        out.exclude.CopyFrom(label_set(*exclude))
    return out


# --- label_set, union, subtract -------------------------------------------------------


def test_label_set_sorts_and_deduplicates_all_input_forms() -> None:
    got = label_set(("bb", "2"), {"aa": "9", "bb": "1"}, pb.Label(name="bb", value="2"))
    assert pairs(got) == [("aa", "9"), ("bb", "1"), ("bb", "2")]


def test_union_replaces_values_of_the_same_name() -> None:
    a = label_set(("author", "1"), ("author", "2"), ("epoch", "5"))
    b = label_set(("author", "3"), ("zz", "x"))
    assert pairs(union(a, b)) == [("author", "3"), ("epoch", "5"), ("zz", "x")]
    assert pairs(union(a, pb.LabelSet())) == pairs(a)


def test_subtract_by_value_or_by_name() -> None:
    a = label_set(("author", "1"), ("author", "2"), ("epoch", "5"))
    assert pairs(subtract(a, label_set(("author", "2")))) == [("author", "1"), ("epoch", "5")]
    assert pairs(subtract(a, label_set(("author", "")))) == [("epoch", "5")]
    assert pairs(subtract(a, label_set(("author", "9")))) == pairs(a)


# --- selector text ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "include", "exclude"),
    [
        ("", [], []),
        ("app=wordcount", [("app", "wordcount", False)], []),
        ("app = wordcount", [("app", "wordcount", False)], []),
        ("app==wordcount", [("app", "wordcount", False)], []),
        ("app!=wordcount", [], [("app", "wordcount", False)]),
        ("stage in (b, a)", [("stage", "a", False), ("stage", "b", False)], []),
        ("stage notin (a,b)", [], [("stage", "a", False), ("stage", "b", False)]),
        ("stage not in (a)", [], [("stage", "a", False)]),
        ("partition", [("partition", "", False)], []),
        ("!deprecated", [], [("deprecated", "", False)]),
        ("name:prefix=logs/", [("name", "logs/", True)], []),
        ("name:prefix in (a/, b/)", [("name", "a/", True), ("name", "b/", True)], []),
        ("prefix=a/b/", [("prefix", "a/b/", False)], []),
        (
            "ct=text/csv;charset=utf-8, zz, !yy",
            [("ct", "text/csv;charset=utf-8", False), ("zz", "", False)],
            [("yy", "", False)],
        ),
    ],
)
def test_parse_selector(text: str, include: list, exclude: list) -> None:
    parsed = parse_selector(text)
    assert [(lbl.name, lbl.value, lbl.prefix) for lbl in parsed.include.labels] == include
    assert [(lbl.name, lbl.value, lbl.prefix) for lbl in parsed.exclude.labels] == exclude
    assert parse_selector(format_selector(parsed)) == parsed


@pytest.mark.parametrize(
    ("text", "quoted"),
    [
        ("app=word count", "app=word count"),
        ("app=", "app="),
        ("app===x", "app===x"),
        ("app:prefix", "app:prefix"),
        ("stage in ()", "stage in ()"),
        ("stage in (a, )", "stage in (a, )"),
        ("x=y", "x=y"),  # Label names are at least two characters.
        ("prefix=a/b", "prefix=a/b"),  # The prefix meta-label must end in "/".
        ("app=a, , zz", "app=a, , zz"),
        ("stage in (a", "stage in (a"),
        ("stage in ((a))", "stage in ((a))"),
    ],
)
def test_parse_selector_rejects_bad_terms(text: str, quoted: str) -> None:
    with pytest.raises(SelectorError, match=re.escape(repr(quoted))):
        parse_selector(text)


def test_format_selector_is_canonical() -> None:
    text = "!deprecated, stage in (b, a), app=wc, name:prefix=logs/, yy!=z, zz notin (q, p)"
    assert format_selector(parse_selector(text)) == (
        "app=wc, name:prefix=logs/, stage in (a, b), !deprecated, yy!=z, zz notin (p, q)"
    )
    assert format_selector(pb.LabelSelector()) == ""


def test_validate_selector_checks_built_messages() -> None:
    validate_selector(parse_selector("app=wc, prefix=a/"))
    with pytest.raises(SelectorError, match="must end in '/'"):
        validate_selector(selector(include=[("prefix", "a/b")]))
    with pytest.raises(SelectorError, match="exclude label"):
        validate_selector(selector(exclude=[("bad name", "x")]))


_NAMES = st.text("abxy-_./01", min_size=2, max_size=6).filter(lambda n: n != "prefix")
_VALUES = st.text("abc/.-=%:;@19", min_size=1, max_size=6).filter(lambda v: v[0] != "=")
_LABELS = st.builds(
    lambda name, value, prefix, any_value: pb.Label(
        name=name, value="" if any_value else value, prefix=prefix and not any_value
    ),
    _NAMES,
    _VALUES,
    st.booleans(),
    st.booleans(),
)


@given(st.lists(_LABELS, max_size=6), st.lists(_LABELS, max_size=6))
def test_selector_text_round_trips(include: list[pb.Label], exclude: list[pb.Label]) -> None:
    built = selector(include, exclude)
    assert parse_selector(format_selector(built)) == built


# --- matching ------------------------------------------------------------------------------

JOURNAL = label_set(("app", "wordcount"), ("stage", "count"), ("region", "eu-west"))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", True),
        ("app=wordcount", True),
        ("app=other", False),
        ("app", True),
        ("missing", False),
        ("!missing", True),
        ("!app", False),
        ("app!=other", True),
        ("app!=wordcount", False),
        ("stage in (split, count)", True),  # Same name: alternatives.
        ("stage in (split, sum)", False),
        ("app=wordcount, stage=split", False),  # Different names: all required.
        ("app=wordcount, stage=count", True),
        ("stage notin (split, count)", False),
        ("region:prefix=eu-", True),
        ("region:prefix=us-", False),
        ("region:prefix!=eu-", False),
        ("region=eu-", False),  # Exact match unless prefix is asked for.
        ("stage=split, stage:prefix=co", True),
    ],
)
def test_matches(text: str, expected: bool) -> None:
    assert matches(parse_selector(text), JOURNAL) is expected


def test_meta_labels_of_a_journal() -> None:
    assert pairs(journal_meta_labels("a/b/c")) == [
        ("name", "a/b/c"),
        ("prefix", "a/"),
        ("prefix", "a/b/"),
    ]
    assert pairs(journal_meta_labels("abcd")) == [("name", "abcd")]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("prefix=logs/clicks/", True),
        ("prefix=logs/", True),
        ("prefix=logs/views/", False),
        ("name=logs/clicks/part-000", True),
        ("name:prefix=logs/clicks/part-", True),
        ("name:prefix=logs/views", False),
        ("prefix=logs/, app=wordcount", True),
        ("!prefix", False),
    ],
)
def test_list_selectors_match_meta_labels(text: str, expected: bool) -> None:
    labels = labels_with_meta(label_set(("app", "wordcount")), "logs/clicks/part-000")
    assert matches(parse_selector(text), labels) is expected


def test_registers_match_treats_empty_registers_as_matching_anything() -> None:
    check = parse_selector("author=7")
    assert registers_match(check, pb.LabelSet())
    assert not matches(check, pb.LabelSet())
    assert registers_match(check, label_set(("author", "7")))
    assert not registers_match(check, label_set(("author", "8")))
    assert registers_match(pb.LabelSelector(), label_set(("author", "8")))
