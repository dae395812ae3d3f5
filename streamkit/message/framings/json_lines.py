"""`application/x-ndjson`: one JSON object per line, each ending in "\\n".

Compatible with Gazette's JSON framing. JSON never needs a raw newline (string
newlines are escaped), so a frame is exactly one line and a decoder finds
boundaries with a bulk `split`. Encoding and decoding go through orjson (dicts)
or pydantic-core's JSON serializer/validator (models), never Python's json.

* dict messages: encoded with orjson (UUID values become canonical strings);
  decoded as dicts, "uuid" left as the string it was.
* `Message` models: serialized by alias; decoded with full validation.
* protobuf messages: JSON mapping with the .proto field names (as Gazette does).

NaN and ±Infinity have no JSON spelling: orjson (and pydantic, by default) would
write them as `null`, silently changing the message, so encoding one raises
NonFiniteNumber naming the field. The check costs nothing for ordinary messages:
only a frame that contains `null` is searched for the float that became it.

A line that isn't a JSON object (or doesn't validate as the model) is reported
with the offset of its first byte, its end and its bytes, and skipped: a bad
line is always exactly one frame, so a shard may skip or dead-letter just it.
"""

from __future__ import annotations

import math
from typing import Any

import orjson
from google.protobuf import json_format
from google.protobuf.message import Message as ProtoMessage
from pydantic import ValidationError

from streamkit.errors import StreamkitError
from streamkit.message.framing import (
    LineDecoderBase,
    acknowledgement_of,
    message_kind,
    validation_summary,
)
from streamkit.message.message import UUID_FIELD, Envelope, Message, MessageLike

try:  # the per-line loop of dict messages in C, where it was built (see _lines.c)
    from streamkit.message._lines import decode_dicts as _decode_in_c
except ImportError:  # no C compiler where streamkit was installed: the Python loop
    _decode_in_c = None

__all__ = [
    "CONTENT_TYPE",
    "JsonLinesDecoder",
    "JsonLinesFraming",
    "NonFiniteNumber",
    "has_non_finite",
]

CONTENT_TYPE = "application/x-ndjson"

_DUMP_OPTIONS = orjson.OPT_APPEND_NEWLINE
_MESSAGE_SHOWN = 200  # characters of a refused message its error quotes
_dumps = orjson.dumps  # one global lookup per frame, not two
_isfinite = math.isfinite
_SEQUENCES = (list, tuple)
_CONTAINERS = (dict, list, tuple)
_SCALARS = frozenset({str, int, bool, type(None)})


class NonFiniteNumber(StreamkitError, ValueError):
    """A message holds NaN or ±Infinity, which JSON can't carry (it would become null)."""


def has_non_finite(value: Any) -> bool:
    """Whether `value` (a JSON-like tree) holds a NaN or infinite float anywhere.

    Run only on the rare frames that contain `null`, but kept lean (no generators or
    paths) since a message with a None field takes it every time.
    """
    if isinstance(value, float):
        return not _isfinite(value)
    if isinstance(value, dict):
        value = value.values()
    elif _is_dataclass(value):  # orjson writes dataclasses' fields too
        value = [getattr(value, name, None) for name in type(value).__dataclass_fields__]
    elif not isinstance(value, _SEQUENCES):
        return False
    for item in value:
        if isinstance(item, float):
            if not _isfinite(item):
                return True
        elif (isinstance(item, _CONTAINERS) or _is_dataclass(item)) and has_non_finite(item):
            return True
    return False


def _is_dataclass(value: Any) -> bool:
    kind = type(value)  # (a failed attribute lookup is slow: JSON's scalars skip it)
    return kind not in _SCALARS and hasattr(kind, "__dataclass_fields__")


def _non_finite_path(value: Any, path: str = "") -> tuple[str, float] | None:
    """Where `value` holds a NaN or infinite float, e.g. `['a'][2]`, and that float."""
    if isinstance(value, float):
        return None if _isfinite(value) else (path, value)
    if isinstance(value, dict):
        steps: list[tuple[str, Any]] = [(f"[{key!r}]", item) for key, item in value.items()]
    elif _is_dataclass(value):
        steps = [(f".{name}", getattr(value, name, None))
                 for name in type(value).__dataclass_fields__]
    elif isinstance(value, _SEQUENCES):
        steps = [(f"[{index}]", item) for index, item in enumerate(value)]
    else:
        return None
    for step, item in steps:
        found = _non_finite_path(item, path + step)
        if found is not None:
            return found
    return None


def _refuse_non_finite(message: Any, tree: Any) -> None:
    """Raise NonFiniteNumber if `tree` (`message` as plain data) holds NaN or ±Infinity."""
    if not has_non_finite(tree):
        return
    path, number = _non_finite_path(tree) or ("", float("nan"))
    shown = repr(message)
    if len(shown) > _MESSAGE_SHOWN:
        shown = shown[:_MESSAGE_SHOWN] + "..."
    raise NonFiniteNumber(
        f"cannot JSON-encode message{path} = {number!r}: JSON has no NaN or Infinity "
        f"(it would be published as null); send it as a string or leave it out. "
        f"The message: {shown}"
    )


def _frame_dict(message: dict[str, Any]) -> bytes:
    """A dict message's frame: its JSON and a newline (the Publisher's shortest way).

    Only a frame with `null` in it may hide a NaN or ±Infinity orjson wrote as null;
    ordinary messages pay a substring search, not a Python scan.
    """
    frame = _dumps(message, option=_DUMP_OPTIONS)
    if frame.find(b"null") != -1:  # (`in` is slower: it first tries the needle as an int)
        _refuse_non_finite(message, message)
    return frame


class JsonLinesFraming:
    """Newline-delimited JSON framing."""

    content_type = CONTENT_TYPE
    # A dict's frame as bytes, what `encode` appends (the Publisher's shortest way; a
    # staticmethod, so that no bound method is made per message).
    frame_dict = staticmethod(_frame_dict)

    def encode(self, message: MessageLike, out: bytearray) -> None:
        """Append the message's JSON and a newline to `out`.

        Raises NonFiniteNumber for a NaN or ±Infinity (see the module doc).
        """
        if isinstance(message, dict):
            out += _frame_dict(message)
        elif isinstance(message, Message):
            # by_alias so that the default (alias-driven) validation reads it back.
            frame = message.__pydantic_serializer__.to_json(message, by_alias=True)
            if frame.find(b"null") != -1 and message.model_config.get(
                    "ser_json_inf_nan", "null") == "null":
                _refuse_non_finite(message, message.model_dump(by_alias=True))
            out += frame
            out += b"\n"
        elif isinstance(message, ProtoMessage):
            as_dict = json_format.MessageToDict(message, preserving_proto_field_name=True)
            out += orjson.dumps(as_dict, option=_DUMP_OPTIONS)
        else:
            raise TypeError(f"cannot JSON-frame a {type(message).__name__}")

    def new_decoder(self, journal: str, message_type: type) -> JsonLinesDecoder:
        return JsonLinesDecoder(journal, message_type)


class JsonLinesDecoder(LineDecoderBase):
    """Splits the stream at newlines, decoding each complete line as one message."""

    def __init__(self, journal: str, message_type: type) -> None:
        super().__init__(journal)
        self.message_type = message_type
        self._kind = message_kind(message_type)

    def feed(self, chunk: bytes | memoryview, offset: int) -> list[Envelope]:
        split = self._complete_lines(chunk, offset)
        if split is None:
            return []
        lines, tail = split
        begin = self._start
        self._start = offset + len(chunk) - len(tail)
        self._pending = len(tail)

        if self._kind == "dict":
            return self._decode_dicts(lines, begin)
        return self._decode_typed(lines, begin)

    def _decode_dicts(self, lines: list[bytes], begin: int) -> list[Envelope]:
        out: list[Envelope] = []
        decode_in_c = _decode_in_c
        if decode_in_c is None:
            self._decode_dicts_here(lines, 0, len(lines), begin, out)
            return out
        index, count = 0, len(lines)
        while True:
            # C takes the lines that are JSON objects; the one it stops at is reported here.
            index, begin = decode_in_c(lines, index, begin, self.journal, out, orjson.loads,
                                       Envelope)
            if index >= count:
                return out
            begin = self._decode_dicts_here(lines, index, index + 1, begin, out)
            index += 1

    def _decode_dicts_here(self, lines: list[bytes], start: int, stop: int, begin: int,
                           out: list[Envelope]) -> int:
        """Decode lines[start:stop] into `out`; the offset after them."""
        # The hot path without C: kept free of attribute lookups and calls per line.
        journal = self.journal
        loads = orjson.loads
        append = out.append
        for index in range(start, stop):
            line = lines[index]
            end = begin + len(line) + 1
            try:
                obj = loads(line)
            except orjson.JSONDecodeError as exc:
                self._bad_line(line, begin, f"invalid JSON: {exc}")
            else:
                if type(obj) is dict:
                    append(Envelope(journal, begin, end, obj))
                else:
                    self._bad_line(line, begin, f"JSON {type(obj).__name__} is not an object")
            begin = end
        return begin

    def _decode_typed(self, lines: list[bytes], begin: int) -> list[Envelope]:
        journal = self.journal
        decode = self._decode_model if self._kind == "model" else self._decode_proto
        out: list[Envelope] = []
        append = out.append
        for line in lines:
            end = begin + len(line) + 1
            message = decode(line, begin)
            if message is not None:
                append(Envelope(journal, begin, end, message))
            begin = end
        return out

    def _decode_model(self, line: bytes, begin: int) -> Message | None:
        model: type[Message] = self.message_type
        try:
            return model.__pydantic_validator__.validate_json(line)
        except ValidationError as exc:
            obj = _loads_object(line)
            ack = acknowledgement_of(model, obj.get(UUID_FIELD)) if obj is not None else None
            if ack is None:
                problem = validation_summary(exc)
                self._bad_line(line, begin, f"not a valid {model.__name__}: {problem}")
            return ack

    def _decode_proto(self, line: bytes, begin: int) -> ProtoMessage | None:
        obj = _loads_object(line)
        if obj is None:
            self._bad_line(line, begin, "not a JSON object")
            return None
        try:
            return json_format.ParseDict(obj, self.message_type(), ignore_unknown_fields=True)
        except json_format.ParseError as exc:
            self._bad_line(line, begin, f"not a valid {self.message_type.__name__}: {exc}")
            return None

    def _bad_line(self, line: bytes, begin: int, reason: str) -> None:
        """Report a bad line as exactly one skippable frame (its newline included)."""
        self._report(begin, reason, begin + len(line) + 1, line + b"\n")


def _loads_object(line: bytes) -> dict[str, Any] | None:
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    return obj if type(obj) is dict else None


