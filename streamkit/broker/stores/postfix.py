"""Which path postfixes a journal's `path_postfix_template` can produce.

A journal's store folder also holds the folders of journals nested below it
(`a/b`'s folder holds `a/b/c/`), so a listing can't take every subfolder for a
path postfix: it keeps only those the journal's own template could have
written. Templates are Go text/templates (Gazette evaluates them over the spool
and the JournalSpec); this turns one into a regular expression of its outputs.
Literal text must match exactly and `.Format "<Go time layout>"` as that layout
prints; any other action stands for text within one path segment.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable

__all__ = ["postfix_matcher"]

log = logging.getLogger(__name__)

_SPACE = " \t\r\n"
_ACTION = re.compile(
    r"\{\{(?P<ltrim>-[ \t\r\n])?"
    r"(?P<body>(?:\"(?:\\.|[^\"\\])*\"|`[^`]*`|'(?:\\.|[^'\\])*'|[^\"`'}]|\}(?!\}))*?)"
    r"(?P<rtrim>[ \t\r\n]-)?\}\}",
    re.S,
)
_QUOTED = r"(?P<quoted>\"(?:\\.|[^\"\\])*\"|`[^`]*`)"
_FORMAT = re.compile(r"\S*\.Format\s+" + _QUOTED)
_NUMERIC = re.compile(r"\S*\.(?:Begin|End|Unix|UnixMilli|UnixMicro|UnixNano|Year|YearDay|Day"
                      r"|Hour|Minute|Second|Nanosecond)")
_ASSIGN = re.compile(r"\$\w*\s*:?=")
_ANY_IN_SEGMENT = "[^/]*"
_DIGITS = r"-?\d+"
_TZ = r"(?:Z|[+-]\d\d(?::?\d\d){0,2})"

# Go time layout elements and what they print, longest first where one prefixes another.
_LAYOUT = [
    ("January", "[A-Z][a-z]+"), ("Jan", "[A-Z][a-z]{2}"),
    ("Monday", "[A-Z][a-z]+"), ("Mon", "[A-Z][a-z]{2}"), ("MST", r"[A-Za-z0-9+-]+"),
    ("2006", r"\d{4}"), ("_2006", r"_\d{4}"), ("__2", r"[ \d]{2}\d"), ("_2", r"[ \d]\d"),
    ("002", r"\d{3}"), ("01", r"\d\d"), ("02", r"\d\d"), ("03", r"\d\d"), ("04", r"\d\d"),
    ("05", r"\d\d"), ("06", r"\d\d"), ("15", r"\d\d"),
    ("1", r"\d\d?"), ("2", r"\d\d?"), ("3", r"\d\d?"), ("4", r"\d\d?"), ("5", r"\d\d?"),
    ("PM", "[AP]M"), ("pm", "[ap]m"),
    ("-070000", _TZ), ("-07:00:00", _TZ), ("-0700", _TZ), ("-07:00", _TZ), ("-07", _TZ),
    ("Z070000", _TZ), ("Z07:00:00", _TZ), ("Z0700", _TZ), ("Z07:00", _TZ), ("Z07", _TZ),
]
_FRACTION = re.compile(r"[.,](0+|9+)(?!\d)")


class _Opaque(Exception):
    """A template this module can't reason about (define, template, block, parse errors)."""


def _layout_pattern(layout: str) -> str:
    """A regular expression of what Go's time.Format prints for `layout`."""
    out, i = [], 0
    while i < len(layout):
        if fraction := _FRACTION.match(layout, i):
            digits = len(fraction[1])
            sep = re.escape(layout[i])
            out.append(f"{sep}\\d{{{digits}}}" if fraction[1][0] == "0"
                       else f"(?:{sep}\\d{{1,{digits}}})?")
            i = fraction.end()
            continue
        for element, pattern in _LAYOUT:
            if layout.startswith(element, i):
                out.append(pattern)
                i += len(element)
                break
        else:
            out.append(re.escape(layout[i]))
            i += 1
    return "".join(out)


def _unquote(quoted: str) -> str:
    if quoted[0] == "`":
        return quoted[1:-1]
    return quoted[1:-1].encode("latin-1", "backslashreplace").decode("unicode_escape")


def _action_pattern(body: str) -> str:
    """What one output action (not a control word) can print."""
    if body.startswith("/*") or _ASSIGN.match(body):
        return ""  # a comment or a variable assignment prints nothing
    if match := _FORMAT.fullmatch(body):
        return _layout_pattern(_unquote(match["quoted"]))
    if _NUMERIC.fullmatch(body):
        return _DIGITS
    return _ANY_IN_SEGMENT


def _tokens(template: str) -> list[tuple[str, str]]:
    """("text", literal) and ("action", body) pairs, with trim markers applied."""
    tokens: list[tuple[str, str]] = []
    position, trim_next = 0, False
    for match in _ACTION.finditer(template):
        text = template[position : match.start()]
        if trim_next:
            text = text.lstrip(_SPACE)
        if match["ltrim"]:
            text = text.rstrip(_SPACE)
        tokens += [("text", text), ("action", match["body"].strip(_SPACE))]
        position, trim_next = match.end(), bool(match["rtrim"])
    text = template[position:]
    if "{{" in text or "}}" in text:
        raise _Opaque("unbalanced {{ }}")
    tokens.append(("text", text.lstrip(_SPACE) if trim_next else text))
    return tokens


def _keyword(body: str) -> str:
    word = body.split(None, 1)[0] if body else ""
    return word if word.isalpha() else ""


def _sequence(tokens: list[tuple[str, str]], i: int) -> tuple[str, int, str]:
    """The pattern of tokens[i:] up to an `else` or `end`, that index, and which one."""
    out = []
    while i < len(tokens):
        kind, value = tokens[i]
        i += 1
        if kind == "text":
            out.append(re.escape(value))
            continue
        word = _keyword(value)
        if word in ("else", "end"):
            return "".join(out), i, value
        if word in ("if", "with", "range"):
            pattern, i = _branches(tokens, i, repeat=word == "range")
            out.append(pattern)
        elif word in ("define", "template", "block"):
            raise _Opaque(f"{{{{{word}}}}} is not supported")
        elif word not in ("break", "continue"):
            out.append(_action_pattern(value))
    return "".join(out), i, ""


def _branches(tokens: list[tuple[str, str]], i: int, repeat: bool) -> tuple[str, int]:
    """An if/with/range block after its opening action: the union of its branches."""
    branches, has_else = [], False
    while True:
        body, i, closer = _sequence(tokens, i)
        branches.append(f"(?:{body})*" if repeat and not branches else body)
        if not closer:
            raise _Opaque("missing {{end}}")
        if closer == "end":
            break
        # `{{else}}` is the last branch; `{{else if …}}` / `{{else with …}}` open another.
        has_else = closer.split() == ["else"]
    if not has_else and not repeat:
        branches.append("")
    return "(?:" + "|".join(branches) + ")", i


@functools.lru_cache(maxsize=1024)
def postfix_matcher(template: str) -> Callable[[str], bool]:
    """Whether a path postfix (the folders between journal and file) fits `template`.

    An empty template writes no postfix, so nothing fits. A template this can't
    reason about fits every postfix (as in Gazette, whose listings take every
    subfolder), with a warning once: losing a journal's own fragments would be
    worse than seeing others'.
    """
    if not template:
        return lambda postfix: False
    try:
        pattern, _, closer = _sequence(_tokens(template), 0)
        if closer:
            raise _Opaque(f"unexpected {{{{{closer}}}}}")
        compiled = re.compile(pattern, re.S)
    except (_Opaque, re.error) as e:
        log.warning("path_postfix_template %r: %s; listings take every subfolder", template, e)
        return lambda postfix: True
    return lambda postfix: compiled.fullmatch(postfix) is not None
