"""The headline flow: `streamkit new myapp`, then `streamkit run myapp --shards 8`.

Run as a newcomer would (real processes, the template app as generated):
eight shards over eight partitions, every event counted once by the one
shard its key routes to, and the shard count guarded once the app has state.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pytest

from streamkit.app.config import load_config
from streamkit.client import BrokerClient, list_journals
from streamkit.testing import read_journals
from tests.brokerproc import BrokerProcess
from tests.e2e import AppView, cli, eventually, run_app

TOPIC_LABEL = "app.streamkit.dev/topic"


def publish(broker: str, keys: list[str]) -> None:
    lines = "".join(json.dumps({"key": k}) + "\n" for k in keys)
    done = cli("publish", "-l", f"{TOPIC_LABEL}=events", "--key", "key", "--broker", broker,
               input_text=lines)
    assert done.returncode == 0, done.stderr


def query(app: Path, key: str, *extra: str) -> object:
    done = cli("query", str(app), json.dumps({"key": key}), *extra)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


async def test_run_with_8_shards_counts_each_event_once(broker_proc: BrokerProcess,
                                                       tmp_path: Path) -> None:
    app = tmp_path / "myapp"
    made = cli("new", "myapp", "--dir", str(tmp_path))
    assert made.returncode == 0, made.stderr
    address = broker_proc.address
    run = run_app(app, address, tmp_path / "run.log", "--shards", "8")
    keys = [f"k{i % 37}" for i in range(900)]
    expected = Counter(keys)
    try:
        async with AppView(app, address) as view:
            view.config = view.config.with_settings(shards=8)
            await view.wait_serving(timeout=60)
            async with BrokerClient(address) as client:
                names = sorted(j.spec.name for j in await list_journals(
                    client, f"{TOPIC_LABEL}=events"))
            assert names == [f"events/part-{i:03d}" for i in range(8)]
            await asyncio.to_thread(publish, address, keys[:450])
            await asyncio.to_thread(publish, address, keys[450:])

            def caught_up() -> bool:
                done = cli("query", str(app), '{"key": "k5"}', "--key", "k5")
                return done.returncode == 0 and json.loads(done.stdout)["total"] == expected["k5"]

            await eventually(lambda: asyncio.to_thread(caught_up), 60, "k5 to be counted")
            # By key: the owning shard has the total. Without: all 8 deployed shards answer,
            # and exactly one of them holds the key.
            for key in ("k0", "k17", "k36"):
                assert query(app, key, "--key", key) == {"key": key, "total": expected[key]}
                answers = query(app, key)
                assert isinstance(answers, dict) and len(answers) == 8
                holding = {s: a["total"] for s, a in answers.items() if a["total"]}
                assert list(holding.values()) == [expected[key]], answers

            # The output, read committed: every key's updates in the partition its key routes
            # to, strictly growing (one update per transaction), the last one the total.
            config = view.config
            mapping = config.mapping_for("totals")
            assert view.client is not None
            by_journal = {j: await read_journals(view.client, [j])
                          for j in config.topic_journals("totals")}
            seen: dict[str, list[int]] = {}
            for journal, updates in by_journal.items():
                for update in updates:
                    assert mapping({"key": update["key"]})[0] == journal
                    seen.setdefault(update["key"], []).append(update["total"])
            for key, totals in seen.items():
                assert totals == sorted(set(totals)), (key, totals)
            assert {k: t[-1] for k, t in seen.items()} == dict(expected)
    finally:
        run.stop()

    # Stopped, the app has state on 8 shards: streamkit.yaml's 2 is refused, by run and
    # serve alike, and a backfill must say --shards to reshard.
    for args in (["run", str(app), "--broker", address, "--no-status"],
                 ["serve", str(app), "--broker", address],
                 ["backfill", str(app), "--spark", "--broker", address]):
        refused = cli(*args)
        assert refused.returncode == 2, refused.stderr
        assert "Traceback" not in refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        assert "deployed with 8 shards" in refused.stderr, refused.stderr
        assert "--shards 8" in refused.stderr
    assert "streamkit backfill" in cli(*["run", str(app), "--broker", address]).stderr


@pytest.mark.parametrize("command", ["run", "serve", "backfill"])
def test_a_source_with_fewer_partitions_than_shards_is_refused(tmp_path: Path,
                                                               command: str) -> None:
    app = tmp_path / "myapp"
    assert cli("new", "myapp", "--dir", str(tmp_path)).returncode == 0
    path = app / "streamkit.yaml"
    path.write_text(path.read_text().replace(
        "  - topic: events ", "  - topic: events\n    partitions: 2\n   "))
    assert load_config(app).sources[0].partitions == 2
    extra = {"run": [], "serve": ["--broker", "127.0.0.1:1"], "backfill": ["--spark"]}[command]
    refused = cli(command, str(app), "--shards", "8", *extra)
    assert refused.returncode == 2, refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    assert line == (
        f"streamkit: error: {path}: sources[0].partitions: topic 'events' has 2 partitions but "
        "the app has 8 shards: several shards would read each partition and process its "
        "messages several times. Leave partitions out (it follows the shard count) or set it "
        "to 8; for a broadcast topic every shard reads whole, set read: every-shard")
