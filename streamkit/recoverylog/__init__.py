"""Recovery logs: record a directory's file operations into a journal, and play them back.

Wire-compatible with Gazette's `recoverylog` package: the same RecordedOp and
FSMHints schemas, fixed framing, chained CRC-32C checksums, and the
`author` register that fences a deposed Recorder after a hand-off.
"""

from streamkit.protocol import recoverylog_pb2 as rpb
from streamkit.recoverylog.fsm import (
    AUTHOR_REGISTER,
    CONTENT_TYPE,
    FSM,
    FSMError,
    Outcome,
    RecoveryLogError,
    author_fence,
    author_value,
    hints_from_json,
    hints_to_json,
    live_log_segments,
    new_random_author,
)
from streamkit.recoverylog.player import Player
from streamkit.recoverylog.recorded_fs import RecordedFile, RecordedFS
from streamkit.recoverylog.recorder import Recorder
from streamkit.recoverylog.segments import Segment, SegmentError, SegmentSet

__all__ = [
    "AUTHOR_REGISTER",
    "CONTENT_TYPE",
    "FSM",
    "FSMError",
    "Outcome",
    "Player",
    "RecordedFS",
    "RecordedFile",
    "Recorder",
    "RecoveryLogError",
    "Segment",
    "SegmentError",
    "SegmentSet",
    "author_fence",
    "author_value",
    "hints_from_json",
    "hints_to_json",
    "live_log_segments",
    "new_random_author",
    "rpb",
]
