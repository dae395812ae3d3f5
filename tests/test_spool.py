"""Spool recovery: what survives is exactly what the commit log says was committed."""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import pytest

from streamkit.broker.persister import SpoolDamaged, compress_spool
from streamkit.broker.spool import INLINE_MAX, Spool
from streamkit.protocol import pb
from streamkit.protocol.fragments import digest_of
from streamkit.protocol.labels import label_set

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
