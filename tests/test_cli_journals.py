"""`streamkit journals …` end to end: the real CLI as a subprocess against real brokers.

Tests on the shared broker work under their own unique name prefix. Setup
and polling use raw gRPC (tests.wire) to stay fast; what is being tested
always goes through the command line.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import click
import grpc
import pytest
import yaml

from streamkit.cli.errors import CliError, explain, reporting_errors
from streamkit.protocol import pb
from streamkit.protocol.fragments import content_path
from streamkit.protocol.spec_tree import load_specs
from tests import wire
from tests.brokerproc import BrokerProcess, free_port
from tests.waiting import LIVENESS, Worker

CLI = [sys.executable, "-m", "streamkit.cli.main", "journals"]


def run(broker: BrokerProcess | str, *args: str, input: bytes | str | None = None,
        timeout: float = 30) -> subprocess.CompletedProcess[bytes]:
    """Run `streamkit journals ARGS --broker …`; never a traceback, whatever the outcome."""
    address = broker if isinstance(broker, str) else broker.address
    data = input.encode() if isinstance(input, str) else input
    result = subprocess.run([*CLI, *args, "--broker", address], input=data,
                            capture_output=True, timeout=timeout)
    assert b"Traceback" not in result.stderr, result.stderr.decode()
    return result


def ok(broker: BrokerProcess | str, *args: str, input: bytes | str | None = None) -> str:
    """stdout of a command that must succeed."""
    result = run(broker, *args, input=input)
    assert result.returncode == 0, result.stderr.decode()
    return result.stdout.decode()


def fails(broker: BrokerProcess | str, *args: str, code: int,
          input: bytes | str | None = None) -> str:
    """stderr of a command that must fail with `code`, in "streamkit: error:" lines."""
    result = run(broker, *args, input=input)
    stderr = result.stderr.decode()
    assert result.returncode == code, (result.returncode, stderr)
    assert stderr.strip() and all(
        line.startswith("streamkit: error: ") for line in stderr.strip().splitlines()
    ), stderr
    return stderr


def prefix() -> str:
    return f"cli-{uuid.uuid4().hex[:10]}/"


def spec_file(tmp_path: Path, text: str, name: str = "specs.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


TREE = """
name: {p}
labels: [{{name: app, value: cli-test}}]
fragment:
  length: 1024
  compression_codec: NONE
  refresh_interval: 1s
children:
  - name: {p}logs/
    labels: [{{name: content-type, value: application/x-ndjson}}]
    children:
      - name: {p}logs/a
      - name: {p}logs/b
  - name: {p}raw
    fragment: {{retention: 1h}}
"""


def create_tree(broker: BrokerProcess, tmp_path: Path) -> str:
    p = prefix()
    ok(broker, "apply", "--specs", spec_file(tmp_path, TREE.format(p=p)))
    return p


# --- apply and list ---------------------------------------------------------------


def test_apply_dry_run_create_round_trip_and_stale(shared_broker: BrokerProcess,
                                                   tmp_path: Path) -> None:
    p = prefix()
    specs = spec_file(tmp_path, TREE.format(p=p))

    out = ok(shared_broker, "apply", "--specs", specs, "--dry-run")
    assert f"would create {p}logs/a" in out and "dry run" in out
    assert p not in ok(shared_broker, "list", "-l", f"prefix={p}")

    out = ok(shared_broker, "apply", "--specs", specs)
    assert all(f"created {p}{name} (revision " in out for name in ("logs/a", "logs/b", "raw"))

    # list -o yaml is an apply-able file that changes nothing.
    listed = ok(shared_broker, "list", "-l", f"prefix={p}", "-o", "yaml")
    out = ok(shared_broker, "apply", "--specs", "-", input=listed)
    assert "0 created, 0 updated, 0 deleted, 3 unchanged" in out

    # An edit of the listing applies, with the changed field shown.
    edited = listed.replace("length: 1024", "length: 2048")
    out = ok(shared_broker, "apply", "--specs", "-", "--max-txn-size", "1", input=edited)
    assert f"updated {p}logs/a" in out and "fragment.length: 1024 -> 2048" in out

    # Editing the first listing again means working from stale revisions.
    stale = listed.replace("length: 1024", "length: 4096")
    revision = yaml.safe_load(listed)["children"][0]["children"][0]["revision"]
    err = fails(shared_broker, "apply", "--specs", "-", input=stale, code=1)
    assert (f"journal {p}logs/a changed since revision {revision} (ETCD_TRANSACTION_FAILED); "
            "re-run list -o yaml and edit again") in err
    assert "length: 2048" in ok(shared_broker, "list", "-l", f"prefix={p}", "-o", "yaml")

    out = ok(shared_broker, "apply", "--specs", "-", "--upsert", input=stale)
    assert "3 updated" in out

    deletion = f"{{name: {p}raw, delete: true, revision: -1}}"
    out = ok(shared_broker, "apply", "--specs", "-", input=deletion)
    assert f"deleted {p}raw (was revision " in out
    assert f"{p}raw" not in ok(shared_broker, "list", "-l", f"prefix={p}")


def test_apply_in_batches_names_what_was_applied_when_one_fails(
        shared_broker: BrokerProcess, tmp_path: Path) -> None:
    """The broker refuses the third of four changes applied one per transaction: the
    error said only the broker's "changes[0]", not that two journals were created."""
    p = prefix()
    text = (f"name: {p}\nfragment: {{length: 1024, compression_codec: NONE}}\nchildren:\n"
            f"  - name: {p}a\n  - name: {p}b\n  - name: {p}c\n    replication: 2\n"
            f"  - name: {p}d\n")
    specs = spec_file(tmp_path, text)
    err = fails(shared_broker, "apply", "--specs", specs, "--max-txn-size", "1", code=2)
    assert f"applying create {p}c failed: the broker rejected the request: " in err, err
    assert f"applied 2 of 4 changes: create {p}a, create {p}b\n" in err, err
    assert f"not applied: create {p}c, create {p}d\n" in err, err
    listed = ok(shared_broker, "list", "-l", f"prefix={p}").splitlines()[1:]
    assert [row.split()[0] for row in listed] == [f"{p}a", f"{p}b"]

    # The same file again: the journals created are unchanged, and nothing else applies.
    err = fails(shared_broker, "apply", "--specs", specs, "--max-txn-size", "1", code=2)
    assert f"applying create {p}c failed" in err and "nothing was applied" in err, err
    specs = spec_file(tmp_path, text.replace("replication: 2", "replication: 1"))
    out = ok(shared_broker, "apply", "--specs", specs, "--max-txn-size", "1")
    assert "2 created, 0 updated, 0 deleted, 2 unchanged" in out, out


async def test_apply_in_batches_names_a_conflict_in_a_later_batch(
        shared_broker: BrokerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another apply of the same file creates a journal between two transactions of this
    one: the error names it, what was applied and what was not, and applying again is done.
    (It said only that journals changed: not that three updates were applied.)"""
    from streamkit.cli import journal_apply
    from streamkit.client import BrokerClient, listing

    p = prefix()
    ok(shared_broker, "apply", "--specs", spec_file(tmp_path, TREE.format(p=p)))
    listed = ok(shared_broker, "list", "-l", f"prefix={p}", "-o", "yaml")
    edited = yaml.safe_dump([yaml.safe_load(listed.replace("length: 1024", "length: 2048")),
                             {"name": f"{p}new", "fragment": {"length": 1024}}])
    entries = load_specs(edited)
    real, calls = listing.apply_journals, []

    async def racing(client: BrokerClient, changes: list[pb.ApplyRequest.Change]) -> object:
        calls.append([c.upsert.name for c in changes])
        if len(calls) == 2:  # the other apply creates the same journal first
            await real(client, [pb.ApplyRequest.Change(
                expect_mod_revision=0, upsert=next(e for e in entries
                                                   if e.spec.name == f"{p}new").spec.to_proto())])
        return await real(client, changes)

    monkeypatch.setattr(listing, "apply_journals", racing)
    async with BrokerClient(shared_broker.address) as client:
        with pytest.raises(CliError) as failed:
            await journal_apply.apply_specs(client, entries, dry_run=False, upsert=False,
                                            max_txn_size=3)
    message = str(failed.value)
    assert calls == [[f"{p}logs/a", f"{p}logs/b", f"{p}raw"], [f"{p}new"]]
    assert "ETCD_TRANSACTION_FAILED" in message and "changed since" not in message, message
    assert (f"applied 3 of 4 changes: update {p}logs/a, update {p}logs/b, update {p}raw\n"
            f"not applied: create {p}new\n") in message, message
    monkeypatch.undo()
    out = ok(shared_broker, "apply", "--specs", "-", "--max-txn-size", "3", input=edited)
    assert "0 created, 0 updated, 0 deleted, 4 unchanged" in out, out


def test_broker_address_from_gazctls_variable(shared_broker: BrokerProcess) -> None:
    """Without --broker: $STREAMKIT_BROKER, else gazctl's $BROKER_ADDRESS (any address form)."""
    name = prefix() + "env"
    wire.create(wire.stub(shared_broker.address), wire.spec(name))
    env = {k: v for k, v in os.environ.items() if k not in ("STREAMKIT_BROKER", "BROKER_ADDRESS")}
    for extra in ({"BROKER_ADDRESS": f"http://{shared_broker.address}"},
                  {"STREAMKIT_BROKER": shared_broker.address, "BROKER_ADDRESS": "127.0.0.1:1"}):
        listed = subprocess.run([*CLI, "list", "-l", f"name={name}"], env={**env, **extra},
                                capture_output=True, text=True, timeout=30)
        assert listed.returncode == 0 and name in listed.stdout, listed.stderr


def test_list_formats_and_selectors(shared_broker: BrokerProcess, tmp_path: Path) -> None:
    p = create_tree(shared_broker, tmp_path)
    selector = f"prefix={p}logs/"

    table = ok(shared_broker, "list", "-l", selector, "--primary").splitlines()
    assert table[0].split() == ["NAME", "LABELS", "CODEC", "LENGTH", "STORES", "REVISION",
                                "PRIMARY"]
    assert [row.split()[0] for row in table[1:]] == [f"{p}logs/a", f"{p}logs/b"]
    assert "NONE" in table[1] and "1KiB" in table[1]

    listed = json.loads(ok(shared_broker, "list", "-l", f"{selector}, app=cli-test", "-o", "json"))
    assert [j["name"] for j in listed] == [f"{p}logs/a", f"{p}logs/b"]
    assert listed[0]["mod_revision"] > 0 and listed[0]["spec"]["fragment"]["length"] == 1024

    entries = load_specs(ok(shared_broker, "list", "-l", f"prefix={p}, !content-type",
                            "-o", "yaml"))
    assert [(e.spec.name, e.revision > 0) for e in entries] == [(f"{p}raw", True)]

    assert ok(shared_broker, "list", "-l", f"prefix={p}, app=other").strip() == (
        "NAME  LABELS  CODEC  LENGTH  STORES  REVISION"
    )


# --- append and read --------------------------------------------------------------


def test_append_raw_and_read_back(shared_broker: BrokerProcess, tmp_path: Path) -> None:
    p = create_tree(shared_broker, tmp_path)
    journal = f"{p}raw"
    first = _noise(700)
    result = run(shared_broker, "append", journal, input=first)
    assert result.returncode == 0 and result.stdout == b""
    assert f"appended 700 bytes to {journal} at offsets [0, 700)" in result.stderr.decode()
    infile = tmp_path / "second.bin"
    infile.write_bytes(b"second")
    ok(shared_broker, "append", journal, "-i", str(infile))

    everything = run(shared_broker, "read", journal).stdout
    assert everything == first + b"second"
    assert run(shared_broker, "read", journal, "--offset", "700").stdout == b"second"
    assert run(shared_broker, "read", journal, "--tail").stdout == b""
    assert run(shared_broker, "read", journal, "--offset", "706").returncode == 0

    # An offset past the head reads nothing: said (it exited 0 as if nothing were new, and
    # --offsets-out saved the offset); the offsets saved are those given.
    out, given = tmp_path / "offsets.json", tmp_path / "given.json"
    given.write_text(json.dumps({journal: 9000}))
    for how in (["--offset", "9000"], ["--offsets", str(given)]):
        err = fails(shared_broker, "read", journal, *how, "--offsets-out", str(out), code=2)
        assert f"{journal}: offset 9,000 is past its write head 706" in err
        assert json.loads(out.read_text()) == {journal: 9000}
    err = fails(shared_broker, "read", f"{p}logs/a", "--offset", "9", "--messages", code=2)
    assert f"{p}logs/a: offset 9 is past its write head 0" in err

    # Raw appends need exactly one journal.
    err = fails(shared_broker, "append", "-l", f"prefix={p}", input="x", code=2)
    assert "exactly one journal" in err


def test_append_lines_spread_over_journals(shared_broker: BrokerProcess,
                                           tmp_path: Path) -> None:
    p = create_tree(shared_broker, tmp_path)
    selector = f"prefix={p}logs/"
    lines = [json.dumps({"n": i, "pad": "x" * (i % 37)}) for i in range(400)]
    result = run(shared_broker, "append", "-l", selector, "-f", "lines",
                 input="\n".join(lines))  # the last line has no newline: it gets one
    assert result.returncode == 0, result.stderr
    assert sum(int(line.split()[1]) for line in result.stderr.decode().splitlines()) == 400

    by_journal = {j: ok(shared_broker, "read", j).splitlines() for j in (f"{p}logs/a",
                                                                          f"{p}logs/b")}
    assert all(by_journal.values()), "random mapping used only one journal"
    assert Counter(itertools.chain.from_iterable(by_journal.values())) == Counter(lines)
    # Reading both through the selector keeps every line whole.
    assert Counter(ok(shared_broker, "read", "-l", selector).splitlines()) == Counter(lines)

    direct = f"{p}logs/b\tto-b\n{p}logs/a\tto-a\n"
    ok(shared_broker, "append", "-l", selector, "-f", "lines", "-m", "direct", input=direct)
    assert ok(shared_broker, "read", f"{p}logs/a").endswith("to-a\n")
    err = fails(shared_broker, "append", "-l", selector, "-f", "lines", "-m", "direct",
                input="elsewhere/x\ty\n", code=2)
    assert "input line 1" in err


def _topic(broker: BrokerProcess, count: int, **spec: object) -> tuple[str, list[str]]:
    """A selector and the sorted names of `count` new journals it matches."""
    topic = f"cli-{uuid.uuid4().hex[:10]}"
    names = [f"{topic}/part-{i:02d}" for i in range(count)]
    wire.create(wire.stub(broker.address),
                *(wire.spec(n, labels={"topic": topic}, **spec) for n in names))
    return f"topic={topic}", names


@pytest.mark.parametrize(("mapping", "given"), [("modulo", True), ("direct", True),
                                                ("random", False)])
def test_a_failed_line_append_accounts_exactly_for_what_was_appended(
        tmp_path: Path, mapping: str, given: bool) -> None:
    """The broker's disk fills part-way: the error said only the broker's, so an operator
    could not tell what to append again. It says how many lines were appended (by journal),
    and --unpublished gets the rest, whose append then completes the input exactly once."""
    broker = BrokerProcess(tmp_path / "broker", fsize_limit=256 << 10).start()
    try:
        selector, names = _topic(broker, 3)
        records = [json.dumps({"n": n, "pad": "x" * 24}) for n in range(20000)]
        lines = ([f"{names[n % 3]}\t{r}" for n, r in enumerate(records)]
                 if mapping == "direct" else records)
        rest = tmp_path / "rest.txt"
        args = ["append", "-l", selector, "-f", "lines", "-m", mapping]
        more = ["--unpublished", str(rest)] if given else []
        err = fails(broker, *args, *more, input="\n".join(lines) + "\n", code=1)
        assert len(err.strip().splitlines()) == 1, err
        assert "RESOURCE_EXHAUSTED" in err and " lines read were appended, " in err, err
        assert "(appended to " in err and " of its " in err, err
        if not given:
            assert "would append the appended ones twice" in err, err
            return
        assert f"are in {rest}: append it with the same options to finish" in err, err
        broker.kill()
        broker.fsize_limit = None
        broker.start()
        ok(broker, *args, "-i", str(rest))
        stub = wire.stub(broker.address)
        landed = Counter(line for name in names
                         for line in wire.read(stub, name)[0].decode().splitlines())
        assert landed == Counter(records)
        if mapping == "direct":
            for name in names:
                numbers = [json.loads(r)["n"] for r in wire.read(stub, name)[0].splitlines()]
                assert all(names[n % 3] == name for n in numbers)
    finally:
        broker.kill()


def test_a_failed_raw_append_says_nothing_was_appended(shared_broker: BrokerProcess,
                                                       tmp_path: Path) -> None:
    """A raw append commits whole or not at all: the error said only the broker's answer."""
    _, (name,) = _topic(shared_broker, 1, flags=pb.JournalSpec.O_RDONLY)
    err = fails(shared_broker, "append", name, input=b"whole", code=1)
    assert "NOT_ALLOWED" in err and f"nothing was appended to {name}" in err, err
    rest = tmp_path / "rest.bin"
    err = fails(shared_broker, "append", name, "--unpublished", str(rest), input=b"whole",
                code=1)
    assert f"the input is in {rest}: append it to finish" in err, err
    assert rest.read_bytes() == b"whole"


def _noise(size: int) -> bytes:
    """`size` incompressible bytes, the same on every run (seeded by the size)."""
    return random.Random(size).randbytes(size)


def _lines_of(stream) -> tuple[queue.Queue[bytes], Worker]:
    """The lines a pipe yields, collected by a thread so a test can wait with a timeout;
    join the thread (once the pipe ended) to have its failure, if any, raised."""
    lines: queue.Queue[bytes] = queue.Queue()

    def pump() -> None:
        for line in iter(stream.readline, b""):
            lines.put(line)

    pump_thread = Worker(pump, name="stdout pump")
    pump_thread.start()
    return lines, pump_thread


def test_read_tail_block_sees_later_append_and_stops_on_sigint(
    shared_broker: BrokerProcess, tmp_path: Path
) -> None:
    p = create_tree(shared_broker, tmp_path)
    journal = f"{p}logs/a"
    stub = wire.stub(shared_broker.address)
    wire.append(stub, journal, b"early\n")
    offsets = tmp_path / "offsets.json"
    proc = subprocess.Popen([*CLI, "read", journal, "--tail", "--block", "--offsets-out",
                             str(offsets), "--broker", shared_broker.address],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        seen, pump = _lines_of(proc.stdout)
        first = None
        for attempt in range(60):  # until the reader, once started, sees one
            wire.append(stub, journal, f"late-{attempt}\n".encode())
            try:
                first = seen.get(timeout=0.5)
                break
            except queue.Empty:
                continue
        assert first is not None and first.startswith(b"late-")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=LIVENESS) == 0
        pump.join()  # the pipe ended with the process
    finally:
        proc.kill()
    assert b"Traceback" not in proc.stderr.read()
    head = wire.read(stub, journal)[1][-1].write_head
    assert json.loads(offsets.read_text()) == {journal: head}


def test_read_into_closed_pipe_is_quiet(shared_broker: BrokerProcess, tmp_path: Path) -> None:
    p = create_tree(shared_broker, tmp_path)
    stub = wire.stub(shared_broker.address)
    wire.append(stub, f"{p}raw", _noise(1 << 20))
    proc = subprocess.Popen([*CLI, "read", f"{p}raw", "--broker", shared_broker.address],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert len(proc.stdout.read(10)) == 10
    proc.stdout.close()  # as `| head -c 10` does
    assert proc.wait(timeout=LIVENESS) == 0
    assert proc.stderr.read() == b""


# --- fragments and prune ----------------------------------------------------------


def _persisted(stub, journal: str, count: int) -> list[pb.Fragment]:
    """Wait until `count` fragments of `journal` are persisted; returns them."""

    def stored() -> list[pb.Fragment]:
        found = [f for f in wire.fragments(stub, journal) if f.backing_store]
        return found if len(found) >= count else []

    return wire.wait_until(stored)


def _roll(stub, journal: str, *sizes: int) -> None:
    """Appends of these sizes; each one after the first rolls a fragment over 1 KiB."""
    for size in sizes:
        wire.append(stub, journal, _noise(size))


def test_fragments_after_rollover(shared_broker: BrokerProcess, tmp_path: Path) -> None:
    p = create_tree(shared_broker, tmp_path)
    journal = f"{p}raw"
    stub = wire.stub(shared_broker.address)
    _roll(stub, journal, 1500, 10)
    persisted = _persisted(stub, journal, 1)[0]
    stored = shared_broker.data_dir / "fragments" / content_path(persisted)
    assert stored.exists()

    listed = json.loads(ok(shared_broker, "fragments", journal, "-o", "json"))
    assert [(f["begin"], f["end"], f["backing_store"]) for f in listed] == [
        (0, 1500, "file:///"), (1500, 1510, "")]
    assert listed[0]["url"].endswith(persisted.journal + "/" + stored.name)
    assert listed[0]["compression_codec"] == "NONE" and listed[0]["mod_time"] > 0

    table = ok(shared_broker, "fragments", "-l", f"prefix={p}", "--url-ttl", "0").splitlines()
    assert table[0].split()[:3] == ["JOURNAL", "BEGIN", "END"]
    assert "(local)" in table[2] and table[1].rstrip().endswith("-")
    assert json.loads(ok(shared_broker, "fragments", journal, "--to", "2000-01-01T00:00:00Z",
                         "-o", "json")) == []


def test_prune_deletes_expired_but_keeps_the_last(shared_broker: BrokerProcess,
                                                  tmp_path: Path) -> None:
    p = prefix()
    journal = f"{p}short"
    ok(shared_broker, "apply", "--specs", spec_file(tmp_path, f"""
name: {journal}
fragment: {{length: 1024, compression_codec: GZIP, refresh_interval: 1s, retention: 1s}}
"""))
    stub = wire.stub(shared_broker.address)
    _roll(stub, journal, 1500, 1500, 10)
    old, last = _persisted(stub, journal, 2)
    # Kept: not synchronisation with another process, but waiting for the wall clock that
    # the retention rule reads (mod_time in whole seconds, retention 1 s) to pass both.
    time.sleep(max(0.0, last.mod_time + 2.1 - time.time()))  # both are past retention
    root = shared_broker.data_dir / "fragments"
    files = [root / content_path(f) for f in (old, last)]

    selector = f"name={journal}"
    out = ok(shared_broker, "prune", "-l", selector, "--dry-run", "--file-root", str(root))
    assert f"would delete {journal} [0, 1500)" in out and "[1500, 3000)" not in out
    assert all(f.exists() for f in files)

    # Another directory finds none of them: an error (it said "deleted 0 fragments").
    wrong = tmp_path / "not-the-root"
    for dry in ([], ["--dry-run"]):
        err = fails(shared_broker, "prune", "-l", selector, *dry, "--file-root", str(wrong),
                    code=1)
        assert "1 fragment listed by the broker was not found" in err, err
        assert f"is --file-root {wrong} the broker's?" in err, err

    out = ok(shared_broker, "prune", "-l", selector, "--file-root", str(root))
    assert f"deleted {journal} [0, 1500)" in out and "deleted 1 fragment" in out
    assert not files[0].exists() and files[1].exists()

    # Journals without retention keep everything.
    q = create_tree(shared_broker, tmp_path)
    _roll(stub, f"{q}logs/a", 1500, 1500, 10)
    _persisted(stub, f"{q}logs/a", 2)
    out = ok(shared_broker, "prune", "-l", f"prefix={q}", "--file-root", str(root))
    assert "deleted 0 fragments" in out


# --- errors -----------------------------------------------------------------------


ERROR_CASES = {
    "bad yaml": (["apply", "--specs", "{file}"], "name: [oops\n", 2, "invalid YAML: line 2"),
    "invalid field": (["apply", "--specs", "{file}"],
                      "name: cli-x/j\nfragment: {length: 12}\n", 2,
                      'journal "cli-x/j": fragment.length: must be between 1024'),
    "missing file": (["apply", "--specs", "{missing}"], None, 2, "cannot read spec file"),
    "unknown journal": (["read", "cli-none/such"], None, 1,
                        "journal cli-none/such not found (JOURNAL_NOT_FOUND)"),
    "invalid name": (["append", "../up"], None, 2, "invalid journal name"),
    "bad selector": (["list", "-l", "app in (a"], None, 2, "bad label selector"),
    "no match": (["read", "-l", "app=cli-nothing-has-this"], None, 1, "no journal matches"),
    "target twice": (["read", "cli-x/j", "-l", "a=b"], None, 2, "one JOURNAL or"),
}


@pytest.mark.parametrize("case", ERROR_CASES, ids=list(ERROR_CASES))
def test_user_errors_are_one_clean_line(shared_broker: BrokerProcess, tmp_path: Path,
                                        case: str) -> None:
    args, content, code, message = ERROR_CASES[case]
    file = spec_file(tmp_path, content or "")
    args = [a.format(file=file, missing=tmp_path / "missing.yaml") for a in args]
    err = fails(shared_broker, *args, code=code)
    assert message in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("address", "said"), [("ftp://x:1", "scheme must be https://"),
                                               ("nonsense::", "address 'nonsense::'")])
def test_a_malformed_broker_address_is_bad_input(address: str, said: str) -> None:
    err = fails(address, "list", code=2)  # it exited 1
    assert said in err and len(err.strip().splitlines()) == 1, err


def test_unreachable_broker(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    for args in (["list"], ["read", "cli-x/j", "--block"], ["append", "cli-x/j"]):
        err = fails(address, *args, input="x", code=1)
        assert err.startswith(f"streamkit: error: cannot reach broker at {address}: ")


def test_error_mapping_in_process(monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Failures that are awkward to provoke from outside, checked on the policy itself."""
    rejected = grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, None, None,
                                    details="journal: must be 4 to 512 characters")
    assert explain(rejected) == (
        ["the broker rejected the request: journal: must be 4 to 512 characters"], 2)
    assert explain(CliError("a\nb", 3)) == (["a", "b"], 3)

    monkeypatch.delenv("STREAMKIT_DEBUG", raising=False)
    with pytest.raises(click.exceptions.Exit) as exited, reporting_errors():
        raise RuntimeError("boom\nagain")
    assert exited.value.exit_code == 1
    err = capsys.readouterr().err
    assert err == ("streamkit: error: unexpected RuntimeError: boom again "
                   "(run with STREAMKIT_DEBUG=1 for a traceback)\n")

    monkeypatch.setenv("STREAMKIT_DEBUG", "1")
    with pytest.raises(click.exceptions.Exit), reporting_errors():
        raise RuntimeError("boom")
    assert "Traceback" in capsys.readouterr().err
