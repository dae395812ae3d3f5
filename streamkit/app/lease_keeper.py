"""LeaseKeeper: keeps a member's lease alive from a thread of its own.

A member's lease is its claim to its shards. Kept alive from the event loop,
it would lapse whenever user code blocks the loop -- a `finalize_txn` stuck in
`time.sleep` or a dead socket -- and every shard of the process would move
elsewhere, to be wedged by the same hook there. A lapse should mean "this
process is gone", not "its user code is slow", so the keepalives run on a
thread with an event loop and a KeySpace client of its own (`KeySpace.reopen`),
and the watchdog is what names a hook that runs too long.

The keeper only reports: the allocator's loop looks at `answered_at` and
`expired_lease` to announce the member again, to stop serving its shards while
the lease is in doubt, or to give it up (`LeaseLost`).
When the process is paused as a whole (SIGSTOP, a VM pause), nothing runs and
the lease lapses, as it should; on waking, the allocator doubts the lease at once
and waits afresh for this thread to hear whether the KeySpace still has it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from streamkit.keyspace.keyspace import KeySpace, KeySpaceError

__all__ = ["LeaseKeeper"]

log = logging.getLogger(__name__)


# Keepalives per TTL. The allocator doubts a lease that went unanswered for 3/4 of its TTL
# (see `streamkit.app.allocator`), so a keepalive every TTL/6 leaves over half the TTL for
# one to be answered on a busy machine before anything is stopped.
KEEPALIVES_PER_TTL = 6


class LeaseKeeper:
    """Sends a keepalive for `lease` every TTL/6 from a daemon thread.

    `answered_at` (time.monotonic) is when the last keepalive the KeySpace
    answered was sent; `expired_lease` is a lease the KeySpace said is gone
    (the process was paused past it); `error` is the last failure, if the
    last attempt failed. All three are plain attributes, read from the
    event loop's thread: each is replaced whole, never updated in place.
    """

    def __init__(self, keyspace: KeySpace, ttl: float, name: str) -> None:
        self._keyspace = keyspace  # reopened in the thread; never used from it
        self.ttl = ttl
        self.name = name
        self.lease = 0
        self.answered_at = time.monotonic()
        self.expired_lease = 0
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, lease: int) -> None:
        """Begin keeping `lease` alive (it was just granted, so counts as answered now)."""
        self.keep(lease)
        self._thread = threading.Thread(target=self._run, name=f"lease {self.name}", daemon=True)
        self._thread.start()

    def keep(self, lease: int) -> None:
        """Keep `lease` alive from now on (a new one, after announcing again)."""
        self.answered_at = time.monotonic()
        self.lease = lease

    def stop(self, timeout: float = 5.0) -> None:
        """Stop sending keepalives and wait (bounded) for the thread, which notices within
        TTL/6."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        try:
            asyncio.run(self._keep_alive())
        except Exception as error:
            if self._stop.is_set():  # e.g. the process exiting under a KeySpace call
                log.debug("the lease keeper of %s ended: %r", self.name, error)
            else:  # the allocator sees answered_at age and gives the lease up
                log.exception("the lease keeper of %s failed", self.name)

    async def _keep_alive(self) -> None:
        keyspace = self._keyspace.reopen()
        try:
            while True:
                # Stop only after a sleep, never right after a keepalive: a keepalive's grpc
                # call, cancelled once answered, completes a moment later, and grpc hands
                # that completion to this thread's loop even once `asyncio.run` closed it
                # ("RuntimeError: Event loop is closed", logged by the loop polling then).
                await asyncio.sleep(self.ttl / KEEPALIVES_PER_TTL)
                if self._stop.is_set():
                    break
                lease = self.lease
                if lease == self.expired_lease:
                    continue  # the allocator will announce again
                began = time.monotonic()
                try:
                    async with asyncio.timeout(self.ttl):
                        alive = await keyspace.keepalive(lease)
                except TimeoutError:
                    self.error = f"no answer within {self.ttl:g}s"
                    continue
                except KeySpaceError as error:
                    self.error = str(error)
                    continue
                self.error = None
                if lease != self.lease:
                    continue  # replaced meanwhile: this answer is about the old one
                if alive:
                    self.answered_at = began
                else:
                    self.expired_lease = lease
        finally:
            await keyspace.close()
