"""A member whose hook blocks its event loop stays alive to the outside: it keeps its lease
(its shards don't move to be wedged elsewhere), /status answers, and a query is answered 503
after `transactions.hook_timeout`, naming the hook the shard is stuck in."""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.error
import urllib.request
from pathlib import Path

from streamkit.protocol import consumer_pb
from tests.brokerproc import BrokerProcess
from tests.e2e import AppView, Feeder, copy_wordcount, eventually, run_app
from tests.test_run_e2e import _app_variant

STUCK_FINALIZE = """
import pathlib
import time


class StuckFinalize(WordCount):
    def finalize_txn(self, shard, store, publisher) -> None:
        (pathlib.Path(__file__).parent / "stuck").write_text(shard.id)
        time.sleep(10**9)
"""

Code = consumer_pb.ReplicaStatus.Code
LEASE_TTL = 1.0  # a member's lease (MemberOptions.lease_ttl)


def _http(url: str, body: bytes | None = None) -> tuple[int, dict | list]:
    request = urllib.request.Request(url, data=body, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


async def test_a_member_stuck_in_a_hook_stays_reachable(
        broker_proc: BrokerProcess, tmp_path: Path) -> None:
    app = copy_wordcount(tmp_path / "wordcount", shards=2)
    _app_variant(app, "StuckFinalize", STUCK_FINALIZE)
    config = app / "streamkit.yaml"
    config.write_text(config.read_text().replace(
        "max_duration: 200ms", "max_duration: 200ms\n  hook_timeout: 2s"))
    address = broker_proc.address
    run = run_app(app, address, tmp_path / "run.log")
    try:
        async with AppView(app, address) as view:
            serving = await view.wait_serving(timeout=60)
            Feeder(app, address, tmp_path / "feed.log", count=20, interval=0).start().finish()
            await eventually(lambda: (app / "stuck").exists(), 60, "a stuck finalize_txn")
            stuck = (app / "stuck").read_text()
            (other,) = {"shard-000", "shard-001"} - {stuck}
            endpoint = serving[stuck]
            member = (await view.state()).primary_of(stuck).member  # type: ignore[union-attr]
            # Blocked for several lease TTLs: the lease must still be held.
            await asyncio.sleep(4 * LEASE_TTL)  # what is tested: time passing while stuck
            # (Read from the KeySpace: the member's gRPC Stat runs on its blocked loop.)
            primary = (await view.state()).primary_of(stuck)
            assert primary is not None and primary.member == member, run.log()
            assert primary.code == Code.PRIMARY, run.log()

            host, port = endpoint.removeprefix("grpc://").rsplit(":", 1)
            base = f"http://{host}:{int(port) + 1}"
            status, replicas = await asyncio.to_thread(_http, f"{base}/status")
            assert status == 200, replicas
            assert [(r["id"], r["status"]) for r in replicas] == [
                ("shard-000", "PRIMARY"), ("shard-001", "PRIMARY")]

            status, answer = await asyncio.to_thread(
                _http, f"{base}/query/{stuck}", b'{"word": "w1"}')
            assert status == 503, answer
            assert "did not answer within 2s" in answer["error"], answer
            assert "finalize_txn" in answer["error"], answer
            # The other shard waits on the same loop: its answer names the one holding it.
            status, answer = await asyncio.to_thread(
                _http, f"{base}/query/{other}", b'{"word": "w1"}')
            assert status == 503, answer
            assert f"shard {stuck} of the same member is running finalize_txn" in \
                answer["error"], answer
            await eventually(lambda: f"{stuck}: finalize_txn has run for" in run.text(), 30,
                             "the watchdog's warning")
    finally:
        if run.alive:
            run.signal(signal.SIGINT, timeout=60)
        run.stop()
