"""`text/csv`: one CSV record per message, its first column the message UUID.

Compatible with Gazette's CSV framing (RFC 4180 as Python's `csv` writes it:
"," separated, fields quoted when they hold a quote, comma or line break, and
records ending in "\\r\\n"). Column order:

* dict messages are written as their values in insertion order with the "uuid"
  value moved first; CSV has no field names, so they decode as dicts keyed
  "uuid", "c1", "c2", ... holding strings.
* `Message` models are written in field order (`uuid` first, as the base class
  declares it), None as an empty cell; decoding needs exactly that many
  columns and validates the strings with pydantic's lax coercion. An empty cell
  is None for fields that accept None. Flat models of scalar fields round-trip.

A quoted field may hold newlines, so a record doesn't always end at the first
newline. The decoder tracks, per line, whether it ends inside a quoted field,
with the same rules as Python's csv reader; state carries over between chunks,
so bytes are scanned once however a long record is split. Blank lines are
skipped (as Go's and Python's CSV readers do); a record whose first column
isn't a UUID is reported with its offset, its end and its bytes, and skipped:
a bad record is exactly one frame, so a shard may skip or dead-letter just it.
"""

from __future__ import annotations

import csv
import io
import types
import typing
from typing import Any
from uuid import UUID

from pydantic import ValidationError

from streamkit.message.framing import (
    LineDecoderBase,
    acknowledgement_of,
    message_kind,
    validation_summary,
)
from streamkit.message.message import UUID_FIELD, Envelope, Message, MessageLike

__all__ = ["CONTENT_TYPE", "CsvDecoder", "CsvFraming"]

CONTENT_TYPE = "text/csv"

_QUOTE = 0x22  # '"'


class _Sink:
    """A write-only file for csv.writer that collects what it writes."""

    __slots__ = ("data",)

    def __init__(self) -> None:
        self.data = ""

    def write(self, text: str) -> int:
        self.data = text
        return len(text)


class CsvFraming:
    """CSV framing (stateless apart from a cache, so one instance serves all threads)."""

    content_type = CONTENT_TYPE

    def __init__(self) -> None:
        self._fields: dict[type[Message], tuple[str, ...]] = {}

    def encode(self, message: MessageLike, out: bytearray) -> None:
        """Append one CSV record (ending "\\r\\n") of the message to `out`."""
        if isinstance(message, dict):
            values = list(message.values())
            if UUID_FIELD in message:
                keys = list(message)
                values.insert(0, values.pop(keys.index(UUID_FIELD)))
            else:
                values.insert(0, "")
        elif isinstance(message, Message):
            names = self._fields.get(type(message))
            if names is None:
                names = self._fields[type(message)] = tuple(type(message).model_fields)
            dumped = message.model_dump(mode="json")  # str/int/float/bool/None
            # Fields missing from a model_construct()ed acknowledgement are blank.
            values = [dumped.get(name) for name in names]
        else:
            raise TypeError(f"cannot CSV-frame a {type(message).__name__}")
        sink = _Sink()
        csv.writer(sink).writerow([_cell(value) for value in values])
        out += sink.data.encode()

    def new_decoder(self, journal: str, message_type: type) -> CsvDecoder:
        return CsvDecoder(journal, message_type)


def _cell(value: Any) -> Any:
    """Cells as Python's csv writes them, except booleans in JSON spelling."""
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, UUID):
        return str(value)
    return value


def _ends_in_quotes(line: bytes, in_quotes: bool) -> bool:
    """Whether the newline after `line` falls inside a quoted field.

    `in_quotes` says whether the line starts inside one (else it starts a
    record). A quote opens a quoted field only at the start of a field; inside,
    a doubled quote is a literal quote and a single one closes it, after which
    (like Python's non-strict reader) the field continues unquoted up to the
    next comma. Only the quote and comma positions are visited, with find().
    """
    n = len(line)
    if in_quotes:
        pos = 0
    elif n and line[0] == _QUOTE:
        pos = 1
    else:
        comma_quote = line.find(b',"')
        if comma_quote < 0:
            return False
        pos = comma_quote + 2
    while True:  # inside a quoted field, at pos
        quote = line.find(b'"', pos)
        if quote < 0:
            return True
        if quote + 1 < n and line[quote + 1] == _QUOTE:
            pos = quote + 2
            continue
        comma_quote = line.find(b',"', quote + 1)
        if comma_quote < 0:
            return False
        pos = comma_quote + 2


def _allows_none(annotation: Any) -> bool:
    if annotation is None or annotation is types.NoneType or annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _allows_none(typing.get_args(annotation)[0])
    if origin is typing.Union or origin is types.UnionType:
        return any(_allows_none(arg) for arg in typing.get_args(annotation))
    return False


class CsvDecoder(LineDecoderBase):
    """Finds record boundaries incrementally, then parses records with `csv`."""

    def __init__(self, journal: str, message_type: type) -> None:
        super().__init__(journal)
        self.message_type = message_type
        self._kind = message_kind(message_type)
        if self._kind == "proto":
            raise TypeError("the CSV framing decodes to dicts or Message models, not protobuf")
        self._keys: list[str] = [UUID_FIELD]
        if self._kind == "model":
            fields = message_type.model_fields
            self._keys = list(fields)
            self._nullable = frozenset(
                name for name, info in fields.items() if _allows_none(info.annotation)
            )
        # Beyond the unfinished last line (the base class's pieces): lines of an
        # unfinished record (scanned; it continues in quotes). `_start` is where
        # that record starts, `_line_start` where the unfinished last line does.
        self._record_lines: list[bytes] = []
        self._line_start = 0

    def _start_at(self, offset: int) -> None:
        self._record_lines.clear()
        self._start = self._line_start = offset

    def feed(self, chunk: bytes | memoryview, offset: int) -> list[Envelope]:
        split = self._complete_lines(chunk, offset)
        if split is None:
            return []
        lines, tail = split

        # Group complete lines into records: [begin, end) and the record's bytes.
        spans: list[tuple[int, int, bytes]] = []
        record_lines = self._record_lines
        begin = self._start
        end = self._line_start
        for line in lines:
            end += len(line) + 1
            if record_lines:
                record_lines.append(line)
                if not _ends_in_quotes(line, True):
                    spans.append((begin, end, b"\n".join(record_lines)))
                    record_lines.clear()
                    begin = end
            elif b'"' not in line or not _ends_in_quotes(line, False):
                spans.append((begin, end, line))
                begin = end
            else:
                record_lines.append(line)
        self._start = begin  # the unfinished record, if any, starts here
        self._line_start = end
        self._pending = (end - begin) + len(tail)
        return self._decode(spans)

    def _decode(self, spans: list[tuple[int, int, bytes]]) -> list[Envelope]:
        # All records in one csv.reader pass; per record only if some record is bad.
        rows: list[list[str] | str]
        try:
            texts = [record.decode() for _, _, record in spans]
            rows = list(csv.reader(texts))
            if len(rows) != len(spans):  # can't happen for records split as above
                raise csv.Error("record count mismatch")
        except (UnicodeDecodeError, csv.Error):
            rows = [_parse_one(record) for _, _, record in spans]

        journal = self.journal
        out: list[Envelope] = []
        for span, row in zip(spans, rows, strict=True):
            if row:  # else a blank line
                message = self._message(row) if isinstance(row, list) else row
                begin, end, record = span
                if isinstance(message, str):
                    self._report(begin, message, end, record + b"\n")
                else:
                    out.append(Envelope(journal, begin, end, message))
        return out

    def _message(self, row: list[str]) -> MessageLike | str:
        """The record's message, or why it isn't one."""
        if self._kind == "dict":
            try:
                UUID(row[0])
            except ValueError:
                return f"first column is not a UUID: {row[0][:40]!r}"
            keys = self._keys
            while len(keys) < len(row):
                keys.append(f"c{len(keys)}")
            return dict(zip(keys, row, strict=False))

        model: type[Message] = self.message_type
        if len(row) != len(self._keys):
            return f"{len(row)} columns, but {model.__name__} has {len(self._keys)} fields"
        nullable = self._nullable
        values = {
            key: None if value == "" and key in nullable else value
            for key, value in zip(self._keys, row, strict=True)
        }
        try:
            return model.model_validate(values)
        except ValidationError as exc:
            ack = acknowledgement_of(model, row[0])
            if ack is None:
                return f"not a valid {model.__name__}: {validation_summary(exc, '(record)')}"
            return ack


def _parse_one(record: bytes) -> list[str] | str:
    """One record's fields, or why it isn't a record."""
    try:
        return next(csv.reader(io.StringIO(record.decode(), newline="")), [])
    except UnicodeDecodeError as exc:
        return f"invalid UTF-8: {exc}"
    except csv.Error as exc:
        return f"invalid CSV: {exc}"


