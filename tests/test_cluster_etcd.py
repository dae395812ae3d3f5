"""A cluster on etcd: three `streamkit serve` members and the bundled broker sharing one etcd
KeySpace (a prefix of a real etcd 3.5 per test), killed, paused, and cut off from etcd.

Every test runs the wordcount example (hot standbys on) as real processes and judges what a
user could observe: the KeySpace's assignments, the members' Shard and HTTP APIs, the
committed output topic, `streamkit query`, and the members' logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from streamkit.app.member import deploy
from streamkit.app.member_http import http_url
from streamkit.app.resolver import Resolver
from streamkit.protocol import pb
from tests import wire
from tests.brokerproc import BrokerProcess
from tests.e2e import (
    AppView,
    Feeder,
    Proc,
    cli,
    copy_wordcount,
    eventually,
    expected_counts,
    serve_app,
    totals_of_updates,
)
from tests.waiting import LIVENESS

if TYPE_CHECKING:
    from tests.etcdproc import EtcdServer

pytest_plugins = ["tests.etcdproc"]  # the etcd fixtures

pytestmark = pytest.mark.slow

MEMBERS = ("node-a", "node-b", "node-c")  # Gazette wants suffixes of 4+ characters


@dataclass
class Cluster:
    """The app folder, its broker, and its members (restartable, each logging to its own
    file per start)."""

    app: Path
    url: str  # the etcd KeySpace everyone shares
    broker: BrokerProcess
    logs: Path
    members: dict[str, Proc] = field(default_factory=dict)
    starts: Counter[str] = field(default_factory=Counter)

    def serve(self, name: str) -> Proc:
        self.starts[name] += 1
        log_path = self.logs / f"serve-{name}-{self.starts[name]:02d}.log"
        self.members[name] = serve_app(self.app, self.broker.address, name, log_path,
                                       "--keyspace", self.url)
        return self.members[name]

    def feeder(self, name: str, **options: object) -> Feeder:
        return Feeder(self.app, self.broker.address, self.logs / f"{name}.log",
                      **options)  # type: ignore[arg-type]

    def stop(self) -> None:
        for proc in self.members.values():
            proc.stop()


@contextlib.asynccontextmanager
async def cluster_of(tmp_path: Path, url: str) -> AsyncIterator[tuple[Cluster, AppView]]:
    """A broker and members node-a, -b, -c on the etcd KeySpace at `url`, every shard with a
    PRIMARY and a STANDBY; stopped afterwards."""
    app = copy_wordcount(tmp_path / "wordcount", standbys=1)
    broker = BrokerProcess(tmp_path / "broker", extra_args=["--keyspace", url]).start()
    cluster = Cluster(app, url, broker, tmp_path)
    try:
        async with AppView(app, broker.address, keyspace=url) as view:
            await view.state()  # opens the KeySpace
            await deploy(view.config, view.client, view.keyspace)
            for name in MEMBERS:
                cluster.serve(name)
            await eventually(view.standing_by, 90, "a PRIMARY and a STANDBY per shard")
            yield cluster, view
    finally:
        cluster.stop()
        broker.kill()


async def check_exact(view: AppView, ids: range) -> dict[str, str]:
    """Once the cluster settled, counts are exact both as queried from the primaries and in
    the committed output (each count update exactly once); returns shard -> its primary's
    endpoint."""
    expected = expected_counts(ids)
    await eventually(lambda: settled(view), LIVENESS, "primaries spread over the members")
    deadline = time.monotonic() + LIVENESS
    while True:
        serving = await view.wait_caught_up(timeout=LIVENESS)
        try:
            counts = await view.query_counts(serving)
            break
        except urllib.error.HTTPError as error:
            if error.code != 404 or time.monotonic() > deadline:
                raise
            # A primary moved since (a hand-off evening out primaries): ask the new one.
    assert counts == expected
    assert totals_of_updates(await view.output_updates()) == expected
    return serving


async def settled(view: AppView) -> bool:
    """Every shard has a PRIMARY and a STANDBY, and no member has two primaries more than
    another (so no hand-off is coming)."""
    if not await view.standing_by():
        return False
    state = await view.state()
    primaries = Counter({m.suffix: 0 for m in state.members})
    for shard in view.config.shard_ids():
        primary = state.primary_of(shard)
        if primary is None:
            return False
        primaries[primary.suffix] += 1
    return max(primaries.values()) - min(primaries.values()) <= 1


async def served_without(view: AppView, member: str) -> dict[str, str] | None:
    """Shard -> primary endpoint, once `member` is gone from the KeySpace (its lease expired)
    and every shard is PRIMARY at another member that answers Stat for it."""
    state = await view.state()
    if any(m.suffix == member for m in state.members):
        return None
    serving = await view.serving()
    if serving is None or any(state.primary_of(s).suffix == member  # type: ignore[union-attr]
                              for s in serving):
        return None
    return serving


def restart_dead(cluster: Cluster) -> dict[str, str]:
    """Members that exited by themselves, started again: name -> the end of its log."""
    dead = {name: proc.log() for name, proc in cluster.members.items() if not proc.alive}
    for name in dead:
        cluster.serve(name)
    return dead


# --- SIGKILL ----------------------------------------------------------------------------------


@pytest.mark.timeout(420)
async def test_sigkill_chaos_on_etcd_keeps_counts_exact(
        etcd_url: str, tmp_path: Path, rng: random.Random) -> None:
    """A random member SIGKILLed at random moments (serving, or still recovering) and started
    again, 20 times, while input keeps arriving: in the end every line is counted exactly once
    and every count update is in the output exactly once. The moments come from the seeded
    `rng` (STREAMKIT_TEST_SEED replays them)."""
    kills = 20
    async with cluster_of(tmp_path, etcd_url) as (cluster, view):
        feeder = cluster.feeder("feeder", batch=20, interval=0.05).start()
        started = time.monotonic()
        exited: dict[str, str] = {}
        try:
            # The random sleeps below choose kill moments (what is tested), not synchronisation.
            for k in range(1, kills + 1):
                victim = rng.choice(MEMBERS)
                if rng.random() < 0.3:  # maybe while the last one still recovers
                    await asyncio.sleep(rng.uniform(0.2, 1.5))
                    moment = "early"
                else:
                    await view.wait_serving(timeout=LIVENESS)
                    await asyncio.sleep(rng.uniform(0.0, 1.0))
                    moment = "serving"
                cluster.members[victim].kill()
                print(f"kill {k}: {victim} ({moment}) at {time.monotonic() - started:.1f}s, "
                      f"{feeder.acked()} lines acked")
                cluster.serve(victim)
                if dead := restart_dead(cluster):
                    exited.update(dead)
                    print(f"  exited by themselves, started again: {list(dead)}")
            assert feeder.proc.alive, feeder.proc.log()
            ids = feeder.finish()
            assert len(ids) > 500, "the feeder should have run through the kills"
            await check_exact(view, ids)
            print(f"{kills} kills, {len(ids)} lines, {time.monotonic() - started:.1f}s")
            assert not exited, f"no member dies of the others' deaths: {exited}"
        finally:
            feeder.proc.stop()


# --- SIGSTOP ----------------------------------------------------------------------------------


@pytest.mark.timeout(300)
async def test_paused_primary_is_fenced_and_commits_nothing(
        etcd_url: str, tmp_path: Path, rng: random.Random) -> None:
    """The member holding the most primaries is SIGSTOPped in the middle of its transactions
    until its etcd lease expired and its shards are served elsewhere; more input arrives; then
    it is SIGCONTinued. Whatever it consumed but had not committed, it must not commit now:
    every line is counted exactly once and every update is in the output once."""
    async with cluster_of(tmp_path, etcd_url) as (cluster, view):
        ids = cluster.feeder("feed-1", count=600, interval=0).start().finish()
        await check_exact(view, ids)

        by_member = await view.primaries_by_member()
        victim = max(by_member, key=lambda m: len(by_member[m]))
        moved = by_member[victim]
        proc = cluster.members[victim].proc
        assert proc is not None
        feeder = cluster.feeder("feed-2", start=ids.stop, batch=20, interval=0.02).start()
        try:
            # Pause it while it consumes: transactions are open (a random moment of them).
            await eventually(lambda: feeder.acked() >= 100, LIVENESS, "input flowing")
            await asyncio.sleep(rng.uniform(0.0, 0.5))
            proc.send_signal(signal.SIGSTOP)
            paused_at = time.monotonic()
            await eventually(lambda: served_without(view, victim), LIVENESS,
                             f"{moved} to be served without {victim}")
            print(f"{moved} moved off paused {victim} in {time.monotonic() - paused_at:.1f}s")
            acked = feeder.acked()
            await eventually(lambda: feeder.acked() >= acked + 200, LIVENESS, "more input")
            before = len(cluster.members[victim].text())
            proc.send_signal(signal.SIGCONT)

            def woke() -> str:
                return cluster.members[victim].text()[before:]

            # It wakes up to find its lease in doubt, then gone: it stops serving what it
            # held, says so, and joins again under a new lease.
            await eventually(lambda: "lost its lease; announcing again" in woke(), LIVENESS,
                             f"{victim} to notice it lost its lease")
            assert "stops serving" in woke(), woke()
            await eventually(lambda: _member_back(view, victim), LIVENESS,
                             f"{victim} to join again")
            acked = feeder.acked()
            await eventually(lambda: feeder.acked() >= acked + 200, LIVENESS, "more input")
            ids = feeder.finish()
        finally:
            feeder.proc.stop()
        print(f"{victim} after SIGCONT:\n{woke()}")
        await check_exact(view, range(ids.stop))
        await eventually(view.standing_by, LIVENESS, "a PRIMARY and a STANDBY per shard")
        exited = {name: proc.log() for name, proc in cluster.members.items() if not proc.alive}
        assert not exited, f"members exited: {exited}"


@pytest.mark.timeout(300)
async def test_a_lease_in_doubt_while_shards_take_over_serves_them_again(
        private_etcd: EtcdServer, tmp_path: Path) -> None:
    """etcd hangs (SIGSTOP) for most of the member's lease TTL as its shards take over, at
    several moments: the member stops serving while its lease is in doubt, and once
    keepalives are answered again every shard is PRIMARY there again."""
    doubted = 0
    for attempt, delay in enumerate((0.0, 0.05, 0.1, 0.15)):
        url = private_etcd.url(f"doubt-{attempt}/")
        app = copy_wordcount(tmp_path / f"wordcount-{attempt}")
        broker = BrokerProcess(tmp_path / f"broker-{attempt}",
                               extra_args=["--keyspace", url]).start()
        log = tmp_path / f"member-{attempt}.log"
        member = None
        try:
            async with AppView(app, broker.address, keyspace=url) as view:
                await view.state()  # opens the KeySpace
                await deploy(view.config, view.client, view.keyspace)
                member = serve_app(app, broker.address, "node-a", log, "--keyspace", url)
                await eventually(lambda: "Shard API on" in log.read_text(), LIVENESS,  # noqa: B023
                                 "the member's APIs")
                await asyncio.sleep(delay)
                private_etcd.freeze()
                try:
                    await asyncio.sleep(0.85)  # TTL 1 s: in doubt from 0.75 s
                finally:
                    private_etcd.thaw()
                await view.wait_serving(LIVENESS)
            doubted += "in doubt" in log.read_text()
        finally:
            if member is not None:
                member.stop()
            broker.kill()
    print(f"lease in doubt in {doubted} of 4 attempts")
    assert doubted, "etcd's hang never put the lease in doubt: the test proves nothing"


async def _member_back(view: AppView, member: str) -> bool:
    state = await view.state()
    return any(m.suffix == member for m in state.members)


# --- etcd restart -----------------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["stop", "crash"])
async def test_members_ride_out_an_etcd_restart(
        private_etcd: EtcdServer, tmp_path: Path, sig: signal.Signals,
        rng: random.Random) -> None:
    """etcd stops (or crashes) while input arrives, and starts again on the same data and
    ports a moment later: the members stop serving while their leases are in doubt, take
    their shards up again when etcd answers (their leases lived through the restart, or they
    join again under new ones), no member exits, and the counts stay exact."""
    async with cluster_of(tmp_path, private_etcd.url("app/")) as (cluster, view):
        feeder = cluster.feeder("feeder", batch=20, interval=0.05).start()
        try:
            await eventually(lambda: feeder.acked() >= 200, LIVENESS, "input flowing")
            await view.wait_serving(timeout=LIVENESS)
            private_etcd.stop(sig)
            stopped = time.monotonic()
            await asyncio.to_thread(_wait_logged, cluster, "its lease may lapse")
            await asyncio.sleep(rng.uniform(0.0, 3.0))  # how long etcd stays down: tested
            await asyncio.to_thread(private_etcd.start)
            print(f"etcd down {time.monotonic() - stopped:.1f}s")
            await asyncio.to_thread(_wait_logged, cluster, "answered again",
                                    "lost its lease; announcing again",
                                    among="its lease may lapse")
            acked = feeder.acked()
            await eventually(lambda: feeder.acked() >= acked + 200, LIVENESS, "more input")
            ids = feeder.finish()
        finally:
            feeder.proc.stop()
        await check_exact(view, ids)
        await eventually(view.standing_by, LIVENESS, "a PRIMARY and a STANDBY per shard")
        exited = {name: proc.log() for name, proc in cluster.members.items() if not proc.alive}
        assert not exited, f"members exited: {exited}"


@pytest.mark.timeout(180)
def test_a_broker_follows_its_specs_again_after_a_long_etcd_outage(
        private_etcd: EtcdServer, tmp_path: Path) -> None:
    """etcd down long enough for the broker's watch, and then its reading the specs afresh,
    to fail: once etcd is back the broker follows spec changes again (it stopped for good,
    and an Apply then waited for ever for the watch to see its change)."""
    broker = BrokerProcess(tmp_path / "broker",
                           extra_args=["--keyspace", private_etcd.url("broker/")]).start()
    try:
        journals = wire.stub(broker.address)
        wire.create(journals, wire.spec("outage/before"))
        private_etcd.stop()
        deadline = time.monotonic() + 120
        while broker.log().count("journal spec watch failed") < 2:  # the re-read failed too
            assert time.monotonic() < deadline, broker.log()
            time.sleep(0.2)
        private_etcd.start()
        change = pb.ApplyRequest.Change(expect_mod_revision=0, upsert=wire.spec("outage/after"))
        applied = journals.Apply(pb.ApplyRequest(changes=[change]), timeout=LIVENESS)
        assert applied.status == pb.OK, applied
        names: set[str] = set()
        while names != {"outage/before", "outage/after"}:
            assert time.monotonic() < deadline, (names, broker.log())
            time.sleep(0.1)
            listed = journals.List(pb.ListRequest(), timeout=LIVENESS)
            names = {j.spec.name for response in listed for j in response.journals}
    finally:
        broker.kill()


def test_a_broker_stops_when_its_etcd_was_wiped(private_etcd: EtcdServer,
                                                tmp_path: Path) -> None:
    """etcd restarted without its data: the broker exits with an error saying so. It went
    on serving specs no longer in etcd, and `streamkit deploy`, comparing against them,
    wrote nothing."""
    broker = BrokerProcess(tmp_path / "broker",
                           extra_args=["--keyspace", private_etcd.url("broker/")]).start()
    try:
        journals = wire.stub(broker.address)
        wire.create(journals, wire.spec("wiped/one"), wire.spec("wiped/two"))
        private_etcd.wipe()
        assert broker.proc is not None
        assert broker.proc.wait(LIVENESS) == 1, broker.log()
        assert "broker stopped on an error: etcd at" in broker.log(), broker.log()
        assert "its data was wiped or replaced): restart this process" in broker.log()
    finally:
        broker.kill()


def _wait_logged(cluster: Cluster, *texts: str, among: str | None = None) -> None:
    """Until some member logged one of `texts`; with `among`: until each member that logged
    `among` logged one of `texts` after it."""

    def logged(text: str) -> bool:
        return any(t in text for t in texts)

    def done() -> bool:
        if among is None:
            return any(logged(proc.text()) for proc in cluster.members.values())
        return all(logged(proc.text().partition(among)[2])
                   for proc in cluster.members.values() if among in proc.text())

    deadline = time.monotonic() + LIVENESS
    while not done():
        assert time.monotonic() < deadline, f"not logged: {texts}"
        time.sleep(0.05)


# --- queries ----------------------------------------------------------------------------------


async def test_queries_reach_every_primary_through_etcd(etcd_url: str, tmp_path: Path) -> None:
    """`streamkit query --keyspace etcd://...` finds each shard's primary, on whichever member
    it runs, and combines their answers; the Shard API's Stat of any shard, asked of any
    member, is forwarded to its primary."""
    async with cluster_of(tmp_path, etcd_url) as (cluster, view):
        ids = cluster.feeder("feed", count=600, interval=0).start().finish()
        await check_exact(view, ids)
        expected = expected_counts(ids)
        by_member = await view.primaries_by_member()
        assert len(by_member) > 1, by_member

        for word in ("w0", "w7", "nope"):
            asked = cli("query", str(cluster.app), json.dumps({"word": word}), "--keyspace",
                        cluster.url)
            assert asked.returncode == 0, asked
            assert int(asked.stdout) == expected[word], asked
        asked = cli("query", str(cluster.app), '{"word": "w0"}',  # as the shards commands
                    env={"STREAMKIT_KEYSPACE": cluster.url})
        assert asked.returncode == 0 and int(asked.stdout) == expected["w0"], asked
        one = next(s for s in view.config.shard_ids())
        asked = cli("query", str(cluster.app), '{"word": "w1"}', "--shard", one,
                    "--keyspace", cluster.url)
        assert asked.returncode == 0, asked
        serving = await view.wait_serving()
        assert int(asked.stdout) == (await view.query_counts({one: serving[one]}, ["w1"]))["w1"]

        asked = cli("query", str(cluster.app), '{"word": "w2"}', "--key", "12345",
                    "--keyspace", cluster.url)
        assert asked.returncode == 0, asked
        assert view.keyspace is not None
        owner = Resolver(view.config, view.keyspace).shard_of("12345")
        assert int(asked.stdout) == (await view.query_counts({owner: serving[owner]},
                                                             ["w2"]))["w2"]

        # Stat, asked of each member about every shard (most of them primary elsewhere).
        state = await view.state()
        assert len(state.members) == len(MEMBERS)
        heads = await view.heads()
        for member in state.members:
            endpoint = view.endpoint_of(state, member)
            for shard in view.config.shard_ids():
                through = {j: heads[j] for j in view.sources_of(shard)}
                response = await view.stat(endpoint, shard, through)
                assert dict(response.read_through).items() >= through.items(), response

        # A query over HTTP, asked of any member, is forwarded to the shard's primary; one
        # marked as forwarded already is not forwarded again.
        serving = await view.wait_serving()
        endpoints = [view.endpoint_of(state, member) for member in state.members]
        for shard in view.config.shard_ids():
            want = await view.query_counts({shard: serving[shard]}, ["w3"])
            for endpoint in endpoints:
                assert await view.query_counts({shard: endpoint}, ["w3"]) == want, endpoint
        shard, primary = next(iter(serving.items()))
        other = next(e for e in endpoints if e != primary)
        code, text = await asyncio.to_thread(
            _post, f"{http_url(other)}/query/{shard}", {"X-Streamkit-Forwarded": "1"})
        assert code == 404 and ("not primary here" in text or "not run by" in text), text


def _post(url: str, headers: dict[str, str]) -> tuple[int, str]:
    request = urllib.request.Request(url, b'{"word": "w3"}', headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
