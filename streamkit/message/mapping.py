"""Mapping functions: which journal of a set of partitions a message goes to.

A MappingFunc takes a message and returns `(journal name, content type)`;
the Publisher then frames the message by that content type. The helpers here
build MappingFuncs over *partitions*, a callable returning the journals that
currently make up a logical "topic" (typically a PolledList's listing, kept
fresh in the background):

* `modulo_mapping`: FNV-1a of the message's key, modulo the number of
  partitions. Cheapest, but adding a partition moves most keys.
* `rendezvous_mapping`: highest random weight hashing over the same FNV-1a
  key hash. A little more work per message (one XOR per partition), and
  adding or removing a partition moves only the keys it wins or loses.
* `random_mapping`: any partition, for messages without a key.

Hashing and the choice of partition follow Gazette's routines bit for bit,
so a Python and a Go producer send a key to the same journal.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from typing import Any

from streamkit.client.listing import PolledList
from streamkit.errors import StreamkitError
from streamkit.message.framing import content_type_of
from streamkit.protocol import pb
from streamkit.protocol.labels import format_selector

__all__ = [
    "EmptyPartitions",
    "KeyFunc",
    "MappingFunc",
    "Partitions",
    "PolledPartitions",
    "StaticPartitions",
    "field_key",
    "fnv1a32",
    "modulo_mapping",
    "partitions_from",
    "random_mapping",
    "rendezvous_mapping",
]

Journal = pb.ListResponse.Journal
# The current partitions. A returned sequence is treated as immutable: return
# a new one when the set changes (PolledList does), so derived data is reused.
Partitions = Callable[[], Sequence[Journal]]
MappingFunc = Callable[[Any], tuple[str, str]]
# A message's mapping key; str keys are hashed as their UTF-8 bytes.
KeyFunc = Callable[[Any], bytes | str]

_FNV_OFFSET = 0x811C9DC5
_FNV_PRIME = 0x01000193


class EmptyPartitions(StreamkitError, LookupError):
    """No journal currently matches the partitions' selector (Gazette's ErrEmptyListResponse).

    Mapping fails before anything is appended, so the caller may simply retry
    later, e.g. once the journals have been created.
    """

    def __init__(self, selector: str | None = None) -> None:
        self.selector = selector
        where = f"selector {selector!r}" if selector else "the partitions"
        super().__init__(f"no journals match {where}: nothing to map messages to")


def fnv1a32(data: bytes) -> int:
    """32-bit FNV-1a of `data`, as Go's hash/fnv New32a computes it."""
    h = _FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * _FNV_PRIME) & 0xFFFFFFFF
    return h


class StaticPartitions:
    """A fixed set of journals as partitions (tests, one-shot tools)."""

    __slots__ = ("journals", "selector")

    def __init__(self, journals: Sequence[Journal], selector: str | None = None) -> None:
        self.journals = list(journals)
        self.selector = selector

    def __call__(self) -> Sequence[Journal]:
        return self.journals


class PolledPartitions:
    """The latest listing of a PolledList as partitions."""

    __slots__ = ("polled", "selector")

    def __init__(self, polled: PolledList) -> None:
        self.polled = polled
        self.selector = format_selector(polled.selector)

    def __call__(self) -> Sequence[Journal]:
        return self.polled.current


def partitions_from(polled: PolledList) -> PolledPartitions:
    """Partitions that follow `polled` (start it first); errors name its selector."""
    return PolledPartitions(polled)


class _Listing:
    """Data derived once per listing: names sorted, their content types and FNV-1a hashes."""

    __slots__ = ("content_types", "count", "hashes", "names")

    def __init__(self, journals: Sequence[Journal], *, hashes: bool) -> None:
        ordered = sorted(journals, key=lambda journal: journal.spec.name)
        self.count = len(journals)
        self.names = [journal.spec.name for journal in ordered]
        self.content_types = [content_type_of(journal.spec.labels) for journal in ordered]
        self.hashes = [fnv1a32(name.encode()) for name in self.names] if hashes else []


class _Cached:
    """Partitions whose derived `_Listing` is recomputed only when the listing changes."""

    __slots__ = ("_listing", "_partitions", "_selector", "_source", "_with_hashes")

    def __init__(self, partitions: Partitions, *, hashes: bool = False) -> None:
        self._partitions = partitions
        self._selector: str | None = getattr(partitions, "selector", None)
        self._with_hashes = hashes
        self._source: Sequence[Journal] | None = None
        self._listing = _Listing((), hashes=False)

    def __call__(self) -> _Listing:
        current = self._partitions()
        listing = self._listing
        # Identity, like Gazette's pointer comparison; the length catches in-place growth.
        if current is not self._source or len(current) != listing.count:
            self._source = current
            listing = self._listing = _Listing(current, hashes=self._with_hashes)
        if not listing.count:
            raise EmptyPartitions(self._selector)
        return listing


@functools.lru_cache(maxsize=1 << 16)
def _cached_hash(value: str | bytes) -> int:
    return fnv1a32(value.encode() if isinstance(value, str) else value)


def _key_hash(key: KeyFunc, message: Any) -> int:
    """fnv1a32 of the message's key. Keys repeat (words, accounts, users), and FNV in
    Python costs about 3 us for a short key, so hashes are cached."""
    value = key(message)
    try:
        return _cached_hash(value)
    except TypeError:  # unhashable (a bytearray): hashed each time
        return fnv1a32(value)


def modulo_mapping(key: KeyFunc, partitions: Partitions) -> MappingFunc:
    """Map to the partition at index fnv1a32(key) % count, partitions sorted by name."""
    listing_of = _Cached(partitions)

    def mapping(message: Any) -> tuple[str, str]:
        listing = listing_of()
        index = _key_hash(key, message) % listing.count
        return listing.names[index], listing.content_types[index]

    return mapping


def rendezvous_mapping(key: KeyFunc, partitions: Partitions) -> MappingFunc:
    """Map to the partition maximizing fnv1a32(key) XOR fnv1a32(journal name).

    The first partition (by name) wins a tie, as in Gazette, where a tie means
    two journal names with the same hash. Kept bit-compatible with Gazette,
    including its weakness: XOR weights of one key are not independent across
    partitions, so with few, similarly named journals the shares are uneven
    (8 journals "part-000".."part-007" get between 6% and 25% of keys each).
    """
    listing_of = _Cached(partitions, hashes=True)

    def mapping(message: Any) -> tuple[str, str]:
        listing = listing_of()
        digest = _key_hash(key, message)
        scores = [digest ^ name_hash for name_hash in listing.hashes]
        index = scores.index(max(scores))
        return listing.names[index], listing.content_types[index]

    return mapping


def random_mapping(partitions: Partitions) -> MappingFunc:
    """Map each message to a partition chosen uniformly at random."""
    listing_of = _Cached(partitions)

    def mapping(message: Any) -> tuple[str, str]:
        listing = listing_of()
        index = random.randrange(listing.count)
        return listing.names[index], listing.content_types[index]

    return mapping


def field_key(name: str) -> KeyFunc:
    """A KeyFunc reading field `name` of a dict or an object (a Message's attribute).

    Strings hash as themselves; other values as their str(), so 7 and "7"
    map alike. A missing field is a ValueError: silently mapping every such
    message to one journal would hide the mistake.
    """

    def key(message: Any) -> bytes | str:
        if isinstance(message, dict):
            value = message.get(name, _MISSING)
        else:
            value = getattr(message, name, _MISSING)
        if value is _MISSING:
            if isinstance(message, list | tuple | str | bytes | int | float | bool | None):
                raise ValueError(f"a message is an object (a dict) with field {name!r} to "
                                 f"map it by, not a {type(message).__name__}")
            raise ValueError(f"the message has no field {name!r} to map it by")
        return value if isinstance(value, str) else str(value)

    return key


_MISSING = object()
