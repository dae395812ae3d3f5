"""Errors of the application's own code: they fail its shard (never the member), and the
log says which line of the app raised, with the app's frames only.

An Application whose constructor raises fails the shard it was made for, naming the
class, while the member goes on serving its other shards; an error in a hook
(`consume_message`, `query`) is logged with the app's frames of its traceback, and the
shard's status names the app's line; streamkit's own errors (a frame that doesn't decode)
stay one line, without a traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import urllib.error
from pathlib import Path
from typing import Any

import pytest

from streamkit.app.application import Application
from streamkit.app.member_http import http_url, open_member_url
from streamkit.app.service import Service
from streamkit.auth.settings import Security
from streamkit.auth.tokens import Capability
from streamkit.client import BrokerClient
from streamkit.protocol import consumer_pb
from tests.brokerproc import BrokerProcess
from tests.e2e import AppView, Proc, cli, copy_wordcount, run_app
from tests.helpers_client import unique_name
from tests.test_app_runtime import WordCount, _journals, _runtime, _specs
from tests.test_run_e2e import _app_variant
from tests.waiting import eventually

Code = consumer_pb.ReplicaStatus.Code

# The first instance made in a process raises in its constructor: one shard fails so.
BROKEN = """
import itertools

_made = itertools.count()


class Broken(WordCount):
    def __init__(self) -> None:
        super().__init__()
        if next(_made) == 0:
            self.ratio = 1 / 0  # INIT

    def consume_message(self, shard, store, envelope, publisher) -> None:
        if "poison" in envelope.message["line"]:
            raise RuntimeError(f"user code blew up on {envelope.message['id']}")  # CONSUME
        super().consume_message(shard, store, envelope, publisher)

    async def query(self, shard, store, request):
        word = request.get("word")
        if word == "boom":
            raise KeyError("no boom here")  # QUERY
        if word in _ESCAPES:  # what no query may do: stop the member, or drop the answer
            raise _ESCAPES[word]()
        if word == "deep":
            answer = []
            for _ in range(100_000):
                answer = [answer]
            return answer
        return await super().query(shard, store, request)


import asyncio

_ESCAPES = {"exit": SystemExit, "interrupt": KeyboardInterrupt,
            "cancel": asyncio.CancelledError}
"""


def _line_of(app_py: Path, mark: str) -> int:
    return next(n for n, text in enumerate(app_py.read_text().splitlines(), 1)
                if text.endswith(f"# {mark}"))


def _logged(run: Proc, first: str) -> list[str]:
    """The log's lines from the one holding `first` on (its record and what follows)."""
    lines = run.text().splitlines()
    start = next(i for i, line in enumerate(lines) if first in line)
    return lines[start:]


async def _codes(view: AppView) -> dict[str, tuple[int, str]]:
    """Shard -> (its primary's status code, its errors)."""
    state = await view.state()
    found = {}
    for shard in view.config.shard_ids():
        primary = state.primary_of(shard)
        if primary is not None:
            found[shard] = (primary.code, " ".join(primary.status.errors))
    return found


def _ask(endpoint: str, shard: str, request: dict[str, Any]) -> tuple[int, str]:
    """(HTTP status, body) of a query of `shard` at its member."""
    url = f"{http_url(endpoint)}/query/{shard}"
    try:
        with open_member_url(Security(), url, json.dumps(request).encode(),
                             cap=Capability.READ, shard=shard, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


async def test_app_errors_fail_their_shard_and_name_the_apps_line(
        broker_proc: BrokerProcess, tmp_path: Path) -> None:
    app = copy_wordcount(tmp_path / "wordcount", shards=3)
    _app_variant(app, "Broken", BROKEN)
    app_py = app / "app.py"
    address = broker_proc.address
    run = run_app(app, address, tmp_path / "run.log")
    try:
        async with AppView(app, address) as view:
            async def settled() -> dict[str, tuple[int, str]] | None:
                codes = await _codes(view)
                done = len(codes) == 3 and all(c in (Code.PRIMARY, Code.FAILED)
                                               for c, _ in codes.values())
                return codes if done else None

            codes = await eventually(settled, 60, "every shard PRIMARY or FAILED")
            failed = [s for s, (code, _) in codes.items() if code == Code.FAILED]
            assert len(failed) == 1, (codes, run.log())
            (init_failed,) = failed
            # The shard names the class and the app's line; the member lives on.
            line = _line_of(app_py, "INIT")
            assert codes[init_failed][1] == ("creating the application (app:Broken) failed: "
                                             f"ZeroDivisionError: division by zero "
                                             f"(at app.py:{line})"), codes
            assert run.alive, run.log()
            logged = _logged(run, f"shard {init_failed} failed: creating the application "
                                  "(app:Broken) failed: ZeroDivisionError: division by zero")
            assert logged[1] == "Traceback of the application's code (most recent call last):"
            assert logged[2] == f'  File "{app_py}", line {line}, in __init__', logged[:6]
            assert "replica.py" not in "\n".join(logged[:6]), logged[:6]  # the app's only
            assert "assignment-follower" not in run.text(), run.log()

            # The other shards serve: a query answers, and one the app raises on is a 500
            # whose log names the app's line.
            healthy = sorted(s for s in codes if s != init_failed)
            state = await view.state()
            endpoint = view.endpoint_of(state, state.primary_of(healthy[0]).member)
            assert await asyncio.to_thread(_ask, endpoint, healthy[0], {"word": "w0"}) == (
                200, "0")
            status, body = await asyncio.to_thread(_ask, endpoint, healthy[0], {"word": "boom"})
            assert status == 500 and "KeyError" in body and "File" not in body, body
            logged = _logged(run, f"query of shard {healthy[0]} failed: KeyError")
            assert logged[1] == "Traceback of the application's code (most recent call last):"
            assert logged[2] == (f'  File "{app_py}", line {_line_of(app_py, "QUERY")}, '
                                 "in query"), logged[:6]
            # Nor does a query raising what ends processes or tasks, or answering too deep.
            for word, error in (("exit", "SystemExit"), ("interrupt", "KeyboardInterrupt"),
                                ("cancel", "CancelledError"), ("deep", "nested too deeply")):
                status, body = await asyncio.to_thread(_ask, endpoint, healthy[0],
                                                       {"word": word})
                assert status == 500 and error in body, (word, status, body)
            assert await asyncio.to_thread(_ask, endpoint, healthy[0], {"word": "w0"}) == (
                200, "0")
            assert run.alive, run.log()

            # consume_message raises: its shard fails, the log showing the app's frame.
            poisoned = healthy[0]
            poison = next(i for i in range(10_000, 20_000) if view.shard_of_id(i) == poisoned)
            await view.publish_line(poison, "a poison pill")
            # streamkit's own error (a frame that doesn't decode) stays one line.
            garbage = view.sources_of(healthy[1])[0]
            done = cli("journals", "append", garbage, "--broker", address,
                       input_text="not json\n")
            assert done.returncode == 0, done.stderr

            async def all_failed() -> dict[str, tuple[int, str]] | None:
                codes = await _codes(view)
                return codes if all(c == Code.FAILED for c, _ in codes.values()) else None

            codes = await eventually(all_failed, 30, "the other shards to fail")
            line = _line_of(app_py, "CONSUME")
            assert re.search(
                rf"failed at consume_message on the message at {view.sources_of(poisoned)[0]} "
                rf"offset \d+: "
                rf"RuntimeError: user code blew up on {poison} \(at app.py:{line}\)$",
                codes[poisoned][1]), codes
            logged = _logged(run, f"shard {poisoned} failed: transaction")
            assert logged[1] == "Traceback of the application's code (most recent call last):"
            assert logged[2] == f'  File "{app_py}", line {line}, in consume_message', logged[:6]
            logged = _logged(run, f"shard {healthy[1]} failed: transaction")
            assert "failed at read" in logged[0] and "(at " not in codes[healthy[1]][1], codes
            assert not any(line.startswith("Traceback") for line in logged[1:2]), logged[:4]
            assert run.alive, run.log()
    finally:
        run.stop()


class BrokenHere(WordCount):
    def __init__(self) -> None:
        super().__init__()
        raise ValueError("no words today")


async def test_a_raising_constructor_fails_the_shard_not_the_assignment(
        shared_broker: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """In-process: `assign` goes through and the shard fails, naming the class."""
    async with BrokerClient(shared_broker.address) as client:
        base = unique_name("app")
        journals = await _journals(client, base, 1)
        specs = _specs(base, journals["inputs"])
        app: type[Application] = BrokenHere
        service = Service(_runtime(app, client, tmp_path, journals["outputs"]))
        with caplog.at_level(logging.ERROR, logger="streamkit.app.replica"):
            await service.assign(specs, {sid: 0 for sid in specs})
            replica = service.replicas["shard-000"]
            await eventually(lambda: replica.status.code == Code.FAILED)
        assert replica.status.errors[0].startswith(
            "creating the application (tests.test_app_errors:BrokenHere) failed: "
            "ValueError: no words today (at tests/test_app_errors.py:"), replica.status
        (record,) = [r for r in caplog.records if "shard-000 failed" in r.getMessage()]
        assert not record.exc_info  # the app's frames only, in the message
        assert f'File "{Path(__file__).resolve()}", line' in record.getMessage()
        assert "in __init__" in record.getMessage() and "replica.py" not in record.getMessage()
        await service.stop()
