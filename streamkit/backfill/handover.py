"""Hand-over: make a backfilled store directory the shard's state in its recovery log.

The backfill ran the shard's store in a scratch directory that nothing was
recorded from. Handing it over:

1. Take over the shard's recovery log: play it back from the shard's hints
   and inject a hand-off under a new author. From then on a primary still
   running elsewhere can no longer append: its next commit fails.
2. Stage: write every backfilled file into the log under `.backfill/`, as
   recorded creates and writes, in as many appends as it takes. Nothing a
   recovering primary reads changes yet (stores ignore the staging folder,
   and a crash here leaves the previous state intact).
3. Swap, in one append (a recorder group): unlink every other live file,
   rename each staged file into place. The log goes from the old state to the
   backfilled one atomically.
4. Store hints of the new state as the shard's primary hints, so the next
   primary recovers quickly; older backup hints still lead to the same state,
   as the swap is later in the log than anything they name.
"""

from __future__ import annotations

import fnmatch
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from streamkit.app.hints import load_hints, store_primary_hints
from streamkit.client import BrokerClient
from streamkit.keyspace.keyspace import KeySpace
from streamkit.protocol import consumer_pb
from streamkit.protocol import recoverylog_pb2 as rpb
from streamkit.recoverylog.fsm import FSMError, RecoveryLogError
from streamkit.recoverylog.recorded_fs import RecordedFS
from streamkit.recoverylog.recovery import Playback
from streamkit.stores.dir_observer import IGNORED

__all__ = ["STAGING", "HandOver", "hand_over", "store_files"]

log = logging.getLogger(__name__)

STAGING = ".backfill"
_COPY_CHUNK = 4 << 20
_BARRIER_EVERY = 64 << 20  # recorded bytes in flight before waiting for the log to take them


@dataclass(frozen=True)
class HandOver:
    """What a hand-over wrote: the files, their bytes, and the hints stored."""

    files: int
    bytes: int
    replaced: int  # live files of the previous state that were unlinked
    hints: rpb.FSMHints


def store_files(directory: Path) -> list[str]:
    """Files of a store directory to hand over (relative, '/'-separated, sorted).

    Lock files, info logs and temp files are left out, as the stores'
    own recording leaves them out.
    """
    found = []
    for folder, _, names in os.walk(directory):
        for name in names:
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in IGNORED):
                continue
            path = Path(folder, name)
            found.append(path.relative_to(directory).as_posix())
    return sorted(found)


async def _take_over(client: BrokerClient, log_name: str, directory: Path,
                     candidates: list[rpb.FSMHints | None]) -> RecordedFS:
    """Play back from the best hints that work (down to the whole log), then take over."""
    for i, hints in enumerate(candidates):
        try:
            return await Playback(client, log_name, directory, hints).take_over()
        except (RecoveryLogError, FSMError) as error:
            if i == len(candidates) - 1:
                raise
            log.warning("recovery log %s: playback from hints failed (%s); trying older ones",
                        log_name, error)
    raise AssertionError("unreachable: the last candidate raises")


async def hand_over(
    client: BrokerClient,
    keyspace: KeySpace,
    spec: consumer_pb.ShardSpec,
    source: Path,
    work_dir: Path,
) -> HandOver:
    """Record `source` (a closed store directory) as the state of shard `spec`; see above."""
    log_name = f"{spec.recovery_log_prefix}/{spec.id}"
    hints = [h for h in await load_hints(keyspace, spec) if h.log == log_name]
    fs = await _take_over(client, log_name, work_dir, [*hints, None])
    recorder = fs.recorder
    try:
        files = store_files(source)
        written = in_flight = 0
        for relative in files:
            fs.makedirs(str(Path(STAGING, relative).parent))
            staged_file = fs.open(f"{STAGING}/{relative}", "wb")
            with open(source / relative, "rb") as src, staged_file as dst:
                while chunk := src.read(_COPY_CHUNK):
                    dst.write(chunk)
                    written += len(chunk)
                    in_flight += len(chunk)
                    if in_flight >= _BARRIER_EVERY:
                        await recorder.barrier()
                        in_flight = 0
        await recorder.barrier()
        targets = {"/" + relative for relative in files}
        staged = {f"/{STAGING}/{relative}" for relative in files}
        stale = [p for p in recorder.fsm.links if p not in targets and p not in staged]
        with recorder.group():  # one append: the log swaps states atomically
            for path in stale:
                fs.remove(path)
            for relative in files:
                fs.makedirs(str(Path(relative).parent))
                fs.rename(f"{STAGING}/{relative}", relative)
        new_hints = await recorder.build_hints()
        await store_primary_hints(keyspace, spec, new_hints)
        return HandOver(len(files), written, len(stale), new_hints)
    finally:
        await recorder.close()
