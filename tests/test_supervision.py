"""Supervised loops: a member's background loop that crashes is logged by name, then restarted
or it stops the member loudly, so that its shards move to other members.

The supervisor alone first; then real in-process Members (a small word-count app on the shared
broker, a SQLite KeySpace) with a failure injected into what each loop calls; last, `streamkit
serve` / `run` processes whose KeySpace stops answering for longer than their lease (another
process holds its write lock), which must exit 1 with one line naming the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from streamkit.app import allocator as allocator_module
from streamkit.app.allocator import Allocator, LeaseLost
from streamkit.app.assignment import AllocState, MemberId, item_key, member_key
from streamkit.app.config import AppConfig
from streamkit.app.member import Member, MemberOptions, deploy
from streamkit.app.supervise import LoopFailure, Restart, supervised
from streamkit.client import BrokerClient
from streamkit.keyspace import KeySpace, KeySpaceError, SQLiteKeySpace, open_keyspace
from streamkit.protocol import consumer_pb
from tests.e2e import AppView, copy_wordcount, run_app, serve_app
from tests.helpers_client import eventually
from tests.test_shard_api import WordCount, app_config, app_name

Code = consumer_pb.ReplicaStatus.Code
TIMEOUT = 30.0
QUICK = Restart(limit=2, delay=0.01, max_delay=0.02)


def errors_naming(caplog: pytest.LogCaptureFixture, loop: str) -> list[logging.LogRecord]:
    """ERROR records of the supervisor about `loop`."""
    return [
        r
        for r in caplog.records
        if r.name == "streamkit.app.supervise"
        and r.levelno == logging.ERROR
        and f"loop {loop} " in r.getMessage()
    ]


def failing(times: int, error: Exception, real: Callable[..., Any]) -> Callable[..., Any]:
    """`real`, but the first `times` calls raise `error` (every call when `times` < 0)."""
    calls = {"n": 0}

    def call(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if times < 0 or calls["n"] <= times:
            raise error
        return real(*args, **kwargs)

    return call


# --- the supervisor alone ---------------------------------------------------------------------


async def test_restarts_then_gives_up(caplog: pytest.LogCaptureFixture) -> None:
    starts: list[int] = []
    failures: list[LoopFailure] = []

    async def loop() -> None:
        starts.append(len(starts))
        raise RuntimeError(f"crash {len(starts)}")

    task = supervised("demo", loop, on_give_up=failures.append, restart=QUICK, owner="test")
    await asyncio.wait_for(task, TIMEOUT)
    assert len(starts) == 3, "the first run, then QUICK.limit restarts"
    (failure,) = failures
    assert failure.loop == "demo" and str(failure) == "loop demo failed: RuntimeError: crash 3"
    records = errors_naming(caplog, "demo")
    assert [r.getMessage().startswith("test: loop demo crashed") for r in records] == [
        True,
        True,
        False,
    ]
    assert "giving up" in records[-1].getMessage()


async def test_a_replaced_keyspace_is_given_up_on_at_once() -> None:
    """No restart mends a KeySpace replaced under the process (every call fails from then
    on): the loop is given up on, for the process to restart, not restarted 5 times."""
    from streamkit.keyspace import ClusterChangedError

    starts: list[int] = []
    failures: list[LoopFailure] = []

    async def loop() -> None:
        starts.append(len(starts))
        raise ClusterChangedError("etcd at h:1 is a different cluster")

    await asyncio.wait_for(supervised("watch", loop, on_give_up=failures.append,
                                      restart=QUICK), TIMEOUT)
    assert len(starts) == 1 and len(failures) == 1


async def test_cancelling_is_not_a_crash(caplog: pytest.LogCaptureFixture) -> None:
    running = asyncio.Event()

    async def loop() -> None:
        running.set()
        await asyncio.Event().wait()

    task = supervised("idle", loop, on_give_up=pytest.fail, restart=QUICK)
    await running.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not errors_naming(caplog, "idle")


async def test_a_loop_that_returns_has_failed() -> None:
    failures: list[LoopFailure] = []

    async def loop() -> None:
        return None

    await asyncio.wait_for(supervised("brief", loop, on_give_up=failures.append), TIMEOUT)
    (failure,) = failures
    assert "should run until cancelled" in str(failure)


async def test_an_expired_lease_is_not_a_failure(tmp_path: Path) -> None:
    """A keepalive the KeySpace answers "expired" (say, the process was paused past its lease)
    announces the member again under a new lease; nothing is given up on."""
    failures: list[LoopFailure] = []
    me = MemberId("zone", "mem-a")
    async with SQLiteKeySpace(tmp_path / "ks.db") as keyspace:
        allocator = Allocator(keyspace, "/t", me, lease_ttl=0.5, on_failure=failures.append)
        await allocator.start()
        old = allocator.lease
        await keyspace.revoke(old)

        def announced_again() -> bool:
            kv = allocator.state.member_kv(me)
            return kv is not None and kv.lease == allocator.lease != old

        await eventually(announced_again, TIMEOUT)
        await allocator.leave()
    assert not failures


# --- members in this event loop ----------------------------------------------------------------


@contextlib.asynccontextmanager
async def running(
    config: AppConfig, client: BrokerClient, path: Path, suffix: str
) -> AsyncIterator[Member]:
    """An allocating member with its own KeySpace connection (so each can be broken alone)."""
    keyspace = open_keyspace(str(path))
    options = MemberOptions(
        work_dir=config.data_dir / "shards" / suffix, suffix=suffix, lease_ttl=1.0
    )
    member = Member(config, WordCount, client, keyspace, options)
    try:
        await member.start()
        yield member
    finally:
        await member.stop()
        await keyspace.close()


def serves(member: Member, shards: list[str]) -> Callable[[], bool]:
    def check() -> bool:
        replicas = member.service.replicas
        return all(s in replicas and replicas[s].status.code == Code.PRIMARY for s in shards)

    return check


async def member_keys(keyspace: KeySpace, config: AppConfig) -> list[str]:
    kvs, _ = await keyspace.range(f"{config.keyspace_root}/members/")
    return [kv.key for kv in kvs]


async def touch(keyspace: KeySpace, config: AppConfig, shard: str) -> None:
    """Write a shard spec again: a change every member's watch sees."""
    kv = await keyspace.get(item_key(config.keyspace_root, shard))
    assert kv is not None
    await keyspace.put(kv.key, kv.value)


@pytest.mark.parametrize("loop", ["allocator-watch", "allocator-converge"])
async def test_restartable_loop_is_restarted_and_the_member_keeps_working(
    shared_broker: Any,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    loop: str,
) -> None:
    """The watch (its state re-read from the KeySpace) and converge loops crash once: each is
    restarted, and a shard spec created meanwhile still gets assigned and served."""
    config = app_config(tmp_path, app_name(), shards=2)
    path = tmp_path / "keyspace.db"
    async with BrokerClient(shared_broker.address) as client:
        keyspace = open_keyspace(str(path))
        await deploy(config, client, keyspace)
        new = item_key(config.keyspace_root, "shard-001")
        spec = await keyspace.get(new)
        assert spec is not None
        await keyspace.delete(new)  # created again below, while the loop is broken
        async with running(config, client, path, "mem-a") as a:
            await eventually(serves(a, ["shard-000"]), TIMEOUT)
            allocator = a.allocator
            assert allocator is not None
            crash = RuntimeError(f"injected into {loop}")
            if loop == "allocator-watch":
                monkeypatch.setattr(allocator, "_publish", failing(1, crash, allocator._publish))
            else:
                monkeypatch.setattr(
                    allocator_module, "solve", failing(1, crash, allocator_module.solve)
                )
            await keyspace.put(new, spec.value)
            await eventually(serves(a, ["shard-000", "shard-001"]), TIMEOUT)
            (record,) = errors_naming(caplog, loop)
            assert "crashed; restarting it" in record.getMessage()
            assert record.exc_info is not None and record.exc_info[1] is crash
            assert a.failure is None
            assert await member_keys(keyspace, config) == [
                f"{config.keyspace_root}/members/local#mem-a"
            ]
        await keyspace.close()


@pytest.mark.parametrize(
    "loop", ["assignment-follower", "allocator-keepalive", "allocator-converge"]
)
async def test_fatal_loop_stops_the_member_and_another_takes_over(
    shared_broker: Any,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    loop: str,
) -> None:
    """A loop given up on stops its member: logged by name, its member key (and so its
    assignments) gone from the KeySpace, and the other member serves its shards.

    The follower is fatal at its first crash; keepalive once it failed for the lease's TTL
    (here: the KeySpace errs on every keepalive); converge after QUICK.limit quick restarts
    (here: solving fails whenever this member leads)."""
    monkeypatch.setattr(allocator_module, "RESTART", QUICK)
    config = app_config(tmp_path, app_name(), shards=2)
    path = tmp_path / "keyspace.db"
    shards = config.shard_ids()
    async with BrokerClient(shared_broker.address) as client:
        keyspace = open_keyspace(str(path))
        await deploy(config, client, keyspace)
        async with running(config, client, path, "mem-a") as a, \
                running(config, client, path, "mem-b") as b:
            assert a.allocator is not None and a.allocator.is_leader

            def a_primary_of_some() -> bool:
                state = a.allocator.state  # type: ignore[union-attr]
                primaries = [state.primary_of(s) for s in shards]
                return all(p is not None and p.code == Code.PRIMARY for p in primaries) and any(
                    p.suffix == "mem-a" for p in primaries if p is not None
                )

            await eventually(a_primary_of_some, TIMEOUT)
            if loop == "assignment-follower":
                crash: Exception = RuntimeError("injected into the follower")
                monkeypatch.setattr(a, "_report", failing(-1, crash, a._report))
            elif loop == "allocator-keepalive":
                # The keepalives are sent from the member's lease keeper thread, with a
                # KeySpace client of its own: fail those of member a only.
                unreachable = KeySpaceError("injected: the KeySpace is unreachable")
                real_keepalive = SQLiteKeySpace.keepalive
                keeper_thread = f"lease {a.allocator.member}"

                async def keepalive(self: SQLiteKeySpace, lease_id: int) -> bool:
                    if threading.current_thread().name == keeper_thread:
                        raise unreachable
                    return await real_keepalive(self, lease_id)

                monkeypatch.setattr(SQLiteKeySpace, "keepalive", keepalive)
            else:
                real_solve = allocator_module.solve

                def solve(state: AllocState, **kwargs: Any) -> Any:
                    if state.leader == a.allocator.member:  # type: ignore[union-attr]
                        raise RuntimeError("injected into solving")
                    return real_solve(state, **kwargs)

                monkeypatch.setattr(allocator_module, "solve", solve)
            await touch(keyspace, config, shards[0])

            failure = await asyncio.wait_for(a.wait_failed(), TIMEOUT)
            assert failure.loop == loop
            if loop == "allocator-keepalive":
                assert isinstance(failure.error, LeaseLost)
            given_up = errors_naming(caplog, loop)[-1]
            assert "giving up on it: " in given_up.getMessage()
            # A traceback for a bug; LeaseLost says what happened.
            assert (given_up.exc_info is None) == (loop == "allocator-keepalive")
            stops = [r for r in caplog.records if r.name == "streamkit.app.member"]
            assert any(f"{loop} failed" in r.getMessage() for r in stops)

            a_key = member_key(config.keyspace_root, a.allocator.member)

            async def a_is_gone() -> bool:
                return a_key not in await member_keys(keyspace, config)

            await eventually(a_is_gone, TIMEOUT)
            await eventually(serves(b, shards), TIMEOUT)
            await a.stop()  # joins the stop the failure began; nothing to raise
            assert not a.service.replicas
            assert b.failure is None
        await keyspace.close()


# --- streamkit serve / run -----------------------------------------------------------------------


@pytest.mark.parametrize("command", ["serve", "run"])
async def test_cli_member_that_cannot_keep_its_lease_exits_1(
    broker_proc: Any, tmp_path: Path, command: str
) -> None:
    """Another process holds the KeySpace's write lock for longer than the member's lease: the
    keepalive loop gives up, the member stops (leaving once the lock is released), and the
    command exits 1 with one error line naming the loop."""
    app = copy_wordcount(tmp_path / "wordcount", shards=2)
    address = broker_proc.address
    log = tmp_path / f"{command}.log"
    async with AppView(app, address) as view:
        if command == "serve":
            await view.state()  # creates the KeySpace
            assert view.client is not None and view.keyspace is not None
            await deploy(view.config, view.client, view.keyspace)
            proc = serve_app(app, address, "mem-a", log)
        else:
            proc = run_app(app, address, log)
        try:
            await view.wait_serving(timeout=60)
            locker = sqlite3.connect(view.keyspace_path, isolation_level=None, timeout=30)
            try:
                locker.execute("BEGIN IMMEDIATE")
                await eventually(lambda: "loop allocator-keepalive failed" in proc.text(), 30)
            finally:
                locker.rollback()
                locker.close()
            assert proc.proc is not None
            code = await asyncio.to_thread(proc.proc.wait, 60)
            output = proc.text().splitlines()
            assert code == 1, proc.log()
            errors = [line for line in output if line.startswith("streamkit: error:")]
            assert errors == [output[-1]], proc.log()
            assert errors[0].startswith("streamkit: error: member local#")
            assert "stopped: loop allocator-keepalive failed: LeaseLost:" in errors[0]
            state = await view.state()
            assert not state.members and not state.assignments, "it left the KeySpace"
        finally:
            proc.stop()
