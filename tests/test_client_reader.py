"""Reader, RetryReader and FragmentReader against real broker processes."""

from __future__ import annotations

import asyncio
import functools
import hashlib
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from streamkit.client import (
    BrokerClient,
    FragmentError,
    OffsetJump,
    OffsetNotYetAvailable,
    Reader,
    RetryReader,
    append_bytes,
    list_fragments,
    open_fragment,
)
from streamkit.protocol import pb
from streamkit.protocol.codecs import new_compressor
from streamkit.protocol.fragments import content_name, sum_of
from tests.brokerproc import BrokerProcess
from tests.helpers_client import (
    create_journal,
    eventually,
    fragment_files,
    open_reads,
    read_range,
    unique_name,
)
from tests.waiting import DEADLINE, Worker


@pytest.fixture
async def client(shared_broker: BrokerProcess):
    async with BrokerClient(shared_broker.address) as c:
        yield c


async def _read_all(reader: Reader | RetryReader, n: int = -1) -> bytes:
    out = bytearray()
    while chunk := await reader.read(n):
        out += chunk
    return bytes(out)


async def test_reader_round_trip(client: BrokerClient) -> None:
    journal = unique_name("reader")
    await create_journal(client, journal)
    await append_bytes(client, journal, b"hello, ")
    await append_bytes(client, journal, [b"journal", b"!"])

    request = pb.ReadRequest(journal=journal, offset=0, end_offset=15)
    async with Reader(client, request) as reader:
        assert await reader.read(5) == b"hello"
        assert reader.offset == 5
        assert await _read_all(reader, 3) == b", journal!"
        assert reader.offset == 15
        assert reader.response.fragment.begin == 0
        assert reader.response.write_head == 15
    # The header's route points at the broker we asked: nothing to re-route.
    assert client.route_of(journal) == client.address


async def test_non_blocking_read_at_head(client: BrokerClient) -> None:
    journal = unique_name("reader")
    await create_journal(client, journal)
    await append_bytes(client, journal, b"abc")
    for reader in (
        Reader(client, pb.ReadRequest(journal=journal, offset=0)),
        RetryReader(client, pb.ReadRequest(journal=journal, offset=0)),
    ):
        assert await reader.read() == b"abc"
        with pytest.raises(OffsetNotYetAvailable):
            await reader.read()
        assert reader.offset == 3
        assert reader.response.write_head == 3
        reader.close()


async def test_blocking_read_woken_by_append(client: BrokerClient) -> None:
    journal = unique_name("reader")
    await create_journal(client, journal)
    reader = RetryReader(client, pb.ReadRequest(journal=journal, offset=0, block=True))
    first = asyncio.create_task(reader.read())
    # Kept, a negative check: for this long, with nothing appended, the read must block.
    # (Whether it blocked before the append below or not, it reads from offset 0: no race.)
    await asyncio.sleep(0.2)
    assert not first.done()
    await append_bytes(client, journal, b"woken")
    assert await asyncio.wait_for(first, DEADLINE) == b"woken"

    # Cancelling a blocked read leaves the reader usable at the same offset.
    blocked = asyncio.create_task(reader.read())
    await asyncio.sleep(0)  # one loop step: the read runs into its wait (no clock: no race)
    blocked.cancel()
    with pytest.raises(asyncio.CancelledError):
        await blocked
    assert reader.reader is None and reader.offset == 5
    await append_bytes(client, journal, b" again")
    assert await asyncio.wait_for(reader.read(), DEADLINE) == b" again"
    reader.close()


async def test_read_from_write_head(broker_proc: BrokerProcess) -> None:
    """Offset -1 is the write head when the broker takes the read: the test waits for that
    (the broker's gauge of open reads, exact on a broker of its own), then appends."""
    async with BrokerClient(broker_proc.address) as client:
        journal = unique_name("reader")
        await create_journal(client, journal)
        await append_bytes(client, journal, b"old content")
        reader = RetryReader(client, pb.ReadRequest(journal=journal, offset=-1, block=True))
        task = asyncio.create_task(reader.read())
        await eventually(lambda: open_reads(broker_proc.http_url) == 1,
                         what="the broker to serve the read")
        await append_bytes(client, journal, b"new")
        assert await asyncio.wait_for(task, DEADLINE) == b"new"
        assert reader.offset == len(b"old content") + 3
        reader.close()


async def test_end_offset_and_seek(client: BrokerClient) -> None:
    journal = unique_name("reader")
    await create_journal(client, journal)
    await append_bytes(client, journal, b"0123456789")
    assert await read_range(client, journal, 3, 8) == b"34567"

    request = pb.ReadRequest(journal=journal, offset=0, end_offset=10, block=True)
    async with RetryReader(client, request) as reader:
        assert await reader.read(2) == b"01"
        reader.seek(7)
        assert await _read_all(reader) == b"789"
        assert await reader.read() == b""


@pytest.mark.parametrize("suffix", ["", "/a%20b"])  # (a file URL escapes the %: not "a b")
async def test_direct_fragment_reads(client: BrokerClient, shared_broker: BrokerProcess,
                                     suffix: str) -> None:
    journal = unique_name("direct") + suffix
    await create_journal(client, journal, length=1024)
    first, second = b"a" * 1500, b"b" * 700
    await append_bytes(client, journal, first)
    await append_bytes(client, journal, second)  # rolls the spool: the first fragment persists
    await eventually(lambda: len(fragment_files(shared_broker.data_dir, journal)) == 1)
    await eventually(lambda: _persisted_count(client, journal))

    file_root = shared_broker.data_dir / "fragments"
    request = pb.ReadRequest(journal=journal, offset=100, do_not_proxy=True, block=True,
                             end_offset=2200)
    async with RetryReader(client, request, file_root=file_root) as reader:
        data = await reader.read()
        assert reader.response.fragment_url.startswith("file:///")
        assert reader.response.fragment.backing_store == "file:///"
        data += await _read_all(reader)
    assert data == (first + second)[100:]

    # Without a file root, a file:// fragment URL can't be resolved.
    plain = Reader(client, pb.ReadRequest(journal=journal, offset=0, do_not_proxy=True))
    with pytest.raises(ValueError, match="file_root"):
        await plain.read()
    plain.close()


async def _persisted_count(client: BrokerClient, journal: str) -> bool:
    listed = await list_fragments(client, journal)
    return any(f.spec.backing_store for f in listed.fragments)


def _write_fragment(root: Path, journal: str, content: bytes, end_delta: int = 0) -> pb.Fragment:
    """A snappy fragment file of `content` whose name claims `end_delta` more bytes."""
    fragment = pb.Fragment(
        journal=journal,
        begin=10,
        end=10 + len(content) + end_delta,
        sum=sum_of(hashlib.sha1(content).digest()),
        compression_codec=pb.SNAPPY,
    )
    compressor = new_compressor(pb.SNAPPY)
    path = root / journal / content_name(fragment)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(compressor.compress(content) + compressor.flush())
    return fragment


def test_fragment_reader_checks_length(tmp_path: Path) -> None:
    content = bytes(range(256)) * 40
    for delta, problem in ((0, None), (5, "short of its end"), (-5, "past its end")):
        fragment = _write_fragment(tmp_path, f"frag/delta{delta}", content, delta)
        url = f"file:///{fragment.journal}/{content_name(fragment)}"
        with open_fragment(fragment, url, tmp_path, 10 + 100) as reader:
            if problem is None:
                assert reader.read() == content[100:]
                assert reader.read() == b""
            else:
                with pytest.raises(FragmentError, match=problem):
                    while reader.read(4096):
                        pass
    with pytest.raises(ValueError, match="outside the fragment root"):
        open_fragment(fragment, "file:///../../etc/passwd", tmp_path, 10)


def test_fragment_reader_over_http(tmp_path: Path) -> None:
    content = b"served over http\n" * 500
    fragment = _write_fragment(tmp_path, "frag/http", content)
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = Worker(server.serve_forever, 0.05, name="fragment server")
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/frag/http/{content_name(fragment)}"
        with open_fragment(fragment, url, None, 10) as reader:
            assert reader.read() == content
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


async def test_retry_reader_survives_broker_restart(broker_proc: BrokerProcess) -> None:
    async with BrokerClient(broker_proc.address) as client:
        journal = unique_name("restart")
        await create_journal(client, journal)
        await append_bytes(client, journal, b"before;")
        reader = RetryReader(client, pb.ReadRequest(journal=journal, offset=0, block=True))
        assert await reader.read() == b"before;"
        pending = asyncio.create_task(reader.read())
        await asyncio.sleep(0)  # one loop step: the read runs into its wait (no clock)
        await asyncio.to_thread(broker_proc.restart)
        await append_bytes(client, journal, b"after")
        assert await asyncio.wait_for(pending, DEADLINE) == b"after"
        assert reader.offset == len(b"before;after")

        # Neither a cancelled read nor close() leaves a Read RPC running.
        for stop in ("cancel", "close"):
            blocked = asyncio.create_task(reader.read())
            await asyncio.sleep(0)  # one loop step: the read runs (the RPC may be open already)
            await eventually(lambda: open_reads(broker_proc.http_url) == 1,
                             what="the read to be blocked inside its Read RPC")
            if stop == "cancel":
                blocked.cancel()
            else:
                reader.close()
            with pytest.raises(asyncio.CancelledError):
                await blocked
            await eventually(lambda: open_reads(broker_proc.http_url) == 0)


async def test_offset_jump_over_a_deleted_fragment(broker_proc: BrokerProcess) -> None:
    async with BrokerClient(broker_proc.address) as client:
        journal = unique_name("jump")
        await create_journal(client, journal, length=1024)
        parts = [bytes([65 + i]) * 2000 for i in range(3)]
        for part in parts:
            await append_bytes(client, journal, part)  # each append rolls the previous spool
        spools = broker_proc.data_dir / "journals" / journal / "@spool"
        # Persisted, and the local spools dropped: else a restart recovers and re-persists them.
        await eventually(lambda: len(fragment_files(broker_proc.data_dir, journal)) == 2
                         and len(list(spools.glob("*.spool"))) == 1)
        fragment_files(broker_proc.data_dir, journal)[0].unlink()  # [0, 2000) is gone
        await asyncio.to_thread(broker_proc.restart)

        reader = Reader(client, pb.ReadRequest(journal=journal, offset=0, end_offset=6000))
        with pytest.raises(OffsetJump) as jumped:
            await reader.read()
        assert (jumped.value.from_offset, jumped.value.to_offset) == (0, 2000)
        assert reader.offset == 2000
        assert await reader.read(10) == parts[1][:10]  # the same Reader continues
        reader.close()

        request = pb.ReadRequest(journal=journal, offset=0, end_offset=6000, block=True)
        async with RetryReader(client, request, skip_jumps=True) as skipping:
            assert await _read_all(skipping) == parts[1] + parts[2]
