"""Serving one Read stream: metadata, then content, fragment after fragment.

For each fragment the stream sends a metadata response (offset, write head,
fragment, and for persisted fragments its URL), then the content in large
chunks. A local spool is read with pread below the committed end; a persisted
fragment is opened in its store and decompressed in a worker thread. When a
gap precedes the next fragment the metadata carries the jumped-to offset.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import BinaryIO

from streamkit.broker import metrics
from streamkit.broker.faults import ContentLost, StoreGone, storage_fault
from streamkit.broker.replica import Replica
from streamkit.broker.stores import FragmentStore, FragmentStoreError
from streamkit.protocol import pb
from streamkit.protocol.codecs import CodecError, open_decompressed
from streamkit.protocol.fragments import content_name

log = logging.getLogger(__name__)

CHUNK = 1 << 19  # 512 KiB: few messages per MB, well under gRPC's 4 MiB limit
URL_TTL = timedelta(minutes=1)


class ReadStream:
    """Produces the ReadResponses of one Read RPC."""

    def __init__(self, replica: Replica, request: pb.ReadRequest, header: pb.Header) -> None:
        self.replica = replica
        self.request = request
        self.header: pb.Header | None = header  # sent with the first response only
        self.offset = replica.write_head if request.offset == -1 else request.offset

    def _response(self, **fields) -> pb.ReadResponse:
        response = pb.ReadResponse(header=self.header, **fields)
        self.header = None
        return response

    def _done(self) -> bool:
        end = self.request.end_offset
        replica = self.replica
        return replica.deleted or replica.reads_ended or (end > 0 and self.offset >= end)

    async def responses(self) -> AsyncIterator[pb.ReadResponse]:
        replica, request = self.replica, self.request
        while not self._done():
            changed = replica.changed()
            unknown = replica.unknown_below(self.offset)
            if unknown is not None:
                raise unknown
            lookup = replica.index.query(self.offset)
            if lookup is None or lookup.offset >= lookup.fragment.end:
                if not request.block:
                    yield self._response(
                        status=pb.OFFSET_NOT_YET_AVAILABLE,
                        offset=self.offset,
                        write_head=replica.write_head,
                    )
                    return
                await changed.wait()
                continue
            fragment = lookup.fragment
            if fragment.mod_time and fragment.mod_time < request.begin_mod_time:
                self.offset = fragment.end  # persisted before the reader's begin_mod_time
                continue
            self.offset = lookup.offset
            url = await self._fragment_url(fragment)
            yield self._response(
                status=pb.OK,
                offset=self.offset,
                write_head=replica.write_head,
                fragment=fragment,
                fragment_url=url,
            )
            if request.metadata_only or (request.do_not_proxy and fragment.backing_store):
                return  # the client reads the fragment itself (or only wanted metadata)
            async for chunk in self._content(fragment):
                yield pb.ReadResponse(offset=self.offset, content=chunk)
                self.offset += len(chunk)
                metrics.READ_BYTES.inc(len(chunk))
                if replica.reads_ended:  # the broker is stopping: end within gRPC's grace,
                    return  # cleanly (the reader goes on from here), not cancelled mid-fragment

    async def _fragment_url(self, fragment: pb.Fragment) -> str:
        if not fragment.backing_store:
            return ""
        for store in self.replica.stores:
            if store.url == fragment.backing_store:
                return await store.signed_url(fragment, URL_TTL)
        return ""

    def _stop(self, fragment: pb.Fragment) -> int:
        end = self.request.end_offset
        return min(fragment.end, end) if end > 0 else fragment.end

    async def _content(self, fragment: pb.Fragment) -> AsyncIterator[bytes]:
        if fragment.backing_store:
            async for chunk in self._remote_content(fragment):
                yield chunk
            return
        spool = self.replica.local.get(fragment.begin)
        stop = self._stop(fragment)
        offset = self.offset
        while offset < stop and spool is not None and not spool.closed:
            try:
                chunk = spool.read(offset, CHUNK, stop)
            except OSError as error:
                raise storage_fault(self.replica.name, f"reading offset {offset}", error) from error
            if not chunk:  # committed bytes are missing from the file: never spin on it
                raise ContentLost(self.replica.name, f"its spool {spool.data_path} holds no "
                                  f"bytes at offset {offset}, below its committed end {stop}")
            offset += len(chunk)
            yield chunk

    async def _remote_content(self, fragment: pb.Fragment) -> AsyncIterator[bytes]:
        """The content of a persisted fragment from its store. A store that fails (an I/O
        error, unreachable) is a StorageFailed the reader retries; content that is there
        but is not what the fragment's name says (it can't be decoded for its codec, or
        it ends before the fragment's end) is ContentLost: retrying reads the same bytes."""
        store = next((s for s in self.replica.stores if s.url == fragment.backing_store), None)
        if store is None:  # (returning nothing, the read found the same fragment for ever)
            raise StoreGone(self.replica.name, f"fragment {content_name(fragment)} is in "
                            f"{fragment.backing_store}, no longer one of the journal's stores; "
                            "its index follows at the next listing of the stores")
        doing = f"reading fragment {content_name(fragment)} from {store.url}"
        try:
            stream = await store.in_thread(_open_at, store, fragment, self.offset)
        except _EndedEarly as short:
            raise self._lost(fragment, doing, short.offset, "it ended early") from None
        except _UndecodableAt as bad:  # while skipping to self.offset: where it failed
            raise self._undecodable(fragment, doing, bad.offset, bad.error) from bad.error
        except CodecError as error:  # (an OSError: caught before the store's failures)
            raise self._undecodable(fragment, doing, self.offset, error) from error
        except (OSError, FragmentStoreError) as error:
            self.replica.list_soon = True  # gone (pruned, say)? the next listing tells
            raise storage_fault(self.replica.name, doing, error) from error
        offset, stop = self.offset, self._stop(fragment)
        try:
            while offset < stop:
                try:
                    chunk = await store.in_thread(stream.read, min(CHUNK, stop - offset))
                except CodecError as error:
                    raise self._undecodable(fragment, doing, offset, error) from error
                except (OSError, FragmentStoreError) as error:
                    raise storage_fault(self.replica.name, doing, error) from error
                if not chunk:
                    raise self._lost(fragment, doing, offset, "it ended early")
                offset += len(chunk)
                yield chunk
        finally:
            try:
                stream.close()
            except Exception as error:  # what was read is intact; only the handle leaks
                log.warning("%s: closing it failed: %s", doing, error)

    def _undecodable(self, fragment: pb.Fragment, doing: str, offset: int,
                     error: CodecError) -> ContentLost:
        codec = pb.CompressionCodec.Name(fragment.compression_codec)
        return self._lost(fragment, doing, offset,
                          f"its {codec} content can't be decoded ({error})")

    def _lost(self, fragment: pb.Fragment, doing: str, offset: int, why: str) -> ContentLost:
        """Content of `fragment` from `offset` on can't be read back (DATA_LOSS: final)."""
        return ContentLost(self.replica.name, f"{doing}: {why}, at offset {offset}; offsets "
                           f"{offset}..{fragment.end} of the fragment "
                           f"({fragment.begin}..{fragment.end}) can't be read back")


class _EndedEarly(Exception):
    """A stored fragment's content ended at `offset`, before where a read was to start."""

    def __init__(self, offset: int) -> None:
        super().__init__(f"the content ends at offset {offset}")
        self.offset = offset


class _UndecodableAt(Exception):
    """A stored fragment's content could not be decoded at `offset`, before where a read
    was to start."""

    def __init__(self, offset: int, error: CodecError) -> None:
        super().__init__(f"the content can't be decoded at offset {offset}: {error}")
        self.offset = offset
        self.error = error


def _open_at(store: FragmentStore, fragment: pb.Fragment, offset: int) -> BinaryIO:
    """Open a decompressed view of a stored fragment, positioned at `offset` (blocking)."""
    stream = open_decompressed(store.open(fragment), fragment.compression_codec)
    position = fragment.begin
    try:
        while position < offset:
            try:
                skipped = len(stream.read(min(offset - position, 1 << 22)))
            except CodecError as error:
                raise _UndecodableAt(position, error) from error
            if skipped == 0:
                raise _EndedEarly(position)
            position += skipped
    except BaseException:
        stream.close()
        raise
    return stream
