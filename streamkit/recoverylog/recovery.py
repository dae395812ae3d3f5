"""Taking over a recovery log: play it into a directory, fence the old author, record on."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from streamkit.client import BrokerClient
from streamkit.protocol import recoverylog_pb2 as rpb
from streamkit.recoverylog.fsm import FSM, new_random_author
from streamkit.recoverylog.player import Player
from streamkit.recoverylog.recorded_fs import RecordedFS
from streamkit.recoverylog.recorder import Recorder
from streamkit.tasks import cancel_and_wait

__all__ = ["Playback", "recover"]

log = logging.getLogger(__name__)

SLOW_TAKE_OVER = 30.0  # seconds between reports of a take-over that is still playing


class Playback:
    """Playback of a log into a directory, running until someone takes the log over.

    A hot standby starts one and lets it tail (`tailing` is set once it
    reached the write head); becoming primary is then `take_over`, which
    only has to read what was appended since. A primary without a standby
    does both at once (`recover`).
    """

    def __init__(
        self, client: BrokerClient, log: str, directory: Path, hints: rpb.FSMHints | None = None
    ) -> None:
        if hints is not None and hints.log != log:
            raise ValueError(f"hints are of log {hints.log!r}, not {log!r}")
        self.client, self.log, self.directory = client, log, Path(directory)
        self.player = Player(client)
        self._taken = False
        self._task = asyncio.create_task(
            self.player.play(hints or rpb.FSMHints(log=log), self.directory),
            name=f"playback:{log}",
        )

    @property
    def tailing(self) -> asyncio.Event:
        return self.player.tailing

    def failed(self) -> BaseException | None:
        """Playback's error if it stopped on one (a corrupt log, a lost broker)."""
        if self._task.done() and not self._task.cancelled():
            return self._task.exception()
        return None

    async def wait_tailing(self) -> None:
        """Until playback reached the write head (raises playback's error if it failed)."""
        tailing = asyncio.ensure_future(self.tailing.wait())
        try:
            await asyncio.wait((tailing, self._task), return_when=asyncio.FIRST_COMPLETED)
        finally:
            tailing.cancel()
        if self._task.done():
            self._task.result()

    async def take_over(self) -> RecordedFS:
        """Fence the log's current author, finish playback, and record on as a new author.

        The returned RecordedFS's recorder is the caller's to close.
        """
        author = new_random_author()
        self.player.inject_handoff(author)
        fsm = await self._reporting_slowness()
        recorder = Recorder(self.client, self.log, fsm, author)
        await recorder.start(write_head=self.player.handoff_end)
        return RecordedFS(self.directory, recorder)

    async def _reporting_slowness(self) -> FSM:
        """Playback's FSM, saying where playback is whenever it takes SLOW_TAKE_OVER more."""
        began = time.monotonic()
        while True:
            try:
                done, _ = await asyncio.wait((self._task,), timeout=SLOW_TAKE_OVER)
            except asyncio.CancelledError:  # as awaiting the task itself would: it stops too
                self._task.cancel()
                raise
            if done:
                self._taken = True  # its error, if any, is raised here: not again by cancel
                return self._task.result()
            log.warning("taking over %s: still playing after %.0fs, %s", self.log,
                        time.monotonic() - began, self.player.progress())

    async def cancel(self) -> None:
        """Stop playing (a standby that was released)."""
        if not self._taken:
            await cancel_and_wait(self._task, f"playback of {self.log}")


async def recover(
    client: BrokerClient, log: str, directory: Path, hints: rpb.FSMHints | None = None
) -> RecordedFS:
    """Rebuild `directory` from `log` and return a RecordedFS that records into it.

    Playback ends with a hand-off to a fresh author, so a previous recorder of
    the log (a deposed primary still running somewhere) can no longer append.
    `hints` (from the last primary) limit what is read; None reads the whole log.
    """
    return await Playback(client, log, directory, hints).take_over()
