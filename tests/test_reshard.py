"""Resharding with `streamkit backfill --spark --shards N`, against a real broker and Spark.

An app runs live on one shard count, is stopped, resharded by the CLI, and
runs live again on the new count while more input arrives. Its state must
be exactly what processing everything live on the final count gives: every
key's total right, and held by exactly the one shard its partition maps to.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from streamkit.app.config import load_config
from streamkit.app.layout import LayoutError, read_layout
from streamkit.app.member import Member, MemberOptions
from streamkit.backfill.errors import BackfillError
from streamkit.backfill.reshard import RETIRED_LABEL
from streamkit.client import append_bytes, get_journal, write_head
from streamkit.client.errors import BrokerError
from streamkit.client.reader import read_write_head
from streamkit.errors import StreamkitError
from streamkit.protocol import pb
from tests.brokerproc import BrokerProcess
from tests.conftest import unavailable
from tests.test_backfill import Setup, process_live, publish, rocksdb_state
from tests.test_wordcount import generate_lines

try:
    import pyspark  # noqa: F401
except ImportError:
    unavailable("pyspark is not installed")

ROOT = Path(__file__).resolve().parent.parent
WORDCOUNT = ROOT / "examples" / "wordcount"

TALLY_YAML = """\
name: tally
application: app:Tally
shards: {shards}
sources:
  - topic: events
    key: key
outputs:
  - topic: totals
    key: key
store: rocksdb
transactions:
  max_duration: 200ms
"""

TALLY_APP = '''\
"""Sums `amount` per key; a key's state is its running total and its last sequence number."""

import streamkit


class Tally(streamkit.Application):
    def consume_message(self, shard, store, envelope, publisher):
        event = envelope.message
        total, last = store.get(event["key"], [0, -1])
        assert event["seq"] > last, f"{event['key']}: seq {event['seq']} after {last}"
        store.put(event["key"], [total + event["amount"], event["seq"]])

    def finalize_txn(self, shard, store, publisher):
        pass
'''


def write_tally(folder: Path, shards: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "streamkit.yaml").write_text(TALLY_YAML.format(shards=shards))
    (folder / "app.py").write_text(TALLY_APP)
    return folder


def set_shards(folder: Path, shards: int) -> None:
    path = folder / "streamkit.yaml"
    document = yaml.safe_load(path.read_text())
    document["shards"] = shards
    path.write_text(yaml.safe_dump(document, sort_keys=False))


def reshard(app: Path, broker: BrokerProcess,
            shards: int | None) -> subprocess.CompletedProcess[str]:
    count = ["--shards", str(shards)] if shards is not None else []
    return subprocess.run(
        [sys.executable, "-m", "streamkit.cli.main", "backfill", str(app), "--spark",
         "--master", "local[2]", *count, "--broker", broker.address,
         "--keyspace", str(app / "keyspace.db"),
         "--fragment-root", str(broker.data_dir / "fragments")],
        capture_output=True, text=True, env=dict(os.environ), timeout=300)


def events(start: int, count: int) -> list[dict[str, Any]]:
    """Events over 50 keys; `seq` increases, so each key's order can be checked."""
    return [{"key": f"k{i * 7 % 50}", "amount": i % 13 - 3, "seq": i}
            for i in range(start, start + count)]


async def run_live(app: Path, broker: BrokerProcess, work: str) -> dict[str, dict[bytes, Any]]:
    setup = await Setup.start(app, broker)
    try:
        state, _ = await process_live(setup, rocksdb_state, work)
        return state
    finally:
        await setup.close()


async def publish_to(app: Path, broker: BrokerProcess, topic: str,
                     messages: list[dict[str, Any]]) -> None:
    setup = await Setup.start(app, broker)
    try:
        await publish(setup, topic, messages)
    finally:
        await setup.close()


def check_tally(app: Path, state: dict[str, dict[bytes, Any]], sent: list[dict[str, Any]]
                ) -> None:
    config = load_config(app)
    mapping = config.mapping_for("events")
    expected = Counter[str]()
    for event in sent:
        expected[event["key"]] += event["amount"]
    holders: dict[str, list[str]] = {}
    for shard, items in state.items():
        for key, (total, _) in items.items():
            holders.setdefault(key.decode(), []).append(shard)
            assert total == expected[key.decode()], key
    assert set(holders) == set(expected)
    for key, shards in holders.items():
        journal, _ = mapping({"key": key})
        assert shards == [f"shard-{int(journal.rsplit('-', 1)[1]):03d}"], key
    assert sorted(state) == config.shard_ids()


async def test_tally_resharded_2_to_8_to_3_keeps_every_key_exact_in_one_shard(
        broker_proc: BrokerProcess, tmp_path: Path) -> None:
    app = write_tally(tmp_path / "tally", shards=2)
    sent = events(0, 1200)
    await publish_to(app, broker_proc, "events", sent)
    check_tally(app, await run_live(app, broker_proc, "live-2"), sent)

    done = await asyncio.to_thread(reshard, app, broker_proc, 8)
    assert done.returncode == 0, done.stderr
    assert "resharded app tally from 2 to 8 shards" in done.stderr
    assert "set `shards: 8` in streamkit.yaml" in done.stderr

    # The file still says 2: running on it is refused, naming both counts and the fix.
    setup_error = None
    try:
        await Setup.start(app, broker_proc)
    except LayoutError as error:
        setup_error = str(error)
    assert setup_error is not None and "deployed with 8 shards, not 2" in setup_error

    set_shards(app, 8)
    more = events(1200, 800)
    await publish_to(app, broker_proc, "events", more)  # routed over 8 partitions now
    sent += more
    check_tally(app, await run_live(app, broker_proc, "live-8"), sent)

    done = await asyncio.to_thread(reshard, app, broker_proc, 3)
    assert done.returncode == 0, done.stderr
    assert "retired (read-only) partitions: events/part-003" in done.stderr
    assert ("kept: the recovery logs of the removed shards (recovery/tally/shard-003, "
            "recovery/tally/shard-004") in done.stderr
    set_shards(app, 3)
    more = events(2000, 600)
    await publish_to(app, broker_proc, "events", more)
    sent += more
    check_tally(app, await run_live(app, broker_proc, "live-3"), sent)

    setup = await Setup.start(app, broker_proc)
    try:
        layout = await read_layout(setup.keyspace, setup.config.keyspace_root)
        assert layout is not None and not layout.resharding
        assert (layout.shards, [e.shards for e in layout.history]) == (3, [2, 8])
        retired = await get_journal(setup.client, "events/part-005")
        assert retired.flags == pb.JournalSpec.O_RDONLY
        assert {(lbl.name, lbl.value) for lbl in retired.labels.labels} >= {
            (RETIRED_LABEL, "events")}
        with pytest.raises(BrokerError):  # a publisher still routing there fails loudly
            await append_bytes(setup.client, "events/part-005", b'{"key": "x"}\n')
        # Its write head is still known (a plan reads it: a zero-byte append is refused).
        head = await write_head(setup.client, "events/part-005")
        assert head > 0 and head == await read_write_head(setup.client, "events/part-005")
    finally:
        await setup.close()


async def test_wordcount_resharded_mid_stream_counts_exactly(
        broker_proc: BrokerProcess, tmp_path: Path) -> None:
    app = tmp_path / "wordcount"
    shutil.copytree(WORDCOUNT, app, ignore=shutil.ignore_patterns(".streamkit", "__pycache__"))
    set_shards(app, 2)
    lines = [{"id": i, "line": line} for i, line in enumerate(generate_lines(2000, seed=5))]
    await publish_to(app, broker_proc, "wordcount/lines", lines[:1200])
    await run_live(app, broker_proc, "live-2")
    done = await asyncio.to_thread(reshard, app, broker_proc, 8)
    assert done.returncode == 0, done.stderr
    set_shards(app, 8)
    await publish_to(app, broker_proc, "wordcount/lines", lines[1200:])
    state = await run_live(app, broker_proc, "live-8")
    assert len(state) == 8
    counted = sum((Counter({k.decode(): v for k, v in shard.items()})
                   for shard in state.values()), Counter())
    assert counted == Counter(w for line in lines for w in line["line"].split())


async def test_resharding_refuses_what_it_cannot_do(broker_proc: BrokerProcess,
                                                    tmp_path: Path) -> None:
    app = write_tally(tmp_path / "tally", shards=2)
    await publish_to(app, broker_proc, "events", events(0, 10))
    # A running member: resharding under it would split its keys' state.
    setup = await Setup.start(app, broker_proc)
    try:
        member = Member(setup.config, setup.config.load_application(), setup.client,
                        setup.keyspace, MemberOptions(work_dir=app / "live"))
        await member.start()
        try:
            running = await asyncio.to_thread(reshard, app, broker_proc, 4)
        finally:
            await member.stop()
    finally:
        await setup.close()
    assert running.returncode == 1
    assert "app tally is running (1 member(s) joined): stop it" in running.stderr
    assert "Traceback" not in running.stderr

    text = (app / "streamkit.yaml").read_text()
    (app / "streamkit.yaml").write_text(text.replace("    key: key\noutputs", "outputs"))
    keyless = await asyncio.to_thread(reshard, app, broker_proc, 4)
    assert keyless.returncode == 1
    assert "source topic 'events' has no key" in keyless.stderr


async def test_a_failed_reshard_can_be_taken_back(broker_proc: BrokerProcess,
                                                  tmp_path: Path) -> None:
    """A reshard whose backfill failed (the app raised on an event) leaves the app
    resharding, with the partitions beyond the new count retired (read-only). A backfill
    back to the count it had finishes the reshard there: the plan reads the retired
    partitions' heads without appending (it failed with NOT_ALLOWED), they serve again,
    and the tally is exact."""
    app = write_tally(tmp_path / "tally", 4)
    sent = events(0, 400)
    await publish_to(app, broker_proc, "events", sent)
    check_tally(app, await run_live(app, broker_proc, "live-4"), sent)

    (app / "app.py").write_text(TALLY_APP.replace(
        "        event = envelope.message\n",
        "        event = envelope.message\n"
        "        if event['seq'] == 123:\n"
        "            raise ValueError('seq 123 is poison')\n"))
    set_shards(app, 2)
    failed = await asyncio.to_thread(reshard, app, broker_proc, 2)
    assert failed.returncode == 1 and "seq 123 is poison" in failed.stderr, failed.stderr

    (app / "app.py").write_text(TALLY_APP)
    set_shards(app, 4)
    # Without --shards, streamkit.yaml's 4 is not the count the reshard was going to: it
    # was taken as the new target without a word (a reshard "to 2" finishing at 4).
    unsaid = await asyncio.to_thread(reshard, app, broker_proc, None)
    assert unsaid.returncode == 2, unsaid.stderr
    assert "to 2 shards did not finish: pass --shards 2" in unsaid.stderr, unsaid.stderr
    back = await asyncio.to_thread(reshard, app, broker_proc, 4)
    assert back.returncode == 0, back.stderr
    more = events(400, 200)
    await publish_to(app, broker_proc, "events", more)  # to all 4 partitions again
    sent += more
    check_tally(app, await run_live(app, broker_proc, "live-4-again"), sent)


async def test_a_backfill_to_another_store_kind_than_the_apps_says_so(
        broker_proc: BrokerProcess, tmp_path: Path) -> None:
    """`--store` other than the app's: the shards run with the app's kind would find none of
    the handed-over state and read their sources afresh (wrong counts, said nowhere)."""
    app = write_tally(tmp_path / "tally", shards=2)
    await publish_to(app, broker_proc, "events", events(0, 10))
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "streamkit.cli.main", "backfill", str(app), "--processes", "1",
         "--store", "json", "--broker", broker_proc.address, "--keyspace",
         str(app / "keyspace.db"), "--fragment-root", str(broker_proc.data_dir / "fragments")],
        capture_output=True, text=True, env=dict(os.environ), timeout=300)
    assert "--store json: the app's store is rocksdb" in done.stderr, done.stderr
    assert "run it with --store json too" in done.stderr, done.stderr


@pytest.mark.parametrize(("end", "said"), [("events/part-000=abc", "'abc' is not an offset"),
                                           ("events/part-000=-5", "offsets are not negative"),
                                           ("nothing", "expected JOURNAL=OFFSET")])
def test_a_malformed_end_is_bad_input(tmp_path: Path, end: str, said: str) -> None:
    app = write_tally(tmp_path / "tally", shards=2)
    done = subprocess.run([sys.executable, "-m", "streamkit.cli.main", "backfill", str(app),
                           "--processes", "1", "--end", end], capture_output=True, text=True,
                          env=dict(os.environ), timeout=60)
    assert done.returncode == 2 and said in done.stderr, done.stderr  # it exited 1


@pytest.mark.parametrize("error", [ValueError("the app's own bug"),
                                   StreamkitError("broker call failed: disk full")],
                         ids=["app-error", "streamkit-error"])
def test_a_failed_task_logs_a_traceback_only_for_the_apps_own_errors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        error: Exception) -> None:
    """streamkit's errors say what and where (a full disk, a fence): a traceback before the
    one-line error was noise; the app's own exceptions keep theirs, to find the line."""
    from streamkit.backfill import task

    async def failing(*args: Any, **kwargs: Any) -> Any:
        raise error

    monkeypatch.setattr(task, "run_shard", failing)
    plan = SimpleNamespace(shards=[SimpleNamespace(shard_id="shard-000")], app_dir=str(tmp_path))
    with pytest.raises(BackfillError, match=f"shard shard-000: {type(error).__name__}"):
        task.run_shard_task(plan, 0)  # type: ignore[arg-type]
    traced = [r for r in caplog.records if r.exc_info]
    assert bool(traced) == isinstance(error, ValueError), caplog.text
