"""The persister: compresses rolled spools and puts them in the journal's first store.

Puts are content-addressed and idempotent, so a spool persisted twice (say,
after a crash between the upload and the local delete) costs only time.
Failures are retried with backoff; the spool stays local and readable meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import time
import uuid
from pathlib import Path

from streamkit.broker import metrics
from streamkit.broker.replica import Replica
from streamkit.broker.spool import Spool
from streamkit.protocol import pb
from streamkit.protocol.codecs import new_compressor

log = logging.getLogger(__name__)

_CHUNK = 1 << 20


def compress_spool(spool: Spool, out_dir: Path) -> Path:
    """Write the spool's committed bytes through its codec into a temp file.

    An uncompressed (NONE) fragment is the sealed spool file itself: hard-link it.
    """
    if spool.codec == pb.NONE:
        path = out_dir / f".persist-{spool.begin:016x}-{uuid.uuid4().hex}"
        os.link(spool.data_path, path)
        return path
    compressor = new_compressor(spool.codec)
    fd, name = tempfile.mkstemp(prefix=".persist-", dir=out_dir)
    # Its own descriptor: the spool's may be closed meanwhile (journal deleted).
    with os.fdopen(fd, "wb") as out, open(spool.data_path, "rb") as source:
        for position in range(0, spool.length, _CHUNK):
            size = min(_CHUNK, spool.length - position)
            out.write(compressor.compress(os.pread(source.fileno(), size, position)))
        out.write(compressor.flush())
    return Path(name)


class Persister:
    """A queue of rolled spools and the workers that persist them."""

    def __init__(self, scratch_dir: Path, workers: int = 2) -> None:
        self.scratch_dir = scratch_dir
        self._queue: asyncio.Queue[tuple[Replica, Spool]] = asyncio.Queue()
        self._workers = workers
        self._tasks: list[asyncio.Task[None]] = []
        self._pending = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def start(self) -> None:
        self.scratch_dir.mkdir(parents=True, exist_ok=True)
        self._tasks = [asyncio.create_task(self._work()) for _ in range(self._workers)]

    def enqueue(self, replica: Replica, spool: Spool) -> None:
        """Called when a replica rolls a spool (or recovers a rolled one)."""
        if spool.length == 0:
            replica.local.pop(spool.begin, None)
            replica.index.remove_local(spool.begin)
            spool.remove_files()
            return
        if not replica.stores:
            return  # no store: the spool stays local and readable
        self._pending += 1
        self._idle.clear()
        self._queue.put_nowait((replica, spool))

    async def drain(self, timeout: float) -> bool:
        """Wait (bounded) until every queued spool is persisted."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _work(self) -> None:
        while True:
            replica, spool = await self._queue.get()
            delay = 0.5
            while not replica.deleted and not spool.closed:
                try:
                    await self._persist(replica, spool)
                    break
                except Exception as err:
                    metrics.PERSIST_ERRORS.inc()
                    log.warning("persisting %s failed (retry in %.1fs): %s",
                                spool.fragment().journal, delay, err)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 30.0)
            self._pending -= 1
            if self._pending == 0:
                self._idle.set()

    async def _persist(self, replica: Replica, spool: Spool) -> None:
        store = replica.stores[0]
        fragment = spool.fragment()
        fragment.backing_store = store.url
        path = await asyncio.to_thread(compress_spool, spool, self.scratch_dir)
        try:
            await store.put(fragment, path)
        finally:
            path.unlink(missing_ok=True)
        fragment.mod_time = int(time.time())
        replica.persisted(spool, fragment)
        metrics.FRAGMENTS_PERSISTED.inc()
        metrics.BYTES_PERSISTED.inc(fragment.end - fragment.begin)
        log.info("persisted %s [%d, %d) to %s", fragment.journal, fragment.begin,
                 fragment.end, store.url)
