"""JSONFileStore against a real broker: commits recover exactly, also after SIGKILL, and fence.

The helpers here (checkpoints that number transactions, the killed-writer
harness) are shared with tests/test_sqlite_store.py. Run as a module
(`python -m tests.test_json_store ADDRESS LOG DIR`), this file is the writer
process of the SIGKILL test.
"""

from __future__ import annotations

import asyncio
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import BaseModel

from streamkit.client import BrokerClient, OpFuture, RegisterMismatch
from streamkit.protocol import consumer_pb
from streamkit.recoverylog import CONTENT_TYPE, FSM, RecordedFS, Recorder, rpb
from streamkit.recoverylog.recovery import recover
from streamkit.stores.json_file import JSONFileStore
from streamkit.stores.store import StoreError
from tests.brokerproc import BrokerProcess
from tests.helpers_client import create_journal, unique_name

ROOT = Path(__file__).resolve().parent.parent
SHARD = "shard-000"
SOURCE = "input/part-000"

# --- helpers shared with test_sqlite_store ------------------------------------


def checkpoint_of(txn: int) -> consumer_pb.Checkpoint:
    """The checkpoint of transaction `txn`: it read its source through offset 100 * txn."""
    return consumer_pb.Checkpoint(
        sources={SOURCE: consumer_pb.Checkpoint.Source(read_through=100 * txn)}
    )


def txn_of(checkpoint: consumer_pb.Checkpoint) -> int:
    """The transaction number a checkpoint of `checkpoint_of` stands for (0: none)."""
    source = checkpoint.sources.get(SOURCE)
    return 0 if source is None else source.read_through // 100


async def new_log(client: BrokerClient) -> str:
    log = unique_name("store-log")
    await create_journal(client, log, labels={"content-type": CONTENT_TYPE})
    return log


def run_and_kill_writer(module: str, *args: str, rng: random.Random,
                        min_commits: int = 10) -> int:
    """Run writer `module`, SIGKILL it at a random moment (drawn from the test's seeded
    `rng`); the last commit it printed.

    The writer prints each transaction number once its commit's OpFuture
    resolved, so the recovered checkpoint may be that one or, if a commit was
    in flight at the kill, the next.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert proc.stdout is not None and proc.stderr is not None
    target, last = rng.randint(min_commits, 3 * min_commits), 0
    deadline = time.monotonic() + 15
    try:
        while last < target and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                raise AssertionError(f"writer exited {proc.wait()}: {proc.stderr.read()}")
            last = int(line)
        time.sleep(rng.uniform(0, 0.05))  # the kill moment (what is tested): inside a commit
    finally:
        proc.kill()
    printed = proc.stdout.read().split()  # printed before the kill landed
    proc.wait()
    proc.stderr.close()
    return int(printed[-1]) if printed else last


# --- the workload --------------------------------------------------------------


class Counts(BaseModel):
    """A pydantic state: the workload's items and the last transaction applied."""

    items: dict[str, list[int]] = {}
    txn: int = 0


def apply_txn(items: dict[str, list[int]], txn: int) -> None:
    """Transaction `txn`'s mutations: random upserts and deletes, reproducible from `txn`."""
    rng = random.Random(txn)
    for _ in range(rng.randint(1, 8)):
        key = f"k{rng.randrange(40)}"
        if rng.random() < 0.3:
            items.pop(key, None)
        else:
            items[key] = [txn, rng.randrange(1000)]


def expected_items(txns: int) -> dict[str, list[int]]:
    items: dict[str, list[int]] = {}
    for txn in range(1, txns + 1):
        apply_txn(items, txn)
    return items


def mutate(store: JSONFileStore, txn: int) -> None:
    """Apply transaction `txn` to either kind of state the tests use."""
    if isinstance(store.state, Counts):
        apply_txn(store.state.items, txn)
        store.state.txn = txn
    else:
        apply_txn(store.state, txn)


# --- tests ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dict", "model"])
@pytest.mark.parametrize("use_hints", [False, True])
async def test_random_workload_recovers_exactly(
    shared_broker: BrokerProcess, tmp_path: Path, kind: str, use_hints: bool
) -> None:
    def initial() -> dict | Counts:
        return Counts() if kind == "model" else {}

    async with BrokerClient(shared_broker.address) as client:
        log = await new_log(client)
        fs = await recover(client, log, tmp_path / "primary")
        store = JSONFileStore(fs, initial())
        assert txn_of(await store.restore_checkpoint(SHARD)) == 0
        for txn in range(1, 51):
            mutate(store, txn)
            await (await store.start_commit(SHARD, checkpoint_of(txn), []))
        hints = await fs.recorder.build_hints() if use_hints else None
        await store.destroy()

    async with BrokerClient(shared_broker.address) as client:  # another process, as it were
        fs = await recover(client, log, tmp_path / "standby", hints)
        recovered = JSONFileStore(fs, initial())
        assert txn_of(await recovered.restore_checkpoint(SHARD)) == 50
        if kind == "model":
            assert recovered.state == Counts(items=expected_items(50), txn=50)
        else:
            assert recovered.state == expected_items(50)
        assert sorted(recovered.fs.listdir()) == ["state.json"]
        await recovered.fs.recorder.close()


async def test_failed_dependency_writes_nothing(
    shared_broker: BrokerProcess, tmp_path: Path
) -> None:
    async with BrokerClient(shared_broker.address) as client:
        log = await new_log(client)
        fs = await recover(client, log, tmp_path / "primary")
        store = JSONFileStore(fs, {})
        await store.restore_checkpoint(SHARD)
        store.state["a"] = 1
        await (await store.start_commit(SHARD, checkpoint_of(1), []))

        store.state["a"] = 2
        pending = OpFuture()
        commit = asyncio.ensure_future(
            store.start_commit(SHARD, checkpoint_of(2), [OpFuture.finished(), pending])
        )
        await asyncio.sleep(0.05)  # a negative check: for this long, nothing may commit
        assert not commit.done()  # still waiting for its dependency
        pending.fail(RuntimeError("append to an output journal failed"))
        with pytest.raises(RuntimeError, match="output journal"):
            await (await commit)

        recovered = JSONFileStore(await recover(client, log, tmp_path / "standby"), {})
        assert txn_of(await recovered.restore_checkpoint(SHARD)) == 1
        assert recovered.state == {"a": 1}
        await recovered.fs.recorder.close()


@pytest.mark.parametrize("kind", ["dict", "model"])
async def test_a_committed_view_reads_the_last_durable_commit(
        shared_broker: BrokerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        kind: str) -> None:
    """In a view, `state` is the last commit that reached the log: not the open
    transaction's, nor one written but not yet durable. Other tasks keep theirs."""
    def items(state: dict | Counts) -> dict:
        return state.items if isinstance(state, Counts) else state

    async with BrokerClient(shared_broker.address) as client:
        fs = await recover(client, await new_log(client), tmp_path / "primary")
        store = JSONFileStore(fs, Counts() if kind == "model" else {})
        await store.restore_checkpoint(SHARD)

        async def viewed() -> dict:
            async with store.committed_view():  # type: ignore[union-attr]
                with pytest.raises(StoreError, match="read-only"):
                    store.state = {}
                return dict(items(store.state))

        mutate(store, 1)
        assert await viewed() == {}  # never committed: the initial state
        await (await store.start_commit(SHARD, checkpoint_of(1), []))
        mutate(store, 2)  # the open transaction
        go = asyncio.Event()

        async def transaction_side() -> dict:
            await go.wait()
            return dict(items(store.state))

        transaction = asyncio.ensure_future(transaction_side())
        async with store.committed_view():  # type: ignore[union-attr]
            assert items(store.state) == expected_items(1)
            go.set()
            assert await transaction == expected_items(2)

        barrier, durable = fs.fsync, OpFuture()
        monkeypatch.setattr(fs, "fsync", lambda: durable)
        op = await store.start_commit(SHARD, checkpoint_of(2), [])  # written, not durable
        assert await viewed() == expected_items(1)
        durable.resolve(await barrier())
        await op
        assert await viewed() == expected_items(2)

        # A view is one commit throughout: one that becomes durable meanwhile is the next
        # view's (whether or not this one read before it); a view's changes are its own.
        for txn, read_first in ((3, True), (4, False)):
            may_commit = asyncio.Event()

            async def commit(txn: int = txn, may_commit: asyncio.Event = may_commit) -> None:
                await may_commit.wait()
                mutate(store, txn)  # (a task made outside the view: the transaction's side)
                await (await store.start_commit(SHARD, checkpoint_of(txn), []))

            committing = asyncio.ensure_future(commit())
            async with store.committed_view():  # type: ignore[union-attr]
                before = dict(items(store.state)) if read_first else None
                may_commit.set()
                await committing
                assert dict(items(store.state)) == expected_items(txn - 1) == (
                    before or expected_items(txn - 1))
                items(store.state)["only-this-view"] = [1]
            assert await viewed() == expected_items(txn)
        await store.destroy()
        await fs.recorder.close()


async def test_restore_without_a_state_file_resets_to_the_initial_state(tmp_path: Path) -> None:
    """A never-committed shard restores to the constructor's state, not a previous attempt's."""
    fs = RecordedFS(tmp_path, Recorder(None, "log", FSM(rpb.FSMHints(log="log"))))  # type: ignore[arg-type]
    store = JSONFileStore(fs, {"items": []})
    assert await store.restore_checkpoint(SHARD) == consumer_pb.Checkpoint()
    store.state["items"].append(1)  # an uncommitted transaction, then a re-assignment
    await store.restore_checkpoint(SHARD)
    assert store.state == {"items": []}

    model = JSONFileStore(fs, Counts())
    await model.restore_checkpoint(SHARD)
    model.state.txn = 7
    await model.restore_checkpoint(SHARD)
    assert model.state == Counts()


async def test_hand_off_fences_the_previous_instance(
    shared_broker: BrokerProcess, tmp_path: Path
) -> None:
    async with BrokerClient(shared_broker.address) as client:
        log = await new_log(client)
        first = JSONFileStore(await recover(client, log, tmp_path / "first"), {})
        await first.restore_checkpoint(SHARD)
        first.state["owner"] = "first"
        await (await first.start_commit(SHARD, checkpoint_of(1), []))

        second = JSONFileStore(await recover(client, log, tmp_path / "second"), {})
        assert txn_of(await second.restore_checkpoint(SHARD)) == 1
        first.state["owner"] = "zombie"
        with pytest.raises(RegisterMismatch):
            await (await first.start_commit(SHARD, checkpoint_of(2), []))
        second.state["owner"] = "second"
        await (await second.start_commit(SHARD, checkpoint_of(2), []))
        await second.fs.recorder.close()

        third = JSONFileStore(await recover(client, log, tmp_path / "third"), {})
        assert txn_of(await third.restore_checkpoint(SHARD)) == 2
        assert third.state == {"owner": "second"}
        await third.fs.recorder.close()


async def test_sigkilled_writer_recovers_a_whole_commit(
    shared_broker: BrokerProcess, tmp_path: Path, rng: random.Random
) -> None:
    async with BrokerClient(shared_broker.address) as client:
        log = await new_log(client)
    last = await asyncio.to_thread(
        run_and_kill_writer, "tests.test_json_store",
        shared_broker.address, log, str(tmp_path / "writer"), rng=rng,
    )
    async with BrokerClient(shared_broker.address) as client:
        store = JSONFileStore(await recover(client, log, tmp_path / "standby"), Counts())
        txn = txn_of(await store.restore_checkpoint(SHARD))
        assert last <= txn <= last + 1
        assert store.state == Counts(items=expected_items(txn), txn=txn)
        await store.fs.recorder.close()


# --- the writer process --------------------------------------------------------


async def _writer(address: str, log: str, directory: str) -> None:
    """Commit transactions until killed, printing each once its commit is durable."""
    async with BrokerClient(address) as client:
        store = JSONFileStore(await recover(client, log, Path(directory)), Counts())
        txn = txn_of(await store.restore_checkpoint(SHARD))
        while txn < 100_000:
            txn += 1
            mutate(store, txn)
            await (await store.start_commit(SHARD, checkpoint_of(txn), []))
            print(txn, flush=True)


if __name__ == "__main__":
    asyncio.run(_writer(*sys.argv[1:]))


async def test_a_full_disk_names_the_file_it_could_not_write(tmp_path: Path) -> None:
    """A write failing (here the file-size limit, as a full disk) fails the commit with an
    error naming the store's file: it said only "[Errno 27] File too large"."""
    fs = RecordedFS(tmp_path, Recorder(None, "log", FSM(rpb.FSMHints(log="log"))))  # type: ignore[arg-type]
    store = JSONFileStore(fs, {"items": []})
    await store.restore_checkpoint(SHARD)
    store.state["items"] = ["x" * 1000] * 100  # 100 kB: past the limit below
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, limits[1]))
    try:
        op = await store.start_commit(SHARD, consumer_pb.Checkpoint(), [])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)
    with pytest.raises(OSError) as caught:
        await op
    assert caught.value.filename == str(tmp_path / "state.json.next"), caught.value
    assert "File too large" in str(caught.value)
