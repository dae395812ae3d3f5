"""`application/x-ndjson`: one JSON object per line, each ending in "\\n".

Compatible with Gazette's JSON framing. JSON never needs a raw newline (string
newlines are escaped), so a frame is exactly one line and a decoder finds
boundaries with a bulk `split`. Encoding and decoding go through orjson (dicts)
or pydantic-core's JSON serializer/validator (models), never Python's json.

* dict messages: encoded with orjson (UUID values become canonical strings);
  decoded as dicts, "uuid" left as the string it was.
* `Message` models: serialized by alias; decoded with full validation.
* protobuf messages: JSON mapping with the .proto field names (as Gazette does).

A line that isn't a JSON object (or doesn't validate as the model) is reported
with the offset of its first byte, its end and its bytes, and skipped: a bad
line is always exactly one frame, so a shard may skip or dead-letter just it.
"""

from __future__ import annotations

import functools
from typing import Any

import orjson
from google.protobuf import json_format
from google.protobuf.message import Message as ProtoMessage
from pydantic import ValidationError

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

__all__ = ["CONTENT_TYPE", "JsonLinesDecoder", "JsonLinesFraming"]

CONTENT_TYPE = "application/x-ndjson"

_DUMP_OPTIONS = orjson.OPT_APPEND_NEWLINE


class JsonLinesFraming:
    """Newline-delimited JSON framing."""

    content_type = CONTENT_TYPE
    # A dict's frame as bytes, what `encode` appends (the Publisher's shortest way; a
    # partial, not a method, to save a Python call per message).
    frame_dict = functools.partial(orjson.dumps, option=_DUMP_OPTIONS)

    def encode(self, message: MessageLike, out: bytearray) -> None:
        """Append the message's JSON and a newline to `out`."""
        if isinstance(message, dict):
            out += orjson.dumps(message, option=_DUMP_OPTIONS)
        elif isinstance(message, Message):
            # by_alias so that the default (alias-driven) validation reads it back.
            out += message.__pydantic_serializer__.to_json(message, by_alias=True)
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


