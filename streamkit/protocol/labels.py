"""Label sets, label selectors and journal registers, as pure functions over pb messages.

A journal's labels, a List request's selector and an append's register checks
all reduce to the same question: does a selector match a label set? The rules:

* every *include* label must be matched, where labels of the same name are
  alternatives (OR) and labels of different names are all required (AND);
* no *exclude* label may be matched;
* a selector label with an empty value matches any value of its name, and one
  with ``prefix=True`` matches any value starting with its value.

Selectors are written in gazctl's text syntax, e.g.
``app=wordcount, stage in (a, b), !deprecated, name:prefix=logs/``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

from streamkit.errors import StreamkitError
from streamkit.protocol import pb

__all__ = [
    "MAX_LABEL_NAME_LEN",
    "MAX_LABEL_VALUE_LEN",
    "META_LABELS",
    "MIN_LABEL_NAME_LEN",
    "LabelLike",
    "SelectorError",
    "format_selector",
    "journal_meta_labels",
    "label_name_problem",
    "label_set",
    "label_value_problem",
    "labels_with_meta",
    "matches",
    "parse_selector",
    "registers_match",
    "subtract",
    "union",
    "validate_selector",
]

MIN_LABEL_NAME_LEN, MAX_LABEL_NAME_LEN = 2, 64
MAX_LABEL_VALUE_LEN = 512
# Labels every journal implicitly carries when matched by a List selector.
META_LABELS = frozenset({"name", "prefix"})

# Names are Gazette "tokens". Values may also hold the characters a MIME type
# with parameters needs ("text/csv;charset=utf-8"); neither holds whitespace,
# commas, parentheses or "!", which the selector syntax reserves, and a value
# never begins with "=" so that "a==b" reads unambiguously as "a=b".
_NAME_CHARS = r"[\w\-+/.]"
_VALUE = r"(?:[\w\-+/.%:;@][\w\-+/.=%:;@]*)"
_NAME_RE = re.compile(_NAME_CHARS + "*")
_VALUE_RE = re.compile(_VALUE + "?")

_EQUALITY_TERM = re.compile(
    rf"(?P<name>{_NAME_CHARS}+)(?P<prefix>:prefix)?\s*(?P<op>!=|==?)\s*(?P<value>{_VALUE})"
)
_SET_TERM = re.compile(
    rf"(?P<name>{_NAME_CHARS}+)(?P<prefix>:prefix)?\s+(?P<op>in|notin|not\s+in)\s*"
    r"\((?P<items>[^()]*)\)"
)
_EXISTS_TERM = re.compile(rf"(?P<op>!?)\s*(?P<name>{_NAME_CHARS}+)")

# A label as a plain, hashable triple; the sort order of a canonical LabelSet.
_Triple = tuple[str, str, bool]
LabelLike = tuple[str, str] | Mapping[str, str] | pb.Label


class SelectorError(StreamkitError, ValueError):
    """A label selector (text or message) that is malformed."""


# --- label sets ------------------------------------------------------------


def _triples_to_set(triples: Iterable[_Triple]) -> pb.LabelSet:
    """Build the canonical form: sorted by (name, value), each label once."""
    return pb.LabelSet(
        labels=[pb.Label(name=n, value=v, prefix=p) for n, v, p in sorted(set(triples))]
    )


def _triples(labels: pb.LabelSet) -> list[_Triple]:
    return [(lbl.name, lbl.value, lbl.prefix) for lbl in labels.labels]


def _as_triples(item: LabelLike) -> list[_Triple]:
    if isinstance(item, pb.Label):
        return [(item.name, item.value, item.prefix)]
    if isinstance(item, Mapping):
        return [(name, value, False) for name, value in item.items()]
    name, value = item
    return [(name, value, False)]


def label_set(*items: LabelLike) -> pb.LabelSet:
    """A canonical LabelSet from (name, value) pairs, {name: value} dicts or pb.Labels."""
    return _triples_to_set(t for item in items for t in _as_triples(item))


def union(a: pb.LabelSet, b: pb.LabelSet) -> pb.LabelSet:
    """Labels of ``a`` and ``b``, where ``b``'s values replace ``a``'s of the same name.

    This is how an append's ``union_registers`` update a journal's registers.
    """
    replaced = {lbl.name for lbl in b.labels}
    kept = [t for t in _triples(a) if t[0] not in replaced]
    return _triples_to_set(kept + _triples(b))


def subtract(a: pb.LabelSet, b: pb.LabelSet) -> pb.LabelSet:
    """Labels of ``a`` not matched by ``b`` (an empty value in ``b`` removes every value)."""
    removed = b.labels
    return _triples_to_set(
        t
        for t in _triples(a)
        if not any(r.name == t[0] and (not r.value or r.value == t[1]) for r in removed)
    )


def journal_meta_labels(name: str) -> pb.LabelSet:
    """The meta-labels a journal matches as: ``name=<name>`` and ``prefix=`` each parent dir.

    ``"a/b/c"`` yields ``name=a/b/c, prefix=a/, prefix=a/b/``.
    """
    triples: list[_Triple] = [("name", name, False)]
    end = name.find("/")
    while end != -1:
        triples.append(("prefix", name[: end + 1], False))
        end = name.find("/", end + 1)
    return _triples_to_set(triples)


def labels_with_meta(labels: pb.LabelSet, name: str) -> pb.LabelSet:
    """A journal's labels plus its meta-labels: what a List selector is matched against."""
    return _triples_to_set(_triples(labels) + _triples(journal_meta_labels(name)))


# --- matching ---------------------------------------------------------------


def _matched_by(want: pb.Label, present: Sequence[tuple[str, str]]) -> bool:
    """Whether one selector label matches any (name, value) present."""
    name, value = want.name, want.value
    if not value:
        return any(have_name == name for have_name, _ in present)
    if want.prefix:
        return any(n == name and v.startswith(value) for n, v in present)
    return (name, value) in present


def matches(selector: pb.LabelSelector, labels: pb.LabelSet) -> bool:
    """Whether ``labels`` satisfy every include group and no exclude label of ``selector``."""
    include, exclude = selector.include.labels, selector.exclude.labels
    if not include and not exclude:
        return True
    present = [(lbl.name, lbl.value) for lbl in labels.labels]
    if any(_matched_by(want, present) for want in exclude):
        return False
    satisfied: dict[str, bool] = {}
    for want in include:
        if not satisfied.get(want.name):
            satisfied[want.name] = _matched_by(want, present)
    return all(satisfied.values())


def registers_match(selector: pb.LabelSelector, registers: pb.LabelSet) -> bool:
    """``matches`` for an append's ``check_registers``, except that empty registers match.

    Gazette lets a journal that never had registers accept any check, so that the
    first writer of a fenced journal can establish them.
    """
    return not registers.labels or matches(selector, registers)


# --- validation ---------------------------------------------------------------


def label_name_problem(name: str) -> str | None:
    """Why ``name`` is not a valid label name, or None if it is."""
    if not MIN_LABEL_NAME_LEN <= len(name) <= MAX_LABEL_NAME_LEN:
        return (
            f"label name must be {MIN_LABEL_NAME_LEN} to {MAX_LABEL_NAME_LEN} characters "
            f"(got {name!r})"
        )
    if not _NAME_RE.fullmatch(name):
        return f"label name may hold only letters, digits and -_+/. (got {name!r})"
    return None


def label_value_problem(value: str) -> str | None:
    """Why ``value`` is not a valid label value, or None if it is."""
    if len(value) > MAX_LABEL_VALUE_LEN:
        return f"label value must be at most {MAX_LABEL_VALUE_LEN} characters (got {len(value)})"
    if not _VALUE_RE.fullmatch(value):
        return (
            f"label value may hold only letters, digits and -_+/.=%:;@, "
            f"and not begin with '=' (got {value!r})"
        )
    return None


def _selector_label_problem(name: str, value: str) -> str | None:
    problem = label_name_problem(name) or label_value_problem(value)
    if problem is None and name == "prefix" and value and not value.endswith("/"):
        problem = f"a prefix meta-label value must end in '/' (got {value!r})"
    return problem


def validate_selector(selector: pb.LabelSelector) -> None:
    """Raise SelectorError unless every label of ``selector`` is well-formed."""
    for side in ("include", "exclude"):
        for lbl in getattr(selector, side).labels:
            problem = _selector_label_problem(lbl.name, lbl.value)
            if problem:
                raise SelectorError(f"{side} label {lbl.name}={lbl.value}: {problem}")


def validate_label_set(labels: pb.LabelSet) -> None:
    """Raise ValueError unless ``labels`` is a well-formed set: valid names and values,
    sorted by (name, value), each once, no prefix matching (as register updates must be)."""
    triples = [(lbl.name, lbl.value) for lbl in labels.labels]
    for lbl in labels.labels:
        problem = label_name_problem(lbl.name) or label_value_problem(lbl.value)
        if problem:
            raise ValueError(f"label {lbl.name[:64]!r}: {problem}")
        if lbl.prefix:
            raise ValueError(f"label {lbl.name!r}: prefix matching is for selectors only")
    if triples != sorted(set(triples)):
        raise ValueError("labels must be sorted by (name, value), each once")


# --- selector text ----------------------------------------------------------------


def _split_terms(text: str) -> list[str]:
    """Split at the commas that are not inside a parenthesised set."""
    terms: list[str] = []
    depth, start = 0, 0
    for at, char in enumerate(text):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 0:
            terms.append(text[start:at])
            start = at + 1
        if depth not in (0, 1):
            raise SelectorError(f"unbalanced parentheses in label selector {text!r}")
    if depth:
        raise SelectorError(f"unbalanced parentheses in label selector {text!r}")
    terms.append(text[start:])
    return [term.strip() for term in terms]


def _parse_term(term: str) -> tuple[bool, list[_Triple]]:
    """One selector term as (is_exclude, labels)."""
    if m := _EQUALITY_TERM.fullmatch(term):
        return m["op"] == "!=", [(m["name"], m["value"], bool(m["prefix"]))]
    if m := _SET_TERM.fullmatch(term):
        values = [item.strip() for item in m["items"].split(",")]
        if not all(values):
            raise SelectorError(f"empty value in label selector term {term!r}")
        return m["op"] != "in", [(m["name"], v, bool(m["prefix"])) for v in values]
    if m := _EXISTS_TERM.fullmatch(term):
        return m["op"] == "!", [(m["name"], "", False)]
    raise SelectorError(f"cannot parse label selector term {term!r}")


def parse_selector(text: str) -> pb.LabelSelector:
    """Parse gazctl's selector syntax into a canonical LabelSelector."""
    if not text.strip():
        return pb.LabelSelector()
    include: list[_Triple] = []
    exclude: list[_Triple] = []
    for term in _split_terms(text):
        if not term:
            raise SelectorError(f"empty term in label selector {text!r}")
        is_exclude, triples = _parse_term(term)
        for name, value, _ in triples:
            problem = _selector_label_problem(name, value)
            if problem:
                raise SelectorError(f"label selector term {term!r}: {problem}")
        (exclude if is_exclude else include).extend(triples)
    # Leave an empty side unset, so that equal selectors compare (and serialize) equal.
    selector = pb.LabelSelector()
    if include:
        selector.include.CopyFrom(_triples_to_set(include))
    if exclude:
        selector.exclude.CopyFrom(_triples_to_set(exclude))
    return selector


def _format_side(labels: Iterable[pb.Label], exclude: bool) -> list[str]:
    """Terms for one side: ``name``, ``name=v`` or ``name in (v, w)``, negated if ``exclude``."""
    terms: list[str] = []
    groups: dict[str, list[str]] = {}
    for lbl in sorted(labels, key=lambda lbl: (lbl.name, lbl.prefix, lbl.value)):
        if not lbl.value:
            terms.append(("!" if exclude else "") + lbl.name)
        else:
            key = lbl.name + (":prefix" if lbl.prefix else "")
            groups.setdefault(key, []).append(lbl.value)
    for key, values in groups.items():
        if len(values) == 1:
            terms.append(f"{key}{'!=' if exclude else '='}{values[0]}")
        else:
            terms.append(f"{key} {'notin' if exclude else 'in'} ({', '.join(values)})")
    return terms


def format_selector(selector: pb.LabelSelector) -> str:
    """The selector in gazctl's syntax; ``parse_selector`` reads it back unchanged."""
    return ", ".join(
        _format_side(selector.include.labels, exclude=False)
        + _format_side(selector.exclude.labels, exclude=True)
    )
