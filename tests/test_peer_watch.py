"""A member whose Shard API port refuses connections loses its lease at once; one that is
paused (its port accepts but never answers) or unreachable keeps it, for its lease to decide."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from pathlib import Path

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


async def test_refused_port_revokes_the_lease_a_paused_one_does_not(tmp_path: Path) -> None:
    paused = socket.socket()  # listens (the kernel accepts connections) but never reads
    paused.bind(("127.0.0.1", 0))
    paused.listen()
    async with open_keyspace(str(tmp_path / "keyspace.db")) as keyspace:
        await _announce(keyspace, ME, free_port())  # itself: never watched
        await _announce(keyspace, MemberId("z", "paused"), paused.getsockname()[1])
        await _announce(keyspace, MemberId("z", "dead-one"), free_port())  # nothing listens there
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

            await eventually(dead_gone, 30, "the dead member's keys to go with its lease")
            # Not a synchronisation: a window in which a wrong verdict on the paused member
            # would show (its watch dials it every few milliseconds if it misjudged it).
            await asyncio.sleep(1.0)
            assert await members() == {"watcher", "paused"}
        finally:
            await cancel_and_wait(task, "the peer watch")
            with contextlib.suppress(OSError):
                paused.close()

