"""`streamkit publish` end to end: the CLI as a subprocess against the shared broker."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest

from streamkit.cli.line_input import READ_SIZE as _READ_SIZE
from streamkit.cli.line_input import LineInput
from streamkit.cli.unsettled import Unsettled, keep_unknown, outcome_unknown
from streamkit.client import OpFuture, TransportError
from streamkit.client.errors import broker_error
from streamkit.message.mapping import fnv1a32
from streamkit.message.uuid import UUID, Flags, parse_uuid
from streamkit.protocol import pb
from tests import wire
from tests.brokerproc import BrokerProcess, free_port

CLI = [sys.executable, "-m", "streamkit.cli.main", "publish"]


def run(address: str, *args: str, input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    result = subprocess.run([*CLI, *args, "--broker", address], input=input,
                            capture_output=True, timeout=60)
    assert b"Traceback" not in result.stderr, result.stderr.decode()
    return result


def failure(address: str, *args: str, code: int, input: bytes | None = None) -> str:
    """The single "streamkit: error:" line of a command that must fail with `code`."""
    result = run(address, *args, input=input)
    stderr = result.stderr.decode().strip()
    assert result.returncode == code, (result.returncode, stderr)
    assert len(stderr.splitlines()) == 1 and stderr.startswith("streamkit: error: "), stderr
    return stderr


def make_topic(broker: BrokerProcess, count: int) -> tuple[str, list[str]]:
    """A selector and the sorted names of `count` new ndjson journals it matches."""
    topic = f"clip-{uuid.uuid4().hex[:10]}"
    names = [f"{topic}/part-{i:02d}" for i in range(count)]
    labels = {"content-type": "application/x-ndjson", "topic": topic}
    wire.create(wire.stub(broker.address), *(wire.spec(n, labels=labels) for n in names))
    return f"topic={topic}", names


def contents(broker: BrokerProcess, names: list[str]) -> dict[str, list[dict[str, Any]]]:
    stub = wire.stub(broker.address)
    return {name: [orjson.loads(line) for line in wire.read(stub, name)[0].splitlines()]
            for name in names}


def json_lines(messages: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(m) + b"\n" for m in messages)


def rendezvous(key: str, names: list[str]) -> str:
    digest = fnv1a32(key.encode())
    scores = [digest ^ fnv1a32(name.encode()) for name in names]
    return names[scores.index(max(scores))]


def modulo(key: str, names: list[str]) -> str:
    return names[fnv1a32(key.encode()) % len(names)]


@pytest.mark.parametrize("kind", ["modulo", "rendezvous"])
def test_keyed_lines_land_once_where_the_mapping_says(shared_broker: BrokerProcess,
                                                      kind: str) -> None:
    selector, names = make_topic(shared_broker, 3)
    messages = [{"n": n, "user": f"u{n % 11}", "text": "hello"} for n in range(300)]
    args = ["-l", selector, "--key", "user"] + (["-m", kind] if kind != "modulo" else [])
    result = run(shared_broker.address, *args, input=json_lines(messages))
    assert result.returncode == 0, result.stderr.decode()
    expected = modulo if kind == "modulo" else rendezvous
    # Topic names are random, so the 11 keys may well avoid one of the journals.
    used = len({expected(m["user"], names) for m in messages})
    plural = "journal" if used == 1 else "journals"
    assert f"published 300 messages to {used} {plural}" in result.stderr.decode()

    landed = contents(shared_broker, names)
    numbers = []
    for journal, lines in landed.items():
        producers = set()
        for line in lines:
            assert expected(line["user"], names) == journal
            producer, _, flags = parse_uuid(UUID(line["uuid"]))
            assert flags == Flags.OUTSIDE_TXN
            producers.add(producer)
            numbers.append(line["n"])
        assert len(producers) == (1 if lines else 0)  # one publisher wrote them all
    assert sorted(numbers) == list(range(300))


def test_random_from_a_file_without_key(shared_broker: BrokerProcess, tmp_path: Path) -> None:
    selector, names = make_topic(shared_broker, 2)
    source = tmp_path / "in.jsonl"
    source.write_bytes(json_lines([{"n": n} for n in range(500)]) + b"\n\n{\"n\": 500}")
    result = run(shared_broker.address, "-l", selector, "-i", str(source))
    assert result.returncode == 0, result.stderr.decode()
    assert "published 501 messages to 2 journals" in result.stderr.decode()
    landed = contents(shared_broker, names)
    assert all(landed.values())  # 500 random picks use both journals
    assert sorted(m["n"] for lines in landed.values() for m in lines) == list(range(501))


def test_bad_line_stops_after_publishing_the_lines_before(shared_broker: BrokerProcess) -> None:
    selector, names = make_topic(shared_broker, 2)
    text = b'{"n": 0, "k": "a"}\n{"n": 1, "k": "b"}\n{"n": 2, oops}\n{"n": 3, "k": "c"}\n'
    err = failure(shared_broker.address, "-l", selector, "--key", "k", input=text, code=2)
    assert "input line 3: invalid JSON" in err and "2 messages before it" in err
    landed = contents(shared_broker, names)
    assert sorted(m["n"] for lines in landed.values() for m in lines) == [0, 1]


@pytest.mark.parametrize("given", [True, False], ids=["unpublished-file", "no-file"])
def test_a_failed_append_accounts_exactly_for_what_committed(tmp_path: Path,
                                                             given: bool) -> None:
    """The broker's disk fills part-way: the command fails saying how many messages
    committed, and with --unpublished writes the rest, whose publishing then completes the
    input exactly once (a retry of the whole input published the committed part twice)."""
    broker = BrokerProcess(tmp_path / "broker", fsize_limit=256 << 10).start()
    try:
        selector, names = make_topic(broker, 2)
        messages = [{"n": n, "k": f"k{n % 97}", "pad": "x" * 24} for n in range(20000)]
        rest = tmp_path / "rest.jsonl"
        more = ["--unpublished", str(rest)] if given else []
        done = run(broker.address, "-l", selector, "--key", "k", *more,
                   input=json_lines(messages))
        # (Progress lines may come first, one a second: a slow machine's run takes longer.)
        err = done.stderr.decode().strip().splitlines()[-1]
        assert done.returncode == 1 and err.startswith("streamkit: error: "), err
        assert "RESOURCE_EXHAUSTED" in err and "were committed" in err, err
        if not given:
            assert "would publish the committed ones twice" in err, err
            return
        assert f"are in {rest}: publish it to finish" in err, err
        broker.kill()
        broker.fsize_limit = None
        broker.start()
        result = run(broker.address, "-l", selector, "--key", "k", "-i", str(rest))
        assert result.returncode == 0, result.stderr.decode()
        landed = contents(broker, names)
        assert sorted(m["n"] for lines in landed.values() for m in lines) == list(range(20000))
    finally:
        broker.kill()


def test_a_bad_line_after_a_failed_append_is_left_to_publish_again(
        shared_broker: BrokerProcess, tmp_path: Path) -> None:
    """Appends to a read-only journal fail while later lines are read; a bad line among
    them reports the failed append, and --unpublished holds every line not committed: the
    bad one and those after it in its batch too (they were dropped)."""
    topic = f"clip-{uuid.uuid4().hex[:10]}"
    labels = {"content-type": "application/x-ndjson", "topic": topic}
    wire.create(wire.stub(shared_broker.address),
                wire.spec(f"{topic}/ro", labels=labels, flags=pb.JournalSpec.O_RDONLY))
    text = b'{"n": 1}\n{"n": 2}\nnot json\n{"n": 4}\n'
    rest = tmp_path / "rest.jsonl"
    err = failure(shared_broker.address, "-l", f"topic={topic}", "--unpublished", str(rest),
                  input=text, code=1)
    assert "NOT_ALLOWED" in err and "0 of the 2 messages read were committed" in err, err
    assert "the input after line 2" in err, err
    assert rest.read_bytes() == text


@pytest.mark.parametrize(("text", "args", "code", "message"), [
    (b'{"n": 0}\n', ["--key", "user"], 2, "input line 1: the message has no field 'user'"),
    (b'[1, 2]\n', [], 2, "input line 1: expected a JSON object, got list"),
    (b'{}\n', ["-m", "rendezvous"], 2, "--mapping rendezvous needs --key FIELD"),
])
def test_user_errors(shared_broker: BrokerProcess, text: bytes, args: list[str], code: int,
                     message: str) -> None:
    selector, _ = make_topic(shared_broker, 1)
    err = failure(shared_broker.address, "-l", selector, *args, input=text, code=code)
    assert message in err


def test_a_bad_line_leaves_it_and_the_rest_in_unpublished(shared_broker: BrokerProcess,
                                                          tmp_path: Path) -> None:
    """With --unpublished, a bad line (exit 2) leaves it and the input after it there, to
    publish once fixed: the file was left empty beside the advice to publish it."""
    selector, names = make_topic(shared_broker, 1)
    rest = tmp_path / "rest.jsonl"
    text = b'{"n": 1}\n{"n": 2}\nnot json\n{"n": 4}\n'
    err = failure(shared_broker.address, "-l", selector, "--unpublished", str(rest),
                  input=text, code=2)
    assert "input line 3: " in err and f"it and the input after it are in {rest}" in err, err
    assert rest.read_bytes() == b'not json\n{"n": 4}\n'
    assert [m["n"] for m in contents(shared_broker, names)[names[0]]] == [1, 2]


def test_no_matching_journal_and_bad_selector(shared_broker: BrokerProcess) -> None:
    err = failure(shared_broker.address, "-l", "topic=none-such", input=b"{}\n", code=1)
    assert "no journals match selector 'topic=none-such'" in err
    err = failure(shared_broker.address, "-l", "not a selector!", input=b"{}\n", code=2)
    assert "bad label selector" in err


def test_journals_without_a_message_framing_are_refused(shared_broker: BrokerProcess) -> None:
    topic = f"clip-{uuid.uuid4().hex[:10]}"
    wire.create(wire.stub(shared_broker.address), wire.spec(f"{topic}/raw", labels={"tp": topic}))
    err = failure(shared_broker.address, "-l", f"tp={topic}", input=b"{}\n", code=2)
    assert f"{topic}/raw" in err and "content-type" in err


def test_unreachable_broker(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    err = failure(address, "-l", "topic=x", input=b"{}\n", code=1)
    assert f"cannot reach broker at {address}" in err

    # With --unpublished, the whole input is left there (the file was left as it was: a
    # retry loop following the docs published a stale file's lines).
    rest = tmp_path / "rest.jsonl"
    rest.write_text("STALE\n")
    done = run(address, "-l", "topic=x", "--unpublished", str(rest), input=b'{"n": 1}\n{"n": 2}')
    lines = done.stderr.decode().strip().splitlines()
    assert done.returncode == 1 and f"cannot reach broker at {address}" in lines[-1], lines
    assert f"nothing was published; the input is in {rest}" in lines[0], lines
    assert rest.read_bytes() == b'{"n": 1}\n{"n": 2}'

    # Naming the input itself (the natural retry) emptied it before reading: refused.
    for how in (["-i", str(rest)], []):
        with rest.open("rb") as stdin:
            done = subprocess.run([*CLI, "-l", "topic=x", *how, "--unpublished", str(rest),
                                   "--broker", address], stdin=stdin,
                                  capture_output=True, timeout=60)
        assert done.returncode == 2 and b"is the input" in done.stderr, done.stderr
        assert rest.read_bytes() == b'{"n": 1}\n{"n": 2}'


async def test_lines_longer_than_a_read_are_whole() -> None:
    """A line spanning many reads (joined once, not at each read: a 70 MB line took 15 s)."""
    long = b'{"pad": "' + b"y" * (3 * _READ_SIZE + 5) + b'"}'
    text = b"{}\n" + long + b"\n\n{}\n" + long
    reader, lines = LineInput(io.BytesIO(text)), []
    while (batch := await reader.batch()) is not None:
        lines += batch
    assert lines == [b"{}", long, b"", b"{}", long]


async def test_appends_whose_outcome_is_unknown_are_kept_apart(tmp_path: Path) -> None:
    """An append whose answer was lost (INTERNAL, a deadline) may have committed: its lines
    were written to --unpublished, whose publishing then appended them twice. They are
    counted apart and kept in FILE.unknown; a broker's refusal is not committed, for sure."""
    unsettled = Unsettled()
    lost, refused, landed = OpFuture(), OpFuture(), OpFuture()
    for number, future in enumerate((lost, refused, landed, lost), start=1):
        unsettled.add(future, number, f"line {number}".encode())
    lost.fail(TransportError("append to j/a", "INTERNAL", "stream reset"))
    refused.fail(broker_error(pb.NOT_ALLOWED, "append to j/b"))
    landed.resolve(pb.AppendResponse(status=pb.OK))
    assert await unsettled.failed() == [(2, b"line 2")]
    assert await unsettled.unknown() == [(1, b"line 1"), (4, b"line 4")]
    assert outcome_unknown(TransportError("x", "DEADLINE_EXCEEDED", ""))
    assert not outcome_unknown(TransportError("x", "UNAVAILABLE", ""))

    with (tmp_path / "rest").open("wb") as kept:
        said = keep_unknown(await unsettled.unknown(), kept, b"\n")
    assert said.startswith(", and 2 unknown (the broker's answer was lost"), said
    assert (tmp_path / "rest.unknown").read_bytes() == b"line 1\nline 4\n"


@pytest.mark.parametrize("from_file", [True, False], ids=["file", "pipe"])
def test_ctrl_c_accounts_for_what_committed(shared_broker: BrokerProcess, tmp_path: Path,
                                            from_file: bool) -> None:
    """Ctrl-C part-way: publishing stops between lines, what was published settles, and the
    account says how much committed; --unpublished gets the rest (a file's unread input too,
    a pipe's lines read), so that publishing it finishes the job once. It was left empty,
    as if everything had committed."""
    selector, names = make_topic(shared_broker, 2)
    total = 1_500_000  # seconds of publishing: it is interrupted a second in
    source = tmp_path / "in.jsonl"
    source.write_bytes(json_lines([{"n": n, "k": f"k{n % 97}"} for n in range(total)]))
    rest = tmp_path / "rest.jsonl"
    args = [*CLI, "--broker", shared_broker.address, "-l", selector, "--key", "k",
            "--unpublished", str(rest)]
    with open(source, "rb") as given:
        proc = subprocess.Popen([*args, *(["-i", str(source)] if from_file else [])],
                                stdin=subprocess.DEVNULL if from_file else subprocess.PIPE,
                                stderr=subprocess.PIPE)
        if not from_file:  # a producer writing as the command reads, until it exits
            feeder = threading.Thread(target=_feed, args=(given, proc.stdin), daemon=True)
            feeder.start()
        assert proc.stderr is not None
        first = proc.stderr.readline()  # "published N messages (R/s)", a second in
        assert first.startswith(b"published "), first
        proc.send_signal(signal.SIGINT)
        err = proc.stderr.read().decode()
        assert proc.wait(30) == 130, err
    account = err.strip().splitlines()[-1]
    assert account.startswith("streamkit: error: interrupted: ") and "committed" in account, err
    landed = [m["n"] for lines in contents(shared_broker, names).values() for m in lines]
    kept = [orjson.loads(line)["n"] for line in rest.read_bytes().splitlines()]
    assert 0 < len(landed) < total and (kept or not from_file), (len(landed), len(kept))
    if not from_file:  # (a pipe's lines read are kept, if any; it is read no further)
        assert "the input after them was not read" in account, account
    assert sorted(landed + kept) == (list(range(total)) if from_file
                                     else list(range(len(landed) + len(kept)))), account


def _feed(source: Any, pipe: Any) -> None:
    with contextlib.suppress(OSError):  # (the command exited: a broken pipe)
        shutil.copyfileobj(source, pipe)
        pipe.close()


@pytest.mark.parametrize("idle", [False, True], ids=["streaming", "idle-pipe"])
def test_ctrl_c_of_a_lines_append_accounts_for_what_landed(shared_broker: BrokerProcess,
                                                           tmp_path: Path, idle: bool) -> None:
    """`journals append -f lines` from a producer's pipe, Ctrl-C part-way (or while the pipe
    is idle, which waited for the producer's end): the same account as publish's, and every
    line fed is in the journals, in --unpublished (read, not appended) or still in the pipe;
    only a line split by the stop may be missing, and the account says so."""
    selector, names = make_topic(shared_broker, 2)
    rest = tmp_path / "rest.jsonl"
    read_end, write_end = os.pipe()  # ours: what the command left unread stays readable
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamkit.cli.main", "journals", "append", "-l", selector,
         "-f", "lines", "-m", "modulo", "--broker", shared_broker.address,
         "--unpublished", str(rest)], stdin=read_end, stderr=subprocess.PIPE)
    fed = _Fed()
    writer = os.fdopen(write_end, "wb")
    feeder = threading.Thread(target=_trickle, args=(writer, fed, 5_000 if idle else 10**6),
                              daemon=True)
    feeder.start()
    stub = wire.stub(shared_broker.address)

    def landed_count() -> int:
        return sum(wire.read(stub, name)[1][-1].write_head for name in names)

    deadline = time.monotonic() + 30
    while landed_count() == 0 or (idle and (feeder.is_alive() or landed_count() < fed.bytes)):
        assert time.monotonic() < deadline, "nothing (or not everything) appended"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    assert proc.stderr is not None
    err = proc.stderr.read().decode()
    assert proc.wait(30) == 130, err
    fed.stop = True  # what the feeder still writes is read here, as unread by the command
    os.set_blocking(read_end, False)
    left = b""
    while feeder.is_alive():
        with contextlib.suppress(BlockingIOError):
            left += os.read(read_end, 1 << 20)
        time.sleep(0.01)
    writer.close()
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(read_end, 1 << 20):
            left += chunk
    os.close(read_end)
    account = err.strip().splitlines()[-1]
    assert account.startswith("streamkit: error: interrupted: "), err
    landed = [m["n"] for lines in contents(shared_broker, names).values() for m in lines]
    kept = [orjson.loads(line)["n"] for line in rest.read_bytes().splitlines()]
    unread = []
    for line in left.splitlines():
        with contextlib.suppress(ValueError):  # (the end of a line the stop split)
            unread.append(orjson.loads(line)["n"])
    missing = set(range(fed.lines)) - set(landed + kept + unread)
    assert len(landed + kept + unread) == len(set(landed + kept + unread)), account
    assert len(missing) <= 1 and (not missing or "of a line begun were" in account), (
        sorted(missing)[:5], account)
    if idle:
        assert len(landed) == fed.lines and not kept and not unread, account


class _Fed:
    lines = 0
    bytes = 0
    stop = False


def _trickle(pipe: Any, fed: _Fed, count: int) -> None:
    """A producer: a thousand lines every 10 ms, until `count` or the command stops
    reading; `fed` counts what was written (the pipe stays open after)."""
    with contextlib.suppress(OSError):
        for start in range(0, count, 1000):
            if fed.stop:
                break
            data = json_lines([{"n": n} for n in range(start, start + 1000)])
            pipe.write(data)
            pipe.flush()
            fed.lines, fed.bytes = start + 1000, fed.bytes + len(data)
            time.sleep(0.01)


async def test_stop_on_signals_gives_the_commands_own_handling_back() -> None:
    """Inside, Ctrl-C and SIGTERM set the stop event; after, SIGTERM cancels the command again
    (as `async_command` has it) and Ctrl-C is asyncio.run's: it was left killing the process
    outright, skipping the command's cleanups."""
    from streamkit.cli.unsettled import stop_on_signals

    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    loop.add_signal_handler(signal.SIGTERM, task.cancel)  # what the command runs under
    sigint = signal.getsignal(signal.SIGINT)
    try:
        async with stop_on_signals() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(stop.wait(), 5)
        assert signal.getsignal(signal.SIGINT) == sigint
        with pytest.raises(asyncio.CancelledError):
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(5)
        task.uncancel()
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
