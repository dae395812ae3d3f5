"""`application/x-protobuf-fixed`: length-prefixed protobuf frames.

Wire format (Gazette's fixed framing): the magic word 66 33 93 36, a uint32
little-endian payload length, then the serialized protobuf message. The magic
word exists to detect a stream that is out of step (a torn append, garbage, a
read starting mid-frame): the decoder then reports the offset and scans forward
to the next magic word.

A length over `max_frame_size` (64 MiB by default) is treated as corruption
rather than waited for, since waiting would buffer unbounded garbage. A frame
whose payload fails to parse is reported and scanning resumes one byte after its
start, not after its declared end: if the length field itself is what got
corrupted, trusting it could swallow the frames that follow.
"""

from __future__ import annotations

import struct

from google.protobuf.message import DecodeError
from google.protobuf.message import Message as ProtoMessage

from streamkit.message.framing import DecoderBase, message_kind
from streamkit.message.message import Envelope, MessageLike

__all__ = [
    "CONTENT_TYPE",
    "DEFAULT_MAX_FRAME_SIZE",
    "HEADER_LENGTH",
    "MAGIC",
    "FixedDecoder",
    "FixedFraming",
]

CONTENT_TYPE = "application/x-protobuf-fixed"
MAGIC = b"\x66\x33\x93\x36"
HEADER_LENGTH = 8
DEFAULT_MAX_FRAME_SIZE = 64 << 20

_HEADER = struct.Struct("<4sI")
_LENGTH = struct.Struct("<I")


class FixedFraming:
    """Fixed-header protobuf framing."""

    content_type = CONTENT_TYPE

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self.max_frame_size = max_frame_size

    def encode(self, message: MessageLike, out: bytearray) -> None:
        """Append header and payload; a payload readers would refuse is a ValueError."""
        if not isinstance(message, ProtoMessage):
            raise TypeError(f"the fixed framing needs a protobuf message, not {type(message)}")
        payload = message.SerializeToString()
        if len(payload) > self.max_frame_size:
            raise ValueError(
                f"{type(message).__name__} of {len(payload)} bytes is over the "
                f"{self.max_frame_size}-byte frame limit"
            )
        out += _HEADER.pack(MAGIC, len(payload))
        out += payload

    def new_decoder(self, journal: str, message_type: type) -> FixedDecoder:
        return FixedDecoder(journal, message_type, self.max_frame_size)


class FixedDecoder(DecoderBase):
    """Decodes frames from a growing buffer; consumed bytes are dropped per feed."""

    def __init__(
        self, journal: str, message_type: type, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    ) -> None:
        super().__init__(journal)
        if message_kind(message_type) != "proto":
            raise TypeError("the fixed framing decodes protobuf messages only")
        self.message_type = message_type
        self.max_frame_size = max_frame_size
        self._buf = bytearray()
        self._base = 0  # journal offset of _buf[0]
        self._skipping = False  # inside reported garbage: don't report it again

    def reset(self, offset: int) -> None:
        self._buf.clear()
        self._base = offset
        self._next = offset
        self._skipping = False

    def feed(self, chunk: bytes | memoryview, offset: int) -> list[Envelope]:
        buf = self._buf
        if not self._check_offset(offset, len(buf)):
            self.reset(offset)
        elif self._next is None:
            self._base = offset
        buf += chunk
        self._next = offset + len(chunk)

        journal, base, size = self.journal, self._base, len(buf)
        new = self.message_type
        limit = self.max_frame_size
        out: list[Envelope] = []
        pos = 0
        while size - pos >= 4:
            if not buf.startswith(MAGIC, pos):
                if not self._skipping:
                    self._report(base + pos, "no magic word: stream out of sync, skipping")
                    self._skipping = True
                found = buf.find(MAGIC, pos + 1)
                if found < 0:
                    pos = size - 3  # the last 3 bytes may begin a magic word
                    break
                pos = found
                continue
            if size - pos < HEADER_LENGTH:
                break
            (length,) = _LENGTH.unpack_from(buf, pos + 4)
            if length > limit:
                self._report(base + pos, f"oversize frame: length {length} is over {limit}")
                self._skipping = True
                pos += 1
                continue
            end = pos + HEADER_LENGTH + length
            if end > size:
                break
            message = new()
            try:
                message.ParseFromString(bytes(buf[pos + HEADER_LENGTH : end]))
            except DecodeError as exc:
                self._report(base + pos, f"payload is not a {new.__name__}: {exc}")
                self._skipping = True
                pos += 1
                continue
            self._skipping = False
            out.append(Envelope(journal, base + pos, base + end, message))
            pos = end
        if pos:
            del buf[:pos]
            self._base = base + pos
        return out
