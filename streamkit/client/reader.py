"""Reader (one Read RPC) and RetryReader (restarts it as needed), as async byte streams.

A Read stream interleaves metadata responses (fragment, write head, maybe a
fragment URL) with content chunks. Reader turns it into `read()` calls that
hand out the chunks' bytes as they arrived, and keeps `offset` at the next
byte the caller will get, so a new RPC can always resume exactly there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Self

import grpc

from streamkit.auth.tokens import Capability
from streamkit.client.broker_client import BrokerClient
from streamkit.client.closing import AsyncClosing
from streamkit.client.errors import (
    Backoff,
    OffsetJump,
    ProtocolError,
    broker_error,
    describe,
    is_transient,
    rpc_failure,
)
from streamkit.client.fragment_reader import FragmentReader, open_fragment
from streamkit.protocol import pb
from streamkit.protocol.codecs import CodecError

__all__ = ["Reader", "RetryReader", "read_write_head"]

log = logging.getLogger(__name__)

_DIRECT_READ = 1 << 20  # largest read() answered from a directly opened fragment
_LASTING = 8  # retries of a transient failure (~5 s of backoff) before it is a warning


class _ByteStream(AsyncClosing):
    """`read()`, `async for` and `async with` on top of a `read(n)` coroutine."""

    async def read(self, n: int = -1) -> bytes:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self.read()
        if not chunk:
            raise StopAsyncIteration
        return chunk


class Reader(_ByteStream):
    """Adapts one Read RPC to `await read(n)` / `async for chunk in reader`.

    `read` returns b"" (end of stream) when the broker ends the RPC, when
    `end_offset` is reached, or when a directly read fragment is exhausted.
    It raises OffsetJump once if the broker skips ahead (then continues from
    the new offset), and the BrokerError of any non-OK status, after which the
    Reader is finished. The RPC starts at the first `read`.
    """

    def __init__(
        self, client: BrokerClient, request: pb.ReadRequest, *, file_root: Path | None = None
    ) -> None:
        self.client = client
        self.request = pb.ReadRequest()
        self.request.CopyFrom(request)
        self.file_root = file_root
        self.offset = request.offset  # next byte to hand out; -1 until the head is known
        self.response = pb.ReadResponse()  # the last metadata response
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._chunk = b""  # content received but not yet handed out, from _pos on
        self._pos = 0
        self._direct: FragmentReader | None = None
        self._finished = False

    @property
    def journal(self) -> str:
        return self.request.journal

    async def read(self, n: int = -1) -> bytes:
        """The next bytes (at most `n` when n > 0); b"" at the end of the stream."""
        if n == 0:
            return b""
        while True:
            if self._pos < len(self._chunk):
                return self._take(n)
            if self._direct is not None:
                return await self._read_direct(n)
            if self._finished:
                return b""
            response = await self._receive()
            if response is None:
                self._finish()
                return b""
            content = response.content
            if content:
                if response.offset != self.offset:
                    self._finish()
                    raise ProtocolError(
                        f"read {self.journal}: content at offset {response.offset}, "
                        f"expected {self.offset}"
                    )
                self._chunk, self._pos = content, 0
            else:
                await self._on_metadata(response)

    def _take(self, n: int) -> bytes:
        chunk, pos = self._chunk, self._pos
        if pos == 0 and (n < 0 or n >= len(chunk)):
            out = chunk  # the common case: the response's bytes, uncopied
        else:
            out = chunk[pos:] if n < 0 else chunk[pos : pos + n]
        self._pos = pos + len(out)
        self.offset += len(out)
        if self._pos == len(chunk):
            self._chunk, self._pos = b"", 0
        return out

    async def _receive(self) -> pb.ReadResponse | None:
        """The next response of the RPC (starting it if needed); None when it ended."""
        if self._call is None:
            metadata = self.client.auth(Capability.READ, self.journal)
            self._call = self.client.stub_for(self.journal).Read(self.request, metadata=metadata)
        try:
            response = await self._call.read()
        except BaseException as exc:
            self._finish()
            if is_transient(exc):
                self.client.forget_route(self.journal)
            if isinstance(exc, grpc.RpcError):
                raise rpc_failure(exc, f"read {self.journal} at offset {self.offset}") from exc
            raise
        return None if response is grpc.aio.EOF else response

    async def _on_metadata(self, response: pb.ReadResponse) -> None:
        self.response = response
        if response.HasField("header"):
            self.client.update_route(self.journal, response.header.route)
        if response.status != pb.OK:
            self._finish()
            raise broker_error(response.status, f"read {self.journal} at offset {self.offset}")
        jump = None
        if self.offset < 0:
            self.offset = response.offset  # a read from the write head learns where it is
        elif response.offset > self.offset:
            jump = OffsetJump(self.offset, response.offset, self.journal)
            self.offset = response.offset
        elif response.offset < self.offset:
            self._finish()
            raise ProtocolError(
                f"read {self.journal}: metadata at offset {response.offset}, "
                f"before the requested {self.offset}"
            )
        request = self.request
        if response.fragment_url and request.do_not_proxy and not request.metadata_only:
            self._direct = await asyncio.to_thread(
                open_fragment, response.fragment, response.fragment_url, self.file_root, self.offset
            )
        if jump is not None:
            raise jump

    async def _read_direct(self, n: int) -> bytes:
        direct = self._direct
        assert direct is not None
        stop = direct.fragment.end
        if self.request.end_offset:
            stop = min(stop, self.request.end_offset)
        want = min(stop - self.offset, _DIRECT_READ if n < 0 else n)
        if want <= 0:
            # Like Gazette: the Reader ends with the fragment; a RetryReader goes on.
            self._finish()
            return b""
        try:
            data = await asyncio.to_thread(direct.read, want)
        except BaseException:
            self._finish()
            raise
        self.offset += len(data)
        return data

    def _finish(self) -> None:
        """Release the RPC and any open fragment; later reads return b""."""
        self._finished = True
        call, self._call = self._call, None
        if call is not None and not call.done():
            call.cancel()
        direct, self._direct = self._direct, None
        if direct is not None:
            direct.close()

    def close(self) -> None:
        """Cancel the RPC (if running) and drop buffered content."""
        self._chunk, self._pos = b"", 0
        self._finish()


class RetryReader(_ByteStream):
    """A Reader that resumes at its offset whenever the RPC ends or the transport fails.

    With `block=True` in the request it tails the journal forever; otherwise it
    raises OffsetNotYetAvailable at the write head. It returns b"" only once
    `end_offset` is reached (or after a metadata-only read). Offset jumps
    raise OffsetJump (the reader has moved on already) unless `skip_jumps`,
    which logs them. A cancelled `read` leaves no RPC behind; the next `read`
    restarts at the offset.
    """

    def __init__(
        self,
        client: BrokerClient,
        request: pb.ReadRequest,
        *,
        skip_jumps: bool = False,
        file_root: Path | None = None,
    ) -> None:
        self.client = client
        self.request = pb.ReadRequest()
        self.request.CopyFrom(request)
        self.skip_jumps = skip_jumps
        self.file_root = file_root
        self.offset = request.offset
        self.reader: Reader | None = None
        self._last_response = pb.ReadResponse()
        self._backoff = Backoff()

    @property
    def journal(self) -> str:
        return self.request.journal

    @property
    def end_offset(self) -> int:
        return self.request.end_offset

    @property
    def response(self) -> pb.ReadResponse:
        """The last metadata response of the current (or last) Reader."""
        return self.reader.response if self.reader is not None else self._last_response

    def seek(self, offset: int) -> int:
        """Continue reading at `offset` (a new Read RPC unless it is the current offset)."""
        if offset != self.offset:
            self._drop()
            self.offset = offset
        return self.offset

    async def read(self, n: int = -1) -> bytes:
        while not (self.end_offset and self.offset >= self.end_offset):
            reader = self.reader or self._open()
            try:
                data = await reader.read(n)
            except OffsetJump as jump:
                self.offset = reader.offset
                if not self.skip_jumps:
                    raise
                log.warning("skipping a gap in %s: %s", self.journal, jump)
                continue
            except BaseException as exc:
                self._drop()
                if not _retryable(exc):
                    raise
                level = logging.WARNING
                if is_transient(exc):  # said louder once it lasts (~5 s): not a restart's blip
                    saying = self._backoff.worth_saying()
                    level = logging.DEBUG if not saying else (
                        logging.WARNING if self._backoff.attempt >= _LASTING else logging.INFO)
                log.log(level, "restarting read of %s at %d: %s",
                        self.journal, self.offset, describe(exc))
                await self._backoff.sleep()
                continue
            self.offset = reader.offset
            if data:
                self._backoff.reset()
                return data
            self._drop()
            if self.request.metadata_only:
                break
            await self._backoff.sleep()  # immediate the first time; a busy loop never
        return b""

    def _open(self) -> Reader:
        request = pb.ReadRequest()
        request.CopyFrom(self.request)
        request.offset = self.offset
        self.reader = Reader(self.client, request, file_root=self.file_root)
        return self.reader

    def _drop(self) -> None:
        reader, self.reader = self.reader, None
        if reader is not None:
            self._last_response = reader.response
            reader.close()

    def close(self) -> None:
        self._drop()


def _retryable(exc: BaseException) -> bool:
    """Transport trouble, or a fragment fetch that failed (its URL may be re-signed).

    Content that is corrupt or doesn't match its fragment is not retried.
    """
    if is_transient(exc):
        return True
    return isinstance(exc, OSError) and not isinstance(exc, CodecError)


async def write_heads(client: BrokerClient, journals: Iterable[str], timeout: float
                      ) -> dict[str, int]:
    """The write heads of `journals` (`read_write_head`), asked together, each within
    `timeout` seconds; a journal whose head can't be had (missing, the broker failing or too
    slow) is left out, for the caller's reads to meet."""
    journals = list(journals)
    heads = await asyncio.gather(*(asyncio.wait_for(read_write_head(client, j), timeout)
                                   for j in journals), return_exceptions=True)
    return {j: h for j, h in zip(journals, heads, strict=True) if isinstance(h, int)}


async def read_write_head(client: BrokerClient, journal: str) -> int:
    """Where the next append to `journal` will land, asked with a metadata-only read (no
    barrier, unlike a zero-byte append; but it works on a read-only journal too)."""
    from streamkit.client.errors import OffsetNotYetAvailable

    reader = Reader(client, pb.ReadRequest(journal=journal, offset=-1, metadata_only=True))
    try:
        await reader.read()
    except OffsetNotYetAvailable:
        pass  # the expected answer at the head; it carries write_head
    finally:
        reader.close()
    return reader.response.write_head
