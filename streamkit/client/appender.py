"""Appender: one Append RPC as an async writer; `append_bytes`: a whole append with retries.

Nothing an Appender writes is visible to readers until `commit` succeeds:
the broker sequences the content as it streams, then makes it visible
atomically on the empty "commit" chunk. Ending the stream without that chunk
rolls everything back. Because the broker holds the journal for an append in
progress, write an Appender's content promptly; for many small, scattered
writes use an AppendService instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

import grpc

from streamkit.auth.tokens import Capability
from streamkit.client.broker_client import BrokerClient
from streamkit.client.errors import (
    Backoff,
    NotAllowed,
    ProtocolError,
    check_status,
    describe,
    is_transient,
    rpc_failure,
    translating_rpc_errors,
)
from streamkit.protocol import pb

__all__ = ["CHUNK_SIZE", "Appender", "append_bytes", "append_with_retries"]

log = logging.getLogger(__name__)

# Content bytes per AppendRequest message. 256 KiB measured best here: the broker
# writes and hashes one chunk while the next is on the wire (bench/broker_bench.py).
CHUNK_SIZE = 256 << 10
_ABORT_TIMEOUT = 10.0
_Bytes = bytes | bytearray | memoryview


class Appender:
    """Streams content into one append transaction of `journal`.

    `async with Appender(client, journal) as a: await a.write(data)` commits
    when the block exits cleanly and rolls back if it raises. Register
    arguments are LabelSelector/LabelSets as in pb.AppendRequest; `offset`,
    if non-zero, must equal the journal's write head. After a commit,
    `response` holds the broker's AppendResponse; non-OK statuses raise
    the matching BrokerError.
    """

    def __init__(
        self,
        client: BrokerClient,
        journal: str,
        *,
        check_registers: pb.LabelSelector | None = None,
        union_registers: pb.LabelSet | None = None,
        subtract_registers: pb.LabelSet | None = None,
        offset: int = 0,
        chunk_size: int = CHUNK_SIZE,
    ) -> None:
        self.client = client
        self.request = pb.AppendRequest(journal=journal, offset=offset)
        if check_registers is not None:
            self.request.check_registers.CopyFrom(check_registers)
        if union_registers is not None:
            self.request.union_registers.CopyFrom(union_registers)
        if subtract_registers is not None:
            self.request.subtract_registers.CopyFrom(subtract_registers)
        self.response: pb.AppendResponse | None = None
        self.chunk_size = chunk_size
        self._call: grpc.aio.StreamUnaryCall | None = None
        self._pending = bytearray()  # small writes gathered into one chunk
        self._closed = False

    @property
    def journal(self) -> str:
        return self.request.journal

    async def __aenter__(self) -> Appender:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            await self.commit()
        elif issubclass(exc_type, asyncio.CancelledError):
            self.cancel()
        else:
            await self.abort()

    async def write(self, data: _Bytes) -> None:
        """Queue `data` for the append; large writes go out in `chunk_size` messages."""
        if self._closed:
            raise RuntimeError(f"append to {self.journal} was already committed or aborted")
        size = self.chunk_size
        if len(data) < size:
            self._pending += data
            if len(self._pending) >= size:
                await self._flush()
            return
        await self._flush()
        if len(data) == size and isinstance(data, bytes):
            await self._send(data)
            return
        view = memoryview(data)
        for start in range(0, len(view), size):
            await self._send(bytes(view[start : start + size]))

    async def _flush(self) -> None:
        if self._pending:
            chunk, self._pending = bytes(self._pending), bytearray()
            await self._send(chunk)

    async def _send(self, content: bytes) -> None:
        await self._write(await self._started(), pb.AppendRequest(content=content))

    async def _write(self, call: grpc.aio.StreamUnaryCall, request: pb.AppendRequest) -> None:
        try:
            await call.write(request)
        except (asyncio.InvalidStateError, grpc.aio.AioRpcError) as err:
            if not call.done():
                if isinstance(err, grpc.RpcError):
                    raise rpc_failure(err, f"append to {self.journal}") from err
                raise
            # The broker answered before taking all content (JOURNAL_NOT_FOUND,
            # say); gRPC then fails the write vaguely, and the answer says why.
            await self._finish(call)
            raise ProtocolError(f"append to {self.journal} ended early with an OK status") from None

    async def _started(self) -> grpc.aio.StreamUnaryCall:
        if self._call is None:
            metadata = self.client.auth(Capability.APPEND, self.journal)
            self._call = self.client.stub_for(self.journal).Append(metadata=metadata)
            try:
                # As any write: a call the broker already finished says why when awaited
                # (grpc.aio raises InvalidStateError for such a write when intercepted).
                await self._write(self._call, self.request)
            except BaseException:
                self.cancel()
                raise
        return self._call

    async def commit(self) -> pb.AppendResponse:
        """Send what remains and the commit chunk; returns (and keeps) the AppendResponse."""
        if self._closed:
            raise RuntimeError(f"append to {self.journal} was already committed or aborted")
        try:
            await self._flush()
            call = await self._started()
            self._closed = True
            await self._write(call, pb.AppendRequest())  # the empty chunk: commit
            with contextlib.suppress(asyncio.InvalidStateError):
                await call.done_writing()
            return await self._finish(call)
        except BaseException as exc:
            self.cancel()
            if is_transient(exc):
                self.client.forget_route(self.journal)
            raise

    async def _finish(self, call: grpc.aio.StreamUnaryCall) -> pb.AppendResponse:
        with translating_rpc_errors(f"append to {self.journal}"):
            response = await call
        self.response = response
        self._closed = True
        if response.HasField("header"):
            self.client.update_route(self.journal, response.header.route)
        check_status(response.status, f"append to {self.journal}")
        return response

    async def abort(self) -> None:
        """Roll back: end the stream without the commit chunk and await the broker's answer."""
        self._closed = True
        self._pending = bytearray()
        call = self._call
        if call is None:
            return
        try:
            await asyncio.wait_for(self._roll_back(call), _ABORT_TIMEOUT)
        except (grpc.RpcError, asyncio.InvalidStateError, TimeoutError):
            pass  # the broker refusing the uncommitted stream is the expected outcome
        finally:
            self.cancel()

    @staticmethod
    async def _roll_back(call: grpc.aio.StreamUnaryCall) -> None:
        with contextlib.suppress(asyncio.InvalidStateError):
            await call.done_writing()
        await call

    def cancel(self) -> None:
        """Cancel the RPC without waiting (its content is rolled back by the broker)."""
        self._closed = True
        call, self._call = self._call, None
        if call is not None and not call.done():
            call.cancel()


async def append_with_retries(
    client: BrokerClient,
    journal: str,
    content: Callable[[], Iterable[_Bytes]],
    **request: Any,
) -> pb.AppendResponse:
    """Append `content()` as one transaction, re-calling it for each retry.

    Transport and routing failures are retried with backoff (forever); any
    other failure raises. A retry after a commit whose answer was lost
    appends the content twice: appends are at-least-once, as in Gazette.
    """
    backoff = Backoff()
    while True:
        try:
            async with Appender(client, journal, **request) as appender:
                for part in content():
                    await appender.write(part)
            assert appender.response is not None
            return appender.response
        except Exception as exc:
            if not is_transient(exc):
                raise
            client.forget_route(journal)
            # The first retry is a warning (a command line shows those: an append waiting
            # on a broker that went away looked hung); later ones ever more rarely.
            level = (logging.WARNING if backoff.attempt == 0 else
                     logging.INFO if backoff.worth_saying() else logging.DEBUG)
            log.log(level, "retrying append to %s: %s", journal, describe(exc))
            await backoff.sleep()


async def append_bytes(
    client: BrokerClient,
    journal: str,
    data: _Bytes | Iterable[_Bytes],
    **request: Any,
) -> pb.AppendResponse:
    """Append `data` (bytes, or a list of bytes to concatenate) atomically, with retries.

    `request` takes the Appender's keyword arguments (registers, offset).
    """
    parts = [data] if isinstance(data, bytes | bytearray | memoryview) else list(data)
    return await append_with_retries(client, journal, lambda: parts, **request)


async def write_head(client: BrokerClient, journal: str) -> int:
    """The journal's current write head, from a zero-byte append (a barrier: every append
    acknowledged before it is below the returned offset). A read-only journal (a partition
    retired by a reshard) refuses appends: nothing can be in flight there, so a
    metadata-only read gives its final head."""
    try:
        response = await append_with_retries(client, journal, lambda: ())
    except NotAllowed:
        from streamkit.client.reader import read_write_head

        return await read_write_head(client, journal)
    return response.commit.end
