"""A member whose Shard API port refuses connections loses its lease at once; one that is
paused (its port accepts but never answers) or unreachable keeps it, for its lease to decide."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from pathlib import Path

import pytest

from streamkit.app import peer_watch
from streamkit.app.assignment import MemberId, member_key
from streamkit.app.peer_watch import PeerWatch
from streamkit.app.shard_ops import read_state
from streamkit.keyspace import open_keyspace
from streamkit.keyspace.keyspace import KeySpace
from streamkit.protocol import consumer_pb, pb
from streamkit.tasks import cancel_and_wait
from tests.brokerproc import free_port
from tests.waiting import eventually

ROOT = "/gazette/consumers/peer-watch"
ME = MemberId("z", "watcher")


async def _announce(keyspace: KeySpace, member: MemberId, port: int) -> int:
    lease = await keyspace.grant(60)
    spec = consumer_pb.ConsumerSpec(process_spec=pb.ProcessSpec(
        id=pb.ProcessSpec.ID(zone=member.zone, suffix=member.suffix),
        endpoint=f"grpc://127.0.0.1:{port}"))
    await keyspace.put(member_key(ROOT, member), spec.SerializeToString(), lease=lease)
    return lease


async def test_refused_port_revokes_the_lease_a_paused_one_does_not(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Also: a port refused from the first dial (a wrong --advertise address, a firewall
    rejecting) is no death: it revoked a live member again at each announcement."""
    paused = socket.socket()  # listens (the kernel accepts connections) but never reads
    paused.bind(("127.0.0.1", 0))
    paused.listen()
    dying = socket.socket()  # listens until the watch reached it, then is gone
    dying.bind(("127.0.0.1", 0))
    dying.listen()
    async with open_keyspace(str(tmp_path / "keyspace.db")) as keyspace:
        await _announce(keyspace, ME, free_port())  # itself: never watched
        await _announce(keyspace, MemberId("z", "paused"), paused.getsockname()[1])
        await _announce(keyspace, MemberId("z", "dead-one"), dying.getsockname()[1])
        await _announce(keyspace, MemberId("z", "misadvertised"), free_port())  # refuses
        state = await read_state(keyspace, ROOT)
        async def wait_changed(revision: int) -> None:
            await asyncio.Event().wait()  # this test's snapshot never changes

        watch = PeerWatch(keyspace, ME, lambda: state, wait_changed)
        task = asyncio.create_task(watch.run())
        try:
            async def members() -> set[str]:
                return {m.suffix for m in (await read_state(keyspace, ROOT)).members}

            async def dead_gone() -> bool:
                return "dead-one" not in await members()

            await eventually(lambda: _accepted(dying), 30, "the watch to reach dead-one")
            dying.close()
            await eventually(dead_gone, 30, "the dead member's keys to go with its lease")
            # Not a synchronisation: a window in which a wrong verdict on the paused or the
            # misadvertised member would show (their watches dial every ~0.5 s at most).
            await asyncio.sleep(1.5)
            assert await members() == {"watcher", "paused", "misadvertised"}
            warned = [r.message for r in caplog.records if "never took one" in r.message]
            assert len(warned) == 1 and "misadvertised" in warned[0], warned
        finally:
            await cancel_and_wait(task, "the peer watch")
            for sock in (paused, dying):
                with contextlib.suppress(OSError):
                    sock.close()


async def _accepted(listener: socket.socket) -> bool:
    """Whether a connection waits in `listener`'s backlog (taken from it)."""
    listener.setblocking(False)
    try:
        conn, _ = listener.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


async def _dies_right_after_it_was_dialed(tmp_path: Path) -> float:
    """Stage a member killed just after the watch connected: its young connection closes,
    and its listening socket a moment later. Seconds from that until its lease is revoked."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    loop = asyncio.get_running_loop()
    async with open_keyspace(str(tmp_path / "keyspace.db")) as keyspace:
        await _announce(keyspace, ME, free_port())
        await _announce(keyspace, MemberId("z", "dying"), listener.getsockname()[1])
        state = await read_state(keyspace, ROOT)

        async def wait_changed(revision: int) -> None:
            await asyncio.Event().wait()

        task = asyncio.create_task(PeerWatch(keyspace, ME, lambda: state, wait_changed).run())
        try:
            conn, _ = await asyncio.wait_for(loop.sock_accept(listener), 10)  # the watch's dial
            await asyncio.sleep(0.1)  # a connection younger than _RETRY
            conn.close()  # the process dies: its connection closes first,
            await asyncio.sleep(0.01)  # (time for the watch's at-once dial to be taken)
            listener.close()  # and its listening socket a moment later
            died = time.monotonic()

            async def dying_gone() -> bool:
                members = (await read_state(keyspace, ROOT)).members
                return all(m.suffix != "dying" for m in members)

            await eventually(dying_gone, 30, "the dying member's lease to be revoked")
            return time.monotonic() - died
        finally:
            await cancel_and_wait(task, "the peer watch")
            with contextlib.suppress(OSError):
                listener.close()


async def test_a_peer_dying_right_after_it_was_dialed_loses_its_lease_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dying listening socket may still take the watch's at-once dial: the watch must
    not take that for a peer that drops clients and wait _RETRY (a fixed half second, seen
    in 2 of 10 failover rounds) before it dials the refusing port."""
    monkeypatch.setattr(peer_watch, "_RETRY", 3.0)  # so that such a wait cannot go unseen
    assert await _dies_right_after_it_was_dialed(tmp_path) < peer_watch._RETRY / 2


async def test_a_dial_reset_by_a_dying_peer_is_no_reason_to_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Or the dying listening socket resets the at-once dial during its handshake (seen in
    1 of 40 failover rounds): that is no unreachable peer, to be dialed again _RETRY later."""
    monkeypatch.setattr(peer_watch, "_RETRY", 3.0)
    dial = asyncio.open_connection
    dials = 0

    async def resetting_the_second(*args: object, **kwargs: object) -> object:
        nonlocal dials
        dials += 1
        if dials == 2:  # the at-once dial after the young connection closed
            raise ConnectionResetError(104, "Connect call failed")
        return await dial(*args, **kwargs)

    monkeypatch.setattr(peer_watch.asyncio, "open_connection", resetting_the_second)
    assert await _dies_right_after_it_was_dialed(tmp_path) < peer_watch._RETRY / 2
    assert dials >= 3
