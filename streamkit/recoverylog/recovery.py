"""Taking over a recovery log: play it into a directory, fence the old author, record on."""

from __future__ import annotations

from pathlib import Path

from streamkit.client import BrokerClient
from streamkit.protocol import recoverylog_pb2 as rpb
from streamkit.recoverylog.fsm import new_random_author
from streamkit.recoverylog.player import Player
from streamkit.recoverylog.recorded_fs import RecordedFS
from streamkit.recoverylog.recorder import Recorder


async def recover(
    client: BrokerClient, log: str, directory: Path, hints: rpb.FSMHints | None = None
) -> RecordedFS:
    """Rebuild `directory` from `log` and return a RecordedFS that records into it.

    Playback ends with a hand-off to a fresh author, so a previous recorder of
    the log (a deposed primary still running somewhere) can no longer append.
    `hints` (from the last primary) limit what is read; None reads the whole log.
    """
    if hints is not None and hints.log != log:
        raise ValueError(f"hints are of log {hints.log!r}, not {log!r}")
    author = new_random_author()
    player = Player(client)
    player.inject_handoff(author)
    fsm = await player.play(hints or rpb.FSMHints(log=log), directory)
    recorder = Recorder(client, log, fsm, author)
    await recorder.start()
    return RecordedFS(directory, recorder)
