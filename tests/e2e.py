"""Helpers of the end-to-end tests that run apps as real `streamkit run` / `serve` processes.

The test process only observes: it reads the app's KeySpace file (assignments
and their statuses), asks members over their Shard API (Stat) and HTTP API
(queries), and reads the committed output topic. Input comes from a feeder
process (tests/programs/wordcount_feeder.py) whose lines are a pure function
of their id, so the expected counts follow from how many it published.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import grpc
import yaml

from streamkit.app.assignment import AllocState
from streamkit.app.config import AppConfig, load_config
from streamkit.app.member_http import http_url, open_member_url
from streamkit.app.shard_ops import read_state
from streamkit.auth.settings import Security
from streamkit.auth.tokens import Capability
from streamkit.client import AppendService, BrokerClient
from streamkit.client.appender import write_head
from streamkit.client.broker_client import normalize_address
from streamkit.keyspace import KeySpace, open_keyspace
from streamkit.message.publisher import Publisher
from streamkit.message.reader import ReadCommitted, ReadUncommitted
from streamkit.protocol import consumer_pb
from streamkit.protocol import consumer_pb2_grpc as consumer_grpc
from streamkit.testing import read_journals
from tests.waiting import eventually

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "wordcount"
FEEDER = Path(__file__).resolve().parent / "programs" / "wordcount_feeder.py"
SOURCE = "wordcount/lines"
OUTPUT = "wordcount/counts"
Code = consumer_pb.ReplicaStatus.Code

# --- input ------------------------------------------------------------------------------

VOCABULARY = [f"w{i}" for i in range(40)]


def line_of(i: int) -> str:
    """Line number `i`: 2-6 words of a small vocabulary, the same every time."""
    rng = random.Random(i)
    return " ".join(rng.choice(VOCABULARY) for _ in range(rng.randint(2, 6)))


def expected_counts(ids: Iterable[int]) -> Counter[str]:
    return Counter(word for i in ids for word in line_of(i).split())


# --- the app folder -----------------------------------------------------------------------


def copy_wordcount(dest: Path, **settings: Any) -> Path:
    """examples/wordcount copied to `dest`, with quick transactions and `settings` applied."""
    text = (EXAMPLE / "streamkit.yaml").read_text()
    config = yaml.safe_load(text)
    config["transactions"] = {"max_duration": "200ms"}
    config.update(settings)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "app.py").write_text((EXAMPLE / "app.py").read_text())
    (dest / "streamkit.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return dest


# --- processes ----------------------------------------------------------------------------


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                         os.environ.get("PYTHONPATH")]))}


def cli(*args: str, timeout: float = 60.0, input_text: str | None = None,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `streamkit ARGS...` to completion (with `env` added), capturing its output."""
    return subprocess.run([sys.executable, "-m", "streamkit.cli.main", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**_env(), **(env or {})}, cwd=ROOT,
                          input=input_text if input_text is not None else "")


class Proc:
    """A child process logging to a file; stopped by the test, never left behind."""

    def __init__(self, argv: list[str], log_path: Path) -> None:
        self.argv, self.log_path = argv, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def streamkit(cls, args: list[str], log_path: Path) -> Proc:
        return cls([sys.executable, "-m", "streamkit.cli.main", *args], log_path)

    def start(self, own_group: bool = False) -> Proc:
        """`own_group`: lead a process group of its own, as a command run at a terminal
        does (its children join it unless they leave); see `signal(..., group=True)`."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=_env(), cwd=ROOT,
                                         process_group=0 if own_group else None)
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def text(self) -> str:
        """Everything the process wrote so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log(self, lines: int = 40) -> str:
        """The end of its output, for assertion messages."""
        return "\n".join(self.text().splitlines()[-lines:])

    def stacks(self, lines: int = 80) -> str:
        """For a failure's message: the end of its log after it printed where each of its
        threads is (SIGUSR1, which a streamkit process answers so and runs on)."""
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(0.5)  # the dump is written by the process: give it a moment
        return self.log(lines)

    def kill(self) -> None:
        """SIGKILL: no commit, no goodbye."""
        if self.alive:
            assert self.proc is not None
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(10)

    def signal(self, sig: int, timeout: float = 30.0, group: bool = False) -> int:
        """Send `sig` and wait for the exit code. `group`: to its whole process group, as a
        terminal's Ctrl-C does (started with `own_group`)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            if group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        """Clean up after a test: SIGTERM, then SIGKILL."""
        if self.alive:
            try:
                self.signal(signal.SIGTERM, timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


def run_app(app_dir: Path, broker: str, log_path: Path, *extra: str) -> Proc:
    return Proc.streamkit(["run", str(app_dir), "--broker", broker, "--no-status",
                           "--log-level", "INFO", *extra], log_path).start()


def serve_app(app_dir: Path, broker: str, suffix: str, log_path: Path, *extra: str) -> Proc:
    """`streamkit serve` as member `suffix`; `extra` options (`--keyspace URL`, say)."""
    return Proc.streamkit(["serve", str(app_dir), "--broker", broker, "--suffix", suffix,
                           "--log-level", "INFO", *extra], log_path).start()


class Feeder:
    """tests/programs/wordcount_feeder.py: publishes lines `start`.. committed, until stopped."""

    def __init__(self, app_dir: Path, broker: str, log_path: Path, *, start: int = 0,
                 count: int = 0, batch: int = 40, interval: float = 0.05,
                 extra: Sequence[str] = ()) -> None:
        self.start_id, self.count = start, count
        self.stdout = log_path.with_suffix(".out")
        self.proc = Proc([sys.executable, str(FEEDER), broker, str(app_dir), "--start",
                          str(start), "--count", str(count), "--batch", str(batch),
                          "--interval", str(interval), "--report", str(self.stdout), *extra],
                         log_path)

    def start(self) -> Feeder:
        self.proc.start()
        return self

    def acked(self) -> int:
        """Lines acknowledged so far (the feeder's last report)."""
        try:
            lines = self.stdout.read_text().split()
        except OSError:
            return 0
        return int(lines[-1]) if lines else 0

    def finish(self, timeout: float = 60.0) -> range:
        """Stop (or wait for a bounded feeder to end); the ids it published, all acknowledged."""
        assert self.proc.proc is not None
        if self.count == 0 and self.proc.alive:
            self.proc.proc.send_signal(signal.SIGTERM)
        code = self.proc.proc.wait(timeout)
        assert code == 0, f"feeder exited {code}:\n{self.proc.log()}"
        return range(self.start_id, self.start_id + self.acked())


# --- observing the app ------------------------------------------------------------------------


class AppView:
    """The test's view of a running app: its KeySpace, members, shards and output."""

    def __init__(self, app_dir: Path, broker: str, security: Security | None = None,
                 keyspace: str | None = None) -> None:
        self.config: AppConfig = load_config(app_dir)
        self.broker = broker
        self.security = security or Security()  # TLS and tokens for broker and members
        self.keyspace_path = self.config.data_dir / "keyspace.db"
        self.keyspace_url = keyspace  # an `open_keyspace` URL (etcd://...); None: the file
        self.keyspace: KeySpace | None = None
        self.client: BrokerClient | None = None

    async def __aenter__(self) -> AppView:
        self.client = await BrokerClient(self.broker, self.security).__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.keyspace is not None:
            await self.keyspace.close()
        if self.client is not None:
            await self.client.__aexit__(None, None, None)

    async def state(self) -> AllocState:
        if self.keyspace is None:
            if self.keyspace_url is not None:
                self.keyspace = open_keyspace(self.keyspace_url)
            else:
                self.config.data_dir.mkdir(parents=True, exist_ok=True)
                self.keyspace = open_keyspace(str(self.keyspace_path))
        return await read_state(self.keyspace, self.config.keyspace_root)

    @staticmethod
    def endpoint_of(state: AllocState, member: Any) -> str:
        entry = state.members.get(member)
        return entry[0].process_spec.endpoint if entry else ""

    async def serving(self) -> dict[str, str] | None:
        """Shard -> its primary's endpoint, once every shard has a PRIMARY whose member
        answers; else None."""
        state = await self.state()
        found = {}
        for shard in self.config.shard_ids():
            primary = state.primary_of(shard)
            if primary is None or primary.code != Code.PRIMARY:
                return None
            endpoint = self.endpoint_of(state, primary.member)
            if not endpoint:
                return None
            found[shard] = endpoint
        for endpoint in set(found.values()):  # a killed member's keys outlive it a while
            shard = next(s for s, e in found.items() if e == endpoint)
            try:
                await self.stat(endpoint, shard, timeout=10.0)  # generous: a busy machine
            except (grpc.aio.AioRpcError, AssertionError):
                return None
        return found

    async def standing_by(self) -> bool:
        """Every shard has a PRIMARY and a STANDBY, on different live members."""
        if await self.serving() is None:
            return False
        state = await self.state()
        for shard in self.config.shard_ids():
            codes = sorted(a.code for a in state.assignments_of(shard))
            if codes != sorted([Code.PRIMARY, Code.STANDBY]):
                return False
        return True

    async def balanced(self) -> bool:
        """Standing by, and each of the two members is primary of half the shards."""
        if not await self.standing_by():
            return False
        state = await self.state()
        primaries = Counter(state.primary_of(s).suffix for s in self.config.shard_ids())
        return sorted(primaries.values()) == [4, 4]

    async def served_by(self, shards: list[str], member: str) -> list[str] | None:
        """`shards`, once each is PRIMARY at `member` and answers Stat and a query there."""
        state = await self.state()
        endpoint = ""
        for shard in shards:
            primary = state.primary_of(shard)
            if primary is None or primary.suffix != member or primary.code != Code.PRIMARY:
                return None
            endpoint = self.endpoint_of(state, primary.member)
        try:
            await asyncio.gather(*(self.stat(endpoint, shard, timeout=10.0) for shard in shards))
            await self.query_counts({shard: endpoint for shard in shards}, ["w0"])
        except Exception:
            return None
        return shards

    async def primaries_by_member(self) -> dict[str, list[str]]:
        """Each member's primaries (by suffix), every shard having one."""
        state = await self.state()
        found: dict[str, list[str]] = {}
        for shard in self.config.shard_ids():
            primary = state.primary_of(shard)
            assert primary is not None, f"{shard} has no primary"
            found.setdefault(primary.suffix, []).append(shard)
        return found

    async def wait_serving(self, timeout: float = 30.0) -> dict[str, str]:
        try:
            return await eventually(self.serving, timeout, "every shard to have a PRIMARY")
        except AssertionError as error:  # say where it is stuck: which shard, which status
            raise AssertionError(f"{error}\n{await self.describe()}") from None

    async def describe(self) -> str:
        """Each shard's assignments as the KeySpace has them (member, status, errors)."""
        state = await self.state()
        lines = []
        for shard in self.config.shard_ids():
            replicas = [
                f"{a.suffix} slot {a.slot} {consumer_pb.ReplicaStatus.Code.Name(a.status.code)}"
                + (f" {list(a.status.errors)}" if a.status.errors else "")
                for a in state.assignments_of(shard)
            ]
            lines.append(f"  {shard}: {', '.join(replicas) or 'no assignments'}")
        members = ", ".join(m.suffix for m in state.members)
        return f"members: {members}\n" + "\n".join(lines)

    async def stat(self, endpoint: str, shard: str, read_through: dict[str, int] | None = None,
                   timeout: float = 30.0) -> consumer_pb.StatResponse:
        request = consumer_pb.StatRequest(shard=shard, read_through=read_through or {})
        signer = self.security.signer()
        metadata = signer.for_shard(Capability.READ, shard) if signer is not None else None
        async with self.security.open_channel(normalize_address(endpoint)) as channel:
            response = await consumer_grpc.ShardStub(channel).Stat(request, timeout=timeout,
                                                                   metadata=metadata)
        assert response.status == consumer_pb.OK, (shard, response)
        return response

    async def heads(self) -> dict[str, int]:
        assert self.client is not None
        journals = self.config.topic_journals(SOURCE)
        offsets = await asyncio.gather(*(write_head(self.client, j) for j in journals))
        return dict(zip(journals, offsets, strict=True))

    async def wait_caught_up(self, timeout: float = 30.0) -> dict[str, str]:
        """Until every shard committed through its sources' current write heads."""
        deadline = time.monotonic() + timeout
        heads = await self.heads()
        while True:
            serving = await self.wait_serving(max(0.1, deadline - time.monotonic()))
            try:
                await asyncio.gather(*(
                    self.stat(endpoint, shard, {j: heads[j] for j in self.sources_of(shard)},
                              timeout=max(0.1, deadline - time.monotonic()))
                    for shard, endpoint in serving.items()))
                return serving
            except (grpc.aio.AioRpcError, AssertionError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)  # a primary moved meanwhile: ask the new one

    def sources_of(self, shard: str) -> list[str]:
        return self.config.source_journals(self.config.shard_ids().index(shard))

    async def query_counts(self, serving: dict[str, str],
                           words: Iterable[str] = VOCABULARY) -> Counter[str]:
        """Each word's count summed over the shards, asked of each primary over HTTP."""

        def ask(endpoint: str, shard: str, word: str) -> int:
            url = f"{http_url(endpoint)}/query/{shard}"
            body = json.dumps({"word": word}).encode()
            with open_member_url(self.security, url, body, cap=Capability.READ, shard=shard,
                                 timeout=30) as response:
                return int(json.loads(response.read()))

        def ask_all() -> Counter[str]:
            totals: Counter[str] = Counter()
            for word in words:
                for shard, endpoint in serving.items():
                    totals[word] += ask(endpoint, shard, word)
            return +totals

        return await asyncio.to_thread(ask_all)

    def shard_of_id(self, line_id: int) -> str:
        """The shard reading the partition a line with this id is published to."""
        journal, _ = self.config.mapping_for(SOURCE)({"id": line_id})
        return next(s for s in self.config.shard_ids() if journal in self.sources_of(s))

    async def publish_line(self, line_id: int, line: str) -> None:
        assert self.client is not None
        async with AppendService(self.client) as service:
            await Publisher(service).publish_committed(self.config.mapping_for(SOURCE),
                                                       {"id": line_id, "line": line})
            await service.flush()

    async def output_updates(self) -> list[dict[str, Any]]:
        """Every read-committed message of the output topic, partition by partition."""
        return await self._read_output(ReadCommitted)

    async def output_messages_uncommitted(self) -> list[dict[str, Any]]:
        """Every message of the output topic as written: transactions' data and their ACKs,
        committed or not."""
        return await self._read_output(ReadUncommitted)

    async def _read_output(self, kind: type) -> list[dict[str, Any]]:
        assert self.client is not None
        return await read_journals(self.client, self.config.topic_journals(OUTPUT), kind)


def totals_of_updates(updates: list[dict[str, Any]]) -> Counter[str]:
    """Sum over shards of each (shard, word)'s latest count, asserting each update is new:
    a count seen twice (a duplicated update) or going down fails."""
    latest: dict[tuple[str, str], int] = {}
    for update in updates:
        key = (update["shard"], update["word"])
        assert update["count"] > latest.get(key, 0), f"duplicate or stale update {update}"
        latest[key] = update["count"]
    totals: Counter[str] = Counter()
    for (_, word), count in latest.items():
        totals[word] += count
    return totals


# A WordCount that raises on lines holding "poison" (a test's poison messages).
POISONED = """
class Poisoned(WordCount):
    def consume_message(self, shard, store, envelope, publisher) -> None:
        if "poison" in envelope.message["line"]:
            raise ValueError(f"cannot count line {envelope.message['id']}")
        super().consume_message(shard, store, envelope, publisher)
"""
