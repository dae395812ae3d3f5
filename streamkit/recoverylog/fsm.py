"""The recovery-log FSM: sequencing, chained checksums, Fnodes, links and hints.

Every RecordedOp carries the seq_no and checksum the FSM expects *before* it;
applying it advances seq_no by one and extends the checksum with CRC-32C over
the op's protobuf bytes (not the frame header, not a write's payload). Only a
linear, consistent history applies, so a Player can tell the history it wants
from dead branches and corruption. FSMHints name the live Fnodes and the log
Segments holding their ops, so that playback reads only those parts.

Framing and registers follow Gazette exactly (so either side can play the
other's logs): fixed frames (magic + uint32 LE length + protobuf), content
type `application/x-gazette-recoverylog`, and the fence register
`author=<author id in base 32>`.
"""

from __future__ import annotations

import enum
import json
import posixpath
import secrets
import struct
from dataclasses import dataclass, field, replace
from typing import Any

import google_crc32c
from google.protobuf import json_format

from streamkit.errors import StreamkitError
from streamkit.protocol import pb
from streamkit.protocol import recoverylog_pb2 as rpb
from streamkit.recoverylog.segments import Segment, SegmentError, SegmentSet

__all__ = [
    "AUTHOR_REGISTER",
    "CONTENT_TYPE",
    "FRAME_HEADER",
    "FRAME_MAGIC",
    "FSM",
    "FSMError",
    "FnodeState",
    "Outcome",
    "RecoveryLogError",
    "author_fence",
    "author_selector",
    "author_value",
    "encode_frame",
    "hints_from_json",
    "hints_to_json",
    "live_log_segments",
    "new_random_author",
]

CONTENT_TYPE = "application/x-gazette-recoverylog"
AUTHOR_REGISTER = "author"
# Gazette's fixed framing. Defined here rather than imported from
# streamkit.message, which recoverylog may not depend on.
FRAME_MAGIC = b"\x66\x33\x93\x36"
FRAME_HEADER = struct.Struct("<4sI")
MAX_OP_SIZE = 64 << 20  # a longer op frame is taken as corruption, not waited for

_BASE32_DIGITS = "0123456789abcdefghijklmnopqrstuv"


class RecoveryLogError(StreamkitError):
    """The log at `journal`:`offset` is corrupt or inconsistent; playback stopped."""

    def __init__(self, journal: str, offset: int, reason: str) -> None:
        self.journal = journal
        self.offset = offset
        self.reason = reason
        super().__init__(f"recovery log {journal} at offset {offset}: {reason}")


class FSMError(StreamkitError):
    """An op contradicts the history applied so far (not a benign skip)."""


class Outcome(enum.Enum):
    """What FSM.apply did with an op that did not contradict the history."""

    APPLIED = "applied"
    # Applied, but the hints say its Fnode is dead by the hinted point in time:
    # a Player skips the local file action.
    UNTRACKED = "untracked"
    # Not applied: written by another author than the hints expect next
    # (a dead branch of the log's history).
    NOT_HINTED_AUTHOR = "not_hinted_author"
    # Not applied: a seq_no already applied or skipped (a duplicate, or log
    # before a hinted segment starts).
    STALE = "stale"

    @property
    def applied(self) -> bool:
        return self is Outcome.APPLIED or self is Outcome.UNTRACKED


def new_random_author() -> int:
    """A random Author id in [1, 2**32 - 1]."""
    return secrets.randbelow(0xFFFFFFFF - 1) + 1


def author_value(author: int) -> str:
    """The register value of `author`: base 32 with digits 0-9a-v, as Go's FormatUint."""
    if author == 0:
        return "0"
    digits = []
    while author:
        author, digit = divmod(author, 32)
        digits.append(_BASE32_DIGITS[digit])
    return "".join(reversed(digits))


def author_fence(author: int) -> pb.LabelSet:
    """The journal register that fences appends to `author`'s."""
    return pb.LabelSet(labels=[pb.Label(name=AUTHOR_REGISTER, value=author_value(author))])


def author_selector(author: int) -> pb.LabelSelector:
    """`check_registers` admitting only appends while `author` holds the fence."""
    return pb.LabelSelector(include=author_fence(author))


def encode_frame(op: rpb.RecordedOp) -> tuple[bytes, bytes]:
    """(fixed-frame header, protobuf payload) of `op`; the checksum covers the payload."""
    payload = op.SerializeToString()
    return FRAME_HEADER.pack(FRAME_MAGIC, len(payload)), payload


@dataclass(slots=True)
class FnodeState:
    """A live Fnode: its current hard links, and the Segments of its ops (for hints)."""

    links: set[str] = field(default_factory=set)
    segments: list[Segment] = field(default_factory=list)


def live_log_segments(hints: rpb.FSMHints) -> tuple[list[int], SegmentSet]:
    """The hinted live Fnodes in order, and one SegmentSet covering all their ops."""
    fnodes: list[int] = []
    segments = SegmentSet()
    for node in hints.live_nodes:
        if not node.segments or node.segments[0].first_seq_no != node.fnode:
            raise SegmentError(f"hinted fnode {node.fnode} must start its first segment")
        if fnodes and fnodes[-1] >= node.fnode:
            raise SegmentError(f"hinted fnodes must increase: {fnodes[-1]} then {node.fnode}")
        fnodes.append(node.fnode)
        for segment in node.segments:
            segments.add(Segment.from_proto(segment, hints.log))
    if len(segments) and segments[-1].log != hints.log:
        raise SegmentError(
            f"the last hinted segment is of log {segments[-1].log}, not hints.log {hints.log}"
        )
    return fnodes, segments


class FSM:
    """Applies RecordedOps in order, verifying each op's seq_no, checksum and author."""

    def __init__(self, hints: rpb.FSMHints) -> None:
        if not hints.log:
            raise ValueError("FSMHints.log is required")
        fnodes, segments = live_log_segments(hints)
        self.next_seq_no = 1
        self.next_checksum = 0
        self.last_log = hints.log
        self.last_author = 0  # author of the last applied op
        self.properties: dict[str, str] = {p.path: p.content for p in hints.properties}
        self.live_nodes: dict[int, FnodeState] = {}
        self.links: dict[str, int] = {}
        # Remaining hints, consumed as ops apply.
        self.hinted_segments: list[Segment] = list(segments)
        self.hinted_fnodes: list[int] = fnodes
        self._seg_i = 0
        self._fnode_i = 0
        # Seq_nos the hints made us skip, and created Fnodes hinted as dead: ops
        # on these Fnodes are expected and benign. Any other unknown Fnode is not.
        self._skipped: list[tuple[int, int]] = []
        self._untracked: set[int] = set()
        if self.hinted_segments:
            self._jump_to(self.hinted_segments[0])

    # --- hints -------------------------------------------------------------

    @property
    def has_remaining_hints(self) -> bool:
        return self._seg_i < len(self.hinted_segments) or self._fnode_i < len(self.hinted_fnodes)

    @property
    def next_hinted_segment(self) -> Segment | None:
        """The hinted segment the next applicable op belongs to, if hints remain."""
        if self._seg_i < len(self.hinted_segments):
            return self.hinted_segments[self._seg_i]
        return None

    def _jump_to(self, segment: Segment) -> None:
        if segment.first_seq_no > self.next_seq_no:
            self._skipped.append((self.next_seq_no, segment.first_seq_no))
        self.next_seq_no, self.next_checksum = segment.first_seq_no, segment.first_checksum

    def build_hints(self, log: str) -> rpb.FSMHints:
        """FSMHints from which a new FSM (and Player) rebuilds this FSM's live state."""
        hints = rpb.FSMHints(log=log)
        for fnode in sorted(self.live_nodes):
            node = hints.live_nodes.add(fnode=fnode)
            for segment in self.live_nodes[fnode].segments:
                msg = segment.to_proto()
                if msg.log == log:
                    msg.log = ""
                node.segments.append(msg)
        for path in sorted(self.properties):
            hints.properties.add(path=path, content=self.properties[path])
        return hints

    # --- applying ----------------------------------------------------------

    def apply(
        self,
        op: rpb.RecordedOp,
        payload: bytes | memoryview,
        log: str,
        first_offset: int,
        last_offset: int = 0,
    ) -> Outcome:
        """Transition by `op` (whose protobuf bytes are `payload`), found at `log`:offsets.

        Returns how a consistent op was handled; raises FSMError (and changes
        nothing) if `op` contradicts the history applied so far.
        """
        segment = self.next_hinted_segment
        if segment is not None and segment.author != op.author:
            return Outcome.NOT_HINTED_AUTHOR
        if op.seq_no < self.next_seq_no:
            return Outcome.STALE
        if op.seq_no > self.next_seq_no:
            raise FSMError(f"wrong seq_no {op.seq_no}: expected {self.next_seq_no} (ops are lost)")
        if op.checksum != self.next_checksum:
            raise FSMError(
                f"checksum mismatch at seq_no {op.seq_no}: op has {op.checksum:#010x}, "
                f"history has {self.next_checksum:#010x}"
            )
        outcome = self._apply_kind(op, log, first_offset, last_offset)

        self.next_seq_no += 1
        self.next_checksum = google_crc32c.extend(self.next_checksum, payload)
        self.last_log = log
        self.last_author = op.author
        if segment is not None and segment.last_seq_no < self.next_seq_no:
            self._seg_i += 1
            following = self.next_hinted_segment
            if following is not None:
                self._jump_to(following)
        return outcome

    def _apply_kind(self, op: rpb.RecordedOp, log: str, first: int, last: int) -> Outcome:
        kind = _op_kind(op)
        if kind == "create":
            return self._apply_create(op, log, first, last)
        hinted = self.hinted_fnodes
        if self._fnode_i < len(hinted) and hinted[self._fnode_i] == op.seq_no:
            raise FSMError(f"op {op.seq_no} is not a create, but its seq_no is a hinted fnode")
        if kind == "link":
            return self._apply_link(op, log, first, last)
        if kind == "unlink":
            return self._apply_unlink(op, log, first, last)
        if kind == "write":
            return self._with_node(op.write.fnode, op, log, first, last)
        if kind == "property":
            self._apply_property(op.property)
        return Outcome.APPLIED  # a no-op (hand-off) or a property

    def _check_free(self, path: str) -> None:
        _check_clean(path)
        if path in self.links:
            raise FSMError(f"path {path!r} is already linked to fnode {self.links[path]}")
        if path in self.properties:
            raise FSMError(f"path {path!r} is a property")

    def _apply_create(self, op: rpb.RecordedOp, log: str, first: int, last: int) -> Outcome:
        path = op.create.path
        self._check_free(path)
        fnode = op.seq_no
        if self.has_remaining_hints:
            # Created before the hints were taken: live then only if hinted, else it
            # died before (its unlink may well lie in a range the hints skip).
            hinted = self.hinted_fnodes
            if self._fnode_i >= len(hinted) or hinted[self._fnode_i] != fnode:
                self._untracked.add(fnode)
                return Outcome.UNTRACKED
            self._fnode_i += 1
        node = FnodeState(links={path})
        self._extend(node, op, log, first, last)
        self.live_nodes[fnode] = node
        self.links[path] = fnode
        return Outcome.APPLIED

    def _with_node(self, fnode: int, op: rpb.RecordedOp, log: str, first: int, last: int
                   ) -> Outcome:
        """Extend the segments of live `fnode` by `op`; UNTRACKED if hinted dead."""
        node = self.live_nodes.get(fnode)
        if node is None:
            if fnode in self._untracked or any(lo <= fnode < hi for lo, hi in self._skipped):
                return Outcome.UNTRACKED
            raise FSMError(f"op {op.seq_no} names unknown fnode {fnode}")
        self._extend(node, op, log, first, last)
        return Outcome.APPLIED

    def _apply_link(self, op: rpb.RecordedOp, log: str, first: int, last: int) -> Outcome:
        path, fnode = op.link.path, op.link.fnode
        self._check_free(path)
        outcome = self._with_node(fnode, op, log, first, last)
        if outcome is Outcome.APPLIED:
            self.live_nodes[fnode].links.add(path)
            self.links[path] = fnode
        return outcome

    def _apply_unlink(self, op: rpb.RecordedOp, log: str, first: int, last: int) -> Outcome:
        path, fnode = op.unlink.path, op.unlink.fnode
        node = self.live_nodes.get(fnode)
        if node is not None and path not in node.links:
            raise FSMError(f"op {op.seq_no} unlinks {path!r}, which fnode {fnode} lacks")
        outcome = self._with_node(fnode, op, log, first, last)
        if node is not None:
            node.links.discard(path)
            del self.links[path]
            if not node.links:
                del self.live_nodes[fnode]
        return outcome

    def _apply_property(self, prop: rpb.Property) -> None:
        if prop.path in self.links:
            raise FSMError(f"property path {prop.path!r} is linked to an fnode")
        _check_clean(prop.path)
        if self.properties.get(prop.path, prop.content) != prop.content:
            raise FSMError(f"property {prop.path!r} already exists with other content")
        self.properties[prop.path] = prop.content

    def _extend(self, node: FnodeState, op: rpb.RecordedOp, log: str, first: int, last: int
                ) -> None:
        segments = node.segments
        if segments and segments[-1].author == op.author and segments[-1].log == log:
            segments[-1] = replace(segments[-1], last_seq_no=op.seq_no, last_offset=last)
        else:
            segments.append(Segment(
                author=op.author,
                first_seq_no=op.seq_no,
                first_offset=first,
                first_checksum=op.checksum,
                last_seq_no=op.seq_no,
                last_offset=last,
                log=log,
            ))


def _check_clean(path: str) -> None:
    """Paths are "/"-rooted and clean, so playback never writes outside its directory."""
    if not path.startswith("/") or posixpath.normpath(path) != path or "/../" in path + "/":
        raise FSMError(f"path {path!r} is not a clean path under the root")


_KINDS = ("create", "link", "unlink", "write", "property")


def _op_kind(op: rpb.RecordedOp) -> str | None:
    """Which of the union's fields is set (None for a no-op)."""
    for kind in _KINDS:
        if op.HasField(kind):
            return kind
    return None


# --- hints as JSON ------------------------------------------------------------

_OMIT_ZERO = ("log", "fnode", "author", "first_seq_no", "first_offset", "first_checksum",
              "last_seq_no", "last_offset", "path", "content")


def _to_go_json(msg: Any) -> dict[str, Any]:
    """A message as Go's encoding/json writes Gazette's structs: snake_case, numbers, omitempty."""
    out: dict[str, Any] = {}
    for fd in msg.DESCRIPTOR.fields:
        value = getattr(msg, fd.name)
        if fd.is_repeated:
            out[fd.name] = [_to_go_json(v) for v in value]
        elif fd.name not in _OMIT_ZERO or value:
            out[fd.name] = value
    return out


def hints_to_json(hints: rpb.FSMHints) -> str:
    """FSMHints as the JSON Gazette keeps in etcd (readable by either side)."""
    return json.dumps(_to_go_json(hints), separators=(",", ":"))


def hints_from_json(text: str | bytes) -> rpb.FSMHints:
    """Parse FSMHints from JSON (Gazette's or protobuf's JSON mapping)."""
    return json_format.ParseDict(json.loads(text), rpb.FSMHints())
