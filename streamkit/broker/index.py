"""The fragment index: which fragment to read an offset from.

It merges the journal's local spools with the fragments listed in its stores.
A read takes the fragment that covers the offset and reaches furthest, so one
long persisted fragment beats several short ones; a local spool wins ties
because reading it costs no decompression.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from streamkit.protocol import pb


@dataclass(frozen=True)
class Lookup:
    """Where to read: `fragment` covers `offset` (which may have jumped forward)."""

    fragment: pb.Fragment
    offset: int


def _key(f: pb.Fragment) -> tuple[int, int, str]:
    return (f.begin, f.end, f.backing_store)


class FragmentIndex:
    """Fragments of one journal, kept sorted by (begin, end)."""

    def __init__(self) -> None:
        self._fragments: list[pb.Fragment] = []
        self._keys: list[tuple[int, int, str]] = []
        self._local_ends: dict[int, int] = {}  # begin -> end of each local spool entry

    def __len__(self) -> int:
        return len(self._fragments)

    def fragments(self) -> list[pb.Fragment]:
        return list(self._fragments)

    def add(self, fragment: pb.Fragment) -> None:
        """Insert a fragment; a local one replaces the local entry with its begin."""
        if not fragment.backing_store:
            old_end = self._local_ends.pop(fragment.begin, None)
            if old_end is not None:
                self._pop((fragment.begin, old_end, ""))
            self._local_ends[fragment.begin] = fragment.end
        key = _key(fragment)
        at = bisect.bisect_left(self._keys, key)
        if at < len(self._keys) and self._keys[at] == key:
            self._fragments[at] = fragment
            return
        self._keys.insert(at, key)
        self._fragments.insert(at, fragment)

    def remove_local(self, begin: int) -> None:
        """Drop the local spool entry starting at `begin` (it was persisted)."""
        end = self._local_ends.pop(begin, None)
        if end is not None:
            self._pop((begin, end, ""))

    def _pop(self, key: tuple[int, int, str]) -> None:
        at = bisect.bisect_left(self._keys, key)
        if at < len(self._keys) and self._keys[at] == key:
            del self._keys[at]
            del self._fragments[at]

    def replace_remote(self, remote: list[pb.Fragment]) -> None:
        """Swap in a fresh store listing, keeping local spools (duplicates collapse)."""
        unique = {_key(f): f for f in remote}
        self._reset([f for f in self._fragments if not f.backing_store] + list(unique.values()))

    def _reset(self, fragments: list[pb.Fragment]) -> None:
        fragments.sort(key=_key)
        self._fragments = fragments
        self._keys = [_key(f) for f in fragments]

    @property
    def end(self) -> int:
        """The furthest offset any fragment reaches."""
        return max((f.end for f in self._fragments), default=0)

    def query(self, offset: int) -> Lookup | None:
        """The best fragment covering `offset`, else the next one after a gap.

        None means nothing at or past `offset` exists yet.
        """
        best: pb.Fragment | None = None
        stop = bisect.bisect_right(self._keys, (offset, 1 << 63, "\U0010ffff"))
        for f in self._fragments[:stop]:
            if f.end > offset and (best is None or _better(f, best)):
                best = f
        if best is not None:
            return Lookup(best, offset)
        if stop < len(self._fragments):
            after = self._fragments[stop]
            # Several fragments may share the next begin: take the longest.
            for f in self._fragments[stop + 1 :]:
                if f.begin != after.begin:
                    break
                if _better(f, after):
                    after = f
            return Lookup(after, after.begin)
        return None


def _better(a: pb.Fragment, b: pb.Fragment) -> bool:
    """Whether `a` is preferred over `b` for a read both can serve."""
    if a.end != b.end:
        return a.end > b.end
    return not a.backing_store and bool(b.backing_store)
