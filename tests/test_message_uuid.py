"""Message UUIDs are bit-exact with Gazette's layout."""

from __future__ import annotations

import uuid

from hypothesis import given
from hypothesis import strategies as st

from streamkit.message.uuid import (
    Clock,
    Flags,
    UuidText,
    build_uuid,
    clock_at,
    clock_unix_ns,
    new_producer_id,
    parse_uuid,
)

PRODUCER = bytes.fromhex("e71e350dbf79")


def test_known_vector() -> None:
    # Gazette's TestUUIDBuilding fixture: 2019-09-01T02:23:41.981273734Z, two ticks,
    # flags 0b1010101010. Two ticks advance the 4-bit counter (not the timestamp).
    clock = Clock()
    clock.update(1567304621 * 10**9 + 981273734)
    clock.tick()
    clock.tick()
    built = build_uuid(PRODUCER, clock.value, 682)
    assert str(built) == "83fc2f81-cc5f-11e9-8aaa-e71e350dbf79"
    assert built.bytes == bytes.fromhex("83fc2f81cc5f11e98aaae71e350dbf79")
    assert parse_uuid(built) == (PRODUCER, clock.value, 682)
    # Ordinary v1 UUID readers agree on version, variant, node and time.
    assert built.version == 1 and built.variant == uuid.RFC_4122
    assert built.node == int.from_bytes(PRODUCER, "big")
    assert built.time == clock.value >> 4
    assert clock_unix_ns(clock.value) == 1567304621_981273700


def test_flag_values_match_gazette() -> None:
    assert (Flags.OUTSIDE_TXN, Flags.CONTINUE_TXN, Flags.ACK_TXN) == (0, 1, 2)


def test_clock_never_goes_backwards() -> None:
    clock = Clock()
    assert clock.tick() == 1 and clock.tick() == 2
    clock.update(12 * 10**9 + 300)
    assert clock.value == clock_at(12 * 10**9 + 399)  # precise to 100 ns
    clock.tick()
    before = clock.value
    clock.update(11 * 10**9)  # earlier wall time: no change
    assert clock.value == before
    clock.update(12 * 10**9 + 5000)  # later: counter bits reset
    assert clock.value == clock_at(12 * 10**9 + 5000)


def test_producer_ids_are_random_multicast() -> None:
    ids = {new_producer_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(p[0] & 1 for p in ids)


@given(
    producer=st.binary(min_size=6, max_size=6),
    clock=st.integers(min_value=0, max_value=(1 << 64) - 1),
    flags=st.integers(min_value=0, max_value=0x3FF),
)
def test_round_trip(producer: bytes, clock: int, flags: int) -> None:
    built = build_uuid(producer, clock, flags)
    assert parse_uuid(built) == (producer, clock, flags)
    assert built.version == 1 and built.variant == uuid.RFC_4122


@given(st.binary(min_size=6, max_size=6),
       st.lists(st.tuples(st.integers(0, (1 << 64) - 1), st.integers(0, 0x3FF)),
                min_size=1, max_size=20))
def test_uuid_text_is_the_uuids_text(producer: bytes, clocks: list[tuple[int, int]]) -> None:
    """The publisher's fast formatting equals str(UUID) for any clock, flags and producer,
    also as the cached time_mid/time_hi text changes from one clock to the next."""
    text = UuidText(producer)
    for clock, flags in clocks:
        assert text(clock, flags) == str(build_uuid(producer, clock, flags))
    text = UuidText(PRODUCER)
    assert text(Clock(0).update(1567304621 * 10**9 + 981273734) + 2, 682) == \
        "83fc2f81-cc5f-11e9-8aaa-e71e350dbf79"
