"""Ordinary faults against a real broker: a full disk, damaged spools, specs it can't open.

Each test checks the promise: every acknowledged byte reads back, nothing
unacknowledged is visible, the fault fails one operation with a status that
names the journal and the cause, the broker keeps serving (other journals
too), and it restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from streamkit.keyspace import open_keyspace
from streamkit.protocol import pb
from tests import wire
from tests.brokerproc import BrokerProcess, free_port

MIB = 1 << 20
LIMIT = 6 * MIB + MIB // 2  # RLIMIT_FSIZE: no file of the broker may grow past 6.5 MiB


def put(broker: BrokerProcess, journal: str, body: bytes) -> tuple[int, str]:
    request = urllib.request.Request(f"{broker.http_url}/{journal}", data=body, method="PUT")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, ""
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def body(i: int, size: int = MIB) -> bytes:
    return bytes([65 + i % 26]) * size


def test_a_full_disk_fails_the_append_and_acknowledges_nothing_partial(tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path / "broker", fsize_limit=LIMIT).start()
    try:
        journals = wire.stub(broker.address)
        wire.create(journals, wire.spec("disk/full", length=512 * MIB),
                    wire.spec("disk/other", length=512 * MIB))
        acked = []
        for i in range(8):
            code, text = put(broker, "disk/full", body(i))
            if code != 204:
                break
            acked.append(body(i))
        # Six bodies fit below the limit; the seventh is written only in part (the kernel
        # stores what fits), and is refused, naming the journal and the cause, with the
        # HTTP status for "insufficient storage".
        assert len(acked) == 6, text
        assert code == 507, (code, text)
        assert "journal disk/full" in text and "File too large" in text, text
        with pytest.raises(grpc.RpcError) as refused:
            wire.append(journals, "disk/full", body(9))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "journal disk/full" in refused.value.details()

        # Nothing partial is visible: the journal ends where the last acknowledged append
        # ended, and a read at that offset says so at once (no busy loop on missing bytes).
        content, meta = wire.read(journals, "disk/full")
        assert content == b"".join(acked)
        assert meta[-1].write_head == 6 * MIB
        _, tail = wire.read(journals, "disk/full", offset=6 * MIB)
        assert tail[0].status == pb.OFFSET_NOT_YET_AVAILABLE
        # The broker and its other journals keep serving.
        assert wire.append(journals, "disk/other", b"fine").commit.end == 4
        # Room again (the spool rolls to a new file once fragments may be 1 MiB): the same
        # journal takes appends at the offset where it stopped.
        wire.update(journals, wire.spec("disk/full", length=MIB))
        again = wire.append(journals, "disk/full", b"after")
        assert (again.commit.begin, again.commit.end) == (6 * MIB, 6 * MIB + 5)
        acked.append(b"after")
    finally:
        broker.kill()
    broker.fsize_limit = None
    broker.start()  # and it restarts, with every acknowledged byte
    try:
        content, _ = wire.read(wire.stub(broker.address), "disk/full")
        assert content == b"".join(acked)
    finally:
        broker.kill()


def test_a_damaged_spool_serves_its_intact_prefix_and_spares_the_others(
        tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path / "broker").start()
    journals = wire.stub(broker.address)
    wire.create(journals, wire.spec("dmg/hurt"), wire.spec("dmg/fine"))
    for i in range(3):
        wire.append(journals, "dmg/hurt", body(i, 40 << 10))  # not inline: in the spool only
    wire.append(journals, "dmg/fine", b"untouched")
    broker.kill()
    (spool,) = (broker.data_dir / "journals" / "dmg" / "hurt" / "@spool").glob("*.spool")
    os.truncate(spool, (40 << 10) * 2 + 100)  # damage from outside: the third append is cut

    broker.start()
    try:
        journals = wire.stub(broker.address)
        content, _ = wire.read(journals, "dmg/hurt")
        assert content == body(0, 40 << 10) + body(1, 40 << 10)
        assert wire.read(journals, "dmg/fine")[0] == b"untouched"
        assert "journal dmg/hurt: DAMAGED" in broker.log()
        assert wire.append(journals, "dmg/hurt", b"more").commit.begin == 80 << 10
    finally:
        broker.kill()


def _cut_short(broker: BrokerProcess, journals: Any, prefix: str) -> Path:
    """Journals PREFIX/hurt (three 40 KiB appends, uncompressed) and PREFIX/fine; hurt's
    spool file cut to 50,000 bytes under the running broker (damage from outside)."""
    wire.create(journals, wire.spec(f"{prefix}/hurt", codec=pb.NONE),
                wire.spec(f"{prefix}/fine"))
    for i in range(3):
        wire.append(journals, f"{prefix}/hurt", body(i, 40 << 10))
    (spool,) = (broker.data_dir / "journals" / prefix / "hurt" / "@spool").glob("*.spool")
    os.truncate(spool, 50000)
    return spool


def test_a_spool_truncated_under_the_running_broker_serves_no_zeros(tmp_path: Path) -> None:
    """The same damage while the broker runs: the next append is refused (FAILED_PRECONDITION,
    naming the journal, the file and the span lost) instead of writing past the file's
    end, which left a hole read, and persisted, as committed zeros with status OK. Reads
    give the intact prefix, then DATA_LOSS; the other journals go on; a restart recovers
    the appends the file still holds whole."""
    broker = BrokerProcess(tmp_path / "broker").start()
    try:
        journals = wire.stub(broker.address)
        spool = _cut_short(broker, journals, "live")
        with pytest.raises(grpc.RpcError) as refused:
            wire.append(journals, "live/hurt", body(3, 40 << 10))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # until a restart
        assert (f"journal live/hurt: its spool {spool} holds 50000 of the {120 << 10} bytes "
                f"committed (damaged from outside the broker): [50000, {120 << 10}) is lost"
                ) in refused.value.details(), refused.value.details()
        code, text = put(broker, "live/hurt", b"more")
        assert code == 503 and "damaged from outside the broker" in text, (code, text)
        intact = (body(0, 40 << 10) + body(1, 40 << 10))[:50000]
        assert wire.read(journals, "live/hurt", end=50000)[0] == intact
        with pytest.raises(grpc.RpcError) as lost:
            wire.read(journals, "live/hurt")
        assert lost.value.code() == grpc.StatusCode.DATA_LOSS, lost.value.details()
        assert "journal live/hurt: DAMAGED" in broker.log()
        assert wire.append(journals, "live/fine", b"fine").commit.end == 4
    finally:
        broker.kill()
    broker.start()
    try:
        journals = wire.stub(broker.address)
        # (Recovery keeps whole appends: the first, which the file still holds whole.)
        assert wire.read(journals, "live/hurt")[0] == body(0, 40 << 10)
        assert wire.append(journals, "live/hurt", b"again").commit.begin == 40 << 10
    finally:
        broker.kill()


def test_a_spool_cut_short_under_the_running_broker_is_neither_rolled_nor_persisted(
        tmp_path: Path) -> None:
    """Rolls happen outside appends too (the ticker's, for a flush interval or a fragment
    length; a clean stop's). Sealing a spool cut short extended it to its committed length:
    the hole was served (status OK) and persisted as committed zeros, a new spool took
    appends (the fence ended silently) and a restart saw nothing wrong. It stays as it is,
    local and fenced, for the restart's recovery; the other journals roll, persist and stop
    cleanly."""
    broker = BrokerProcess(tmp_path / "broker").start()
    try:
        journals = wire.stub(broker.address)
        spool = _cut_short(broker, journals, "cut")
        wire.append(journals, "cut/fine", b"rolled" * 20000)
        # Both spools are now past their fragment's length: the ticker rolls them (the
        # appends' own rolls are refused or over), cut/hurt first, in the same pass.
        wire.update(journals, wire.spec("cut/hurt", codec=pb.NONE, length=64 << 10))
        wire.update(journals, wire.spec("cut/fine", length=64 << 10))
        wire.wait_until(lambda: any(f.backing_store for f in wire.fragments(journals, "cut/fine")))
        assert os.stat(spool).st_size == 50000  # not extended with zeros
        assert not any(f.backing_store for f in wire.fragments(journals, "cut/hurt"))
        with pytest.raises(grpc.RpcError) as lost:
            wire.read(journals, "cut/hurt")
        assert lost.value.code() == grpc.StatusCode.DATA_LOSS, lost.value.details()
        with pytest.raises(grpc.RpcError) as refused:
            wire.append(journals, "cut/hurt", b"more")
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # still fenced
        wire.append(journals, "cut/fine", b", then stopped")
        assert broker.terminate() == 0  # a clean stop, which rolls and persists the others
    finally:
        broker.kill()
    assert os.stat(spool).st_size == 50000
    assert [p.name for p in spool.parent.glob("*.spool")] == [spool.name]
    assert "cut/hurt: its spool" in broker.log() and "stays spooled" in broker.log()
    broker.start()
    try:
        journals = wire.stub(broker.address)
        assert wire.read(journals, "cut/hurt")[0] == body(0, 40 << 10)  # its whole appends
        assert wire.read(journals, "cut/fine")[0] == b"rolled" * 20000 + b", then stopped"
        assert all(f.backing_store for f in wire.fragments(journals, "cut/fine")
                   if f.end > f.begin)
    finally:
        broker.kill()


BAD_SPECS = {
    "name": ("a" * 300, "segment 'aaaaaaaaaaaaaaaaaaaaaaaa'… is 300 bytes"),
    "utf-8 name": ("x/" + "ü" * 128, "is 256 bytes"),
    "gs": ("ok/gs", "gs:// stores are not supported"),
    "azure": ("ok/azure", "azure:// stores are not supported"),
    "escape": ("ok/escape", "is not a clean relative path"),
    "dot": ("ok/dot", "is not a clean relative path"),
    "query": ("ok/query", "unknown query argument 'x'"),
    "replication": ("ok/replicated", "replication: 3, but this broker is single-node"),
}
STORES = {"gs": "gs://bucket/", "azure": "azure://account/container/",
          "escape": "file:///../../x/", "dot": "file:///./x/", "query": "file:///a/b/?x=1"}


@pytest.mark.parametrize("case", sorted(BAD_SPECS))
def test_apply_refuses_specs_the_broker_could_not_open(shared_broker: BrokerProcess,
                                                       case: str) -> None:
    name, message = BAD_SPECS[case]
    spec = wire.spec(name, stores=[STORES.get(case, "file:///")])
    spec.replication = 3 if case == "replication" else 1
    with pytest.raises(grpc.RpcError) as refused:
        wire.create(wire.stub(shared_broker.address), spec)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    field = {"name": "name", "utf-8 name": "name", "replication": "replication"}.get(
        case, "fragment.stores[0]")
    assert f"changes[0].upsert.{field}: " in refused.value.details()
    assert message in refused.value.details(), refused.value.details()


def _sneak_spec(broker: BrokerProcess, spec: pb.JournalSpec) -> None:
    """Write a spec straight into the broker's KeySpace, around Apply's checks (as an
    older version, or another tool, may have)."""

    async def write() -> None:
        async with open_keyspace(str(broker.data_dir / "keyspace.db")) as keyspace:
            await keyspace.put(f"/gazette/cluster/items/{spec.name}", spec.SerializeToString())

    asyncio.run(write())


def test_an_unopenable_spec_affects_its_journal_only(tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path / "broker").start()
    try:
        journals = wire.stub(broker.address)
        wire.create(journals, wire.spec("open/good"))
        wire.append(journals, "open/good", b"kept")
        _sneak_spec(broker, wire.spec("open/bad", stores=["gs://bucket/"]))
        broker.kill()
        broker.start()  # it starts anyway, and says what is wrong with which journal
        journals = wire.stub(broker.address)
        assert wire.read(journals, "open/good")[0] == b"kept"
        assert "journal open/bad: cannot be served" in broker.log()
        with pytest.raises(grpc.RpcError) as refused:
            wire.append(journals, "open/bad", b"x")
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "gs:// stores are not supported" in refused.value.details()
        code, text = put(broker, "open/bad", b"x")
        assert code == 503 and "journal open/bad: cannot be served" in text
        # Apply fixes it (or deletes it); the journal is served at once.
        wire.update(journals, wire.spec("open/bad"))
        assert wire.append(journals, "open/bad", b"fixed").commit.end == 5
    finally:
        broker.kill()


def test_a_bad_spec_update_does_not_stop_the_watch(tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path / "broker").start()
    try:
        journals = wire.stub(broker.address)
        wire.create(journals, wire.spec("watch/open"))
        wire.append(journals, "watch/open", b"before")
        _sneak_spec(broker, wire.spec("watch/open", stores=["file:///../../x/"]))
        acked = [b"before"]

        def refused() -> bool:
            try:
                wire.append(journals, "watch/open", b"x")
            except grpc.RpcError as error:
                return error.code() == grpc.StatusCode.FAILED_PRECONDITION
            acked.append(b"x")  # before the watch delivered the bad spec
            return False

        wire.wait_until(refused)
        # The watch goes on: a new journal is applied and served, and reads go on.
        wire.create(journals, wire.spec("watch/new"))
        assert wire.append(journals, "watch/new", b"served").commit.end == 6
        assert wire.read(journals, "watch/open")[0] == b"".join(acked)
    finally:
        broker.kill()


def test_http_offsets_out_of_range_and_names_with_control_characters(
        shared_broker: BrokerProcess) -> None:
    for query in ("offset=99999999999999999999999", "offset=-99999999999999999999"):
        request = urllib.request.Request(f"{shared_broker.http_url}/any/journal?{query}")
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(request, timeout=10)
        assert failed.value.code == 400
        assert "offset: out of range" in failed.value.read().decode()


def test_a_trickling_appender_is_rolled_back_and_frees_the_journal(
        shared_broker: BrokerProcess) -> None:
    journals = wire.stub(shared_broker.address)
    wire.create(journals, wire.spec("slow/trickle"))

    def trickle() -> Iterator[pb.AppendRequest]:
        yield pb.AppendRequest(journal="slow/trickle")
        for _ in range(60):  # a byte every half second: far below 64 KiB/s
            yield pb.AppendRequest(content=b"x")
            time.sleep(0.5)  # pacing the appender: its slowness is what is tested
        yield pb.AppendRequest()

    with pytest.raises(grpc.RpcError) as aborted:  # by the rate rule, not the 30 s stall one
        journals.Append(trickle())
    assert aborted.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "below the minimum rate of 64 KiB/s; rolled back" in aborted.value.details()
    # Nothing of it was appended, and the journal takes the next append at once.
    assert wire.append(journals, "slow/trickle", b"next").commit.begin == 0


def test_an_appender_waiting_for_the_journal_is_not_charged_for_the_wait() -> None:
    """The minimum rate applies while the append holds the journal: an appender queued
    10 s behind another was rolled back as too slow as soon as it got the journal."""
    from streamkit.broker.pace import ALLOWANCE, AppendPace

    now = [100.0]
    pace = AppendPace(64 << 10, 30.0, clock=lambda: now[0])  # made as the append arrives
    now[0] += 10.0  # waiting for the append lock
    assert pace.next_timeout() == pytest.approx(ALLOWANCE)  # its first chunk: all of it
    pace.got(64 << 10)
    now[0] += 0.5
    assert pace.next_timeout() == pytest.approx(ALLOWANCE + 1.0 - 0.5)
    now[0] += 5.0
    assert "sent 65536 bytes in 5.5s, below the minimum rate" in str(pace.timed_out("j"))


def test_an_append_whose_journal_is_deleted_meanwhile_is_not_acknowledged(
        shared_broker: BrokerProcess) -> None:
    """The journal is deleted while an append's content comes in: the append answers
    JOURNAL_NOT_FOUND. It was acknowledged (OK, with its offsets) into a journal gone."""
    import threading

    journals = wire.stub(shared_broker.address)
    wire.create(journals, wire.spec("gone/mid-append"))
    deleted = threading.Event()

    def content() -> Iterator[pb.AppendRequest]:
        yield pb.AppendRequest(journal="gone/mid-append")
        yield pb.AppendRequest(content=b"s" * 100_000)
        deleted.wait(10)
        yield pb.AppendRequest(content=b"t" * 100_000)
        yield pb.AppendRequest()

    answer: list[pb.AppendResponse] = []
    appending = threading.Thread(target=lambda: answer.append(journals.Append(content())))
    appending.start()
    time.sleep(0.3)  # (the append holds the journal, its first chunk in)
    wire.delete(journals, "gone/mid-append")
    deleted.set()
    appending.join(10)
    assert answer and answer[0].status == pb.JOURNAL_NOT_FOUND, answer


def test_gazette_request_rules_for_appends(shared_broker: BrokerProcess) -> None:
    journals = wire.stub(shared_broker.address)
    wire.create(journals, wire.spec("rules/append"))
    cases = {
        "the first AppendRequest carries no content": pb.AppendRequest(
            journal="rules/append", content=b"early"),
        "union_registers: label 'bad name'": pb.AppendRequest(
            journal="rules/append",
            union_registers=pb.LabelSet(labels=[pb.Label(name="bad name", value="x")])),
        "subtract_registers: labels must be sorted": pb.AppendRequest(
            journal="rules/append", subtract_registers=pb.LabelSet(
                labels=[pb.Label(name="bb", value="1"), pb.Label(name="aa", value="1")])),
    }
    for message, first in cases.items():
        with pytest.raises(grpc.RpcError) as refused:
            journals.Append(wire.append_requests(first, [b"content"]))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, message
        assert message in refused.value.details()
    # A 10 KB name is refused by length, without echoing it into the status.
    with pytest.raises(grpc.RpcError) as refused:
        wire.read(journals, "n" * 10_000)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(refused.value.details()) < 200
    assert wire.read(journals, "rules/append")[0] == b""  # nothing got in


def test_a_client_vanishing_mid_put_is_rolled_back_quietly(tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path / "broker").start()
    try:
        journals = wire.stub(broker.address)
        wire.create(journals, wire.spec("gone/put"))
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", broker.port + 1), timeout=10) as sock:
                sock.sendall(b"PUT /gone/put HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                             b"Content-Length: 100000\r\n\r\n" + b"y" * 5000)
        assert wire.append(journals, "gone/put", b"whole").commit.begin == 0
        assert wire.read(journals, "gone/put")[0] == b"whole"
        assert "Traceback" not in broker.log() and "ERROR" not in broker.log(), broker.log()
    finally:
        broker.kill()


def test_a_reader_killed_mid_stream_ends_its_read_quietly(tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path / "broker").start()
    try:
        journals = wire.stub(broker.address)
        wire.create(journals, wire.spec("gone/read", length=64 << 20))
        for _ in range(40):
            wire.append(journals, "gone/read", os.urandom(256 << 10))
        for _ in range(2):
            # It stops taking what it reads (its stdout is never drained), so the broker
            # is sending when the reader is killed.
            reader = subprocess.Popen(
                [sys.executable, "-m", "streamkit.cli.main", "journals", "read", "gone/read",
                 "--broker", broker.address], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
            reader.kill()
            reader.wait()
        content, _ = wire.read(journals, "gone/read", end=1 << 20)
        assert len(content) == 1 << 20  # still serving reads
        assert "Traceback" not in broker.log() and "ERROR" not in broker.log(), broker.log()
    finally:
        broker.kill()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 12 MiB tmpfs (skipped where the test may not mount one)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_device_out_of_space_fails_appends_until_space_returns(small_disk: Path) -> None:
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (5 * MIB))  # someone else's file, taking half the disk
    broker = BrokerProcess(small_disk / "broker").start()
    try:
        journals = wire.stub(broker.address)
        wire.create(journals, wire.spec("enospc/j", length=512 * MIB))
        acked = []
        for i in range(12):
            code, text = put(broker, "enospc/j", body(i))
            if code != 204:
                break
            acked.append(body(i))
        assert code == 507 and "No space left on device" in text, (code, text)
        assert 3 <= len(acked) < 12
        content, _ = wire.read(journals, "enospc/j")
        assert content == b"".join(acked)
        filler.unlink()  # space returns: the same journal appends at the same offset
        again = wire.append(journals, "enospc/j", b"after")
        assert again.commit.begin == len(acked) * MIB
        acked.append(b"after")
    finally:
        broker.kill()
    broker.start()
    try:
        assert wire.read(wire.stub(broker.address), "enospc/j")[0] == b"".join(acked)
    finally:
        broker.kill()


def test_a_rolled_back_append_gives_its_space_back(small_disk: Path) -> None:
    """An append failing on a full disk left what it wrote in its spool file: the disk
    stayed full, and every journal's appends failed until the broker restarted."""
    broker = BrokerProcess(small_disk / "broker").start()
    try:
        journals = wire.stub(broker.address)
        for name in ("full/one", "full/two"):
            wire.create(journals, wire.spec(name, length=512 * MIB))
        assert put(broker, "full/one", b"x" * MIB)[0] == 204
        code, text = put(broker, "full/one", b"y" * (16 * MIB))  # more than the disk holds
        assert code == 507 and "No space left on device" in text, (code, text)
        assert wire.append(journals, "full/one", b"after").commit.begin == MIB
        assert wire.append(journals, "full/two", b"other").commit.begin == 0
        spooled = sum(f.stat().st_size for f in (small_disk / "broker").rglob("*") if f.is_file())
        assert spooled < 2 * MIB, spooled
        assert wire.read(journals, "full/one")[0] == b"x" * MIB + b"after"
    finally:
        broker.kill()


def test_a_journal_first_opened_on_a_full_disk_is_retried_once_there_is_room(
        small_disk: Path) -> None:
    """A journal's first spool can't be written on a full disk: its appends fail
    RESOURCE_EXHAUSTED (HTTP 507) saying so, not "fix its spec" (FAILED_PRECONDITION) held
    for 30 s after the room came back, and work once there is room."""
    broker = BrokerProcess(small_disk / "broker").start()
    filler = small_disk / "filler"
    try:
        journals = wire.stub(broker.address)
        wire.create(journals, wire.spec("room/later"), wire.spec("room/now"))
        assert wire.append(journals, "room/now", b"open").commit.end == 4
        with open(filler, "wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * MIB)
        for _ in range(5):
            code, text = put(broker, "room/later", b"x")
            assert code == 507 and "No space left on device" in text, (code, text)
            assert "fix its spec" not in text
        # Logged once per outage, not at each request.
        assert broker.log().count("journal room/later: no room for its write head's "
                                  "spool") == 1, broker.log()
        filler.unlink()
        appended = wire.wait_until(lambda: _append_unless_full(journals, "room/later", b"now"),
                                   what="room/later to open once there is room")
        assert appended.commit.end == 3
        assert wire.read(journals, "room/now")[0] == b"open"
    finally:
        broker.kill()


def test_a_journal_opened_on_a_full_disk_serves_its_stores_history(small_disk: Path) -> None:
    """A journal opened without local spools (re-created after its spec was deleted, its
    spool folder gone) has its history in the stores; on a full disk it can't write its
    head's spool yet, but reads of that history go on, and appends are refused saying the
    disk is full until there is room."""
    broker = BrokerProcess(small_disk / "broker").start()
    filler = small_disk / "filler"
    journals = wire.stub(broker.address)
    try:
        wire.create(journals, wire.spec("hist/j"))
        assert wire.append(journals, "hist/j", b"history").commit.end == 7
        assert broker.terminate() == 0  # a clean stop persists the spool to the store
        broker.start()
        journals = wire.stub(broker.address)
        (listed,) = next(iter(journals.List(pb.ListRequest()))).journals
        deleted = journals.Apply(pb.ApplyRequest(changes=[pb.ApplyRequest.Change(
            expect_mod_revision=listed.mod_revision, delete="hist/j")]))
        assert deleted.status == pb.OK
        shutil.rmtree(small_disk / "broker" / "journals" / "hist" / "j")
        wire.create(journals, wire.spec("hist/j"))
        with open(filler, "wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * MIB)
        assert wire.read(journals, "hist/j")[0] == b"history"
        code, text = put(broker, "hist/j", b"x")
        assert code == 507 and "No space left on device" in text, (code, text)
        filler.unlink()
        appended = wire.append(journals, "hist/j", b" goes on")
        assert (appended.commit.begin, appended.commit.end) == (7, 15)
        assert wire.read(journals, "hist/j")[0] == b"history goes on"
    finally:
        broker.kill()
    broker.start()
    try:
        assert wire.read(wire.stub(broker.address), "hist/j")[0] == b"history goes on"
    finally:
        broker.kill()


def test_a_broker_started_on_a_full_disk_says_so(small_disk: Path) -> None:
    """SQLite calls a full disk met while making its WAL index "disk I/O error"; the broker's
    one line names the room left as well."""
    broker = BrokerProcess(small_disk / "broker").start()
    assert broker.terminate() == 0
    with open(small_disk / "filler", "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * MIB)
    done = subprocess.run([sys.executable, "-m", "streamkit.cli.main", "broker", "serve",
                           "--data-dir", str(small_disk / "broker"), "--port", str(free_port())],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert "cannot open keyspace" in done.stderr and "bytes free)" in done.stderr, done.stderr


def _append_unless_full(journals, journal: str, content: bytes) -> pb.AppendResponse | None:
    try:
        return wire.append(journals, journal, content)
    except grpc.RpcError as error:
        if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        return None


def test_size_limits_refuse_large_bodies_and_messages_and_keep_serving(tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path / "broker", extra_args=[
        "--max-body-size", "64KiB", "--max-message-size", "128KiB"]).start()
    try:
        journals = wire.stub(broker.address)
        wire.create(journals, wire.spec("big/one"))
        code, text = put(broker, "big/one", body(0, 100 << 10))  # with a Content-Length
        assert code == 413, (code, text)
        assert "limit of 65536 bytes (--max-body-size)" in text and "big/one" in text, text
        chunked = (body(1, 16 << 10) for _ in range(6))  # no Content-Length: counted as read
        code, text = put(broker, "big/one", chunked)  # type: ignore[arg-type]
        assert code == 413 and "rolled back" in text, (code, text)
        assert put(broker, "big/one", body(2, 60 << 10)) == (204, "")
        with pytest.raises(grpc.RpcError) as refused:
            wire.append(journals, "big/one", body(3, 200 << 10))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in (refused.value.details() or "")
        # An append larger than the message limit, in chunks under it, goes through.
        assert wire.append(journals, "big/one", *[body(4, 64 << 10)] * 4).status == pb.OK
        content, _ = wire.read(journals, "big/one")
        assert content == body(2, 60 << 10) + body(4, 64 << 10) * 4  # nothing refused landed
    finally:
        broker.kill()


def test_a_bad_size_is_one_line(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "streamkit.cli.main", "broker", "serve",
                           "--data-dir", str(tmp_path),
                           "--max-body-size", "lots"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "'lots' is not a size" in done.stderr and "--max-body-size" in done.stderr


def test_hundreds_of_journals_under_a_low_soft_open_file_limit(tmp_path: Path) -> None:
    """Two open files per journal served: a broker started under a soft limit of 256 (the
    hard limit higher, as usual) raises it, as Go's brokers do, and serves 200 journals.
    It refused a hundred of them, "Too many open files"."""
    broker = BrokerProcess(tmp_path / "broker", open_files=256).start()
    try:
        journals = wire.stub(broker.address)
        names = [f"many/p{i:04d}" for i in range(200)]
        wire.create(journals, *(wire.spec(name) for name in names))
        for name in names:
            assert wire.append(journals, name, b"x\n").commit.end == 2, name
        assert "Too many open files" not in broker.log(), broker.log()[-2000:]
    finally:
        broker.kill()
