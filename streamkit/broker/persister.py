"""The persister: compresses rolled spools and puts them in the journal's first store.

Puts are content-addressed and idempotent, so a spool persisted twice (say,
after a crash between the upload and the local delete) costs only time.
Failures are retried with backoff per journal, so one unreachable store never
holds up the others' persisting; the spool stays local and readable meanwhile.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import logging
import os
import random
import tempfile
import time
import uuid
from pathlib import Path

from streamkit.broker import metrics
from streamkit.broker.local_disk import on_disk
from streamkit.broker.replica import Replica
from streamkit.broker.spool import Spool, SpoolDamaged
from streamkit.protocol import pb
from streamkit.protocol.codecs import new_compressor
from streamkit.protocol.fragments import sum_of
from streamkit.tasks import cancel_and_wait

log = logging.getLogger(__name__)

_CHUNK = 1 << 20
FIRST_RETRY, MAX_RETRY = 1.0, 300.0  # seconds, doubling in between

_Item = tuple[Replica, Spool]


def compress_spool(spool: Spool, out_dir: Path) -> Path:
    """Write the spool's committed bytes through its codec into a temp file.

    An uncompressed (NONE) fragment is the sealed spool file itself: hard-link it.
    A spool file that no longer holds what was committed (damaged from outside the
    broker) raises SpoolDamaged rather than become a fragment: its length is checked,
    and, where the bytes are read anyway to compress them, their SHA-1 against the
    one the appends computed (the fragment's name carries it).
    """
    if spool.codec == pb.NONE:
        path = out_dir / f".persist-{spool.begin:016x}-{uuid.uuid4().hex}"
        os.link(spool.data_path, path)
        if (size := os.stat(path).st_size) != spool.length:
            path.unlink()
            raise SpoolDamaged(spool, f"holds {size} bytes, not {spool.length}")
        return path
    compressor = new_compressor(spool.codec)
    sha1 = hashlib.sha1()
    fd, name = tempfile.mkstemp(prefix=".persist-", dir=out_dir)
    try:
        # Its own descriptor: the spool's may be closed meanwhile (journal deleted).
        with os.fdopen(fd, "wb") as out, open(spool.data_path, "rb") as source:
            for position in range(0, spool.length, _CHUNK):
                chunk = os.pread(source.fileno(), min(_CHUNK, spool.length - position), position)
                if not chunk:
                    raise SpoolDamaged(spool, f"ends at {position} bytes, not {spool.length}")
                sha1.update(chunk)
                out.write(compressor.compress(chunk))
            out.write(compressor.flush())
        if sum_of(sha1.digest()) != spool.fragment().sum:
            raise SpoolDamaged(spool, "holds other bytes than were committed (its SHA-1 "
                                      "differs from the appends')")
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    return Path(name)


class _Backoff:
    """A journal whose persisting fails: its spools wait while one at a time probes the store."""

    def __init__(self) -> None:
        self.failures = 0
        self.parked: list[_Item] = []  # by offset: the oldest spool probes first
        self.probe: _Item | None = None  # the spool let through to try again
        self.timer: asyncio.TimerHandle | None = None

    def park(self, item: _Item) -> None:
        bisect.insort(self.parked, item, key=lambda parked: parked[1].begin)

    def delay(self) -> float:
        """Exponential, jittered so journals failing together don't retry in lockstep."""
        base = min(FIRST_RETRY * 2 ** min(self.failures - 1, 20), MAX_RETRY)
        return base * random.uniform(0.8, 1.2)


class Persister:
    """A queue of rolled spools and the workers that persist them.

    A failed spool doesn't keep its worker: it is parked with its journal's
    backoff, and the workers go on with other journals' spools.
    """

    def __init__(self, scratch_dir: Path, workers: int = 2) -> None:
        self.scratch_dir = scratch_dir
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._workers = workers
        self._tasks: list[asyncio.Task[None]] = []
        self._pending = 0  # queued, being persisted, or parked
        self._idle = asyncio.Event()
        self._idle.set()
        self._failing: dict[str, _Backoff] = {}  # by journal name

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
        metrics.UNPERSISTED.set(self._pending)
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
        """Parked spools stay on disk; the next start recovers and persists them."""
        for backoff in self._failing.values():
            if backoff.timer is not None:
                backoff.timer.cancel()
        for task in self._tasks:
            await cancel_and_wait(task, "a persister worker")

    async def _work(self) -> None:
        while True:
            item = await self._queue.get()
            replica, spool = item
            backoff = self._failing.get(replica.name)
            if replica.deleted or spool.closed or not replica.stores:
                self._finish(item, persisted=False)  # gone, or stays local
            elif backoff is not None and backoff.probe is not item:
                backoff.park(item)  # waits for the probe's verdict
            else:
                store_url = replica.stores[0].url  # the spec may change during the attempt
                try:
                    await self._persist(replica, spool)
                except SpoolDamaged as err:
                    # Not a store outage: retrying reads the same damaged file, and as the
                    # journal's oldest spool it would probe for ever, parking the later
                    # ones. It leaves the queue (said once) and stays local; the restart's
                    # recovery keeps its intact prefix. The journal's later spools go on.
                    metrics.PERSIST_FAILURES.labels(journal=replica.name).inc()
                    log.error("%s (it stays local; the broker's next start recovers its intact "
                              "prefix); the journal's later spools are persisted", err)
                    self._finish(item, persisted=False)
                except Exception as err:
                    self._failed(item, store_url, err)
                else:
                    self._finish(item, persisted=True)

    def _failed(self, item: _Item, store_url: str, err: Exception) -> None:
        """Park the spool; a failed probe (or first failure) schedules the next probe."""
        replica, _ = item
        metrics.PERSIST_FAILURES.labels(journal=replica.name).inc()
        backoff = self._failing.get(replica.name)
        if backoff is None:
            backoff = self._failing[replica.name] = _Backoff()
            log.warning(
                "persisting journal %s to %s failed; its spools stay local and are retried "
                "with backoff (up to %.0fs), other journals go on: %s",
                replica.name, store_url, MAX_RETRY, err,
            )
        elif backoff.probe is not item:
            # Another spool of the journal was already in flight when it started failing.
            backoff.park(item)
            return
        else:
            log.debug("persisting journal %s failed again: %s", replica.name, err)
        backoff.failures += 1
        backoff.probe = None
        backoff.park(item)
        backoff.timer = asyncio.get_running_loop().call_later(
            backoff.delay(), self._release, replica.name
        )

    def _release(self, journal: str) -> None:
        """Let the journal's oldest parked spool through to probe its store."""
        backoff = self._failing.get(journal)
        if backoff is None:
            return
        backoff.timer = None
        if backoff.parked:
            backoff.probe = backoff.parked.pop(0)
            self._queue.put_nowait(backoff.probe)
        else:
            del self._failing[journal]

    def _finish(self, item: _Item, persisted: bool) -> None:
        """Account for a spool leaving the persister; a good probe frees its journal's spools."""
        self._pending -= 1
        metrics.UNPERSISTED.set(self._pending)
        if self._pending == 0:
            self._idle.set()
        journal = item[0].name
        backoff = self._failing.get(journal)
        if backoff is None or backoff.probe is not item:
            return
        if not persisted:
            self._release(journal)  # the probe was dropped: the next spool probes at once
            return
        del self._failing[journal]
        log.info("persisting journal %s works again, after %d failed attempts",
                 journal, backoff.failures)
        for parked in backoff.parked:
            self._queue.put_nowait(parked)

    async def _persist(self, replica: Replica, spool: Spool) -> None:
        store = replica.stores[0]
        fragment = spool.fragment()
        fragment.backing_store = store.url
        path = await on_disk(compress_spool, spool, self.scratch_dir)
        try:  # (a store that hangs is given up by its client's timeouts: see stores/s3.py)
            await store.put(fragment, path)
        finally:
            path.unlink(missing_ok=True)
        fragment.mod_time = int(time.time())
        replica.persisted(spool, fragment)
        metrics.FRAGMENTS_PERSISTED.inc()
        metrics.BYTES_PERSISTED.inc(fragment.end - fragment.begin)
        log.info("persisted %s [%d, %d) to %s", fragment.journal, fragment.begin,
                 fragment.end, store.url)
