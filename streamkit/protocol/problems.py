"""Problems with user input, and the one exception that lists them.

Every spec or file streamkit validates (journal specs, shard specs,
streamkit.yaml) reports failures the same way: a ``SpecError`` holding one
``Problem`` per finding, each printed on its own line naming the file, the
journal and the field path, then the rule. pydantic's own errors never reach
a user: ``validation_problems`` words them, and validators raise
``FieldProblems`` to point below the value they check (``stores[2]``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import yaml
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from streamkit.errors import StreamkitError

__all__ = [
    "FieldProblems",
    "Problem",
    "SpecError",
    "render_path",
    "validation_problems",
    "yaml_problem",
]

Loc = Sequence[str | int]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec, and where."""

    message: str
    path: str = ""
    journal: str | None = None
    source: str | None = None

    def __str__(self) -> str:
        parts = [self.source] if self.source else []
        if self.journal is not None:
            kind = "directory" if self.journal.endswith("/") or not self.journal else "journal"
            parts.append(f'{kind} "{self.journal}"')
        if self.path:
            parts.append(self.path)
        return ": ".join([*parts, self.message])


class SpecError(StreamkitError, ValueError):
    """An invalid spec or spec file; ``problems`` holds each finding, the message one per line."""

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))

    def located(self, source: str) -> SpecError:
        """The same problems, attributed to a file."""
        return SpecError(replace(p, source=source) for p in self.problems)


class FieldProblems(StreamkitError, ValueError):
    """Raised inside validators for problems located below the validated value.

    pydantic only knows the field a validator checks; ``found`` pairs each
    message with the path under it, so the user reads ``stores[2]``, not ``stores``.
    """

    def __init__(self, found: Iterable[tuple[Loc, str]]) -> None:
        self.found = [(tuple(below), message) for below, message in found]
        super().__init__("; ".join(message for _, message in self.found))

    @classmethod
    def at(cls, message: str, *below: str | int) -> FieldProblems:
        """One problem at ``below`` (e.g. ``2, "name"``) under the validated value."""
        return cls([(below, message)])


def render_path(loc: Iterable[str | int], below: str = "") -> str:
    """("fragment", "stores", 0) -> "fragment.stores[0]", then ``below`` appended."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    if below:
        out += below if below.startswith("[") or not out else f".{below}"
    return out


# How a validated document words one pydantic error, or None for the default words.
Wording = Callable[[ErrorDetails], str | None]

_DEFAULT_WORDS = {
    "extra_forbidden": "unknown field",
    "missing": "is required",
}


def _default_message(error: ErrorDetails) -> str:
    if error["type"] in _DEFAULT_WORDS:
        return _DEFAULT_WORDS[error["type"]]
    return f"{error['msg'][0].lower()}{error['msg'][1:]} (got {error['input']!r})"


def _problems_of(
    error: ErrorDetails, journal: str | None, source: str | None, wording: Wording | None
) -> list[Problem]:
    loc = tuple(error["loc"])
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, SpecError):
        # A nested model's own __init__ failed (pydantic calls custom __init__s).
        return [
            Problem(p.message, render_path(loc, p.path), journal, source) for p in cause.problems
        ]
    if isinstance(cause, FieldProblems):
        return [
            Problem(message, render_path(loc + below), journal, source)
            for below, message in cause.found
        ]
    if isinstance(cause, ValueError):
        message = str(cause)
    else:
        worded = wording(error) if wording is not None else None
        message = worded or _default_message(error)
    return [Problem(message, render_path(loc), journal, source)]


def validation_problems(
    err: ValidationError,
    *,
    journal: str | None = None,
    source: str | None = None,
    wording: Wording | None = None,
) -> list[Problem]:
    """Readable problems for every entry of a pydantic ValidationError.

    A validator's own ValueError gives its message as is; ``wording`` lets a
    document phrase pydantic's built-in errors its own way.
    """
    return [p for error in err.errors() for p in _problems_of(error, journal, source, wording)]


def yaml_problem(err: yaml.YAMLError, source: str) -> Problem:
    """A YAML syntax error as a problem naming the file, line and column."""
    mark = getattr(err, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    reason = getattr(err, "problem", None) or str(err)
    return Problem(f"invalid YAML: {where}{reason}", source=source)
