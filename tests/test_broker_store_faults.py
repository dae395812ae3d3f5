"""Stores that don't behave: nested journals' folders, and stores that refuse writes.

A journal's store folder also holds the folders of journals nested below it,
so its listing must keep only its own files (whatever the path postfix
template). And a store that refuses every write must not stop the broker from
persisting other journals, nor flood its log.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import boto3
import grpc
import pytest

from streamkit.broker.stores import FragmentStore, open_store
from streamkit.broker.stores.postfix import postfix_matcher
from streamkit.protocol import pb
from streamkit.protocol.fragments import sum_of
from tests import wire
from tests.brokerproc import BrokerProcess
from tests.s3server import TEST_KEYS

PARENT, CHILD = "pp/parent", "pp/parent/child"
TEMPLATE = 'date={{ .Spool.FirstAppendTime.Format "2006-01-02" }}'
DAY = "date=2024-05-01"  # what TEMPLATE wrote on that day


# --- helpers -----------------------------------------------------------------


def _store_url(kind: str, request: pytest.FixtureRequest) -> str:
    return "file:///" if kind == "file" else request.getfixturevalue("s3_url")


def _plant(store: FragmentStore, journal: str, content: bytes, begin: int = 0,
           postfix: str = "") -> pb.Fragment:
    """Put an uncompressed fragment into `store` as another writer (say Gazette) would."""
    fragment = pb.Fragment(
        journal=journal, begin=begin, end=begin + len(content),
        sum=sum_of(hashlib.sha1(content).digest()), compression_codec=pb.NONE,
        path_postfix=postfix,
    )
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "fragment"
        path.write_bytes(content)
        asyncio.run(store.put(fragment, path))
    return fragment


def _spans(fragments: list[pb.Fragment]) -> list[tuple[str, int, int, str]]:
    return [(f.journal, f.begin, f.end, f.path_postfix) for f in fragments]


def _metric(broker: BrokerProcess, name: str, journal: str) -> float:
    with urllib.request.urlopen(f"{broker.http_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    match = re.search(rf'^{name}{{journal="{re.escape(journal)}"}} (\S+)$', text, re.M)
    return float(match[1]) if match else 0.0


def _gauge(broker: BrokerProcess, name: str) -> float:
    with urllib.request.urlopen(f"{broker.http_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match, f"{name} is not exported"
    return float(match[1])


def _lines(broker: BrokerProcess, *words: str) -> list[str]:
    return [line for line in broker.log().splitlines() if all(w in line for w in words)]


# --- listings of nested journals ------------------------------------------------


def test_postfix_matcher_takes_only_what_the_template_writes() -> None:
    fits = postfix_matcher(TEMPLATE)
    assert fits(DAY)
    assert not fits("child")  # a nested journal's folder
    assert not fits(f"child/{DAY}")
    assert not fits(f"{DAY}/child")
    assert not fits("date=yesterday")
    hourly = postfix_matcher(
        '{{ .Spool.FirstAppendTime.Format "2006/01/02" }}/h={{ .Spool.FirstAppendTime.Hour }}'
    )
    assert hourly("2024/05/01/h=7")
    assert not hourly("child/05/01/h=7")
    assert not postfix_matcher("")("anything")


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_store_lists_only_the_journals_own_files(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    store = open_store(_store_url(kind, request), tmp_path / "root")
    planted = {
        "parent": _plant(store, PARENT, b"p" * 10),
        "parent/day": _plant(store, PARENT, b"q" * 10, 10, DAY),
        "child": _plant(store, CHILD, b"c" * 30),
        "child/day": _plant(store, CHILD, b"d" * 30, 30, DAY),
    }

    def listed(journal: str, template: str) -> list[tuple[str, int, int, str]]:
        return _spans(asyncio.run(store.list(journal, template)))

    def expect(*keys: str) -> list[tuple[str, int, int, str]]:
        return _spans([planted[k] for k in keys])

    assert listed(PARENT, TEMPLATE) == expect("parent", "parent/day")
    assert listed(PARENT, "") == expect("parent")
    assert listed(CHILD, TEMPLATE) == expect("child", "child/day")
    assert listed(CHILD, "") == expect("child")


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_parent_journal_never_reads_its_childs_fragments(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url = _store_url(kind, request)
    broker = BrokerProcess(tmp_path / "broker").start()
    try:
        journals = wire.stub(broker.address)
        store = open_store(url, broker.data_dir / "fragments")
        # The child's fragments: one the broker persists (no postfix), one as Gazette writes.
        wire.create(journals, wire.spec(CHILD, length=1024, codec=pb.NONE, stores=[url]))
        assert wire.append(journals, CHILD, b"c" * 1500).status == pb.OK
        wire.wait_until(lambda: any(f.backing_store for f in wire.fragments(journals, CHILD)))
        _plant(store, CHILD, b"d" * 100, 5000, DAY)
        # The parent's own fragment, written under its template's postfix.
        parent = _plant(store, PARENT, b"parent's own bytes\n", 0, DAY)

        spec = wire.spec(PARENT, length=1024, codec=pb.NONE, stores=[url])
        spec.fragment.path_postfix_template = TEMPLATE
        wire.create(journals, spec)  # opening the journal lists the store
        listed = [f for f in wire.fragments(journals, PARENT) if f.backing_store]
        assert _spans(listed) == _spans([parent])
        content, _ = wire.read(journals, PARENT, offset=0, end=parent.end)
        assert content == b"parent's own bytes\n"
    finally:
        broker.kill()


# --- a store that refuses writes --------------------------------------------------


def _failing_store(kind: str, request: pytest.FixtureRequest, fragment_root: Path) -> str:
    """A store URL whose writes fail: a missing bucket, or a root that is a regular file."""
    if kind == "file":
        fragment_root.mkdir(parents=True, exist_ok=True)
        (fragment_root / "blocked").write_text("a file where the store's folder should be")
        return "file:///blocked/"
    endpoint = request.getfixturevalue("s3_endpoint")
    request.getfixturevalue("aws_env")
    return f"s3://missing-{uuid.uuid4().hex[:12]}/?endpoint={endpoint}&region=us-east-1"


def _heal(kind: str, url: str, fragment_root: Path) -> None:
    if kind == "file":
        (fragment_root / "blocked").unlink()
        return
    endpoint = url.split("endpoint=")[1].split("&")[0]
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **TEST_KEYS)
    client.create_bucket(Bucket=url.removeprefix("s3://").split("/")[0])


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_a_failing_store_does_not_hold_up_other_journals(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    fragment_root = tmp_path / "broker" / "fragments"
    bad_url = _failing_store(kind, request, fragment_root)
    broker = BrokerProcess(tmp_path / "broker").start()
    bad, good = "faults/bad", "faults/good"
    failures = "streamkit_broker_persist_failures_total"

    def persisted(journal: str) -> int:
        return sum(bool(f.backing_store) for f in wire.fragments(journals, journal))

    try:
        journals = wire.stub(broker.address)
        wire.create(journals, wire.spec(bad, length=1024, codec=pb.NONE, stores=[bad_url]),
                    wire.spec(good, length=1024, codec=pb.NONE))
        # Rolled first, and more spools than the persister has workers.
        for _ in range(4):
            assert wire.append(journals, bad, b"b" * 1500).status == pb.OK
        for _ in range(3):
            assert wire.append(journals, good, b"g" * 1500).status == pb.OK
        wire.wait_until(lambda: persisted(good) == 3, timeout=10)

        # The bad journal goes on failing, with backoff, and says so once.
        wire.wait_until(lambda: _metric(broker, failures, bad) >= 4, timeout=20)
        assert persisted(bad) == 0
        assert len(_lines(broker, "WARNING", f"persisting journal {bad}")) == 1
        assert _metric(broker, failures, good) == 0
        # The backlog shows (spools waiting on a failing store were counted nowhere).
        assert _gauge(broker, "streamkit_broker_unpersisted_spools") == 4

        # Once the store works again, the parked spools follow, with one INFO line.
        _heal(kind, bad_url, fragment_root)
        wire.wait_until(lambda: persisted(bad) == 4, timeout=20)
        wire.wait_until(lambda: _gauge(broker, "streamkit_broker_unpersisted_spools") == 0)
        assert len(_lines(broker, "INFO", f"persisting journal {bad} works again")) == 1
        content, _ = wire.read(journals, bad, offset=0, end=6000)
        assert content == b"b" * 6000
    finally:
        broker.kill()


# --- a store that can't be listed at start-up -------------------------------------


def _unlistable(folder: Path) -> Path:
    """Make the store's folder of a journal unlistable (a file in its place); returns where
    its fragments went, for `_listable`."""
    away = folder.with_name(folder.name + ".away")
    folder.rename(away)
    folder.write_text("not a folder: listing this store fails")
    return away


def _listable(folder: Path, away: Path) -> None:
    folder.unlink()
    away.rename(folder)


def _read_or_code(journals, journal: str) -> bytes | grpc.StatusCode:
    try:
        return wire.read(journals, journal, offset=0)[0]
    except grpc.RpcError as error:
        return error.code()


def test_a_restart_while_the_store_cant_be_listed_skips_and_overwrites_nothing(
        tmp_path: Path) -> None:
    """The store can't be listed as the broker restarts (unreachable, say). A read below the
    local spools is UNAVAILABLE naming the store: it jumped over the persisted content as
    if deleted, and a shard reading there skipped acknowledged messages for good. A
    journal with no spools left (a lost data dir) refuses appends rather than write at 0
    over its history. Once the store lists again, both go on exactly."""
    broker = BrokerProcess(tmp_path / "broker").start()
    journal = "unlisted/j"
    folder = broker.data_dir / "fragments" / "unlisted" / "j"
    try:
        journals = wire.stub(broker.address)
        spec = wire.spec(journal, length=1024, codec=pb.NONE)
        # Listed again only hourly: a first listing that failed is retried sooner (it was
        # retried only at the refresh interval, 5 minutes by default).
        spec.fragment.refresh_interval.seconds = 3600
        wire.create(journals, spec)
        for n in range(3):
            assert wire.append(journals, journal, bytes([65 + n]) * 1500).status == pb.OK
        wire.wait_until(lambda: sum(bool(f.backing_store)
                                    for f in wire.fragments(journals, journal)) == 3)
        broker.kill()
        away = _unlistable(folder)
        broker.start()
        journals = wire.stub(broker.address)
        with pytest.raises(grpc.RpcError) as refused:
            wire.read(journals, journal, offset=0)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "offsets below 4,500 are in its fragment stores, which could not be listed" \
            in refused.value.details() and "file:///" in refused.value.details()
        # A command-line read retries, and says so once it lasts (it was silent, for ever).
        reading = subprocess.Popen([sys.executable, "-m", "streamkit.cli.main", "journals",
                                    "read", journal, "--broker", broker.address],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            _, err = reading.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            reading.kill()
            _, err = reading.communicate()
        assert b"restarting read of unlisted/j at 0" in err and b"could not be listed" in err
        assert wire.append(journals, journal, b"more").commit.begin == 4500  # the head is known
        _listable(folder, away)
        wire.wait_until(lambda: _read_or_code(journals, journal) == b"A" * 1500 + b"B" * 1500
                        + b"C" * 1500 + b"more", timeout=20)

        # The data dir is lost (the unpersisted "more" with it) and the store unlistable.
        broker.kill()
        shutil.rmtree(broker.data_dir / "journals")
        away = _unlistable(folder)
        broker.start()
        journals = wire.stub(broker.address)
        with pytest.raises(grpc.RpcError) as refused:
            wire.append(journals, journal, b"after")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "its content and write head are in its fragment stores" in \
            refused.value.details()
        _listable(folder, away)

        def appended() -> pb.AppendResponse | None:
            try:
                return wire.append(journals, journal, b"after")
            except grpc.RpcError:
                return None

        assert wire.wait_until(appended, timeout=20).commit.begin == 4500  # not 0
    finally:
        broker.kill()


def test_a_store_that_hangs_holds_up_no_other_journal(
        s3_url: str, tmp_path: Path) -> None:
    """An S3 endpoint that takes connections and never answers. Its journals' listings
    (at open) and puts hang; every append to every other journal waited behind them (they
    held the threads each commit syncs in), for a minute per call. Nor does it hold up
    another S3 endpoint's journals (they shared its threads)."""
    hung = socket.socket()  # the kernel accepts connections; nothing ever answers
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)
    url = f"s3://hung/?endpoint=http://127.0.0.1:{hung.getsockname()[1]}&region=us-east-1"
    broker = BrokerProcess(tmp_path / "broker").start()
    names = [f"hung/j{n}" for n in range(20)]  # more than an endpoint's threads
    try:
        journals = wire.stub(broker.address)
        wire.create(journals, *(wire.spec(n, length=1024, stores=[url]) for n in names),
                    wire.spec("fine/local", length=1024, codec=pb.NONE),
                    wire.spec("fine/s3", length=1024, codec=pb.NONE, stores=[s3_url]))

        def append(name: str) -> None:
            with contextlib.suppress(grpc.RpcError):  # the broker is killed meanwhile
                wire.append(journals, name, b"x" * 2000)

        waiting = [threading.Thread(target=append, args=(n,), daemon=True) for n in names]
        for thread in waiting:
            thread.start()
        time.sleep(1.0)  # not a synchronisation: the hung journals' opens under way
        started = time.monotonic()
        for _ in range(20):
            response = journals.Append(wire.append_requests(
                pb.AppendRequest(journal="fine/local"), [b"y" * 1500]), timeout=10)
            assert response.status == pb.OK
        assert time.monotonic() - started < 10
        content, _ = wire.read(journals, "fine/local", offset=0)
        assert content == b"y" * 30000
        wire.wait_until(lambda: sum(bool(f.backing_store)
                                    for f in wire.fragments(journals, "fine/local")) >= 19)
        started = time.monotonic()
        for _ in range(3):
            wire.append(journals, "fine/s3", b"z" * 1500)
        wire.wait_until(lambda: sum(bool(f.backing_store)
                                    for f in wire.fragments(journals, "fine/s3")) >= 2,
                        timeout=20)
        assert time.monotonic() - started < 20
    finally:
        broker.kill()
        hung.close()


def test_a_fragment_of_a_store_taken_out_of_the_spec_is_unavailable_not_a_spin(
        tmp_path: Path) -> None:
    """A journal's spec moves it to another store: its listed fragments of the old one are
    in the index until the next listing. A read there found the same fragment again and
    again without awaiting (the broker's loop froze); now UNAVAILABLE, naming the cause."""
    broker = BrokerProcess(tmp_path / "broker").start()
    journal = "moved/j"
    try:
        journals = wire.stub(broker.address)
        spec = wire.spec(journal, length=1024, codec=pb.NONE, stores=["file:///old/"])
        spec.fragment.refresh_interval.seconds = 3600  # no listing during the test
        wire.create(journals, spec)
        for n in range(2):
            assert wire.append(journals, journal, bytes([65 + n]) * 1500).status == pb.OK
        wire.wait_until(lambda: any(f.backing_store for f in wire.fragments(journals, journal)))
        (listed,) = [e for e in next(iter(journals.List(pb.ListRequest()))).journals
                     if e.spec.name == journal]
        moved = listed.spec
        del moved.fragment.stores[:]
        moved.fragment.stores.append("file:///new/")
        wire.update(journals, moved)
        with pytest.raises(grpc.RpcError) as refused:
            for _ in journals.Read(pb.ReadRequest(journal=journal, offset=0), timeout=10):
                pass
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        assert "no longer one of the journal's stores" in refused.value.details()
        assert wire.append(journals, journal, b"still served").status == pb.OK
    finally:
        broker.kill()


def test_a_fragment_pruned_under_the_broker_is_skipped_within_seconds(
        tmp_path: Path) -> None:
    """`journals prune` deletes a fragment file the broker's index still lists: a read there
    is UNAVAILABLE once, the stores are listed again at the next tick, and the read then
    skips the gap. The index waited for the refresh interval (5 min by default), and a
    read without --block retried the missing file all that time."""
    broker = BrokerProcess(tmp_path / "broker").start()
    journal = "pruned/j"
    try:
        journals = wire.stub(broker.address)
        spec = wire.spec(journal, length=1024, codec=pb.NONE)
        spec.fragment.refresh_interval.seconds = 3600  # no listing but the one asked for
        wire.create(journals, spec)
        for n in range(3):
            assert wire.append(journals, journal, bytes([65 + n]) * 1500).status == pb.OK
        wire.wait_until(lambda: sum(bool(f.backing_store)
                                    for f in wire.fragments(journals, journal)) >= 2)
        (first,) = [path for path in (broker.data_dir / "fragments" / "pruned" / "j").iterdir()
                    if path.name.startswith("0000000000000000-")]
        first.unlink()
        assert _read_or_code(journals, journal) == grpc.StatusCode.UNAVAILABLE
        wire.wait_until(lambda: _read_or_code(journals, journal) == b"B" * 1500 + b"C" * 1500,
                        timeout=10)
    finally:
        broker.kill()
