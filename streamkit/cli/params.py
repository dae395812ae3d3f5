"""Option types shared by the commands."""

from __future__ import annotations

import math
from typing import Any

import click


class Seconds(click.FloatRange):
    """A number of seconds within a range. NaN and infinities are refused: FloatRange lets
    NaN through any bounds (it compares false with them), and a NaN timeout waits for ever
    or not at all, depending on the code that reads it."""

    name = "seconds"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        seconds = super().convert(value, param, ctx)
        if not math.isfinite(seconds):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        return seconds
