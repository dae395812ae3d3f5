"""The fragment index: which fragment to read an offset from.

It merges the journal's local spools with the fragments listed in its stores.
A read takes the fragment that covers the offset and reaches furthest, so one
long persisted fragment beats several short ones; a local spool wins ties
because reading it costs no decompression.

Every blocked read looks its offset up again after each append, so a lookup
must not cost in proportion to the journal's history: beside the fragments
(sorted by begin) the index keeps, for each prefix of them, where its best
fragment is. A lookup is then a bisection, and keeping that up costs little
since fragments change almost only at the journal's head.
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
        # _best[i]: the index of the best fragment of _fragments[:i + 1] (the first of equals)
        self._best: list[int] = []

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
        else:
            self._keys.insert(at, key)
            self._fragments.insert(at, fragment)
        self._rank_from(at)

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
            self._rank_from(at)

    def replace_remote(self, remote: list[pb.Fragment]) -> None:
        """Swap in a fresh store listing, keeping local spools (duplicates collapse)."""
        unique = {_key(f): f for f in remote}
        self._reset([f for f in self._fragments if not f.backing_store] + list(unique.values()))

    def _reset(self, fragments: list[pb.Fragment]) -> None:
        fragments.sort(key=_key)
        self._fragments = fragments
        self._keys = [_key(f) for f in fragments]
        self._rank_from(0)

    def _rank_from(self, at: int) -> None:
        """Bring `_best` up to date from position `at` on."""
        fragments, best = self._fragments, self._best
        del best[at:]
        current = best[-1] if best else -1
        for i in range(at, len(fragments)):
            if current < 0 or _better(fragments[i], fragments[current]):
                current = i
            best.append(current)

    @property
    def end(self) -> int:
        """The furthest offset any fragment reaches."""
        return self._fragments[self._best[-1]].end if self._best else 0

    def query(self, offset: int) -> Lookup | None:
        """The best fragment covering `offset`, else the next one after a gap.

        None means nothing at or past `offset` exists yet.
        """
        stop = bisect.bisect_right(self._keys, (offset, 1 << 63, "\U0010ffff"))
        if stop:
            best = self._fragments[self._best[stop - 1]]  # of all that begin at or before
            if best.end > offset:
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
