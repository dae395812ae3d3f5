"""A member paused as a whole (SIGSTOP, a VM pause) for longer than its lease TTL +
KEYSPACE_PATIENCE, then continued: the time it was frozen is not the KeySpace's silence, so
it finds its lease expired, announces itself again and serves again, rather than exiting
with `LeaseLost`; a KeySpace that stays silent after the thaw still gets only that much
patience."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from streamkit.app import allocator as allocator_module
from streamkit.app.allocator import KEYSPACE_PATIENCE, Allocator, LeaseLost
from streamkit.app.assignment import AllocState, MemberId
from streamkit.app.member import deploy
from streamkit.app.supervise import LoopFailure
from streamkit.keyspace import KeySpaceError, SQLiteKeySpace
from tests.brokerproc import BrokerProcess
from tests.e2e import AppView, Proc, copy_wordcount, eventually, serve_app
from tests.waiting import LIVENESS

if TYPE_CHECKING:
    from tests.etcdproc import EtcdServer

pytest_plugins = ["tests.etcdproc"]  # the etcd fixtures

TTL = 1.0  # --lease-ttl: the shortest this etcd grants (tests/etcdproc.py)
PAUSE = TTL + KEYSPACE_PATIENCE + 1.5  # past all the patience a silent KeySpace gets
# Two pauses: on waking, the member's loops race its lease keeper's first keepalive, and a
# member that counted the pause as the KeySpace's silence exited only if they won.
PAUSES = 2


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_member_paused_past_its_patience_rejoins(etcd_url: str, tmp_path: Path) -> None:
    """SIGSTOP for longer than TTL + KEYSPACE_PATIENCE, then SIGCONT, twice: each time the
    member stops serving at once, finds its lease gone, joins again under a new lease and
    serves every shard again; it never exits, and logs no traceback."""
    app = copy_wordcount(tmp_path / "wordcount")
    broker = BrokerProcess(tmp_path / "broker", extra_args=["--keyspace", etcd_url]).start()
    member: Proc | None = None
    try:
        async with AppView(app, broker.address, keyspace=etcd_url) as view:
            await view.state()  # opens the KeySpace
            await deploy(view.config, view.client, view.keyspace)
            member = serve_app(app, broker.address, "node-a", tmp_path / "member.log",
                               "--keyspace", etcd_url, "--lease-ttl", f"{TTL:g}")
            assert member.proc is not None
            await view.wait_serving(LIVENESS)
            for pause in range(1, PAUSES + 1):
                lease = _lease(await view.state())
                member.proc.send_signal(signal.SIGSTOP)
                try:
                    await asyncio.sleep(PAUSE)  # how long it is paused: what is tested
                finally:
                    before = len(member.text())  # it writes nothing while stopped
                    member.proc.send_signal(signal.SIGCONT)
                thawed = time.monotonic()

                def woke(before: int = before) -> str:
                    return member.text()[before:]  # type: ignore[union-attr]

                def noticed(woke: Callable[[], str] = woke) -> bool:
                    return "lost its lease; announcing again" in woke() or not member.alive

                await eventually(noticed, LIVENESS, "the member to notice it lost its lease")
                assert member.alive, f"it exited after a {PAUSE:g}s pause:\n{woke()}"
                assert "stops serving" in woke(), woke()

                async def rejoined(lease: int = lease) -> bool:
                    state = await view.state()
                    return bool(state.members) and _lease(state) != lease

                await eventually(rejoined, LIVENESS, "the member to join again, new lease")
                await view.wait_serving(LIVENESS)
                print(f"pause {pause}: serving again {time.monotonic() - thawed:.1f}s after "
                      f"SIGCONT:\n{woke()}")
                assert member.alive, woke()
            assert "Traceback" not in member.text(), member.text()
    finally:
        if member is not None:
            member.stop()
        broker.kill()


def _lease(state: AllocState) -> int:
    """The lease of the only member's key."""
    ((_, kv),) = state.members.values()
    return kv.lease


async def test_a_keyspace_silent_after_a_freeze_gets_the_patience_afresh(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In process, quick (patience 1 s): the event loop and the lease keeper's thread are both
    frozen for longer than TTL + patience, and the KeySpace answers no keepalive after the
    thaw either. The lease is doubted on waking, and `LeaseLost` comes no sooner than TTL +
    patience after the thaw (not at once, for a silence that was the process's own)."""
    patience, ttl = 1.0, 0.5
    monkeypatch.setattr(allocator_module, "KEYSPACE_PATIENCE", patience)
    me = MemberId("zone", "frozen")
    thaw = threading.Event()
    real_keepalive = SQLiteKeySpace.keepalive

    async def keepalive(self: SQLiteKeySpace, lease_id: int) -> bool:
        if threading.current_thread().name != f"lease {me}":
            return await real_keepalive(self, lease_id)
        thaw.wait()  # blocking on purpose: the keeper's thread is frozen too
        raise KeySpaceError("injected: the KeySpace is unreachable")

    failures: list[LoopFailure] = []
    doubted: list[int] = []
    async with SQLiteKeySpace(tmp_path / "ks.db") as keyspace:
        allocator = Allocator(keyspace, "/t", me, lease_ttl=ttl, on_failure=failures.append,
                              on_doubt=lambda: doubted.append(len(failures)))
        await allocator.start()
        started = time.monotonic()
        keeper = allocator._keeper
        assert keeper is not None
        # Running as before a freeze: the loops started, a keepalive was answered.
        await eventually(lambda: keeper.answered_at > started, LIVENESS, "a keepalive")
        monkeypatch.setattr(SQLiteKeySpace, "keepalive", keepalive)
        try:
            time.sleep(2 * (ttl + patience))  # the freeze: blocking on purpose, what is tested
        finally:
            thawed = time.monotonic()
            thaw.set()
        await eventually(lambda: failures, LIVENESS, "the allocator to give the lease up")
        lost_after = time.monotonic() - thawed
        (failure,) = failures
        assert isinstance(failure.error, LeaseLost), failure
        assert lost_after >= ttl + patience, f"LeaseLost {lost_after:.2f}s after the thaw"
        assert doubted and doubted[0] == 0, "the lease is doubted on waking, before LeaseLost"
        await allocator.close()


async def test_a_keyspace_that_cannot_be_written_gets_the_same_patience(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The lease expired and announcing again fails (the KeySpace's disk full): the member
    gives up after TTL + patience, as for a silent KeySpace, saying so once. It retried every
    50 ms for ever, two warnings each time, serving nothing."""
    patience, ttl = 1.0, 0.5
    monkeypatch.setattr(allocator_module, "KEYSPACE_PATIENCE", patience)
    failures: list[LoopFailure] = []
    async with SQLiteKeySpace(tmp_path / "ks.db") as keyspace:
        allocator = Allocator(keyspace, "/t", MemberId("zone", "full-disk"), lease_ttl=ttl,
                              on_failure=failures.append)
        await allocator.start()

        async def announce() -> None:
            raise KeySpaceError("injected: database or disk is full")

        monkeypatch.setattr(allocator, "_announce", announce)
        keeper = allocator._keeper
        assert keeper is not None
        keeper.expired_lease = allocator.lease  # as the KeySpace answers after a long pause
        began = time.monotonic()
        await eventually(lambda: failures, LIVENESS, "the allocator to give the lease up")
        assert time.monotonic() - began >= ttl + patience
        (failure,) = failures
        assert isinstance(failure.error, LeaseLost), failure
        assert "could not announce itself again for" in str(failure.error)
        said = [r for r in caplog.records if r.name == "streamkit.app.allocator"
                and "could not announce itself again" in r.message]
        assert len(said) == 1, [r.message for r in said]
        await allocator.close()


@pytest.mark.timeout(180)
async def test_a_member_whose_etcd_is_gone_exits_once_without_tracebacks(
        private_etcd: EtcdServer, tmp_path: Path) -> None:
    """etcd gone for good: the member gives up after TTL + patience and exits 1 saying why
    in a line, without first spending the KeySpace's patience again on revoking a lease
    that lapsed, and without tracebacks for failures that say what they are."""
    app = copy_wordcount(tmp_path / "wordcount")
    url = private_etcd.url("gone/")
    broker = BrokerProcess(tmp_path / "broker").start()
    member: Proc | None = None
    try:
        async with AppView(app, broker.address, keyspace=url) as view:
            await view.state()
            await deploy(view.config, view.client, view.keyspace)
            member = serve_app(app, broker.address, "node-a", tmp_path / "member.log",
                               "--keyspace", url, "--lease-ttl", f"{TTL:g}")
            await view.wait_serving(LIVENESS)
            private_etcd.stop()
            stopped = time.monotonic()
            assert member.proc is not None
            code = await asyncio.to_thread(member.proc.wait, LIVENESS + TTL + KEYSPACE_PATIENCE)
            took = time.monotonic() - stopped
        print(f"exited {took:.1f}s after etcd stopped:\n{member.text()[-2000:]}")
        assert code == 1, member.log()
        assert "LeaseLost" in member.text() and "Traceback" not in member.text(), member.log()
        assert took < TTL + 2 * KEYSPACE_PATIENCE, f"{took:.1f}s: it waited to revoke"
    finally:
        if member is not None:
            member.stop()
        broker.kill()
