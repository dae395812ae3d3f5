"""Message UUIDs: RFC 4122 version-1 UUIDs that carry a producer, a clock and flags.

Bit layout, identical to Gazette's so either side parses the other's UUIDs:

* node (last 6 bytes): the ProducerID, 6 random bytes with the multicast bit set
  (so it can never be a real MAC address);
* timestamp (60 bits, time_low/time_mid/time_hi with version 1): the Clock's
  high 60 bits, in 100 ns units since 1582-10-15;
* clock sequence (14 bits after the 2 variant bits): the Clock's low 4 bits (a
  counter that orders UUIDs made within one 100 ns tick), then 10 bits of Flags.

A Clock is thus `timestamp << 4 | counter`, a single int that totally orders the
UUIDs of one producer.
"""

from __future__ import annotations

import enum
import os
import time
import uuid as _uuid

UUID = _uuid.UUID

# 100 ns intervals between the UUID epoch (1582-10-15) and the Unix epoch.
_GREGORIAN_OFFSET = 122_192_928_000_000_000
FLAGS_MASK = 0x3FF


class Flags(enum.IntEnum):
    """Transaction semantics of a message (the UUID's low 10 clock-sequence bits)."""

    OUTSIDE_TXN = 0x0  # committed on its own: process it as soon as it is read
    CONTINUE_TXN = 0x1  # part of a transaction: wait for an ACK_TXN with a larger clock
    ACK_TXN = 0x2  # commits the producer's earlier CONTINUE_TXNs; a smaller clock rolls back


def new_producer_id() -> bytes:
    """A random 6-byte ProducerID with the multicast bit set, as RFC 4122 asks."""
    raw = bytearray(os.urandom(6))
    raw[0] |= 0x01
    return bytes(raw)


def clock_at(unix_ns: int) -> int:
    """The Clock value of a wall-clock time (counter zero), precise to 100 ns."""
    return (unix_ns // 100 + _GREGORIAN_OFFSET) << 4


def clock_unix_ns(clock: int) -> int:
    """The wall-clock time (Unix ns) of a Clock's timestamp, ignoring its counter."""
    return ((clock >> 4) - _GREGORIAN_OFFSET) * 100


class Clock:
    """A monotonic Clock: `tick` and `update` never move it backwards.

    Publishers tick once per message; the counter bits absorb up to 16 UUIDs per
    100 ns before the clock runs ahead of wall time (it then simply keeps ticking).
    """

    __slots__ = ("value",)

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def tick(self) -> int:
        """Advance by one and return the new value."""
        self.value += 1
        return self.value

    def update(self, unix_ns: int | None = None) -> int:
        """Move to a wall-clock time (default: now) unless that would go backwards."""
        now = clock_at(time.time_ns() if unix_ns is None else unix_ns)
        if now > self.value:
            self.value = now
        return self.value

    def __repr__(self) -> str:
        return f"Clock({self.value})"


def build_uuid(producer: bytes, clock: int, flags: int) -> UUID:
    """The v1 UUID of a producer's message at `clock` with `flags`."""
    if not 0 <= flags <= FLAGS_MASK:
        raise ValueError(f"flags must fit in 10 bits (got {flags:#x})")
    if len(producer) != 6:
        raise ValueError(f"a ProducerID is 6 bytes (got {len(producer)})")
    stamp = clock >> 4
    value = (
        (stamp & 0xFFFFFFFF) << 96  # time_low
        | ((stamp >> 32) & 0xFFFF) << 80  # time_mid
        | (((stamp >> 48) & 0x0FFF) | 0x1000) << 64  # time_hi and version 1
        | (0x8000 | (clock & 0xF) << 10 | flags) << 48  # variant, counter, flags
        | int.from_bytes(producer, "big")
    )
    return UUID(int=value)


class UuidText:
    """The text of a producer's UUIDs (what `str(build_uuid(...))` gives), formatted from
    ints: the publishing hot path makes one per message, and building a `uuid.UUID` just
    to print it costs four times as much. time_mid and time_hi change once every
    2**32 ticks of 100 ns (about 7 minutes), so their text is kept."""

    __slots__ = ("_high", "_high_text", "_node")

    def __init__(self, producer: bytes) -> None:
        if len(producer) != 6:
            raise ValueError(f"a ProducerID is 6 bytes (got {len(producer)})")
        self._node = producer.hex()
        self._high = -1
        self._high_text = ""

    def __call__(self, clock: int, flags: int) -> str:
        if not 0 <= flags <= FLAGS_MASK:
            raise ValueError(f"flags must fit in 10 bits (got {flags:#x})")
        stamp = clock >> 4
        high = stamp >> 32
        if high != self._high:
            self._high_text = f"-{high & 0xFFFF:04x}-{((high >> 16) & 0x0FFF) | 0x1000:04x}-"
            self._high = high
        return "%08x%s%04x-%s" % (  # noqa: UP031 (%-formatting is the fastest here)
            stamp & 0xFFFFFFFF, self._high_text, 0x8000 | (clock & 0xF) << 10 | flags,
            self._node)


def producer_of(u: UUID) -> bytes:
    return (u.int & 0xFFFF_FFFF_FFFF).to_bytes(6, "big")


def clock_of(u: UUID) -> int:
    value = u.int
    stamp = (
        (value >> 96) & 0xFFFFFFFF
        | ((value >> 80) & 0xFFFF) << 32
        | ((value >> 64) & 0x0FFF) << 48
    )
    return stamp << 4 | (value >> 58) & 0xF


def flags_of(u: UUID) -> int:
    return (u.int >> 48) & FLAGS_MASK


def parse_uuid(u: UUID) -> tuple[bytes, int, int]:
    """(producer, clock, flags) of a message UUID."""
    return producer_of(u), clock_of(u), flags_of(u)
