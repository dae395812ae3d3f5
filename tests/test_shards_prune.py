"""Pruning recovery logs: fragments no hints need are deleted, and playback from the hints
still rebuilds the store exactly (through the gaps the deletion left)."""

from __future__ import annotations

import signal
from pathlib import Path

from streamkit.broker.stores import open_store
from streamkit.client import BrokerClient, list_fragments
from streamkit.protocol import pb
from streamkit.recoverylog import CONTENT_TYPE
from streamkit.recoverylog.fsm import live_log_segments
from streamkit.recoverylog.prune import prunable_fragments
from streamkit.recoverylog.recovery import recover
from tests import wire
from tests.brokerproc import BrokerProcess
from tests.e2e import AppView, Feeder, cli, copy_wordcount, run_app
from tests.helpers_client import create_journal, unique_name
from tests.test_run_e2e import _check_exact
from tests.waiting import eventually

KIB = 1024


async def _persisted(client: BrokerClient, log: str) -> list[pb.Fragment]:
    return [f.spec for f in (await list_fragments(client, log)).fragments if f.spec.backing_store]


async def test_pruned_log_still_plays_back(shared_broker: BrokerProcess, tmp_path: Path) -> None:
    async with BrokerClient(shared_broker.address) as client:
        log = unique_name("prune")
        # Fragments of 1 KiB: every few writes roll (and persist) one.
        await create_journal(client, log, length=KIB, labels={"content-type": CONTENT_TYPE})
        fs = await recover(client, log, tmp_path / "primary")
        for i in range(8):  # churn: files written then deleted (a compaction's inputs)
            with fs.open(f"old-{i}.sst", "wb") as f:
                f.write(bytes([i]) * (3 * KIB))
            await fs.fsync()
        with fs.open("live.sst", "wb") as f:
            f.write(b"L" * (2 * KIB))
        await fs.fsync()
        early = await fs.recorder.build_hints()  # a backup: the churned files still live
        for i in range(8):
            fs.remove(f"old-{i}.sst")
        with fs.open("CURRENT", "wb") as f:
            f.write(b"live.sst\n")
        await fs.fsync()
        hints = await fs.recorder.build_hints()
        with fs.open("after-hints", "wb") as f:  # recorded after the hints: must be kept
            f.write(b"A" * (2 * KIB))
        await fs.fsync()
        await fs.recorder.close()
        head = (await client.stub.Read(pb.ReadRequest(journal=log, offset=-1,
                                                      metadata_only=True, block=False)).read())
        write_head = head.write_head

        async def all_persisted() -> bool:
            persisted = await _persisted(client, log)
            return sum(f.end - f.begin for f in persisted) >= write_head - 4 * KIB

        await eventually(all_persisted, what="the log's fragments to be persisted")
        fragments = await _persisted(client, log)
        doomed = prunable_fragments(log, fragments, [hints])
        assert doomed, "the deleted files' fragments should be prunable"
        assert len(doomed) < len(fragments)
        # A recorder's segments are open-ended (last_offset 0: where its ops end is not
        # known), so what goes is what lies wholly before the first live file's ops.
        _, live = live_log_segments(hints)
        for fragment in doomed:
            assert not live.intersect(log, fragment.begin, fragment.end), fragment
            assert fragment.end <= min(s.first_offset for s in live), fragment

        # Were the older hints still a backup, the churned files' fragments must stay.
        kept_for_backup = prunable_fragments(log, fragments, [hints, early])
        assert len(kept_for_backup) < len(doomed)
        assert {f.begin for f in kept_for_backup} <= {f.begin for f in doomed}

        root = shared_broker.data_dir / "fragments"
        for fragment in doomed:
            await open_store(fragment.backing_store, root).remove(fragment)

        rebuilt = await recover(client, log, tmp_path / "rebuilt", hints)
        assert (tmp_path / "rebuilt" / "live.sst").read_bytes() == b"L" * (2 * KIB)
        assert (tmp_path / "rebuilt" / "CURRENT").read_bytes() == b"live.sst\n"
        assert (tmp_path / "rebuilt" / "after-hints").read_bytes() == b"A" * (2 * KIB)
        assert not list((tmp_path / "rebuilt").glob("old-*"))
        await rebuilt.recorder.close()


async def test_shards_prune_cli_then_the_app_recovers_exactly(
        broker_proc: BrokerProcess, tmp_path: Path) -> None:
    """wordcount on the JSON store (which rewrites its state file at every commit, so its
    log's early fragments soon hold nothing live), its recovery log's fragments shrunk to
    1 KiB: `streamkit shards prune` deletes fragments, and the restarted app recovers from
    the pruned log with every count exact."""
    app = copy_wordcount(tmp_path / "wordcount", shards=1, store="json")
    address = broker_proc.address
    run = run_app(app, address, tmp_path / "run-1.log")
    try:
        async with AppView(app, address) as view:
            log = view.config.recovery_log("shard-000")
            # Three runs: each recovery moves the primary's hints to the backups, and the
            # first backups (an empty store's) would keep the whole log.
            ids = range(0)
            for n in range(1, 4):
                if n > 1:
                    run = run_app(app, address, tmp_path / f"run-{n}.log")
                await view.wait_serving(timeout=60)
                _shrink_fragments(address, log)  # (each run deploys the app's own spec)
                # Batches apart in time make transactions apart: every commit rewrites the
                # state file, and it takes several to leave early fragments nothing live
                # (fed at once, a fast consumer may take a run's lines in one commit).
                more = Feeder(app, address, tmp_path / f"feed-{n}.log", start=ids.stop,
                              count=200, batch=20, interval=0.05).start().finish()
                ids = range(0, more.stop)
                await _check_exact(view, ids)
                assert run.signal(signal.SIGINT, timeout=60) == 0, run.log()  # hints written

            async with BrokerClient(address) as client:
                await eventually(lambda: _persisted_some(client, log), what="persisted fragments")
            args = ["shards", "prune", "--app", str(app), "--broker", address,
                    "--file-root", str(broker_proc.data_dir / "fragments")]
            wrong = cli(*args[:-1], str(tmp_path / "not-the-root"))
            assert wrong.returncode == 1 and "is --file-root" in wrong.stderr, wrong.stderr
            # Without it: the app's bundled broker's (not one under the current folder).
            bundled = cli(*args[:-2])
            assert bundled.returncode == 1, bundled.stderr
            assert f"is --file-root {app / '.streamkit/broker/fragments'} " in bundled.stderr
            dry = cli(*args, "--dry-run")
            assert dry.returncode == 0, dry.stderr
            done = cli(*args)
            assert done.returncode == 0, done.stderr
            summary = done.stdout.strip().splitlines()[-1]
            assert summary.startswith("deleted ") and not summary.startswith("deleted 0 "), \
                done.stdout
            assert dry.stdout.replace("would delete", "deleted") == done.stdout

            run = run_app(app, address, tmp_path / "run-4.log")
            more = Feeder(app, address, tmp_path / "feed-4.log", start=ids.stop, count=100,
                          interval=0).start().finish()
            await _check_exact(view, range(ids.start, more.stop))
    finally:
        run.stop()


async def _persisted_some(client: BrokerClient, log: str) -> bool:
    return len(await _persisted(client, log)) > 3


def _shrink_fragments(address: str, log: str) -> None:
    journals = wire.stub(address)
    listed = next(iter(journals.List(pb.ListRequest()))).journals
    (spec,) = [j.spec for j in listed if j.spec.name == log]
    spec.fragment.length = KIB
    wire.update(journals, spec)
