"""A hook that blocks or never returns is named (shard, hook, stack), and never makes its
process unstoppable or its queries hang.

In-process tests lower the watchdog's limit on a real AppHarness; the end-to-end ones run
`streamkit run` of a wordcount variant whose hook blocks forever.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from streamkit.testing import AppHarness
from tests.brokerproc import BrokerProcess
from tests.e2e import AppView, Feeder, cli, copy_wordcount, eventually, run_app
from tests.test_run_e2e import _app_variant, _check_exact
from tests.waiting import LIVENESS

SOURCE = "wordcount/lines"

BLOCKING_FINALIZE = """
import threading


class BlockingFinalize(WordCount):
    released = threading.Event()

    def finalize_txn(self, shard, store, publisher) -> None:
        self.released.wait(60)  # blocks the event loop, as a sync call to a dead server does
        self.counts.clear()
"""

NEVER_CONSUMING = """
class NeverConsuming(WordCount):
    def __init__(self) -> None:
        super().__init__()
        self.released = asyncio.Event()

    async def consume_message(self, shard, store, envelope, publisher) -> None:
        await self.released.wait()  # an await that never returns
        super().consume_message(shard, store, envelope, publisher)
"""

BLOCKING_ASYNC_FINALIZE = """
import threading


class BlockingAsyncFinalize(WordCount):
    released = threading.Event()

    async def finalize_txn(self, shard, store, publisher) -> None:
        self.released.wait(60)  # a blocking call in an async hook: it blocks the loop too
        await super().finalize_txn(shard, store, publisher)
"""

# Blocks forever, once it left a file saying so (the test waits for that file).
STUCK_FINALIZE = """
import pathlib
import time


class StuckFinalize(WordCount):
    def finalize_txn(self, shard, store, publisher) -> None:
        (pathlib.Path(__file__).parent / "stuck").touch()
        time.sleep(10**9)
"""

STUCK_QUERY = """
import time


class StuckQuery(WordCount):
    def query(self, shard, store, request):
        time.sleep(10**9)
"""


class _Warnings(logging.Handler):
    """Collects the watchdog's warnings, and calls `then` (from its thread) at the first."""

    def __init__(self, then: Callable[[], None]) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []
        self.then = then

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        if len(self.records) == 1:
            self.then()


@pytest.fixture
def warnings() -> Iterator[Callable[[Callable[[], None]], _Warnings]]:
    handlers: list[_Warnings] = []
    logger = logging.getLogger("streamkit.app.watchdog")

    def install(then: Callable[[], None]) -> _Warnings:
        handlers.append(_Warnings(then))
        logger.addHandler(handlers[-1])
        return handlers[-1]

    yield install
    for handler in handlers:
        logger.removeHandler(handler)


def _variant(tmp_path: Path, name: str, source: str) -> Path:
    app = copy_wordcount(tmp_path / "wordcount", shards=1)
    _app_variant(app, name, source)
    return app


def _assert_one_warning(seen: _Warnings, hook: str, app: Path) -> None:
    assert len(seen.records) == 1, [r.getMessage() for r in seen.records]
    text = seen.records[0].getMessage()
    assert "shard shard-000" in text and hook in text, text
    assert f'File "{app / "app.py"}"' in text, text  # the stack reaches into the app's code


@pytest.mark.parametrize("name, source", [("BlockingFinalize", BLOCKING_FINALIZE),
                                          ("BlockingAsyncFinalize", BLOCKING_ASYNC_FINALIZE)],
                         ids=["plain", "async"])
async def test_a_hook_blocking_the_loop_is_named_with_its_stack(
        tmp_path: Path, warnings: Callable[[Callable[[], None]], _Warnings], name: str,
        source: str) -> None:
    """A finalize_txn blocking the event loop, plain or async (whose coroutine chain would
    stop at the task: a running coroutine awaits nothing): the watchdog's thread still logs
    it, once, with the shard, the hook, the limit and the app's line it is blocked on."""
    app = _variant(tmp_path, name, source)
    async with AppHarness(app) as h:
        h.member.runtime.watchdog.limit = 0.3  # type: ignore[union-attr]
        released = type(h.app("shard-000")).released  # type: ignore[attr-defined]
        seen = warnings(released.set)
        await h.publish(SOURCE, [{"id": 1, "line": "a b"}])
        await h.wait_idle()
    _assert_one_warning(seen, "finalize_txn", app)
    assert "self.released.wait(60)" in seen.records[0].getMessage()
    assert "the limit is 0.3s" in seen.records[0].getMessage()


async def test_async_hook_that_never_returns_is_named_with_its_stack(
        tmp_path: Path, warnings: Callable[[Callable[[], None]], _Warnings]) -> None:
    """An async consume_message awaiting forever: the task's coroutine chain is logged."""
    app = _variant(tmp_path, "NeverConsuming", NEVER_CONSUMING)
    async with AppHarness(app) as h:
        h.member.runtime.watchdog.limit = 0.3  # type: ignore[union-attr]
        released: asyncio.Event = h.app("shard-000").released  # type: ignore[attr-defined]
        loop = asyncio.get_running_loop()
        seen = warnings(lambda: loop.call_soon_threadsafe(released.set))
        await h.publish(SOURCE, [{"id": 1, "line": "a b"}])
        await h.wait_idle()
        assert await h.query({"word": "a"}, shard="shard-000") == 1
    _assert_one_warning(seen, "consume_message", app)
    assert "await self.released.wait()" in seen.records[0].getMessage()


def _exit_code(run: object, timeout: float = 60.0) -> int:
    """SIGINT, and the exit code (a generous bound: the watchdog's grace is 5s)."""
    return run.signal(signal.SIGINT, timeout=timeout)  # type: ignore[attr-defined, no-any-return]


async def test_ctrl_c_ends_a_run_stuck_in_a_hook_and_nothing_is_lost(
        broker_proc: BrokerProcess, tmp_path: Path) -> None:
    """`streamkit run` whose finalize_txn blocks forever: Ctrl-C still ends it, naming the
    hook, and the next run (a healthy app) counts every line exactly once."""
    app = copy_wordcount(tmp_path / "wordcount", shards=2)
    healthy = (app / "app.py").read_text(), (app / "streamkit.yaml").read_text()
    _app_variant(app, "StuckFinalize", STUCK_FINALIZE)
    address = broker_proc.address
    run = run_app(app, address, tmp_path / "run-1.log")
    try:
        async with AppView(app, address) as view:
            await view.wait_serving(timeout=60)
            ids = Feeder(app, address, tmp_path / "feed.log", count=200, interval=0
                         ).start().finish()
            await eventually(lambda: (app / "stuck").exists(), 60, "a stuck finalize_txn")
            code = await asyncio.to_thread(_exit_code, run)
            assert code == 1, run.log()
            assert "is stuck in finalize_txn since" in run.text(), run.log()
            assert "exiting without committing it" in run.text(), run.log()
            assert "time.sleep(10**9)" in run.text(), run.log()  # its stack

            (app / "app.py").write_text(healthy[0])
            (app / "streamkit.yaml").write_text(healthy[1])
            run = run_app(app, address, tmp_path / "run-2.log")
            await _check_exact(view, ids)
    finally:
        run.stop()


async def test_query_timeout_names_the_shard_that_does_not_answer(
        broker_proc: BrokerProcess, tmp_path: Path) -> None:
    """`streamkit query --timeout 1` to a member whose query hook blocks: that shard is
    reported as not answering ("within 1s": the timeout applied), exit 1; the command ends
    rather than hanging on the shard."""
    app = _variant(tmp_path, "StuckQuery", STUCK_QUERY)
    address = broker_proc.address
    run = run_app(app, address, tmp_path / "run.log")
    try:
        async with AppView(app, address) as view:
            await view.wait_serving(timeout=60)
        # In a worker thread whose failure (cli's own liveness bound expiring) reaches here.
        result = await asyncio.to_thread(
            cli, "query", str(app), '{"word": "w1"}', "--timeout", "1", timeout=LIVENESS)
        assert result.returncode == 1, result.stderr
        assert "shard-000" in result.stderr and "within 1s" in result.stderr, result.stderr
        # The app runs (its hook is what hangs): no hint that it might not.
        assert "is the app running" not in result.stderr, result.stderr
        code = await asyncio.to_thread(_exit_code, run)
        assert code == 1, run.log()
        assert "is stuck in query since" in run.text(), run.log()
    finally:
        run.stop()


REENTERED = r"""
import os, signal, sys, threading, time
from streamkit.app.watchdog import Watchdog

watchdog = Watchdog(limit=30.0)
record = watchdog.watch("shard-000")  # its thread runs, waiting to be woken
seen = 0

def on_signal(_sig, _frame):  # what `run`'s handler does with the watchdog
    global seen
    seen += 1
    watchdog.stop_requested()

signal.signal(signal.SIGTERM, on_signal)

def tracer(frame, event, arg):
    # A second signal at every line run under the first handler's stop_requested: wherever
    # it holds a lock, if it takes one, the second handler comes in while it holds it.
    names, caller = [], frame
    while caller is not None:
        names.append(caller.f_code.co_name)
        caller = caller.f_back
    if event == "line" and "stop_requested" in names and names.count("on_signal") == 1:
        os.kill(os.getpid(), signal.SIGTERM)  # (handled at once, nested in this handler)
    return tracer

sys.settrace(tracer)
os.kill(os.getpid(), signal.SIGTERM)
sys.settrace(None)
time.sleep(0.2)
print("handled", seen, flush=True)
"""


def test_a_stop_signal_arriving_inside_the_handler_of_another_is_handled() -> None:
    """Stop signals come in bursts (a killed `run`'s parent-death signal reached a worker
    several times): the handler, which tells the watchdog, may be entered again while it
    runs. It used to set a threading.Event, whose lock the interrupted call held: the
    member waited in its handler for ever, its lease kept alive by another thread, and
    its shards stalled. Here a second signal lands at each line the first one runs."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", REENTERED], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("handled "), done.stdout
    assert int(done.stdout.split()[1]) >= 2, done.stdout
