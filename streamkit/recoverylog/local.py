"""LocalRecorder: a Recorder that keeps its log to itself, for stores nobody needs to recover.

Stores write through a RecordedFS and call into its Recorder (open, write,
rename, barrier...). A backfill runs a shard's store in a scratch directory
whose intermediate states are worthless: only the final directory is handed
to the shard's real recovery log, in one go. The LocalRecorder gives such a
store everything it expects of a Recorder (file-node bookkeeping through the
same FSM, groups, barriers that resolve) while appending nothing anywhere.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, cast

from streamkit.client import BrokerClient
from streamkit.protocol import pb
from streamkit.protocol import recoverylog_pb2 as rpb
from streamkit.recoverylog.fsm import FSM
from streamkit.recoverylog.recorded_fs import RecordedFS
from streamkit.recoverylog.recorder import Recorder

if TYPE_CHECKING:
    from streamkit.recoverylog.recorder import _Batch

__all__ = ["LocalRecorder", "local_fs"]

_LOCAL_LOG = "local/unrecorded"  # a name for the FSM's bookkeeping; no such journal is written


class LocalRecorder(Recorder):
    """Sequences ops through an FSM as a Recorder does, and drops them instead of appending.

    Its barriers resolve as soon as the dispatch task gets to them (call
    `start()` first, as with any Recorder). Data written is not retained.
    """

    def __init__(self) -> None:
        super().__init__(cast(BrokerClient, None), _LOCAL_LOG, FSM(rpb.FSMHints(log=_LOCAL_LOG)),
                         fenced=False)

    async def _send(self, batch: _Batch) -> pb.AppendResponse:
        begin = self.write_head
        end = begin + batch.size
        batch.parts = []
        return pb.AppendResponse(
            status=pb.OK, commit=pb.Fragment(journal=self.journal, begin=begin, end=end)
        )


async def local_fs(root: str | os.PathLike[str]) -> RecordedFS:
    """A RecordedFS over the (new, empty) directory `root` whose recorder records nothing."""
    Path(root).mkdir(parents=True, exist_ok=True)
    recorder = LocalRecorder()
    await recorder.start()
    return RecordedFS(root, recorder)
