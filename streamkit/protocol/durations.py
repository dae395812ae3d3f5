"""Durations spelled as Go spells them ("1m30s", "500ms"), as gazctl files and Gazette do.

Specs read and written here must round-trip through Gazette's tools, so
parsing accepts Go's duration syntax (plus a plain number of seconds) and
formatting reproduces Go's ``time.Duration.String``.
"""

from __future__ import annotations

import re
from datetime import timedelta
from fractions import Fraction
from typing import Annotated

from pydantic import BeforeValidator, PlainSerializer

__all__ = ["GoDuration", "format_duration", "parse_duration"]

_DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_NANOS = {"ns": 1, "us": 10**3, "µs": 10**3, "μs": 10**3, "ms": 10**6, "s": 10**9}
_NANOS |= {"m": 60 * 10**9, "h": 3600 * 10**9}


def _parse_go_duration(text: str) -> timedelta:
    sign, body = (-1, text[1:]) if text.startswith("-") else (1, text.removeprefix("+"))
    nanos, at = Fraction(0), 0
    while at < len(body) and (m := _DURATION_PART.match(body, at)):
        nanos += Fraction(m[1]) * _NANOS[m[2]]
        at = m.end()
    if not body or at != len(body):
        raise ValueError(f'not a duration like "1m30s", "500ms" or a number of seconds ({text!r})')
    return timedelta(microseconds=round(sign * nanos / 1000))


def parse_duration(value: object) -> timedelta:
    """A timedelta from a Go duration string ("1h30m", "500ms"), seconds, or a timedelta."""
    if isinstance(value, timedelta):
        return value
    try:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return timedelta(seconds=value)
        if isinstance(value, str):
            text = value.strip()
            if re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)", text):
                return timedelta(seconds=float(text))
            return _parse_go_duration(text)
    except OverflowError:
        raise ValueError(f"duration out of range (got {value!r})") from None
    raise ValueError(f"expected a duration string or a number of seconds (got {value!r})")


def _decimal(value: int, unit: int) -> str:
    """``value / unit`` in decimal, without trailing zeros, as Go prints durations."""
    whole, frac = divmod(value, unit)
    if not frac:
        return str(whole)
    digits = len(str(unit)) - 1
    return f"{whole}.{frac:0{digits}d}".rstrip("0")


def format_duration(delta: timedelta) -> str:
    """Go's spelling of a duration: "0s", "500ms", "30s", "1m0s", "1h30m0s"."""
    micros = delta // timedelta(microseconds=1)
    sign, micros = ("-" if micros < 0 else ""), abs(micros)
    if micros == 0:
        return "0s"
    if micros < 1000:
        return f"{sign}{micros}µs"
    if micros < 10**6:
        return f"{sign}{_decimal(micros, 1000)}ms"
    hours, rest = divmod(micros, 3600 * 10**6)
    minutes, rest = divmod(rest, 60 * 10**6)
    head = f"{hours}h{minutes}m" if hours else f"{minutes}m" if minutes else ""
    return f"{sign}{head}{_decimal(rest, 10**6)}s"


# A model field holding a duration: read from Go's spelling or seconds, dumped to JSON as Go's.
GoDuration = Annotated[
    timedelta,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str, when_used="json"),
]
