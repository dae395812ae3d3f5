"""The built-in framings; `streamkit.message.framing` registers them on first use."""

from __future__ import annotations

from streamkit.message.framings.csv_lines import CsvDecoder, CsvFraming
from streamkit.message.framings.fixed import FixedDecoder, FixedFraming
from streamkit.message.framings.json_lines import JsonLinesDecoder, JsonLinesFraming

__all__ = [
    "BUILTIN_FRAMINGS",
    "CsvDecoder",
    "CsvFraming",
    "FixedDecoder",
    "FixedFraming",
    "JsonLinesDecoder",
    "JsonLinesFraming",
]

_json = JsonLinesFraming()

# content-type -> framing. Gazette registers exactly the first three; the
# "application/jsonl" alias matches what `streamkit journals read` already
# treats as line-delimited JSON.
BUILTIN_FRAMINGS = {
    _json.content_type: _json,
    CsvFraming.content_type: CsvFraming(),
    FixedFraming.content_type: FixedFraming(),
    "application/jsonl": _json,
}
