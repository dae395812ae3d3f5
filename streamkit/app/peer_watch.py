"""Noticing a dead member at once, rather than when its lease lapses.

A member killed outright (SIGKILL, a crash, the OOM killer) holds its lease
until the lease expires: a TTL, plus on etcd up to half a second more for
etcd to notice, and only then do the others take its shards over. Yet a dead
process's ports refuse connections at once. So each member holds one plain
TCP connection to every other member's Shard API port. When one closes, it
dials again; when the port refuses, the peer is dead, and the member revokes
the peer's lease. That deletes the peer's keys just as expiry would, and the
allocator moves its shards now.

It is safe. A refused connection means nothing listens on that port: a
paused or overloaded process still accepts connections, and a peer that is
merely unreachable (a timeout, a network error) is left to its lease. A port
refuses only a peer that was reached there under the lease being watched: an
endpoint refused from the first dial is a wrong `--advertise` address or a
firewall rejecting this machine, not a death (revoking it revoked a live
member again at each of its announcements, several times a second). Even a
member revoked by mistake cannot double-commit: its recovery log fences its
writes, and it joins again under a new lease (see `streamkit.app.allocator`).
Only the lease that was being watched is revoked, never a newer one of the
same member.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from streamkit.app.assignment import AllocState, MemberId
from streamkit.auth.tls import parse_address
from streamkit.keyspace.keyspace import KeySpace, KeySpaceError
from streamkit.tasks import cancel_and_wait

__all__ = ["PeerWatch", "refuses"]

log = logging.getLogger(__name__)

_CONNECT_TIMEOUT = 1.0  # an unanswered dial is no proof of death: dial again later
_RETRY = 0.5  # after an unreachable peer; the longest pause after connections closed at once
_CONFIRM = 0.02  # a refusal is confirmed by a second one this much later


class PeerWatch:
    """Watches every other member's Shard API port; revokes the lease of one that refuses.

    `state()` is the latest KeySpace snapshot and `changed(revision)` waits for a newer
    one (the allocator's). Run with `run()` until cancelled.
    """

    def __init__(self, keyspace: KeySpace, me: MemberId, state: Callable[[], AllocState],
                 changed: Callable[[int], Awaitable[object]]) -> None:
        self.keyspace = keyspace
        self.me = me
        self._state = state
        self._changed = changed
        self._watching: dict[tuple[MemberId, int], asyncio.Task[None]] = {}

    async def run(self) -> None:
        try:
            while True:
                state = self._state()
                self._follow(state)
                await self._changed(state.revision)
        finally:
            for task in list(self._watching.values()):
                await cancel_and_wait(task, "a peer watch")
            self._watching.clear()

    def _follow(self, state: AllocState) -> None:
        """One watch per (peer, lease) in `state`; watches of peers gone are cancelled."""
        wanted: dict[tuple[MemberId, int], str] = {}
        for member, (spec, kv) in state.members.items():
            endpoint = spec.process_spec.endpoint
            if member != self.me and kv.lease and endpoint:
                wanted[(member, kv.lease)] = endpoint
        for key in [k for k in self._watching if k not in wanted]:
            self._watching.pop(key).cancel()
        for key, endpoint in wanted.items():
            task = self._watching.get(key)
            if task is None or task.done():
                self._watching[key] = asyncio.create_task(
                    self._watch(*key, endpoint), name=f"peer watch {key[0]}")

    async def _watch(self, member: MemberId, lease: int, endpoint: str) -> None:
        where = parse_address(endpoint)
        loop = asyncio.get_running_loop()
        pause = 0.0  # before dialing again after a connection closed (or reset) at once
        reached = False  # a refusal proves a death only where the peer once listened
        warned = False

        async def dial_again_soon() -> None:
            # A peer dying just after we dialed: its young connection closes, and its
            # listening socket may still take one more dial (closed or reset a moment
            # later), and refuses by then. Or a peer that drops clients, not to be dialed
            # in a spin. So the first such end is dialed again at once, and the pause
            # after the next ones doubles from _CONFIRM up to _RETRY.
            nonlocal pause
            await asyncio.sleep(pause)
            pause = min(_RETRY, max(_CONFIRM, 2 * pause))

        while True:
            # Dial again at once after a close: a port whose process died refuses at once.
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(where.host, where.port), _CONNECT_TIMEOUT)
            except ConnectionRefusedError:
                if not reached:
                    if not warned:
                        warned = True
                        log.warning("member %s: %s's Shard API at %s refuses connections "
                                    "and never took one: left to its lease (is its "
                                    "--advertise address right, and its port open to this "
                                    "machine?)", self.me, member, endpoint)
                    await asyncio.sleep(_RETRY)
                    continue
                await asyncio.sleep(_CONFIRM)
                if await refuses(endpoint):
                    await self._revoke(member, lease, endpoint)
                    return
                continue
            except ConnectionResetError:  # reset in the handshake: a listening socket closing
                await dial_again_soon()
                continue
            except (OSError, TimeoutError):
                await asyncio.sleep(_RETRY)  # unreachable is not dead: the lease decides
                continue
            reached = True
            opened = loop.time()
            await _until_closed(reader, writer)
            if loop.time() - opened >= _RETRY:
                pause = 0.0
            else:
                await dial_again_soon()

    async def _revoke(self, member: MemberId, lease: int, endpoint: str) -> None:
        log.warning("member %s: %s's Shard API at %s refuses connections: it is gone, so its "
                    "lease %d is revoked and its shards move now", self.me, member, endpoint,
                    lease)
        try:
            await self.keyspace.revoke(lease)
        except KeySpaceError as err:  # already gone, or the KeySpace is out of reach
            log.info("member %s: revoking %s's lease %d: %s", self.me, member, lease, err)


async def refuses(endpoint: str) -> bool:
    """Whether the Shard API `endpoint` refuses connections: nothing listens there (its
    process is gone). A timeout or another network error is no proof: False."""
    where = parse_address(endpoint)
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(where.host, where.port), _CONNECT_TIMEOUT)
    except ConnectionRefusedError:
        return True
    except (OSError, TimeoutError):
        return False
    writer.close()
    return False


async def _until_closed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Until the peer closes the connection (it died, or dropped an idle client)."""
    try:
        while await reader.read(1 << 12):
            pass
    except OSError:
        pass
    finally:
        writer.close()
