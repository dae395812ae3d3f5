"""DirObserver: record a directory by diffing it, for engines we cannot hook.

RocksDB (through rocksdict) offers no file-system hook, so its file
operations cannot be recorded as they happen. Instead, at each commit point,
the directory is compared with what was recorded last and the differences
are recorded. That is exact for RocksDB because of how it treats its files:

* SST, blob, WAL (`*.log`) and MANIFEST files are only ever appended to, so
  a file that grew under the same inode is recorded as a write of its tail;
* CURRENT, IDENTITY and OPTIONS are written to a temp file and renamed into
  place, so they show up as a new inode, recorded as the whole new content;
* deleted files are recorded as removals; anything else that changed in
  place is re-recorded whole (with a debug line, as it is unexpected).

RocksDB's background threads (flushes, compactions) keep changing the
directory while it is observed. What must never reach the log is a MANIFEST
naming a file the log lacks, or a removal of a file a recorded MANIFEST still
names. Both are avoided by the order RocksDB itself keeps (a file is complete
before the MANIFEST names it, and removed only after the MANIFEST dropped it)
plus one rule: MANIFEST/CURRENT changes and removals are recorded only from a
pass during which MANIFEST and CURRENT did not change at all. Other passes
record only new and grown files, which is harmless whatever the MANIFEST
says, and are retried. Within a recorded pass the order is: data files, then
MANIFEST/CURRENT in a batch of their own (so no crash can leave half a
CURRENT replacement in the log), then removals; every prefix of the log is
therefore a directory RocksDB can open.
"""

from __future__ import annotations

import fnmatch
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from streamkit.client import OpFuture
from streamkit.recoverylog.recorder import Recorder

__all__ = ["Change", "DirObserver", "FileState", "Observation"]

log = logging.getLogger(__name__)

WRITE_CHUNK = 4 << 20  # a large new file is recorded as several write ops of this size

APPEND_ONLY = ("*.sst", "*.blob", "*.log", "MANIFEST-*")
METADATA = ("MANIFEST-*", "CURRENT")
# The info log, the lock file, and temp files renamed into place before a commit point.
IGNORED = ("LOG", "LOG.old.*", "LOCK", "*.dbtmp", ".*")


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


@dataclass(frozen=True)
class FileState:
    """What identifies a version of a file cheaply: a rename-replace changes the inode."""

    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileState:
        return cls(st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass
class Change:
    """One file's difference from the recorded state.

    kind "append": `data` was written at `offset`; "replace": the file (new
    or not) now holds exactly `data`; "remove": it is gone.
    """

    kind: str
    name: str
    state: FileState | None = None
    data: bytes = b""
    offset: int = 0


@dataclass
class Observation:
    """The differences one pass found, and whether MANIFEST/CURRENT held still during it."""

    changes: list[Change] = field(default_factory=list)
    stable: bool = False


class DirObserver:
    """Diffs a flat directory against its recorded state and records the differences.

    `scan` only reads the file system (run it on a worker thread); `record`
    only talks to the recorder (run it on the event loop). `known` is the
    state of every recorded file as of the last pass that recorded it.
    """

    def __init__(self, root: str | os.PathLike[str], recorder: Recorder) -> None:
        self.root = Path(root)
        self.recorder = recorder
        self.known: dict[str, FileState] = {}
        self.passes = 0  # observation passes made, stable or not (for tests and stats)
        self.bytes_recorded = 0

    def adopt(self) -> None:
        """Take the directory as it is now as the recorded state (right after playback).

        Recorded files missing locally are recorded as removed, so the log
        and the directory agree from here on.
        """
        for name in self._recorded_names():
            try:
                self.known[name] = FileState.of(os.stat(self.root / name))
            except FileNotFoundError:
                self.recorder.record_remove(name)

    def scan(self) -> Observation:
        """One pass over the directory: what changed since `known`, with the data to record."""
        self.passes += 1
        before = self._metadata_states()
        obs = Observation()
        seen: set[str] = set()
        with os.scandir(self.root) as entries:
            files = [e for e in entries
                     if e.is_file(follow_symlinks=False) and not _matches(e.name, IGNORED)]
        for entry in files:
            try:
                unchanged = FileState.of(entry.stat(follow_symlinks=False)) == self.known.get(
                    entry.name)
                change = None if unchanged else self._diff(entry.name)
            except FileNotFoundError:
                continue  # deleted under us: seen as missing below, and unstable anyway
            seen.add(entry.name)
            if change is not None:
                obs.changes.append(change)
        obs.changes += [Change("remove", name) for name in self.known if name not in seen]
        obs.stable = before == self._metadata_states()
        return obs

    def record(self, obs: Observation) -> bool:
        """Record what is safe to record of `obs`; True if that was all of it.

        New and grown data files are always safe. MANIFEST/CURRENT changes and
        removals are recorded only from a stable pass.
        """
        data = [c for c in obs.changes if c.kind != "remove" and not _matches(c.name, METADATA)]
        for change in data:
            self._apply(change)
        if not obs.stable:
            return False
        metadata = [c for c in obs.changes if c.kind != "remove" and _matches(c.name, METADATA)]
        metadata.sort(key=lambda c: c.name == "CURRENT")  # the MANIFEST it names goes first
        if metadata:
            # A finished dependency still starts a fresh batch, and the group keeps
            # MAX_BATCH from splitting it: it lands whole or not at all.
            self.recorder.barrier([OpFuture.finished()])
            with self.recorder.group():
                for change in metadata:
                    self._apply(change)
        for change in obs.changes:
            if change.kind == "remove":
                self._apply(change)
        return True

    # --- internals ----------------------------------------------------------

    def _recorded_names(self) -> list[str]:
        """Top-level paths the recorder holds, as names relative to the root."""
        return [p.lstrip("/") for p in self.recorder.fsm.links if p.count("/") == 1]

    def _metadata_states(self) -> dict[str, FileState]:
        states = {}
        with os.scandir(self.root) as entries:
            for entry in entries:
                if _matches(entry.name, METADATA):
                    try:
                        states[entry.name] = FileState.of(entry.stat(follow_symlinks=False))
                    except FileNotFoundError:
                        continue
        return states

    def _diff(self, name: str) -> Change | None:
        path = self.root / name
        with open(path, "rb", buffering=0) as f:
            state = FileState.of(os.fstat(f.fileno()))
            old = self.known.get(name)
            if old == state:
                return None
            if (
                old is not None
                and old.ino == state.ino
                and state.size >= old.size
                and _matches(name, APPEND_ONLY)
            ):  # (same size: only its mtime moved, e.g. by preallocation; nothing to record)
                tail = os.pread(f.fileno(), state.size - old.size, old.size)
                return Change("append", name, FileState(state.ino, old.size + len(tail),
                                                        state.mtime_ns), tail, old.size)
            if old is not None and old.ino == state.ino:  # not a rename-replace: unexpected
                log.debug("%s changed in place (%s -> %s): recording it whole", name, old, state)
            content = os.pread(f.fileno(), state.size, 0)
        return Change("replace", name, FileState(state.ino, len(content), state.mtime_ns), content)

    def _apply(self, change: Change) -> None:
        rec = self.recorder
        if change.kind == "remove":
            if rec.fnode_of(change.name) is not None:
                rec.record_remove(change.name)
            self.known.pop(change.name, None)
            return
        if change.kind == "replace":
            fnode = rec.record_create(change.name)  # truncates a recorded file of that name
        else:
            fnode = rec.fnode_of(change.name)
            if fnode is None:  # cannot happen: appends are only diffed against known files
                raise RuntimeError(f"append to unrecorded {change.name}")
        view = memoryview(change.data)
        for start in range(0, len(view), WRITE_CHUNK):
            rec.record_write(fnode, view[start:start + WRITE_CHUNK], change.offset + start)
        self.bytes_recorded += len(view)
        assert change.state is not None
        self.known[change.name] = change.state
