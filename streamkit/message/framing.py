"""Framings: how messages are laid out as bytes in a journal, and the registry of them.

A journal names its framing with its `content-type` label. Writers append whole
frames (`Framing.encode`); readers feed whatever chunks the broker returns to a
`FrameDecoder`, which yields an `Envelope` per complete frame with the exact byte
range [begin, end) the frame occupies, so a reader can checkpoint "just after
this message" and resume there.

Journals are shared and long-lived, so one bad frame must not stop a reader: a
decoder reports it (a warning log and a bounded `errors` list of `FrameError`s,
each naming journal and offset), skips it and finds the next frame boundary.
When the framing knows exactly where the bad frame ends (a line of JSON or
CSV), the FrameError also holds its end and bytes: then a shard may skip (or
dead-letter) exactly that frame, by its source's policy. A decoder that had to
resynchronize by scanning (the fixed protobuf framing) can't say, and a shard
fails on such an error whatever its policy.

Built-in framings, registered on first registry use:

* `application/x-ndjson` -- one JSON object per line (`framings.json_lines`);
* `text/csv` -- one CSV record per message, UUID first (`framings.csv_lines`);
* `application/x-protobuf-fixed` -- magic word, length, protobuf (`framings.fixed`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Literal, Protocol, runtime_checkable
from uuid import UUID

from google.protobuf.message import Message as ProtoMessage
from pydantic import ValidationError

from streamkit.errors import StreamkitError
from streamkit.message.message import UUID_FIELD, Envelope, Message, MessageLike
from streamkit.message.uuid import Flags, flags_of
from streamkit.protocol import pb

__all__ = [
    "CONTENT_TYPE_LABEL",
    "MAX_ERRORS",
    "DecoderBase",
    "FrameDecoder",
    "FrameError",
    "Framing",
    "UnknownFraming",
    "acknowledgement_of",
    "content_type_of",
    "framing_for",
    "message_kind",
    "register_framing",
    "registered_content_types",
]

log = logging.getLogger(__name__)

CONTENT_TYPE_LABEL = "content-type"
# How many recent FrameErrors a decoder keeps; older ones are only in the log.
MAX_ERRORS = 100


class FrameError(StreamkitError, ValueError):
    """A frame that could not be decoded: where it was and why.

    `end` and `frame` are the bad frame's end offset and exact bytes when the
    decoder skipped exactly that frame (`skippable`); None when it had to
    resynchronize, so what it passed over is not known to be one frame.
    """

    def __init__(
        self,
        journal: str,
        offset: int,
        reason: str,
        end: int | None = None,
        frame: bytes | None = None,
    ) -> None:
        super().__init__(f"bad frame in journal {journal!r} at offset {offset}: {reason}")
        self.journal = journal
        self.offset = offset
        self.reason = reason
        self.end = end
        self.frame = frame

    @property
    def skippable(self) -> bool:
        """Whether the frame's extent and bytes are known, so that exactly it can be skipped."""
        return self.end is not None and self.frame is not None

    def __reduce__(
        self,
    ) -> tuple[type[FrameError], tuple[str, int, str, int | None, bytes | None]]:
        # Default pickling would call FrameError(message); keep the fields instead.
        return (type(self), (self.journal, self.offset, self.reason, self.end, self.frame))


class UnknownFraming(StreamkitError, ValueError):
    """No framing is registered for a journal's content-type."""


@runtime_checkable
class FrameDecoder(Protocol):
    """Incremental decoder of one journal's byte stream into Envelopes."""

    errors: list[FrameError]

    def feed(self, chunk: bytes | memoryview, offset: int) -> list[Envelope]:
        """Decode the complete frames available after adding `chunk` (at `offset`)."""
        ...

    def reset(self, offset: int) -> None:
        """Drop any partial frame: the stream continues at `offset`."""
        ...


@runtime_checkable
class Framing(Protocol):
    """Encodes messages to frames and makes decoders for a content-type.

    A framing may also have `frame_dict(message: dict) -> bytes`, returning the
    frame `encode` would append for a dict message: publishers then use it.
    """

    content_type: str

    def encode(self, message: MessageLike, out: bytearray) -> None:
        """Append exactly one complete frame of `message` to `out`."""
        ...

    def new_decoder(self, journal: str, message_type: type) -> FrameDecoder:
        """A decoder of `journal` producing `message_type` instances (or dicts)."""
        ...


class DecoderBase:
    """Offset bookkeeping and error reporting shared by the built-in decoders.

    `_next` is the journal offset the next fed chunk must start at, or None
    before the first chunk (any offset is then accepted). `on_error`, if set,
    is called with every FrameError as it is reported: unlike `errors`, it
    misses none however many a chunk holds (a shard passes them on this way).
    """

    def __init__(self, journal: str) -> None:
        self.journal = journal
        self.errors: list[FrameError] = []
        self.on_error: Callable[[FrameError], None] | None = None
        self._next: int | None = None

    def _report(
        self, offset: int, reason: str, end: int | None = None, frame: bytes | None = None
    ) -> None:
        """Report a bad frame; with `end` and `frame` when exactly [offset, end) was skipped."""
        error = FrameError(self.journal, offset, reason, end, frame)
        log.warning("%s", error)
        self.errors.append(error)
        if len(self.errors) > MAX_ERRORS:
            del self.errors[: len(self.errors) - MAX_ERRORS]
        if self.on_error is not None:
            self.on_error(error)

    def _check_offset(self, offset: int, buffered: int) -> bool:
        """Whether a chunk at `offset` continues the stream; False means start over.

        With nothing buffered any offset is fine (the caller skipped ahead, which
        is its business). A jump while a partial frame is buffered loses that
        frame: it is reported, and the caller should have called reset().
        """
        if self._next is None or offset == self._next:
            return True
        if buffered:
            self._report(
                self._next - buffered,
                f"partial frame of {buffered} bytes dropped: next chunk is at offset "
                f"{offset}, not {self._next}",
            )
        return False


MessageKind = Literal["dict", "model", "proto"]


def message_kind(message_type: type) -> MessageKind:
    """Which of the three message kinds a decoder's `message_type` asks for."""
    if message_type is dict:
        return "dict"
    if isinstance(message_type, type):
        if issubclass(message_type, Message):
            return "model"
        if issubclass(message_type, ProtoMessage):
            return "proto"
    raise TypeError(
        f"message_type must be dict, a Message subclass or a protobuf message class "
        f"(got {message_type!r})"
    )


def acknowledgement_of(model: type[Message], raw_uuid: object) -> Message | None:
    """An ACK_TXN message of `model` carrying `raw_uuid`, if that is an ACK's UUID.

    A model's default acknowledgement is `model_construct()` with only a UUID, so
    models with required fields can't re-validate their own ACKs. Readers need
    those ACKs to commit transactions, so a frame that fails validation but has
    an ACK_TXN UUID decodes to a bare acknowledgement instead of an error.
    """
    if not isinstance(raw_uuid, str):
        return None
    try:
        uuid = UUID(raw_uuid)
    except ValueError:
        return None
    if uuid.version != 1 or not flags_of(uuid) & Flags.ACK_TXN:
        return None
    return model.model_construct(**{UUID_FIELD: uuid})


# content-type -> framing. Writes happen at import/startup; a lock keeps the lazy
# built-in registration from racing a concurrent first lookup.
_registry: dict[str, Framing] = {}
_lock = threading.Lock()
_builtins_loaded = False


def _normalize(content_type: str) -> str:
    """The bare media type: parameters dropped, lower-cased ("text/csv; x=y" -> "text/csv")."""
    return content_type.split(";", 1)[0].strip().lower()


def _load_builtins() -> None:
    """Register the built-in framings once, without replacing earlier registrations.

    Deferred to first use because the framing modules import this one.
    """
    global _builtins_loaded
    if _builtins_loaded:
        return
    with _lock:
        if _builtins_loaded:
            return
        from streamkit.message.framings import BUILTIN_FRAMINGS

        for content_type, framing in BUILTIN_FRAMINGS.items():
            _registry.setdefault(content_type, framing)
        _builtins_loaded = True


def register_framing(framing: Framing, *aliases: str) -> None:
    """Register `framing` under its content_type (and any aliases), replacing earlier ones."""
    _load_builtins()
    with _lock:
        for content_type in (framing.content_type, *aliases):
            _registry[_normalize(content_type)] = framing


def framing_for(content_type: str) -> Framing:
    """The framing of a content-type label value; parameters and case are ignored."""
    _load_builtins()
    framing = _registry.get(content_type) or _registry.get(_normalize(content_type))
    if framing is None:
        known = ", ".join(sorted(_registry))
        raise UnknownFraming(
            f"no message framing for content-type {content_type!r} (known: {known})"
        )
    return framing


def registered_content_types() -> list[str]:
    """Every content-type with a framing, sorted."""
    _load_builtins()
    return sorted(_registry)


def content_type_of(labels: pb.LabelSet) -> str:
    """The value of a journal's `content-type` label, or "" if it has none."""
    for label in labels.labels:
        if label.name == CONTENT_TYPE_LABEL:
            return label.value
    return ""


class LineDecoderBase(DecoderBase):
    """Decoders of newline-terminated frames (JSON lines, CSV).

    Holds the unfinished last line across chunks in `_pieces` (`_pending`
    bytes); `_start` is the offset where the next frame begins.
    """

    def __init__(self, journal: str) -> None:
        super().__init__(journal)
        self._pieces: list[bytes] = []
        self._pending = 0
        self._start = 0

    def reset(self, offset: int) -> None:
        self._pieces.clear()
        self._pending = 0
        self._start_at(offset)
        self._next = offset

    def _start_at(self, offset: int) -> None:
        """The next frame starts at `offset` (first chunk, or after a reset)."""
        self._start = offset

    def _complete_lines(
        self, chunk: bytes | memoryview, offset: int
    ) -> tuple[list[bytes], bytes] | None:
        """Lines this chunk completes and the new unfinished tail; None if none completed."""
        if not self._check_offset(offset, self._pending):
            self.reset(offset)
        elif self._next is None:
            self._start_at(offset)
        data = bytes(chunk) if not isinstance(chunk, bytes) else chunk
        self._next = offset + len(data)
        split = split_lines(self._pieces, data)
        if split is None:
            self._pending += len(data)
        return split


def split_lines(pieces: list[bytes], data: bytes) -> tuple[list[bytes], bytes] | None:
    """Complete lines (newlines removed) that `data` finishes, and the new unfinished tail.

    `pieces` holds the unfinished last line across calls; it is joined only
    once its newline arrives, so a long line fed in many chunks costs linear
    time. Returns None (holding `data`) when `data` finishes no line.
    """
    last = data.rfind(b"\n")
    if last < 0:
        if data:
            pieces.append(data)
        return None
    if pieces:
        pieces.append(data[:last])
        lines = b"".join(pieces).split(b"\n")
        pieces.clear()
    else:
        lines = data[:last].split(b"\n")
    tail = data[last + 1 :]
    if tail:
        pieces.append(tail)
    return lines, tail


def validation_summary(exc: ValidationError, whole: str = "(message)") -> str:
    """A one-line summary of a pydantic error (its full text spans lines per error)."""
    errors = exc.errors(include_url=False)
    if not errors:
        return str(exc)
    first = errors[0]
    where = ".".join(str(part) for part in first["loc"]) or whole
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {first['msg']}{more}"
