"""Gazette's rules for journal names, apart from the spec models.

Brokers check the name of every request against them; keeping them out of
`spec` spares a broker's start the import of pydantic and the spec models
(~60 ms), which it needs only when an Apply changes a spec.
"""

from __future__ import annotations

import re

__all__ = ["MAX_JOURNAL_NAME_LEN", "MIN_JOURNAL_NAME_LEN", "journal_name_problem"]

MIN_JOURNAL_NAME_LEN, MAX_JOURNAL_NAME_LEN = 4, 512

_JOURNAL_NAME_RE = re.compile(r"[\w\-+/.=%]*")


def journal_name_problem(name: str) -> str | None:
    """Why ``name`` is not a valid journal name, or None. Also for brokers checking requests."""
    if not MIN_JOURNAL_NAME_LEN <= len(name) <= MAX_JOURNAL_NAME_LEN:
        return (
            f"must be {MIN_JOURNAL_NAME_LEN} to {MAX_JOURNAL_NAME_LEN} characters (got {len(name)})"
        )
    if not _JOURNAL_NAME_RE.fullmatch(name):
        return f"may hold only letters, digits and -_+/.=% (got {name!r})"
    if name.startswith("/") or name.endswith("/") or "//" in name:
        return f"must be a relative path without empty segments or a trailing '/' (got {name!r})"
    if any(segment in (".", "..") for segment in name.split("/")):
        return f"must not contain '.' or '..' segments (got {name!r})"
    return None
