"""AppendService: asynchronous, batched, ordered and retried appends.

Per journal the service keeps a FIFO queue of AsyncAppends, served by one
task that sends them in order, one Append RPC each. While an RPC is in
flight, new writes to that journal gather in the queue's tail, so many
small co-occurring appends coalesce into one RPC (Gazette's design). Each
AsyncAppend holds its content in an AppendBuffer: in memory while small, in a
temporary file once large (which keeps the heap small and rides out long
broker outages), replayed as often as retries need.

Ordering across journals is expressed with dependencies: an append starts
only after the OpFutures it depends on have committed, and fails with a
dependency's error if one failed. A failure other than a transport one
fails the journal's queue for good (later appends fail with the same
error), so nothing written after a failed append can commit out of order.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from types import TracebackType
from typing import Any

from streamkit.client.append_buffer import AppendBuffer
from streamkit.client.appender import CHUNK_SIZE, append_with_retries
from streamkit.client.broker_client import BrokerClient
from streamkit.client.closing import AsyncClosing
from streamkit.client.errors import describe
from streamkit.errors import StreamkitError
from streamkit.protocol import pb
from streamkit.tasks import cancel_and_wait

__all__ = ["AppendService", "AsyncAppend", "OpFuture", "ServiceClosed"]

log = logging.getLogger(__name__)

MAX_APPEND_SIZE = 8 << 20  # an AsyncAppend this large takes no more writes
_YIELD_EVERY = 256 << 10  # bytes `append` buffers before letting other tasks run


class ServiceClosed(StreamkitError, RuntimeError):
    """The AppendService was closed before this append could be sent."""


class OpFuture:
    """The outcome of an asynchronous operation: an AppendResponse, or an error.

    Await it for the response (raising the error), or poll `done()`,
    `result()` and `exception()`. Many appends batched into one RPC share
    one OpFuture, whose response describes the whole batch's commit.
    """

    __slots__ = ("_future",)

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._future: asyncio.Future[pb.AppendResponse] = (
            loop or asyncio.get_running_loop()
        ).create_future()

    @classmethod
    def finished(
        cls, error: BaseException | None = None, response: pb.AppendResponse | None = None
    ) -> OpFuture:
        """An already resolved OpFuture (Gazette's FinishedOperation)."""
        op = cls()
        if error is None:
            op.resolve(response or pb.AppendResponse(status=pb.OK))
        else:
            op.fail(error)
        return op

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> pb.AppendResponse:
        """The response; raises the failure, or InvalidStateError if not yet done."""
        return self._future.result()

    def exception(self) -> BaseException | None:
        return self._future.exception()

    def succeeded(self) -> bool:
        return self._future.done() and self._future.exception() is None

    def __await__(self) -> Generator[Any, None, pb.AppendResponse]:
        # Shielded: a cancelled awaiter must not cancel an outcome others share.
        return asyncio.shield(self._future).__await__()

    def on_success(self, callback: Callable[[pb.AppendResponse], object]) -> None:
        """Call `callback(response)` on the loop once it resolves successfully."""
        def done(future: asyncio.Future[pb.AppendResponse]) -> None:
            if not future.cancelled() and future.exception() is None:
                callback(future.result())
        self._future.add_done_callback(done)

    async def wait(self) -> None:
        """Wait until done, without raising its error."""
        if not self._future.done():
            await asyncio.wait((self._future,))

    def resolve(self, response: pb.AppendResponse) -> None:
        """Complete it successfully (no-op if already done). For producers of OpFutures
        outside the AppendService: recorders, stores."""
        if not self._future.done():
            self._future.set_result(response)

    def fail(self, error: BaseException) -> None:
        """Complete it with an error (no-op if already done)."""
        if not self._future.done():
            if isinstance(error, asyncio.CancelledError):
                error = ServiceClosed(f"cancelled: {error}")
            self._future.set_exception(error)
            self._future.exception()  # retrieved: the service logs failures itself


class AsyncAppend:
    """Content queued for one journal, sent as one Append RPC once released.

    From `start_append` until `release`, the caller has it to itself: it
    `write`s content, may `require` that an error is None, and then
    `release`s it. If a required error was set, release rolls back exactly
    this caller's writes and raises it. Use as a context manager to release
    on exit and roll back on an exception.
    """

    __slots__ = (
        "_buffer",
        "_dispatching",
        "_error",
        "_held",
        "_mark",
        "_queue",
        "_release_waiter",
        "dependencies",
        "future",
        "journal",
    )

    def __init__(
        self,
        queue: _JournalQueue,
        dependencies: frozenset[OpFuture],
        buffer: AppendBuffer | None,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.journal = queue.journal
        self.dependencies = dependencies
        self.future = OpFuture(loop)
        self._queue = queue
        self._buffer = buffer  # None when the journal already failed: writes are dropped
        self._mark = 0  # size when the current holder's start_append returned
        self._held = False
        self._dispatching = False
        self._error: BaseException | None = None
        self._release_waiter: asyncio.Future[None] | None = None

    @property
    def size(self) -> int:
        """Bytes of content queued so far."""
        return 0 if self._buffer is None else self._buffer.size

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Queue `data`."""
        if self._buffer is not None:
            self._buffer.write(data)

    def require(self, error: BaseException | None) -> AsyncAppend:
        """Remember a non-None `error`: release will roll back and raise it."""
        if error is not None and self._error is None:
            self._error = error
        return self

    def release(self) -> None:
        """Hand the append over for dispatch (or roll back and raise a required error)."""
        if not self._held:
            raise RuntimeError(f"append to {self.journal} is not held (released twice?)")
        error, self._error = self._error, None
        if error is not None:
            self._truncate(self._mark)
        self._held = False
        self._queue.released(self)
        waiter = self._release_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if error is not None:
            raise error

    def _truncate(self, size: int) -> None:
        if self._buffer is not None:
            self._buffer.truncate(size)

    def __enter__(self) -> AsyncAppend:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            self._error = None
            self.require(exc)
            try:
                self.release()  # rolls back and raises `exc` again, which propagates anyway
            except BaseException as error:
                if error is not exc:  # "not held", say: a bug, logged as `exc` propagates
                    log.warning("append to %s: dropped %r, raised while rolling back after %r",
                                self.journal, error, exc)
            return
        self.release()

    def _free(self) -> None:
        """Drop the content once sent or failed; later writes are dropped."""
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None

    async def _released(self) -> None:
        # A loop: another caller may take the tail again before the dispatcher runs.
        while self._held:
            self._release_waiter = asyncio.get_running_loop().create_future()
            await self._release_waiter

    def _chunks(self) -> Iterator[bytes]:
        """The content, read back (again for every retry)."""
        assert self._buffer is not None
        return self._buffer.chunks(CHUNK_SIZE)


class _JournalQueue:
    """The AsyncAppends of one journal, in dispatch order, and its dispatch task."""

    __slots__ = ("appends", "error", "journal", "open_tails", "task")

    def __init__(self, journal: str, open_tails: dict[str, AsyncAppend]) -> None:
        self.journal = journal
        self.appends: deque[AsyncAppend] = deque()
        self.error: BaseException | None = None
        self.task: asyncio.Task[None] | None = None
        self.open_tails = open_tails  # the service's fast-path index

    def released(self, append: AsyncAppend) -> None:
        """A released, undispatched tail can take more writes without a start_append."""
        if (
            self.appends
            and self.appends[-1] is append
            and not append._dispatching
            and self.error is None
        ):
            self.open_tails[self.journal] = append


class AppendService(AsyncClosing):
    """Batches, orders, dispatches and retries appends to many journals.

    `await service.append(journal, data)` is the cheap, common call. For
    content written piecewise, or to roll back on an error, use
    `start_append` / `write` / `release`. Close the service (or use
    `async with`) to flush everything and stop its tasks.

    With `sticky_failures=False`, a failure fails the appends queued at the
    time but not later ones: for writers whose appends need no order among
    themselves (independent producers sharing one service).
    """

    def __init__(self, client: BrokerClient, *, max_append_size: int = MAX_APPEND_SIZE,
                 sticky_failures: bool = True) -> None:
        self.client = client
        self.max_append_size = max_append_size
        self.sticky_failures = sticky_failures
        self._queues: dict[str, _JournalQueue] = {}
        # journal -> its tail when released and undispatched: `append` writes straight into it.
        self._open_tails: dict[str, AsyncAppend] = {}
        self._budget = _YIELD_EVERY
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- producing --------------------------------------------------------

    async def append(
        self,
        journal: str,
        data: bytes | bytearray | memoryview,
        dependencies: Iterable[OpFuture] = (),
    ) -> OpFuture:
        """Queue `data` as (part of) an append to `journal`; returns its OpFuture."""
        future = self.append_nowait(journal, data, dependencies)
        await self.yield_if_due()
        return future

    async def yield_if_due(self) -> None:
        """Yield to the event loop once enough was queued since the last time.

        Producers that never wait would starve the dispatch tasks otherwise.
        """
        if self._budget < 0:
            self._budget = _YIELD_EVERY
            await asyncio.sleep(0)

    def append_nowait(
        self,
        journal: str,
        data: bytes | bytearray | memoryview,
        dependencies: Iterable[OpFuture] = (),
    ) -> OpFuture:
        """`append` for synchronous callers, who must yield to the event loop regularly."""
        tail = None if dependencies else self._open_tails.get(journal)
        if tail is not None and tail.size < self.max_append_size:
            tail._buffer.write(data)  # type: ignore[union-attr]  # open tails have buffers
        else:
            tail = self.start_append(journal, dependencies)
            tail.write(data)
            tail.release()
        self._budget -= len(data)
        return tail.future

    def start_append(self, journal: str, dependencies: Iterable[OpFuture] = ()) -> AsyncAppend:
        """Hold an AsyncAppend of `journal` to write into; `release` it when done.

        It is the journal's undispatched tail when that has room and already
        waits for these dependencies (so writes batch), else a new one.
        """
        if self._closed:
            raise ServiceClosed("the AppendService is closed")
        loop = self._loop or self._bind_loop()
        queue = self._queues.get(journal)
        if queue is None:
            queue = self._queues[journal] = _JournalQueue(journal, self._open_tails)
        deps = frozenset(d for d in dependencies if not d.succeeded())
        if queue.error is not None:
            append = AsyncAppend(queue, deps, None, loop)
            append.future.fail(queue.error)
        else:
            append = queue.appends[-1] if queue.appends else None
            if (
                append is None
                or append._held
                or append._dispatching
                or append.size >= self.max_append_size
                or not deps <= append.dependencies
            ):
                append = AsyncAppend(queue, deps, AppendBuffer(), loop)
                queue.appends.append(append)
                if queue.task is None:
                    queue.task = loop.create_task(self._serve(queue))
            self._open_tails.pop(journal, None)
        append._held = True
        append._mark = append.size
        return append

    def pending_except(self, journal: str) -> list[OpFuture]:
        """OpFutures covering every unfinished append to other journals (a barrier).

        A journal's last queued append commits after all before it, so its
        future stands for the whole queue. Failed journals contribute a
        failed OpFuture, so dependents fail as well.
        """
        futures = []
        for name, queue in self._queues.items():
            if name == journal:
                continue
            if queue.error is not None:
                futures.append(OpFuture.finished(queue.error))
            elif queue.appends:
                futures.append(queue.appends[-1].future)
        return futures

    async def flush(self) -> None:
        """Wait until everything appended so far has committed or failed."""
        while True:
            pending = [q.appends[-1].future for q in self._queues.values() if q.appends]
            if not pending:
                return
            for future in pending:
                await future.wait()

    async def close(self, *, flush: bool = True) -> None:
        """Stop taking appends, flush them (unless `flush=False`), and stop the tasks."""
        self._closed = True
        if flush:
            await self.flush()
        for queue in list(self._queues.values()):
            if queue.task is not None:
                await cancel_and_wait(queue.task, f"appending to {queue.journal}")
            self._fail_queue(queue, ServiceClosed("the AppendService was closed"), log_it=False)

    # --- dispatching ------------------------------------------------------

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        self._loop = asyncio.get_running_loop()
        return self._loop

    async def _serve(self, queue: _JournalQueue) -> None:
        """Send the queue's appends in order until it is empty or has failed."""
        try:
            while queue.appends:
                append = queue.appends[0]
                try:
                    await _await_dependencies(append)
                    await append._released()
                    append._dispatching = True
                    if self._open_tails.get(queue.journal) is append:
                        del self._open_tails[queue.journal]
                    response = await self._send(append)
                except Exception as error:
                    self._fail_queue(queue, error, log_it=True)
                    return
                queue.appends.popleft()
                append.future.resolve(response)
                append._free()
        finally:
            queue.task = None

    async def _send(self, append: AsyncAppend) -> pb.AppendResponse:
        if append.size == 0:
            return pb.AppendResponse(status=pb.OK)  # everything was rolled back
        return await append_with_retries(self.client, append.journal, append._chunks)

    def _fail_queue(self, queue: _JournalQueue, error: BaseException, *, log_it: bool) -> None:
        """Fail every queued append; later appends to the journal fail too."""
        if log_it:
            log.warning("appends to %s failed: %s", queue.journal, describe(error))
        queue.error = queue.error or error
        self._open_tails.pop(queue.journal, None)
        while queue.appends:
            append = queue.appends.popleft()
            append.future.fail(error)
            append._free()
        if not self.sticky_failures and self._queues.get(queue.journal) is queue:
            del self._queues[queue.journal]  # the next append starts afresh


async def _await_dependencies(append: AsyncAppend) -> None:
    """Wait for every dependency; raise the error of the first that failed."""
    for dependency in append.dependencies:
        await dependency.wait()
        error = dependency.exception()
        if error is not None:
            raise error
