"""Recording through RecordedFS and playing back, against a real broker."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from streamkit.client import BrokerClient, RegisterMismatch, append_bytes
from streamkit.protocol import pb
from streamkit.recoverylog import (
    CONTENT_TYPE,
    FSM,
    Player,
    RecordedFS,
    Recorder,
    RecoveryLogError,
    hints_from_json,
    hints_to_json,
    new_random_author,
    rpb,
)
from streamkit.recoverylog.fsm import _op_kind, encode_frame
from streamkit.recoverylog.recorder import RecorderClosed
from tests.brokerproc import BrokerProcess
from tests.helpers_client import create_journal, eventually, fragment_files, unique_name
from tests.waiting import DEADLINE


@pytest.fixture
async def client(shared_broker: BrokerProcess) -> AsyncIterator[BrokerClient]:
    async with BrokerClient(shared_broker.address) as c:
        yield c


async def new_log(client: BrokerClient) -> str:
    name = unique_name("recoverylog")
    await create_journal(client, name, length=256 << 10, labels={"content-type": CONTENT_TYPE})
    return name


async def start_recorder(client: BrokerClient, log: str, fsm: FSM | None = None,
                         author: int | None = None) -> Recorder:
    recorder = Recorder(client, log, fsm or FSM(rpb.FSMHints(log=log)), author)
    await recorder.start()
    return recorder


async def play(client: BrokerClient, hints: rpb.FSMHints, directory: Path,
               handoff: int = 0) -> tuple[Player, FSM]:
    player = Player(client)
    if handoff:
        player.inject_handoff(handoff)
    else:
        player.finish_at_write_head()
    fsm = await asyncio.wait_for(player.play(hints, directory), 30)
    return player, fsm


def tree(root: Path) -> dict[str, bytes]:
    """Relative path -> content of every file under root."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def inodes(root: Path) -> set[frozenset[str]]:
    """Groups of paths that are hard links of one file."""
    groups: dict[int, set[str]] = {}
    for p in root.rglob("*"):
        if p.is_file():
            groups.setdefault(p.stat().st_ino, set()).add(str(p.relative_to(root)))
    return {frozenset(g) for g in groups.values()}


async def random_workload(fs: RecordedFS, rng: random.Random, steps: int) -> None:
    """Creates, writes at offsets, truncates, renames over files, links, unlinks, fsyncs."""
    fs.makedirs("d/e")
    names = [f"f{i}" for i in range(6)] + [f"d/g{i}" for i in range(3)] + ["d/e/h"]
    handles = {}
    for _ in range(steps):
        existing = [n for n in names if fs.exists(n)]
        action = rng.choice(["create", "write", "write", "write", "truncate", "rename",
                             "link", "remove", "fsync", "append"])
        name = rng.choice(names)
        if action == "create" or not existing:
            if name in handles:
                handles.pop(name).close()
            handles[name] = fs.open(name, "wb")
            handles[name].write(rng.randbytes(rng.randrange(0, 3000)))
            continue
        target = rng.choice(existing)
        if action in ("write", "append", "truncate"):
            with fs.open(target, "ab" if action == "append" else "r+b") as f:
                if action == "truncate":
                    f.truncate(rng.choice([0, rng.randrange(0, 5000)]))
                else:
                    f.seek(rng.randrange(0, 4000))
                    f.write(rng.randbytes(rng.randrange(1, 5000)))
        elif action == "rename":
            fs.rename(target, name)
        elif action == "link" and not fs.exists(name):
            fs.link(target, name)
        elif action == "remove":
            fs.remove(target)
        elif action == "fsync":
            await fs.fsync()
    for handle in handles.values():
        handle.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_random_workload_plays_back_identically(
    client: BrokerClient, tmp_path: Path, seed: int
) -> None:
    log = await new_log(client)
    recorder = await start_recorder(client, log)
    fs = RecordedFS(tmp_path / "live", recorder)
    (tmp_path / "live").mkdir()
    await random_workload(fs, random.Random(seed), 300)
    hints = await recorder.build_hints()
    await recorder.close()

    # From empty hints (the whole log), and from the recorder's hints.
    for i, h in enumerate([rpb.FSMHints(log=log), hints]):
        out = tmp_path / f"played{i}"
        await play(client, h, out)
        assert tree(out) == tree(tmp_path / "live")
        assert inodes(out) == inodes(tmp_path / "live")


async def test_hints_skip_dead_segments(client: BrokerClient, tmp_path: Path) -> None:
    log = await new_log(client)
    recorder = await start_recorder(client, log)
    root = tmp_path / "live"
    root.mkdir()
    fs = RecordedFS(root, recorder)
    with fs.open("junk", "wb") as f:
        f.write(b"J" * (3 << 20))
    fs.remove("junk")
    await fs.fsync()
    junk_end = recorder.write_head
    with fs.open("keep", "wb") as f:
        f.write(b"keep me")
    await fs.fsync()
    hints = hints_from_json(hints_to_json(await recorder.build_hints()))
    assert [n.fnode for n in hints.live_nodes] == [recorder.fnode_of("keep")]
    assert hints_from_json(hints.SerializeToString() and hints_to_json(hints)) == hints
    await recorder.close()

    player, _ = await play(client, hints, tmp_path / "out")
    assert tree(tmp_path / "out") == {"keep": b"keep me"}
    assert all(begin >= junk_end for _, begin, _ in player.fetched), player.fetched

    # Without hints the junk is read (and its file dropped).
    player, _ = await play(client, rpb.FSMHints(log=log), tmp_path / "all")
    assert tree(tmp_path / "all") == {"keep": b"keep me"}
    assert player.fetched[0][1] == 0


async def test_handoff_fences_the_old_recorder(client: BrokerClient, tmp_path: Path) -> None:
    log = await new_log(client)
    old = await start_recorder(client, log)
    fs = RecordedFS(tmp_path / "old", old)
    (tmp_path / "old").mkdir()
    with fs.open("a", "wb") as f:
        f.write(b"from the old recorder")
    await fs.fsync()
    hints = await old.build_hints()

    # A standby tails the log, then takes over with a hand-off.
    new_author = new_random_author()
    player = Player(client)
    playing = asyncio.ensure_future(player.play(hints, tmp_path / "new"))
    await asyncio.wait_for(player.tailing.wait(), 10)
    with fs.open("b", "wb") as f:
        f.write(b"seen while tailing")
    await fs.fsync()
    player.inject_handoff(new_author)
    fsm = await asyncio.wait_for(playing, 30)
    assert tree(tmp_path / "new") == {"a": b"from the old recorder", "b": b"seen while tailing"}

    # The deposed recorder can no longer append.
    with fs.open("c", "wb") as f:
        f.write(b"zombie write")
    with pytest.raises(RegisterMismatch):
        await fs.fsync()

    # The winner records on; playback rebuilds only its history.
    new = await start_recorder(client, log, fsm, new_author)
    new_fs = RecordedFS(tmp_path / "new", new)
    with new_fs.open("a", "ab") as f:
        f.write(b" + new")
    new_hints = await new.build_hints()
    await new.close()
    await play(client, new_hints, tmp_path / "replay")
    await play(client, rpb.FSMHints(log=log), tmp_path / "replay-all")
    expect = {"a": b"from the old recorder + new", "b": b"seen while tailing"}
    assert tree(tmp_path / "replay") == expect
    assert tree(tmp_path / "replay-all") == expect


async def test_recorder_without_handoff_is_refused(client: BrokerClient) -> None:
    log = await new_log(client)
    first = await start_recorder(client, log)
    first.record_create("x")
    await first.barrier()
    with pytest.raises(RegisterMismatch):
        await start_recorder(client, log, FSM(rpb.FSMHints(log=log)))


async def _recorded_log(client: BrokerClient, tmp_path: Path) -> tuple[str, Recorder]:
    log = await new_log(client)
    recorder = await start_recorder(client, log)
    fs = RecordedFS(tmp_path / "live", recorder)
    (tmp_path / "live").mkdir(parents=True)
    with fs.open("a", "wb") as f:
        f.write(b"hello")
    await fs.fsync()
    return log, recorder


async def _assert_playback_fails(client: BrokerClient, log: str, directory: Path,
                                 offset: int, reason: str) -> None:
    with pytest.raises(RecoveryLogError, match=reason) as info:
        await play(client, rpb.FSMHints(log=log), directory)
    assert info.value.journal == log
    assert info.value.offset == offset
    assert log in str(info.value)
    assert not directory.exists()  # never a silently wrong directory


async def test_bad_checksum_stops_playback(client: BrokerClient, tmp_path: Path) -> None:
    log, recorder = await _recorded_log(client, tmp_path)
    op = rpb.RecordedOp(seq_no=recorder.fsm.next_seq_no, checksum=recorder.fsm.next_checksum ^ 1,
                        author=recorder.author, create=rpb.RecordedOp.Create(path="/bad"))
    at = recorder.write_head
    await append_bytes(client, log, encode_frame(op))
    await _assert_playback_fails(client, log, tmp_path / "out", at, "checksum mismatch")


async def test_garbage_and_truncated_frames_stop_playback(
    client: BrokerClient, tmp_path: Path
) -> None:
    log, recorder = await _recorded_log(client, tmp_path)
    at = recorder.write_head
    header, payload = encode_frame(rpb.RecordedOp(seq_no=recorder.fsm.next_seq_no,
                                                  checksum=recorder.fsm.next_checksum,
                                                  author=recorder.author))
    await append_bytes(client, log, header + payload[:-1])
    await _assert_playback_fails(client, log, tmp_path / "out", at, "cut short")

    log, recorder = await _recorded_log(client, tmp_path / "2")
    at = recorder.write_head
    await append_bytes(client, log, b"garbage!" * 4)
    await _assert_playback_fails(client, log, tmp_path / "out", at, "bad frame magic")


async def test_op_for_unknown_fnode_stops_playback(client: BrokerClient, tmp_path: Path) -> None:
    log, recorder = await _recorded_log(client, tmp_path)
    at = recorder.write_head
    op = rpb.RecordedOp(seq_no=recorder.fsm.next_seq_no, checksum=recorder.fsm.next_checksum,
                        author=recorder.author, write=rpb.RecordedOp.Write(fnode=999, length=2))
    await append_bytes(client, log, [*encode_frame(op), b"zz"])
    await _assert_playback_fails(client, log, tmp_path / "out", at, "unknown fnode 999")


async def test_flipped_byte_is_detected(client: BrokerClient, tmp_path: Path) -> None:
    """A corrupted op breaks the checksum chain at its successor."""
    log = await new_log(client)
    author = new_random_author()
    fsm = FSM(rpb.FSMHints(log=log))
    frames = []
    for path in ("/a", "/b"):
        op = rpb.RecordedOp(seq_no=fsm.next_seq_no, checksum=fsm.next_checksum, author=author,
                            create=rpb.RecordedOp.Create(path=path))
        header, payload = encode_frame(op)
        fsm.apply(op, payload, log, 0)
        frames.append(header + payload)
    corrupt = bytearray(frames[0])
    corrupt[-1] ^= ord("a") ^ ord("c")  # "/a" becomes "/c"
    await append_bytes(client, log, [bytes(corrupt), frames[1]])
    await _assert_playback_fails(client, log, tmp_path / "out", len(corrupt), "checksum mismatch")
    assert not os.path.exists(tmp_path / "out")


async def test_gap_without_a_hint_ahead_stops_playback(
    broker_proc: BrokerProcess, tmp_path: Path
) -> None:
    """A deleted fragment whose ops no later op reveals is an error, not a silent skip.

    The log: [create + write v1][write v2][a stale duplicate noop]. With the
    middle fragment gone, playback without hints would otherwise end at v1.
    """
    async with BrokerClient(broker_proc.address) as client:
        log = unique_name("recoverylog-gap")
        await create_journal(client, log, length=1024, labels={"content-type": CONTENT_TYPE})
        recorder = await start_recorder(client, log)
        (tmp_path / "live").mkdir()
        fs = RecordedFS(tmp_path / "live", recorder)
        with fs.open("a", "wb") as f:
            f.write(b"1" * 2000)  # each append exceeds the fragment length: rolls the spool
            await f.fsync()
            gap_at = recorder.write_head
            f.seek(0)
            f.write(b"2" * 2000)
            await f.fsync()
        stale = rpb.RecordedOp(seq_no=1, author=new_random_author())
        await append_bytes(client, log, encode_frame(stale))
        await recorder.close()

        spools = broker_proc.data_dir / "journals" / log / "@spool"
        await eventually(lambda: len(fragment_files(broker_proc.data_dir, log)) == 2
                         and len(list(spools.glob("*.spool"))) == 1)
        fragment_files(broker_proc.data_dir, log)[1].unlink()  # the write of v2 is gone
        await asyncio.to_thread(broker_proc.restart)

    async with BrokerClient(broker_proc.address) as client:
        with pytest.raises(RecoveryLogError, match="missing") as info:
            await play(client, rpb.FSMHints(log=log), tmp_path / "out")
        assert info.value.offset == gap_at
        assert not (tmp_path / "out").exists()


def _frames_per_batch(recorder: Recorder) -> list[list[str]]:
    """The op kinds of each queued batch, decoded from its parts."""
    batches = []
    for batch in recorder._queue:
        kinds, parts = [], list(batch.parts)
        while parts:
            parts.pop(0)  # the frame header
            op = rpb.RecordedOp.FromString(parts.pop(0))
            kind = _op_kind(op) or "noop"
            kinds.append(kind)
            if kind == "write" and op.write.length:
                parts.pop(0)  # its data
        batches.append(kinds)
    return batches


async def test_full_batches_roll_over_only_between_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rename's or a replace's ops are never split over two appends by MAX_BATCH."""
    monkeypatch.setattr("streamkit.recoverylog.recorder.MAX_BATCH", 1)
    recorder = Recorder(None, "log", FSM(rpb.FSMHints(log="log")))  # type: ignore[arg-type]
    a = recorder.record_create("/a")
    recorder.record_write(a, b"x", 0)
    recorder.record_create("/b")
    recorder.record_rename("/b", "/a")  # unlink /a, link /a, unlink /b
    recorder.record_replace(recorder.fnode_of("/a"), b"new")  # unlink, create, write
    assert _frames_per_batch(recorder) == [
        ["create"], ["write"], ["create"],
        ["unlink", "link", "unlink"],
        ["unlink", "create", "write"],
    ]


async def test_close_fails_batches_it_never_appended(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ops queued when close() stops the dispatch task fail instead of hanging forever."""
    stuck = asyncio.Event()  # never set: appends after the first hang, like an unreachable broker
    calls = 0

    async def append(*args: object, **kwargs: object) -> object:
        nonlocal calls
        calls += 1
        if calls > 1:
            await stuck.wait()
        return pb.AppendResponse(status=pb.OK)

    monkeypatch.setattr("streamkit.recoverylog.recorder.append_with_retries", append)
    recorder = Recorder(None, "log", FSM(rpb.FSMHints(log="log")))  # type: ignore[arg-type]
    await recorder.start()
    recorder.record_create("/a")
    pending = recorder.barrier()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(recorder.close(), 0.2)  # its flush hangs: cancelled
    with pytest.raises(RecorderClosed):
        await asyncio.wait_for(pending, DEADLINE)
    with pytest.raises(RecorderClosed):
        recorder.record_create("/b")


async def test_failed_record_open_closes_the_fd(tmp_path: Path) -> None:
    recorder = Recorder(None, "log", FSM(rpb.FSMHints(log="log")))  # type: ignore[arg-type]
    fs = RecordedFS(tmp_path, recorder)
    recorder._error = RuntimeError("append failed")  # sticky: every record call raises
    for _ in range(5):
        with pytest.raises(RuntimeError, match="append failed"):
            fs.open("a", "wb")
    # No fd of this process is left on the file (others may come and go meanwhile).
    target = str(tmp_path / "a")
    assert [fd for fd in os.listdir("/proc/self/fd")
            if _link(f"/proc/self/fd/{fd}") == target] == []


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:  # closed since listed
        return ""
