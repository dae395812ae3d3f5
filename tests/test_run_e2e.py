"""The consumer runtime as users run it: `streamkit run` / `serve` processes, killed and restarted.

Every test runs a real broker process and the wordcount example (copied into
the test's folder) as separate processes, and judges only what a user could
observe: the KeySpace's assignments, the members' Shard and HTTP APIs, the
committed output topic, exit codes and error messages.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import time
import urllib.request
from pathlib import Path

from streamkit.app.config import load_config
from streamkit.app.member import deploy
from streamkit.app.member_http import http_url
from tests.brokerproc import BrokerProcess, free_port
from tests.e2e import (
    POISONED,
    AppView,
    Code,
    Feeder,
    Proc,
    cli,
    copy_wordcount,
    eventually,
    expected_counts,
    run_app,
    serve_app,
    totals_of_updates,
)
from tests.waiting import LIVENESS


async def _check_exact(view: AppView, ids: range) -> None:
    """Counts are exact both as queried from the primaries and in the committed output."""
    expected = expected_counts(ids)
    serving = await view.wait_caught_up(timeout=60)
    assert await view.query_counts(serving) == expected
    assert totals_of_updates(await view.output_updates()) == expected


async def test_sigkill_chaos_keeps_counts_exact(broker_proc: BrokerProcess, tmp_path: Path,
                                                rng: random.Random) -> None:
    """`streamkit run` SIGKILLed at random moments (serving, or still recovering) while input
    keeps arriving: after each restart it takes over, and in the end every line is counted
    exactly once and every count update is in the output exactly once. The moments come from
    the test's seeded `rng` (its seed is printed: STREAMKIT_TEST_SEED replays the sequence)."""
    app = copy_wordcount(tmp_path / "wordcount")
    address = broker_proc.address
    feeder = Feeder(app, address, tmp_path / "feeder.log", batch=20, interval=0.05)
    run = run_app(app, address, tmp_path / "run-00.log")
    kills = 10
    try:
        async with AppView(app, address) as view:
            await view.wait_serving(timeout=60)
            feeder.start()
            # The random sleeps below are what is tested (kill moments), not synchronisation.
            for k in range(1, kills + 1):
                started = time.monotonic()
                dice = rng.random()
                if dice < 0.25:  # still starting up or recovering
                    await asyncio.sleep(rng.uniform(0.4, 1.8))
                    moment = "early"
                else:
                    try:
                        await view.wait_serving(timeout=30)
                    except AssertionError as error:  # where is the run process stuck?
                        raise AssertionError(f"{error}\n--- {run.log_path.name}, with its "
                                             f"stacks:\n{run.stacks()}") from None
                    await asyncio.sleep(rng.uniform(0.0, 1.0))
                    moment = "serving"
                    if dice < 0.45:  # in the middle of a graceful stop
                        assert run.proc is not None
                        run.proc.send_signal(signal.SIGINT)
                        await asyncio.sleep(rng.uniform(0.0, 0.4))
                        moment = "stopping"
                run.kill()
                print(f"kill {k} ({moment}) {time.monotonic() - started:.2f}s after start, "
                      f"{feeder.acked()} lines acked")
                run = run_app(app, address, tmp_path / f"run-{k:02d}.log")
            assert feeder.proc.alive, feeder.proc.log()
            ids = feeder.finish()
            assert len(ids) > 500, "the feeder should have run through the kills"
            await _check_exact(view, ids)
    finally:
        feeder.proc.stop()
        run.stop()


async def test_hot_standby_takes_over(broker_proc: BrokerProcess, tmp_path: Path) -> None:
    """Two `streamkit serve` members, one hot standby per shard: SIGKILL the member holding
    some primaries, and its standbys on the other member serve those shards. (How fast is a
    measurement for bench/; the time is printed here only as a hint.)"""
    app = copy_wordcount(tmp_path / "wordcount", standbys=1)
    address = broker_proc.address
    members = {}
    try:
        async with AppView(app, address) as view:
            await view.state()  # opens (creates) the KeySpace
            await deploy(view.config, view.client, view.keyspace)
            for name in ("mem-a", "mem-b"):
                members[name] = serve_app(app, address, name, tmp_path / f"serve-{name}.log")
            await eventually(view.standing_by, 60, "a PRIMARY and a STANDBY per shard")
            first = Feeder(app, address, tmp_path / "feed-1.log", count=1000, interval=0).start()
            ids = first.finish()
            await _check_exact(view, ids)

            by_member = await view.primaries_by_member()
            victim = max(by_member, key=lambda m: len(by_member[m]))
            survivor = "mem-b" if victim == "mem-a" else "mem-a"
            moved = by_member[victim]
            killed_at = time.monotonic()
            members[victim].kill()
            taken = await eventually(lambda: view.served_by(moved, survivor), 60,
                                     f"{survivor} to serve {moved}", interval=0.01)
            failover = time.monotonic() - killed_at
            print(f"failover of {len(moved)} shard(s) from {victim} to {survivor}: "
                  f"{failover:.2f}s")
            assert set(taken) == set(moved)
            # Noticed by the refused port (streamkit.app.peer_watch), not the lease's lapse.
            assert "refuses connections" in members[survivor].text(), members[survivor].log()

            second = Feeder(app, address, tmp_path / "feed-2.log", start=1000, count=1000,
                            interval=0).start()
            more = second.finish()
            await _check_exact(view, range(0, more.stop))

            # The killed member comes back: it catches up as a standby, primaries are handed
            # back to it until both hold half, and the counts stay exact through hand-offs.
            members[victim] = serve_app(app, address, victim,
                                        tmp_path / f"serve-{victim}-again.log")
            await eventually(view.balanced, 60, "primaries spread over both members")
            third = Feeder(app, address, tmp_path / "feed-3.log", start=2000, count=1000,
                           interval=0).start()
            await _check_exact(view, range(0, third.finish().stop))
    finally:
        for proc in members.values():
            proc.stop()


async def test_a_member_that_cannot_reach_the_broker_stops_at_once(
        broker_proc: BrokerProcess, tmp_path: Path) -> None:
    """A member given a wrong --broker holds standbys (or primaries) stuck recovering: on
    SIGTERM it has no transaction to commit, so it stops at once. It waited out the 20 s
    commit timeout, then said it abandoned uncommitted transactions it never had."""
    app = copy_wordcount(tmp_path / "wordcount", standbys=1)
    members = {}
    try:
        async with AppView(app, broker_proc.address) as view:
            await view.state()  # opens (creates) the KeySpace
            await deploy(view.config, view.client, view.keyspace)
            members["good"] = serve_app(app, broker_proc.address, "mem-good",
                                        tmp_path / "serve-good.log")
            await view.wait_serving(timeout=60)
            members["lost"] = serve_app(app, f"127.0.0.1:{free_port()}", "mem-lost",
                                        tmp_path / "serve-lost.log")

            async def assigned() -> bool:
                state = await view.state()
                return any(a.suffix == "mem-lost" for a in state.assignments)

            await eventually(assigned, 60, "the lost member to be given replicas")
            await asyncio.sleep(1.0)  # its replicas try to recover
            stopping = time.monotonic()
            code = await asyncio.to_thread(members["lost"].signal, signal.SIGTERM, LIVENESS)
            took = time.monotonic() - stopping
            print(f"stopped in {took:.2f}s")
            assert code == 0, members["lost"].log()
            assert took < 10, members["lost"].log()
            assert "abandoning its uncommitted" not in members["lost"].text()
    finally:
        for proc in members.values():
            proc.stop()


async def test_interrupt_commits_and_run_resumes(broker_proc: BrokerProcess,
                                                 tmp_path: Path) -> None:
    """Ctrl-C (SIGINT) with a backlog of input: `streamkit run` ends its transactions, commits
    what it consumed and exits 0 without consuming the backlog first, leaving no transaction
    open in the output; run again, it resumes where it stopped."""
    app = copy_wordcount(tmp_path / "wordcount")
    _app_variant(app, "Slow", SLOW)  # a backlog builds up quickly
    address = broker_proc.address
    run = run_app(app, address, tmp_path / "run-1.log")
    try:
        async with AppView(app, address) as view:
            await view.wait_serving(timeout=60)
            ids = Feeder(app, address, tmp_path / "feed-1.log", count=400,
                         interval=0).start().finish()
            await _check_exact(view, ids)
            more = Feeder(app, address, tmp_path / "feed-2.log", start=400, count=3000,
                          batch=500, interval=0).start().finish()
            stopping = time.monotonic()
            # LIVENESS only bounds "it stops by itself"; that it stopped before consuming the
            # backlog is checked below by what it committed, not by a clock.
            code = await asyncio.to_thread(run.signal, signal.SIGINT, LIVENESS)
            stopped = time.monotonic() - stopping
            print(f"stopped in {stopped:.2f}s")
            assert code == 0, run.log()
            assert "committing the shards' last transactions" in run.text()
            committed = await view.output_updates()
            published = [m for m in await view.output_messages_uncommitted() if "word" in m]
            assert len(published) == len(committed), "a transaction was left unacknowledged"
            assert totals_of_updates(committed) != expected_counts(range(more.stop)), \
                "the stop should have come before the shards consumed the backlog"

            run = run_app(app, address, tmp_path / "run-2.log")
            await _check_exact(view, range(more.stop))
            # Updates after the restart continue from the committed counts (no update is
            # repeated: _check_exact asserts each (shard, word)'s counts strictly increase).
            assert len(await view.output_updates()) > len(committed)
    finally:
        run.stop()


async def test_a_second_interrupt_exits_while_a_commit_waits(broker_proc: BrokerProcess,
                                                            tmp_path: Path) -> None:
    """Ctrl-C while the shards' commits wait on something that isn't a hook (a broker
    stopped, a store's database holding a lock): the stop waits its ~40 s; a second Ctrl-C
    exits within a second or so (it was ignored, the docs saying it exits at once)."""
    app = copy_wordcount(tmp_path / "wordcount")
    _app_variant(app, "Slow", SLOW)
    address = broker_proc.address
    run = run_app(app, address, tmp_path / "run.log")
    try:
        async with AppView(app, address) as view:
            await view.wait_serving(timeout=60)
            Feeder(app, address, tmp_path / "feed.log", count=3000, batch=500,
                   interval=0).start().finish()
            assert broker_proc.proc is not None
            os.kill(broker_proc.proc.pid, signal.SIGSTOP)  # commits now wait
            try:
                assert run.proc is not None
                run.proc.send_signal(signal.SIGINT)
                await asyncio.sleep(2.0)  # not a synchronisation: the stop under way
                assert run.alive, run.log()
                second = time.monotonic()
                code = await asyncio.to_thread(run.signal, signal.SIGINT, LIVENESS)
                print(f"exited {time.monotonic() - second:.2f}s after the second signal")
                assert code == 1, run.log()
                assert "exiting now, without the shards' last commits" in run.text(), run.log()
            finally:
                os.kill(broker_proc.proc.pid, signal.SIGCONT)
    finally:
        run.stop()


async def test_an_interrupt_exits_though_a_store_stays_blocked(
        broker_proc: BrokerProcess, tmp_path: Path, postgres_url: str) -> None:
    """Ctrl-C while the shards' commits are blocked in their database (another session
    holds a lock): once the stop gave up on them, the command exits. It then waited for
    the stores' threads at the interpreter's exit, for ever."""
    import sqlalchemy as sa

    from streamkit.app.replica import STOP_TIMEOUT
    from tests.test_wordcount import with_sql_url

    app = copy_wordcount(tmp_path / "wordcount")
    with_sql_url(app, postgres_url)
    address = broker_proc.address
    run = run_app(app, address, tmp_path / "run.log")
    admin = sa.create_engine(postgres_url)
    try:
        async with AppView(app, address) as view:
            await view.wait_serving(timeout=60)
        with admin.connect() as locker:
            locker.execute(sa.text("LOCK TABLE streamkit_checkpoints IN ACCESS EXCLUSIVE MODE"))
            Feeder(app, address, tmp_path / "feed.log", count=400, batch=100,
                   interval=0).start().finish()
            await asyncio.sleep(2.0)  # not a synchronisation: the commits under way
            assert run.alive, run.log()
            code = await asyncio.to_thread(run.signal, signal.SIGINT, 2 * STOP_TIMEOUT + 30)
            assert code == 0, run.log()
            assert "exiting without waiting for what is left behind: shard shard-0" in run.text(), \
                run.log()
            locker.rollback()
    finally:
        run.stop()
        admin.dispose()


SLOW = """
class Slow(WordCount):
    async def consume_message(self, shard, store, envelope, publisher) -> None:
        await asyncio.sleep(0.005)
        super().consume_message(shard, store, envelope, publisher)
"""



def _app_variant(app: Path, name: str, source: str) -> None:
    """Make the app folder run class `name` (defined by `source`, a WordCount subclass)."""
    (app / "app.py").write_text((app / "app.py").read_text() + "\nimport asyncio\n\n" + source)
    config = app / "streamkit.yaml"
    config.write_text(config.read_text().replace("app:WordCount", f"app:{name}"))


async def test_bad_input_fails_only_its_shard(broker_proc: BrokerProcess,
                                              tmp_path: Path) -> None:
    """A source message that doesn't decode, and one the application raises on: each fails
    its own shard with an error naming what went wrong, and the other shards keep counting."""
    app = copy_wordcount(tmp_path / "wordcount")
    _app_variant(app, "Poisoned", POISONED)
    address = broker_proc.address
    config = load_config(app)
    garbage_journal = config.source_journals(3)[0]  # shard-003's
    run = run_app(app, address, tmp_path / "run.log")
    try:
        async with AppView(app, address) as view:
            await view.wait_serving(timeout=60)
            # Some good lines first, then garbage in shard-003's journal and a poisoned
            # line in shard-005's, then more good lines.
            Feeder(app, address, tmp_path / "feed-1.log", count=400, interval=0).start().finish()
            garbage_at = (await view.heads())[garbage_journal]
            done = cli("journals", "append", garbage_journal, "--broker", address,
                       input_text="not json\n")
            assert done.returncode == 0, done.stderr
            poison = next(i for i in range(10_000, 20_000)
                          if view.shard_of_id(i) == "shard-005")
            await view.publish_line(poison, "a poison pill")
            Feeder(app, address, tmp_path / "feed-2.log", start=400, count=400,
                   interval=0).start().finish()

            failed = await eventually(lambda: _failed(view), 30, "two FAILED shards")
            assert set(failed) == {"shard-003", "shard-005"}, failed
            assert garbage_journal in failed["shard-003"], failed
            assert f"offset {garbage_at}" in failed["shard-003"], failed
            assert f"cannot count line {poison}" in failed["shard-005"], failed

            listed = cli("shards", "list", "--app", str(app))
            assert listed.returncode == 0, listed.stderr
            rows = {line.split()[0]: line.split()[1] for line in listed.stdout.splitlines()[1:]}
            assert rows["shard-003"] == rows["shard-005"] == "FAILED", listed.stdout
            assert all(rows[s] == "PRIMARY" for s in rows if s not in failed), listed.stdout
            warnings = listed.stderr.splitlines()
            assert any("shard-003" in w and "FAILED" in w and garbage_journal in w
                       and f"offset {garbage_at}" in w for w in warnings), listed.stderr
            assert any("shard-005" in w and "FAILED" in w and f"cannot count line {poison}" in w
                       for w in warnings), listed.stderr

            # Unassigning a FAILED shard restarts it: it recovers, reads the same message
            # again, and fails again the same way.
            restarts = run.text().count("shard-005: primary, reading")
            done = cli("shards", "unassign", "shard-005", "--app", str(app))
            assert done.returncode == 0 and done.stdout.split() == ["shard-005"], done
            await eventually(lambda: run.text().count("shard-005: primary, reading") > restarts,
                             30, "shard-005 to be restarted")
            again = await eventually(lambda: _failed(view), 30, "shard-005 to fail again")
            assert f"cannot count line {poison}" in again["shard-005"], again

            # The healthy shards counted every line routed to them, exactly.
            healthy = [s for s in config.shard_ids() if s not in failed]
            state = await view.state()
            serving = {s: view.endpoint_of(state, state.primary_of(s).member) for s in healthy}
            heads = await view.heads()
            for shard, endpoint in serving.items():
                await view.stat(endpoint, shard, {j: heads[j] for j in view.sources_of(shard)})
            ids = [i for i in range(800) if view.shard_of_id(i) in healthy]
            assert await view.query_counts(serving) == expected_counts(ids)

            # Asking every shard: the healthy ones' answers are combined, and the command
            # names the two that did not answer and exits 1.
            asked = cli("query", str(app), '{"word": "w0"}')
            assert asked.returncode == 1, asked
            assert int(asked.stdout) == expected_counts(ids)["w0"]
            for shard in failed:
                assert f"shard {shard} did not answer: " in asked.stderr, asked.stderr
            assert asked.stderr.strip().splitlines()[-1] == (
                "streamkit: error: the answer combines 6 of 8 shards: shard-003, shard-005 "
                "did not answer"), asked.stderr
    finally:
        run.stop()


async def _failed(view: AppView) -> dict[str, str] | None:
    """Shard -> its primary's error, once there are FAILED shards."""
    state = await view.state()
    failed = {}
    for shard in view.config.shard_ids():
        primary = state.primary_of(shard)
        if primary is not None and primary.code == Code.FAILED:
            failed[shard] = " ".join(primary.status.errors)
    return failed if len(failed) >= 2 else None


def test_unknown_store_kind_is_a_one_line_error(tmp_path: Path) -> None:
    app = copy_wordcount(tmp_path / "wordcount", store={"kind": "mongo"})
    done = cli("run", str(app), "--broker", "127.0.0.1:1", "--no-status", timeout=30)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "store.kind" in lines[0] and "mongo" in lines[0], lines[0]


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    app = copy_wordcount(tmp_path / "wordcount")
    config = app / "streamkit.yaml"
    config.write_text(config.read_text().replace("shards: 8", "shards: [8"))
    line = next(n for n, text in enumerate(config.read_text().splitlines(), 1)
                if text.startswith("shards"))
    done = cli("run", str(app), "--broker", "127.0.0.1:1", "--no-status", timeout=30)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert str(config) in lines[0], lines[0]
    reported = re.search(r"line (\d+)", lines[0])
    assert reported and int(reported.group(1)) in (line, line + 1), lines[0]


def test_member_names_follow_gazettes_rules(tmp_path: Path) -> None:
    """A member's zone and suffix name it in every route and header: Gazette's clients
    refuse a suffix under 4 characters, so `serve` refuses it first, in one line."""
    app = copy_wordcount(tmp_path / "wordcount")
    for option, value, reason in (("--suffix", "ab", "suffix: must be 4 to 128 characters"),
                                  ("--zone", "a b", "zone: may hold only letters")):
        done = cli("serve", str(app), "--broker", "127.0.0.1:1", option, value, timeout=30)
        assert done.returncode == 2, done
        assert done.stderr.count("\n") == 1 and reason in done.stderr, done.stderr


def test_a_member_of_an_app_not_deployed_in_its_keyspace_says_so(tmp_path: Path) -> None:
    """A wrong --keyspace prefix (or no deploy) left `serve` serving nothing without a word."""
    app = copy_wordcount(tmp_path / "wordcount")
    empty = tmp_path / "elsewhere.db"
    member = Proc.streamkit(["serve", str(app), "--broker", "127.0.0.1:1", "--keyspace",
                             str(empty), "--suffix", "lost-member"], tmp_path / "serve.log")
    member.start()
    try:
        deadline = time.monotonic() + LIVENESS
        while "no shards deployed" not in member.text():
            assert member.alive and time.monotonic() < deadline, member.log()
            time.sleep(0.05)
        assert (f"app wordcount has no shards deployed in KeySpace {empty}" in member.text()
                and f"streamkit deploy {app}" in member.text()), member.log()
    finally:
        member.stop()


async def test_restart_after_sigkill_does_not_wait_out_the_old_lease(
        broker_proc: BrokerProcess, tmp_path: Path) -> None:
    """A member with a long lease (`serve --lease-ttl 60`) SIGKILLed and started again under
    its name: it finds its previous incarnation's port refusing connections and revokes that
    lease rather than waiting a minute for it to lapse; the app serves with exact counts."""
    app = copy_wordcount(tmp_path / "wordcount")
    address = broker_proc.address
    long_lease = ("--lease-ttl", "60")
    async with AppView(app, address) as view:
        await view.state()  # opens (creates) the KeySpace
        await deploy(view.config, view.client, view.keyspace)
        member = serve_app(app, address, "mem-a", tmp_path / "serve-1.log", *long_lease)
        try:
            await view.wait_serving(timeout=60)
            ids = Feeder(app, address, tmp_path / "feed.log", count=200, interval=0).start() \
                .finish()
            await view.wait_caught_up(timeout=60)
            member.kill()
            member = serve_app(app, address, "mem-a", tmp_path / "serve-2.log", *long_lease)
            await _check_exact(view, ids)  # well within the old lease's minute
            assert "previous incarnation" in member.text(), member.log()
        finally:
            member.stop()


async def test_a_member_lists_its_shard_metrics_before_any_transaction(
        broker_proc: BrokerProcess, tmp_path: Path) -> None:
    """Shard metrics are made on first use (streamkit/app/metrics.py); a scrape makes them
    first, so Prometheus finds every family on a member that has committed nothing yet."""
    app = copy_wordcount(tmp_path / "wordcount")
    run = run_app(app, broker_proc.address, tmp_path / "run.log")
    try:
        async with AppView(app, broker_proc.address) as view:
            endpoint = next(iter((await view.wait_serving(timeout=60)).values()))
        url = f"{http_url(endpoint)}/metrics"
        with await asyncio.to_thread(urllib.request.urlopen, url, timeout=10) as answer:
            text = answer.read().decode()
    finally:
        run.stop()
    for family in ("streamkit_shard_messages_total", "streamkit_shard_transactions_total",
                   "streamkit_shard_txn_phase_seconds", "streamkit_shard_lag_bytes",
                   "streamkit_shard_skipped_messages_total"):
        assert f"# TYPE {family} " in text, text[:2000]
    assert "streamkit_shard_transactions_total{" not in text  # no transaction yet


async def test_a_killed_members_shard_files_are_removed_by_the_next(
        broker_proc: BrokerProcess, tmp_path: Path) -> None:
    """`serve` names its member (and its folder of shard files) `<host>-<pid>`, never used
    again: a SIGKILLed one's folder would stay for good. The next member to start removes
    this host's folders whose process is gone, and keeps those of live processes and of
    members named otherwise; counts stay exact."""
    app = copy_wordcount(tmp_path / "wordcount")
    address = broker_proc.address
    shards = app / ".streamkit" / "shards"
    host = os.uname().nodename
    kept = [shards / f"{host}-{os.getpid()}", shards / "worker-1", shards / "other-12"]
    for folder in kept:
        (folder / "shard-000").mkdir(parents=True)
    async with AppView(app, address) as view:
        await view.state()  # opens (creates) the KeySpace
        await deploy(view.config, view.client, view.keyspace)
        first = Proc.streamkit(["serve", str(app), "--broker", address],
                               tmp_path / "serve-1.log").start()
        member = Proc.streamkit(["serve", str(app), "--broker", address],
                                tmp_path / "serve-2.log")
        try:
            await view.wait_serving(timeout=60)
            ids = Feeder(app, address, tmp_path / "feed.log", count=200, interval=0).start() \
                .finish()
            await view.wait_caught_up(timeout=60)
            assert first.proc is not None
            left = shards / f"{host}-{first.proc.pid}"
            assert any(left.rglob("*")), sorted(shards.rglob("*"))
            first.kill()
            member.start()
            await _check_exact(view, ids)
            await eventually(lambda: not left.exists(), what=f"{left} removed")
            assert all(folder.is_dir() for folder in kept), sorted(shards.iterdir())
            assert f"removed {left}" in member.text(), member.log()
        finally:
            first.stop()
            member.stop()
