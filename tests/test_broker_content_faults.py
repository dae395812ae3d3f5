"""Content that is not there or not whole, and a KeySpace that is full, against a real broker.

A persisted fragment whose compressed bytes are cut short or corrupt can't be read back:
a read there ends DATA_LOSS, naming the journal, the fragment and the offsets, as a cut
uncompressed one does (it was UNAVAILABLE, which readers retry for ever). A GET through
the HTTP gateway whose read comes to offsets no fragment holds ends its body there (it
joined the content on both sides up as if whole). An Apply when the KeySpace's disk is
full fails RESOURCE_EXHAUSTED, saying why, in one log line (it was UNKNOWN, with a
traceback), and the broker serves on.
"""

from __future__ import annotations

import errno
import hashlib
import http.client
import os
from pathlib import Path

import grpc
import pytest

from streamkit.protocol import pb
from streamkit.protocol.fragments import content_name
from tests import wire
from tests.brokerproc import BrokerProcess
from tests.test_broker_faults import small_disk  # noqa: F401 (the fixture: a tmpfs)
from tests.test_broker_store_faults import _lines, _read_or_code
from tests.test_cli_journals import run, spec_file

SIZE = 1500  # each append: a fragment of its own (fragments of 1024 bytes roll at once)


def _content(tag: str) -> bytes:
    """SIZE bytes that compress little (a damaged fragment then has a middle to lose)."""
    digests = (hashlib.sha256(f"{tag}{i}".encode()).hexdigest() for i in range(SIZE // 64 + 1))
    return "".join(digests).encode()[:SIZE]


def _persisted(journals, journal: str) -> list[pb.Fragment]:
    return [f for f in wire.fragments(journals, journal) if f.backing_store]


def _write(journals, journal: str, codec: int, count: int = 3) -> list[bytes]:
    """`count` appends to a new journal, each a fragment; waits until all but the last (at
    least) are in its store."""
    wire.create(journals, wire.spec(journal, length=1024, codec=codec))
    appended = [_content(f"{journal}/{n}") for n in range(count)]
    for content in appended:
        assert wire.append(journals, journal, content).status == pb.OK
    wire.wait_until(lambda: len(_persisted(journals, journal)) >= count - 1)
    return appended


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0x5A for b in data[middle : middle + 16])
    path.write_bytes(bytes(data))


DAMAGE = {  # journal: (codec, damage)
    "damaged/gz-cut": (pb.GZIP, _truncate),
    "damaged/sz-cut": (pb.SNAPPY, _truncate),
    "damaged/zst-bad": (pb.ZSTANDARD, _corrupt),
    "damaged/gz-bad": (pb.GZIP, _corrupt),
}


def test_a_damaged_compressed_fragment_is_data_loss_not_retried(tmp_path: Path) -> None:
    """Truncated or corrupt GZIP, SNAPPY and ZSTANDARD fragments: a read from the start or
    from inside the fragment ends DATA_LOSS naming journal, fragment and offsets (the
    content before the damage is served), and `journals read` ends (exit 1) instead of
    restarting the read for ever. The journal's other fragments read as before."""
    broker = BrokerProcess(tmp_path / "broker").start()
    try:
        journals = wire.stub(broker.address)
        for journal, (codec, damage) in DAMAGE.items():
            appended = _write(journals, journal, codec)
            (first,) = [f for f in _persisted(journals, journal) if f.begin == 0]
            damage(broker.data_dir / "fragments" / journal / content_name(first))

            for offset in (0, 700):  # at its start; inside it (past what is readable)
                request = pb.ReadRequest(journal=journal, offset=offset)
                served = bytearray()
                with pytest.raises(grpc.RpcError) as lost:
                    for response in journals.Read(request, timeout=15):
                        served += response.content
                details = lost.value.details()
                assert lost.value.code() == grpc.StatusCode.DATA_LOSS, (journal, details)
                assert f"journal {journal}: " in details, details
                assert content_name(first) in details, details
                assert f"..{SIZE} of the fragment (0..{SIZE}) can't be read back" in details, \
                    details
                assert appended[0][offset:].startswith(bytes(served))  # what is, is right
            assert wire.read(journals, journal, offset=SIZE)[0] == b"".join(appended[1:])

            done = run(broker, "read", journal, timeout=20)
            stderr = done.stderr.decode()
            assert done.returncode == 1, stderr
            assert "DATA_LOSS" in stderr and content_name(first) in stderr, stderr
            assert "restarting read" not in stderr, stderr
        assert "Traceback" not in broker.log(), broker.log()
    finally:
        broker.kill()


def _get(broker: BrokerProcess, journal: str, offset: int
         ) -> tuple[http.client.HTTPResponse, bytes, bool]:
    """GET a journal from `offset`: the response, its body, and whether the body ended
    whole (False: the connection was cut before the end of its chunked encoding)."""
    host, port = broker.http_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=15)
    try:
        connection.request("GET", f"/{journal}?offset={offset}")
        response = connection.getresponse()
        try:
            return response, response.read(), True
        except http.client.IncompleteRead as cut:
            return response, cut.partial, False
    finally:
        connection.close()


def test_a_get_ends_its_body_at_a_fragment_missing_in_the_middle(tmp_path: Path) -> None:
    """The middle of three fragments is moved out of the store. A gRPC read skips it (the
    metadata's offset jumps, and readers say so); a GET answered 206 with the content
    before and after it joined up, nothing telling of the hole. Now the body ends at the
    hole, cut short (as Gazette's gateway ends it, there with an X-Close-Error trailer),
    and the log says which offsets are missing; a GET from the hole is served from its
    end on, its Content-Range saying where it starts."""
    broker = BrokerProcess(tmp_path / "broker").start()
    journal = "holed/one"
    try:
        journals = wire.stub(broker.address)
        appended = _write(journals, journal, pb.NONE)
        (middle,) = [f for f in _persisted(journals, journal) if f.begin == SIZE]
        stored = broker.data_dir / "fragments" / journal / content_name(middle)
        stored.rename(tmp_path / "elsewhere")
        # The index lists the fragment until the stores are listed again (a read of it is
        # UNAVAILABLE meanwhile); then the read of the journal skips it.
        wire.wait_until(lambda: _read_or_code(journals, journal) == appended[0] + appended[2],
                        timeout=20)

        response, body, whole = _get(broker, journal, 0)
        assert response.status == 206
        assert response.headers["Content-Range"].startswith("bytes 0-")
        assert body == appended[0]
        assert not whole, "the body ended as if whole, at the hole"
        assert _lines(broker, "WARNING", f"GET {journal} ended early",
                      f"offsets {SIZE}..{2 * SIZE} are in none of its fragments")

        response, body, whole = _get(broker, journal, SIZE)  # at the hole: served after it
        assert response.status == 206
        assert response.headers["Content-Range"].startswith(f"bytes {2 * SIZE}-")
        assert (body, whole) == (appended[2], True)
        assert _get(broker, journal, 2 * SIZE)[1:] == (appended[2], True)
        assert "Traceback" not in broker.log() and "Error handling request" not in broker.log()
    finally:
        broker.kill()


def _fill(disk: Path) -> Path:
    """Fill the file system at `disk` with a file of its own, to the last block."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    block = b"\0" * (64 << 10)
    try:
        while True:
            try:
                written = os.write(fd, block)
            except OSError as error:
                assert error.errno == errno.ENOSPC, error
                if len(block) == 1:
                    return filler
                block = block[: len(block) // 2]
                continue
            if written < len(block):
                block = block[:written]
    finally:
        os.close(fd)


def test_apply_when_the_keyspace_disk_is_full_is_resource_exhausted(
        request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """The broker's KeySpace is on a disk that fills up. An Apply failed UNKNOWN
    ("Unexpected <class 'KeySpaceError'>") and the broker logged a traceback; now it is
    RESOURCE_EXHAUSTED naming the cause, in one log line, and the broker serves on: its
    journals take appends and list, and an Apply goes through once there is room."""
    disk: Path = request.getfixturevalue("small_disk")  # (skips where none can mount)
    broker = BrokerProcess(tmp_path / "broker",
                           extra_args=["--keyspace", str(disk / "keyspace.db")]).start()
    try:
        journals = wire.stub(broker.address)
        wire.create(journals, wire.spec("kfull/served"))
        assert wire.append(journals, "kfull/served", b"before").status == pb.OK
        filler = _fill(disk)

        with pytest.raises(grpc.RpcError) as refused:
            wire.create(journals, wire.spec("kfull/new"))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
        details = refused.value.details()
        assert "Apply" in details and "database or disk is full" in details, details
        assert str(disk / "keyspace.db") in details, details
        # As the operator met it: the command line says the same, and no "UNKNOWN".
        specs = spec_file(tmp_path, "name: kfull/cli\nreplication: 1\n"
                                    "fragment: {length: 1024, stores: ['file:///']}\n")
        done = run(broker, "apply", "--specs", specs, timeout=20)
        stderr = done.stderr.decode()
        assert done.returncode != 0, stderr
        assert "RESOURCE_EXHAUSTED" in stderr and "database or disk is full" in stderr, stderr
        assert "UNKNOWN" not in stderr and "Unexpected" not in stderr, stderr

        # The broker serves on, with the specs it has.
        assert wire.append(journals, "kfull/served", b"during").status == pb.OK
        listed = [j.spec.name for j in next(iter(journals.List(pb.ListRequest()))).journals]
        assert listed == ["kfull/served"]
        assert wire.read(journals, "kfull/served")[0] == b"beforeduring"
        # One line per failed Apply, naming the cause; no traceback.
        assert len(_lines(broker, "WARNING", "database or disk is full")) == 2, broker.log()
        assert "Traceback" not in broker.log() and "Exception calling" not in broker.log()

        filler.unlink()  # room again: the same Apply goes through
        wire.create(journals, wire.spec("kfull/new"))
        assert wire.append(journals, "kfull/new", b"after").commit.end == 5
    finally:
        broker.kill()
