"""Spool recovery: what survives is exactly what the commit log says was committed."""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import pytest

from streamkit.broker.persister import Persister, SpoolDamaged, compress_spool
from streamkit.broker.replica import Replica
from streamkit.broker.spool import INLINE_MAX, Spool
from streamkit.broker.stores import open_store
from streamkit.protocol import pb
from streamkit.protocol.fragments import digest_of
from streamkit.protocol.labels import label_set
from tests import wire
from tests.waiting import LIVENESS

JOURNAL = "spool/test"


async def _append(spool: Spool, *chunks: bytes, registers: pb.LabelSet | None = None) -> None:
    txn = spool.start_append()
    for chunk in chunks:
        await txn.write(chunk)
    await txn.commit(registers)


def _recover(spool: Spool) -> Spool:
    spool.close()
    recovered, _ = Spool.recover(JOURNAL, spool.data_path, pb.NONE)
    return recovered


def _content(spool: Spool) -> bytes:
    return spool.read(spool.begin, spool.length, spool.end)


async def test_small_appends_replay_from_the_log_when_spool_bytes_are_lost(
    tmp_path: Path,
) -> None:
    spool = Spool.create(JOURNAL, tmp_path, 100, pb.NONE, pb.LabelSet())
    big = random.Random(1).randbytes(INLINE_MAX + 1)  # the same on every run
    await _append(spool, big)  # synced into the spool itself
    await _append(spool, b"small one\n")
    await _append(spool, b"small ", b"two\n")
    expected = big + b"small one\nsmall two\n"
    spool.close()
    # A power loss may drop the unsynced tail of the spool file: simulate it.
    with open(spool.data_path, "r+b") as f:
        f.truncate(len(big))
    recovered, _ = Spool.recover(JOURNAL, spool.data_path, pb.NONE)
    assert (recovered.begin, recovered.end) == (100, 100 + len(expected))
    assert _content(recovered) == expected
    assert digest_of(recovered.fragment().sum) == hashlib.sha1(expected).digest()


async def test_torn_commit_record_rolls_back_only_that_append(tmp_path: Path) -> None:
    spool = Spool.create(JOURNAL, tmp_path, 0, pb.NONE, pb.LabelSet())
    await _append(spool, b"kept\n")
    await _append(spool, b"torn\n")
    spool.close()
    with open(spool.log_path, "r+b") as f:
        f.truncate(os.path.getsize(spool.log_path) - 3)  # crash mid-record
    recovered, _ = Spool.recover(JOURNAL, spool.data_path, pb.NONE)
    assert _content(recovered) == b"kept\n"
    await _append(recovered, b"next\n")
    assert _content(_recover(recovered)) == b"kept\nnext\n"


async def test_uncommitted_bytes_past_the_end_are_cut_off(tmp_path: Path) -> None:
    spool = Spool.create(JOURNAL, tmp_path, 0, pb.NONE, pb.LabelSet())
    await _append(spool, b"committed\n")
    txn = spool.start_append()
    await txn.write(b"x" * 100_000)  # never committed
    recovered = _recover(spool)
    assert os.path.getsize(recovered.data_path) == len(b"committed\n")
    assert _content(recovered) == b"committed\n"


async def test_registers_survive_recovery(tmp_path: Path) -> None:
    initial = label_set(("author", "a"))
    spool = Spool.create(JOURNAL, tmp_path, 0, pb.NONE, initial)
    spool.close()
    _, log = Spool.recover(JOURNAL, spool.data_path, pb.NONE)
    assert log.registers == initial
    spool, _ = Spool.recover(JOURNAL, spool.data_path, pb.NONE)
    changed = label_set(("author", "b"))
    await _append(spool, b"x", registers=changed)
    await _append(spool, b"y")
    spool.close()
    _, log = Spool.recover(JOURNAL, spool.data_path, pb.NONE)
    assert log.registers == changed and log.end == 2


async def test_a_spool_truncated_under_the_broker_is_fenced_before_the_next_append(
        tmp_path: Path) -> None:
    """A spool file cut short from outside while its journal is open: the next append
    must not write past the file's new end (the hole between would read, and persist, as
    committed zeros), so the spool is fenced, naming the file and the span lost."""
    spool = Spool.create(JOURNAL, tmp_path, 0, pb.NONE, pb.LabelSet())
    await _append(spool, b"x" * (INLINE_MAX + 1))
    spool.check_intact()
    assert not spool.fenced
    os.truncate(spool.data_path, 1000)
    spool.check_intact()
    assert spool.fenced == (f"its spool {spool.data_path} holds 1000 of the {INLINE_MAX + 1} "
                            f"bytes committed (damaged from outside the broker): "
                            f"[1000, {INLINE_MAX + 1}) is lost")


@pytest.mark.parametrize("codec", [pb.NONE, pb.SNAPPY, pb.ZSTANDARD, pb.GZIP])
@pytest.mark.parametrize("damage", ["truncated", "overwritten"])
async def test_a_damaged_spool_is_not_persisted(tmp_path: Path, codec: int, damage: str
                                                ) -> None:
    """The persister's compress step refuses a rolled spool whose file no longer holds the
    committed bytes: cut short, or (where it reads them, to compress) other bytes than the
    appends hashed. Intact, it persists."""
    spool = Spool.create(JOURNAL, tmp_path / "spool", 0, codec, pb.LabelSet())
    await _append(spool, random.Random(2).randbytes(3 * (1 << 20)))
    spool.seal()
    out = tmp_path / "out"
    out.mkdir()
    compress_spool(spool, out).unlink()
    if damage == "truncated":
        os.truncate(spool.data_path, 1 << 20)
    else:
        with open(spool.data_path, "r+b") as f:
            f.seek(2 << 20)
            f.write(b"\0" * 4096)
    if codec == pb.NONE and damage == "overwritten":  # linked, not read: not detected
        compress_spool(spool, out).unlink()
        return
    with pytest.raises(SpoolDamaged, match=rf"journal {JOURNAL}: DAMAGED: spool .* left "):
        compress_spool(spool, out)
    assert list(out.iterdir()) == []  # no temp file left behind


async def test_sealing_a_spool_cut_short_never_extends_it(tmp_path: Path) -> None:
    """ftruncate to the committed length would extend a file cut short from outside: the
    hole would read, and persist, as committed zeros. Seal fences the spool and raises
    instead, leaving the file as it is (for the restart's recovery); a file longer than
    committed (rolled-back appends) is still cut to it."""
    spool = Spool.create(JOURNAL, tmp_path, 0, pb.NONE, pb.LabelSet())
    await _append(spool, b"x" * (INLINE_MAX + 1))
    os.truncate(spool.data_path, 1000)
    with pytest.raises(SpoolDamaged, match=rf"holds 1000 bytes, not {INLINE_MAX + 1}"):
        spool.seal()
    assert os.stat(spool.data_path).st_size == 1000
    assert "damaged from outside the broker" in spool.fenced
    spool.close()

    longer = Spool.create(JOURNAL, tmp_path / "longer", 0, pb.NONE, pb.LabelSet())
    await _append(longer, b"y" * 10)
    with open(longer.data_path, "ab") as f:
        f.write(b"rolled back")
    longer.seal()
    assert os.stat(longer.data_path).st_size == 10
    longer.close()


async def test_a_spool_cut_short_is_not_rolled(tmp_path: Path) -> None:
    """Replica.roll (a flush interval, the fragment length, a clean shutdown) leaves a spool
    cut short from outside as it is: not extended, not handed to the persister, still the
    journal's spool and fenced (a new spool taking appends would end the fence silently)."""
    rolled: list[Spool] = []
    replica = await Replica.open(wire.spec("roll/cut", codec=pb.NONE), tmp_path, [],
                                 lambda r, s: rolled.append(s))
    spool = replica.spool
    txn = spool.start_append()
    await txn.write(b"z" * (INLINE_MAX + 1))
    await txn.commit(None)
    os.truncate(spool.data_path, 1000)
    assert not replica.roll()
    assert not replica.maybe_roll(now=10**10)  # (it is long past its fragment's length too)
    assert replica.spool is spool and rolled == [] and spool.fenced
    assert os.stat(spool.data_path).st_size == 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == [spool.log_path.name,
                                                         spool.data_path.name]
    await replica.close()


async def test_a_damaged_spool_does_not_stop_its_journal_persisting(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A rolled spool damaged before it is persisted is no store outage: retried, it would
    be the journal's probe for ever and park every later spool. It is said once (ERROR),
    stays local, and the journal's later spools are persisted."""
    store = open_store("file:///", tmp_path / "store")
    spec = wire.spec("persist/damaged", length=1 << 10, codec=pb.SNAPPY)
    persister = Persister(tmp_path / "scratch")
    replica = await Replica.open(spec, tmp_path / "spool", [store], persister.enqueue)
    for i in range(3):
        txn = replica.spool.start_append()
        await txn.write(bytes([65 + i]) * (INLINE_MAX + 1))
        await txn.commit(None)
        assert replica.roll()
    first = replica.local[0]
    with open(first.data_path, "r+b") as f:  # damaged from outside: other bytes
        f.write(b"\0" * 100)
    persister.start()
    try:
        assert await persister.drain(LIVENESS)
    finally:
        await persister.stop()
    persisted = sorted((f.begin, f.end) for f in await store.list(spec.name))
    step = INLINE_MAX + 1
    assert persisted == [(step, 2 * step), (2 * step, 3 * step)]
    assert first.data_path.exists() and replica.local[0] is first  # stays local
    damaged = [r for r in caplog.records if "DAMAGED" in r.getMessage()]
    assert len(damaged) == 1 and damaged[0].levelname == "ERROR", caplog.text
    assert f"journal {spec.name}: DAMAGED: spool {first.data_path}" in damaged[0].getMessage()
    await replica.close()


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_journal_whose_open_fails_leaks_no_descriptors(tmp_path: Path) -> None:
    """Replica.open closes the spools it recovered when a later step fails: a journal whose
    open is retried (at requests) must not leak two descriptors per spool each time."""
    directory = tmp_path / "spool"
    spec = wire.spec("open/fails", length=1 << 10)
    replica = await Replica.open(spec, directory, [], lambda r, s: None)
    for i in range(3):
        txn = replica.spool.start_append()
        await txn.write(bytes([65 + i]) * 2000)
        await txn.commit(None)
        replica.roll()
    await replica.close()
    (directory / f"{1 << 40:016x}.spool").mkdir()  # recovering it fails: a folder
    before = _open_descriptors()
    for _ in range(5):
        with pytest.raises(IsADirectoryError):
            await Replica.open(spec, directory, [], lambda r, s: None)
    assert _open_descriptors() == before
