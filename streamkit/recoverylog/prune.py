"""Which fragments of a recovery log no playback can need any more.

A recovery log records every write a store ever made, compactions included,
so it grows without bound while the store's live files stay small. Playback
starts from hints: the live files' segments of the log (where their ops
are) and nothing else, skipping missing content between segments. So a
fragment is needed by a set of hints when it intersects one of their live
segments, or when it lies past their last segment (ops recorded after the
hints were written, which playback reads to the write head).

A fragment may be deleted only when no hints of the shard need it: the
primary's latest hints and every backup (an older set a playback may fall
back on). Hints that only ever grow forward make this safe against a race
with a primary writing newer hints meanwhile: a file live in newer hints
and written before older hints was live in those as well.

Conservative where in doubt: hints with no live segment in the log (say, a
log forked from another, or a store with no files yet) keep the whole log.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from streamkit.protocol import pb
from streamkit.protocol import recoverylog_pb2 as rpb
from streamkit.recoverylog.fsm import live_log_segments

__all__ = ["prunable_fragments"]


def prunable_fragments(
    log: str, fragments: Iterable[pb.Fragment], hints: Sequence[rpb.FSMHints]
) -> list[pb.Fragment]:
    """The persisted fragments of `log` that no playback from any of `hints` reads.

    Raises SegmentError if a set of hints is inconsistent (nothing is pruned then).
    """
    if not hints:
        return []
    needs = [_needs(log, h) for h in hints]
    if any(need is None for need in needs):
        return []
    return [
        f
        for f in fragments
        if f.backing_store and not any(need(f) for need in needs if need is not None)
    ]


def _needs(log: str, hints: rpb.FSMHints) -> Callable[[pb.Fragment], bool] | None:
    """A predicate: does playback from `hints` read fragment f of `log`? None: all of it."""
    _, segments = live_log_segments(hints)
    ours = [s for s in segments if s.log == log]
    if not ours:
        return None
    # Past the last segment's end lie ops recorded after the hints (an open-ended segment,
    # last_offset 0, reaches the write head by itself).
    horizon = None if any(s.last_offset == 0 for s in ours) else max(s.last_offset for s in ours)

    def needs(f: pb.Fragment) -> bool:
        past = horizon is not None and f.end > horizon
        return past or bool(segments.intersect(log, f.begin, f.end))

    return needs
