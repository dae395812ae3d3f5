"""`streamkit run` and `streamkit serve`: running an application's shards.

`run` is the one-machine experience: it starts the bundled broker (unless
`--broker` names one), creates the app's journals and shard specs, runs the
shards in this process (plus `--workers - 1` worker processes that share them
through the KeySpace), and shows their live status. Ctrl-C stops gracefully:
every primary commits what it consumed, and running again resumes there.
`run` supervises the bundled broker: if it dies, `run` says so and starts it
again on the same port and data (the shards' clients reconnect; appends the
broker acknowledged survive), giving up after a few quick failures in a row.

`serve` is one member process alone, for running an app's shards across
machines against a shared broker and KeySpace.

Both take the security options (`security_options`): the member dials the
broker and other members with them, and its Shard API and HTTP API serve TLS
and check tokens with them. `run` hands them to its workers and its bundled
broker through the environment (keys stay out of command lines), so with keys
the bundled broker requires tokens too, and with --tls-cert it serves TLS.

`run` starts its bundled broker and worker processes first thing, then loads
the app and imports the member's stacks while they start (their start is mostly
imports too, on the other cores); so this module imports those stacks inside the
commands, not at its top.

A member that stops itself because one of its loops failed (see
`streamkit.app.member`) ends `run` and `serve` with exit code 1 and a line naming the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from streamkit.app.app_folder import bundled_fragments, data_dir_of, is_app_folder
from streamkit.app.gc_tuning import hold_collections
from streamkit.app.store_kinds import STORE_KINDS
from streamkit.app.waits import first_of
from streamkit.app.work_dirs import hold_work_dir, remove_abandoned
from streamkit.auth.settings import Exposed, Security
from streamkit.broker.data_lock import data_dir_holder
from streamkit.cli.children import Child, Supervisor, port_in_use, start_child
from streamkit.cli.errors import DATA_ERROR, CliError, async_command, warn
from streamkit.cli.logs import configure_logging
from streamkit.cli.params import Seconds
from streamkit.cli.security_options import security_env, security_options
from streamkit.client.environment import BROKER_ENV
from streamkit.process_limits import raise_open_file_limit
from streamkit.process_lock import Held, Holder, ProcessLock
from streamkit.signal_safe import Waker
from streamkit.tasks import cancel_and_wait

if TYPE_CHECKING:
    from streamkit.app.config import AppConfig
    from streamkit.app.member import Member
    from streamkit.app.watchdog import Stuck
    from streamkit.client import BrokerClient
    from streamkit.keyspace.keyspace import KeySpace

__all__ = ["DEFAULT_BROKER_PORT", "app_config", "deploy_when_ready", "keyspace_url_of", "run",
           "serve", "spawn_bundled_broker", "start_bundled_broker"]

log = logging.getLogger(__name__)

DEFAULT_BROKER_PORT = 8080
# Seconds the shards get to commit when stopping while the bundled broker is down or just
# back: its clients may not have reconnected, and a transaction not committed is only done
# again by the next run.
_QUICK_STOP = 1.0
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# Seconds a stop waits on a plain hook that blocks the event loop (nothing can commit
# meanwhile) before the process exits without committing; a second Ctrl-C exits at once.
STUCK_GRACE = 5.0
_SECOND_SIGNAL_EXIT = 1.0  # seconds after a second signal that end the process anyway


def _stop_timeout() -> float:
    """Seconds the shards get to commit in a graceful stop (the member's default); imported
    on use, as the member's modules are (`_import_member_side`)."""
    from streamkit.app.replica import STOP_TIMEOUT

    return STOP_TIMEOUT


async def _load_app(app_dir: Path, shards: int | None, standbys: int | None,
                    store: str | None, keyspace: KeySpace) -> tuple[AppConfig, type]:
    """The app (`app_config`), checked against its deployed shard count, and the member's
    modules imported: what `run` does while its bundled broker starts (the broker's own
    imports take about as long, in another process)."""
    from streamkit.app.layout import check_layout

    config, app_class = app_config(app_dir, shards, standbys, store)
    await check_layout(config, keyspace)
    import streamkit.app.member
    import streamkit.app.member_apis
    import streamkit.cli.run_status  # noqa: F401

    return config, app_class


def app_config(app_dir: Path, shards: int | None, standbys: int | None,
                store: str | None) -> tuple[AppConfig, type]:
    """The app's streamkit.yaml with the command line's overrides, and its Application."""
    from streamkit.app.config import load_config

    config = load_config(app_dir)
    overrides = {k: v for k, v in (("shards", shards), ("standbys", standbys)) if v is not None}
    if overrides:
        config = config.with_settings(**overrides)
    app_class = config.load_application()
    config = config.with_store(store) if store else config.for_application(app_class)
    return config, app_class


def keyspace_url_of(config: AppConfig, keyspace: str | None) -> str:
    return _keyspace_url(config.data_dir, keyspace)


def _keyspace_url(data_dir: Path, keyspace: str | None) -> str:
    return keyspace or str(data_dir / "keyspace.db")


@contextlib.asynccontextmanager
async def _member(config: AppConfig, app_class: type, client: BrokerClient, keyspace: KeySpace,
                  *, suffix: str, broker_file_root: Path | None,
                  stop_timeout: Callable[[], float] = _stop_timeout,
                  security: Security | None = None, host: str = "127.0.0.1",
                  port: int = 0, advertise: str | None = None, zone: str = "local",
                  lease_ttl: float = 1.0, expect_members: int = 1,
                  ) -> AsyncIterator[Member]:
    """A member with its Shard API and HTTP endpoints (on `host`, announced as `advertise`
    when given), stopped gracefully on exit (its commits bounded by `stop_timeout()`, asked
    as the stop begins)."""
    from streamkit.app.gc_tuning import tune_for_throughput
    from streamkit.app.member import Member, MemberOptions
    from streamkit.app.member_apis import serve_member_apis

    tune_for_throughput()  # this process consumes in bulk from here on
    options = MemberOptions(work_dir=config.data_dir / "shards" / suffix, suffix=suffix,
                            zone=zone, file_root=broker_file_root, lease_ttl=lease_ttl,
                            expect_members=expect_members)
    folder_lock = await _hold_work_dir(options.work_dir, suffix)
    member = Member(config, app_class, client, keyspace, options)
    try:
        grpc_server, http_runner, _ = await serve_member_apis(member, host, port, security,
                                                              advertise, wait_http=False)
    except (OSError, Exposed) as err:
        raise CliError(f"the member cannot serve its APIs: {err}", DATA_ERROR) from None
    try:
        await member.start()  # its shards' take-over overlaps the HTTP API's start
        try:
            await http_runner.ready()
        except OSError as err:
            raise CliError(f"the member cannot serve its HTTP API: {err}", DATA_ERROR) from None
        # In a thread, beside serving: a dead member's RocksDB files may be many.
        sweep = asyncio.create_task(asyncio.to_thread(
            remove_abandoned, options.work_dir.parent, os.uname().nodename))
        sweep.add_done_callback(_log_failure)
        yield member
        del sweep  # (held until here: a task only the loop refers to may be collected)
    finally:
        await member.stop(stop_timeout())
        await grpc_server.stop(1.0)
        await http_runner.cleanup()
        folder_lock.release()


async def _hold_work_dir(folder: Path, suffix: str, patience: float = 30.0) -> ProcessLock:
    """The lock of the member's folder of shard files (app/work_dirs.py), waited for while
    another process holds it: the previous member of this name, still stopping (a killed
    `run`'s worker), gives it up soon; one that keeps it is another member of this name."""
    deadline = time.monotonic() + patience
    said = False
    while True:
        try:
            return hold_work_dir(folder, f"member {suffix}")
        except Held as held:
            if time.monotonic() > deadline:
                raise CliError(f"member folder {folder} is in use by {held.held_by.describe()}:"
                               f" another member named {suffix} runs from this app folder; "
                               "give this one another --suffix", DATA_ERROR) from None
            if not said:
                log.warning("waiting for member folder %s, held by %s (a member of this "
                            "name still stopping?)", folder, held.held_by.describe())
                said = True
            await asyncio.sleep(0.2)


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and (error := task.exception()) is not None:
        log.warning("removing folders of members that ended without stopping failed: %s: %s",
                    type(error).__name__, error)


async def _wait_for_members(config: AppConfig, keyspace: KeySpace, workers: list[Child],
                            timeout: float = 20.0, poll: float = 0.02) -> None:
    """Until the worker processes joined; a worker that exited instead is a CliError
    with the end of its log. (The members' allocator holds the first assignment back
    for them, so that it spreads the shards over all members instead of moving half of
    them, and their recovery, a moment later.) Polled often (a KeySpace read)."""
    prefix = f"{config.keyspace_root}/members/"
    deadline = asyncio.get_running_loop().time() + timeout
    while workers and asyncio.get_running_loop().time() < deadline:
        kvs, _ = await keyspace.range(prefix)
        joined = {kv.key.removeprefix(prefix) for kv in kvs}
        if all(any(name.endswith(f"#{w.name.replace(' ', '-')}") for name in joined)
               for w in workers):
            return
        for worker in workers:
            if worker.proc.poll() is not None:
                raise CliError(f"{worker.name} exited with code {worker.proc.returncode}:\n"
                               f"{worker.tail()}")
        await asyncio.sleep(poll)


async def _supervise_worker(worker: Supervisor) -> None:
    """Restart a worker process that died (its shards fail over to the other members
    meanwhile); one that keeps dying is given up on, saying so, and `run` goes on without
    it. It was left dead without a word: the status line showed fewer processes' work."""
    try:
        await worker.run()
    except CliError as error:
        warn(f"{error}; the other members serve its shards")
    except Exception as error:  # (it could not even be started again: out of processes)
        warn(f"{worker.child.name}: restarting it failed: {type(error).__name__}: {error}; "
             "the other members serve its shards")


async def deploy_when_ready(config: AppConfig, client: BrokerClient, keyspace: KeySpace,
                             broker: str, timeout: float = 30.0, adopt: bool = False) -> None:
    """Create the app's journals and shards, retrying while the broker is still starting."""
    from streamkit.app.member import deploy
    from streamkit.client import TransportError

    loop = asyncio.get_running_loop()
    began = loop.time()
    said = False
    while True:
        try:
            await deploy(config, client, keyspace, adopt)
            return
        except TransportError as err:
            if err.code not in _NOT_YET or loop.time() > began + timeout:
                raise CliError(f"cannot set up the app's journals at broker {broker}: "
                               f"{err.code}: {err.details}") from None
            if not said and loop.time() > began + _SAY_WAITING:  # not just starting
                said = True
                warn(f"broker {broker} does not answer ({err.code}); still trying for "
                     f"{timeout - _SAY_WAITING:.0f}s (is it running, and is this its address?)")
            await asyncio.sleep(0.25)


_NOT_YET = ("UNAVAILABLE", "DEADLINE_EXCEEDED")
_SAY_WAITING = 3.0  # seconds of a broker not answering before saying so


def _exit_stuck(stuck: list[Stuck], children: Callable[[], list[Child]] = list) -> None:
    """Say which hooks a stop could not wait for, and exit without committing them (their
    shards' next primaries do those transactions again). From the watchdog's thread."""
    for s in stuck:
        sys.stderr.write(f"stopping: shard {s.shard} is stuck in {s.hook} since {s.elapsed:.1f}s; "
                         f"exiting without committing it. It is at:\n{s.stack}\n")
    if not stuck:  # a second signal while the stop waits on a commit (broker or store)
        sys.stderr.write("stopping: exiting now, without the shards' last commits (their "
                         "next primaries do those transactions again)\n")
    sys.stderr.flush()
    for child in children():  # workers and the bundled broker stop by themselves
        with contextlib.suppress(OSError):
            child.proc.send_signal(signal.SIGTERM)
    os._exit(1)


def _orphan_aware(parent: int) -> Callable[[], float]:
    """The stop timeout of a worker of `run` (pid `parent`): quick once `run` is gone. A
    killed `run` took its bundled broker along, so commits can't land; the parent-death
    signal that stops the worker would otherwise have it wait out the usual time."""
    return lambda: _QUICK_STOP if os.getppid() != parent else _stop_timeout()


async def _check_deployed_store(config: AppConfig, keyspace: KeySpace,
                                given: str | None) -> None:
    """Refuse to serve shards whose state is kept in another store kind than this member
    would run: it would find none of their state, and recount their sources from the
    start (or fail at the app's first use of the other store)."""
    from streamkit.app.assignment import items_prefix
    from streamkit.app.config import STORE_LABEL
    from streamkit.protocol import consumer_pb

    kvs, _ = await keyspace.range(items_prefix(config.keyspace_root))
    for kv in kvs:
        try:
            spec = consumer_pb.ShardSpec.FromString(kv.value)
        except Exception:  # (an unreadable spec: the member says so)
            continue
        deployed = next((label.value for label in spec.labels.labels
                         if label.name == STORE_LABEL), config.store_kind)
        if deployed != config.store_kind:
            where = "--store" if given else "streamkit.yaml"
            raise CliError(
                f"refusing to serve: app {config.name}'s shards keep their state in the "
                f"{deployed} store (as deployed: label {STORE_LABEL} of shard {spec.id}), "
                f"and this member would run {config.store_kind} ({where}): it would find "
                f"none of their state", DATA_ERROR)
        return


async def _check_broker_accepts(client: BrokerClient, broker: str, security: Security
                                ) -> None:
    """Refuse to serve with a token the broker refuses, or when TLS with it fails (a
    certificate this member doesn't trust, one the broker wants or refuses, https:// to a
    plaintext broker): a member that started anyway would take shards it can't serve
    (failing them in a loop, or stalling them), and say so only in its log. A broker that
    is merely out of reach now (refusing connections, not listening yet) is left to the
    shards' retries, as ever."""
    from streamkit.auth.tls import parse_address, presents_certificate, tls_trouble, without_ok
    from streamkit.client.errors import TransportError
    from streamkit.client.listing import list_journals

    try:
        await asyncio.wait_for(list_journals(client, "name=streamkit-member-check"), 10.0)
    except TransportError as err:
        if err.code in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
            raise CliError(f"the broker at {broker} refuses this member's token ({err.code}: "
                           f"{err.details}): give the member the broker's --auth-keys",
                           DATA_ERROR) from None
        tls = parse_address(client.address).tls
        advice = tls_trouble(err.details, tls=tls, me="member",
                             client_cert=presents_certificate(security.client_tls))
        if err.code != "UNAVAILABLE" or advice is None:
            return
        if not tls:
            # A plaintext dial closed at once: a broker serving TLS only, or as likely a proxy
            # with no broker behind it right now. Said, and left to the retries.
            warn(f"the broker at {broker} closed the connection "
                 f"({without_ok(err.details)}): {advice}; retrying")
            return
        raise CliError(f"refusing to serve: TLS with the broker at {broker} failed: "
                       f"{advice} ({without_ok(err.details)})", DATA_ERROR) from None
    except TimeoutError:
        pass  # out of reach for now: the shards retry


def _stop_signals() -> tuple[signal.Signals, ...]:
    """What stops a run gracefully: Ctrl-C, SIGTERM, and a hang-up (its terminal or SSH
    session went away: the shards commit and hand over rather than die mid-transaction),
    unless hang-ups are ignored (`nohup`)."""
    hang_up = () if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else (signal.SIGHUP,)
    return (signal.SIGINT, signal.SIGTERM, *hang_up)


async def _until_signalled(supervising: asyncio.Task[None] | None = None,
                           member: Member | None = None,
                           children: Callable[[], list[Child]] = list) -> None:
    """Until SIGINT, SIGTERM or SIGHUP (`_stop_signals`); raises what ended `supervising` (a
    broker given up on), or the failed loop that stopped `member`.

    The signal also reaches `member`'s watchdog through a plain signal handler, which runs
    even while a hook blocks the event loop (the loop's own handlers can't): a hook still
    stuck STUCK_GRACE seconds later (an async one: after the shards' stop timeout too), or at
    a second signal, ends the process, naming it (`_exit_stuck`)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = _stop_signals()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    on_signal: Callable[[int, object], None] = _stopping_anyway
    if member is not None:
        watchdog = member.runtime.watchdog
        watchdog.arm_exit(lambda stuck: _exit_stuck(stuck, children), STUCK_GRACE,
                          _stop_timeout() + STUCK_GRACE)
        second = Waker()  # the second signal: set from the handler, which takes no lock

        def exit_after_second() -> None:
            # The watchdog exits at once, naming a stuck hook; should the stop wait on
            # something else (a store's commit blocked in its database), this does.
            second.wait()
            time.sleep(_SECOND_SIGNAL_EXIT)
            _exit_stuck([], children)

        threading.Thread(target=exit_after_second, name="second signal", daemon=True).start()
        seen = 0

        def on_watched_signal(_sig: int, _frame: object) -> None:
            # (It may interrupt itself: signals come in bursts, as the parent-death signal
            # does when `run` is killed. So it only counts and wakes, through a pipe.)
            nonlocal seen
            seen += 1
            watchdog.stop_requested()
            if seen >= 2:
                second.set()

        on_signal = on_watched_signal
        for sig in signals:
            # Replaces asyncio's no-op Python-level handler; the loop still gets the signal
            # through its wakeup fd.
            signal.signal(sig, on_signal)
    try:
        await first_of([stop.wait(), *([supervising] if supervising is not None else []),
                        *([member.wait_failed()] if member is not None else [])])
    finally:
        # Later signals go to `on_signal` alone: the loop closes its wakeup fd as the process
        # ends, and a signal written to that closed fd in between prints a traceback. (Held
        # meanwhile: between the two, SIGINT's handler is Python's KeyboardInterrupt.)
        signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        try:
            for sig in signals:
                loop.remove_signal_handler(sig)
                signal.signal(sig, on_signal)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
    if supervising is not None and supervising.done():
        supervising.result()
    if member is not None and member.failure is not None:
        raise CliError(f"member {member.options.member_id()} stopped: {member.failure}")


def _stopping_anyway(_sig: int, _frame: object) -> None:
    """A stop signal while already stopping, with no watchdog to tell."""


def spawn_bundled_broker(data_dir: Path, port: int, keyspace_url: str,
                         security: Security | None = None) -> Child:
    """The bundled broker on `port` (HTTP on the next), its pid in DATA_DIR/broker.pid;
    with `security`'s keys and certificate (given through its environment). Started, not
    yet listening: its start takes a few tenths of a second, mostly imports."""
    held = _previous_broker(data_dir / "broker")
    if held is not None:
        raise CliError(f"the app's bundled broker already runs ({held.describe()}), started "
                       f"by another command: stop it, or pass --broker {held.note} to use it",
                       DATA_ERROR)
    if port_in_use(port) or port_in_use(port + 1):
        raise CliError(f"port {port} or {port + 1} is in use: is a broker already running? "
                       f"Pass --broker 127.0.0.1:{port} to use it, or --port to pick others",
                       DATA_ERROR)
    return start_child("the bundled broker", [
        "broker", "serve", "--data-dir", str(data_dir / "broker"), "--port", str(port),
        "--keyspace", keyspace_url], data_dir / "broker.log", data_dir / "broker.pid",
        security_env(security, dict(os.environ)) if security is not None else None)


def _previous_broker(data_dir: Path, patience: float = 30.0) -> Holder | None:
    """The broker serving `data_dir`, if one does. One whose `run` was killed (orphaned: its
    parent is init) is stopping by itself, persisting its spools, which takes a few seconds:
    it is waited for (up to `patience`), so that `run` right after a kill starts, rather
    than refusing or (worse) starting a second broker on the same data."""
    held = data_dir_holder(data_dir)
    if held is None or _parent_of(held.pid) != 1:
        return held
    click.echo(f"waiting for the app's previous bundled broker (pid {held.pid}) to stop...",
               err=True)
    deadline = time.monotonic() + patience
    while held is not None and time.monotonic() < deadline:
        time.sleep(0.05)
        held = data_dir_holder(data_dir)
    return held


def _parent_of(pid: int) -> int | None:
    """`pid`'s parent (Linux's /proc), or None if that can't be read."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def start_bundled_broker(config: AppConfig, port: int, keyspace_url: str,
                         security: Security | None = None) -> Child:
    """The bundled broker (`spawn_bundled_broker`), once it listens."""
    child = spawn_bundled_broker(config.data_dir, port, keyspace_url, security)
    try:
        child.wait_listening(port)
    except BaseException:  # Ctrl-C, say: stop the broker it was waiting for
        child.stop(5.0)
        raise
    return child


def _start_worker(index: int, app_dir: Path, broker: str, keyspace_url: str,
                  file_root: Path | None, overrides: dict[str, object], workers: int,
                  log_level: str, lease_ttl: float, security: Security) -> Child:
    """`streamkit serve` as worker `index` of `run --workers`: the same app, broker,
    KeySpace and command-line overrides (it loads streamkit.yaml as this process does)."""
    args = ["serve", str(app_dir), "--broker", broker, "--keyspace", keyspace_url,
            "--suffix", f"worker-{index}", "--log-level", log_level, "--lease-ttl", str(lease_ttl),
            "--expect-members", str(workers), "--worker-of-run"]
    for option, value in overrides.items():
        if value is not None:
            args += [f"--{option}", str(value)]
    if file_root is not None:
        args += ["--file-root", str(file_root)]
    return start_child(f"worker {index}", args, data_dir_of(app_dir) / f"worker-{index}.log",
                       env=security_env(security, dict(os.environ)))


lease_ttl_option = click.option(
    "--lease-ttl", type=Seconds(0.5, 600), default=1.0, show_default=True,
    metavar="SECONDS",
    help="The member's lease: others take its shards over this long after it stops "
         "answering (etcd rounds it up to whole seconds). Longer rides out slow networks "
         "and stalls; shorter fails over sooner.")


@click.command("run")
@click.argument("app_dir", default=".", type=click.Path(file_okay=False, path_type=Path))
@click.option("--shards", type=click.IntRange(1, 1000), default=None,
              help="Number of shards (default: streamkit.yaml's). Topics whose partitions "
                   "streamkit.yaml leaves out get one per shard.")
@click.option("--broker", default=None, metavar="HOST:PORT",
              help="Use this broker (any that speaks the Journal protocol; https://HOST:PORT "
                   "for TLS) instead of starting the bundled one.")
@click.option("--port", type=click.IntRange(1, 65534), default=DEFAULT_BROKER_PORT,
              show_default=True, help="Port of the bundled broker (HTTP on the next one).")
@click.option("--workers", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Member processes on this machine sharing the shards.")
@click.option("--standbys", type=click.IntRange(0, 8), default=None,
              help="Hot standbys per shard (default: streamkit.yaml's).")
@click.option("--store", type=click.Choice(STORE_KINDS), default=None,
              help="Store kind, overriding streamkit.yaml.")
@click.option("--keyspace", default=None,
              help="KeySpace (default: APP_DIR/.streamkit/keyspace.db).")
@click.option("--status/--no-status", default=None,
              help="Show the live status table (default: when stdout is a terminal).")
@click.option("--log-level", default="WARNING", show_default=True, envvar="STREAMKIT_LOG_LEVEL",
              type=click.Choice(_LEVELS, case_sensitive=False), help="Log level of the shards.")
@lease_ttl_option
@security_options(serves=True, dials=True)
@async_command(interrupt_exit=0)
async def run(app_dir: Path, shards: int | None, broker: str | None, port: int, workers: int,
              standbys: int | None, store: str | None, keyspace: str | None,
              status: bool | None, log_level: str, lease_ttl: float,
              security: Security) -> None:
    """Run APP_DIR's shards (default: the current folder) until Ctrl-C.

    With --auth-keys the bundled broker and the members require tokens, and with
    --tls-cert and --tls-key they serve TLS (give --tls-ca too, for the members to
    trust it).
    """
    _check_dials_itself(security)
    hold_collections()  # until the member starts (`_member`)
    raise_open_file_limit()  # a store's files per shard
    configure_logging(log_level)
    if not is_app_folder(app_dir):
        app_config(app_dir, shards, standbys, store)  # raises, saying what is missing
    data_dir = data_dir_of(app_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    running = _lock_app(app_dir, data_dir, broker or f"127.0.0.1:{port}")
    keyspace_url = _keyspace_url(data_dir, keyspace)
    bundled: Supervisor | None = None
    supervising: asyncio.Task[None] | None = None
    workers_: list[Supervisor] = []  # of the worker processes (`--workers`)
    watching: list[asyncio.Task[None]] = []  # their supervision
    file_root = None
    stopping: dict[str, float] = {}  # the shards' time to commit; when stopping began

    def stop_timeout() -> float:
        """The usual time to commit, unless the bundled broker is down or just back (decided
        as stopping begins)."""
        if not stopping:
            quick = bundled is not None and not bundled.settled()
            stopping.update(timeout=_QUICK_STOP if quick else _stop_timeout(),
                            began=time.monotonic())
        return stopping["timeout"]

    try:
        # The broker and the workers start first (before this process opens gRPC channels:
        # forking a process with gRPC's threads running is what gRPC warns about), so that
        # their imports overlap this process's; a bad app or shard count stops them again.
        if broker is None:
            bundled = Supervisor(spawn_bundled_broker(data_dir, port, keyspace_url, security),
                                 port)
            scheme = "https://" if security.server_tls is not None else ""
            broker = f"{scheme}127.0.0.1:{port}"
            file_root = bundled_fragments(app_dir)
        overrides = {"shards": shards, "store": store}
        workers_.extend(Supervisor(_start_worker(index, app_dir, broker, keyspace_url,
                                                 file_root, overrides, workers, log_level,
                                                 lease_ttl, security), None)
                        for index in range(1, workers))
        from streamkit.client import BrokerClient
        from streamkit.keyspace import open_keyspace

        # (The client dials on its first call, once the broker listens.)
        async with BrokerClient(broker, security) as client, open_keyspace(keyspace_url) as ks:
            config, app_class = await _load_app(app_dir, shards, standbys, store, ks)
            if bundled is not None:
                bundled.child.wait_listening(port)
                supervising = asyncio.create_task(bundled.run(), name="broker supervisor")
            from streamkit.cli.run_status import StatusView

            await deploy_when_ready(config, client, ks, broker)
            async with _member(config, app_class, client, ks, suffix="worker-0",
                               broker_file_root=file_root, stop_timeout=stop_timeout,
                               security=security, expect_members=workers,
                               lease_ttl=lease_ttl) as member:
                # The first assignment waits for the workers (`expect_members`); this says
                # why if one of them exits instead of joining.
                await _wait_for_members(config, ks, [w.child for w in workers_])
                watching.extend(asyncio.create_task(_supervise_worker(w), name=w.child.name)
                                for w in workers_)
                view = StatusView(config, ks, live=status,
                                  notice=bundled.state if bundled is not None else None,
                                  security=security)
                viewing = asyncio.create_task(view.run())
                try:
                    await _until_signalled(
                        supervising, member,
                        lambda: [*(w.child for w in workers_),
                                 *([bundled.child] if bundled is not None else [])])
                finally:
                    await cancel_and_wait(viewing, "the status view")
                    stop_timeout()  # decided now, while stopping begins
                    click.echo("stopping: committing the shards' last transactions..."
                               if bundled is None or bundled.running() else
                               f"stopping: the bundled broker is down: what the shards cannot "
                               f"commit within {_QUICK_STOP:.0f}s is left to the next run...",
                               err=True)
                    for task in watching:  # (not restarted as they stop)
                        await cancel_and_wait(task, task.get_name())
                    for worker in workers_:  # they stop while this member stops too
                        worker.child.proc.send_signal(signal.SIGTERM)
    finally:
        # Workers wait on the broker as this member does: when it's down, they get about the
        # time this member's shards got, then SIGKILL (their transactions are done again).
        patience = _stop_timeout()
        if stop_timeout() != patience:
            patience = max(0.1, stopping["began"] + 2 * _QUICK_STOP + 1.0 - time.monotonic())
        # Before stopping the broker, which it would restart. Had it ended with an error,
        # _until_signalled raised that already.
        if supervising is not None and not supervising.done():
            await cancel_and_wait(supervising, "the broker supervisor")
        for task in watching:
            await cancel_and_wait(task, task.get_name())
        await asyncio.gather(*(asyncio.to_thread(w.child.stop, patience) for w in workers_))
        if bundled is not None:
            await asyncio.to_thread(bundled.child.stop)
        running.release()


def _check_dials_itself(security: Security) -> None:
    """`run`'s members dial its own servers (the bundled broker, each other's Shard APIs):
    requiring client certificates there, they must present one, or every call fails (the
    first, setting up the journals, half a minute later)."""
    from streamkit.auth.tls import presents_certificate

    server = security.server_tls
    if server is not None and server.require_client_cert and not presents_certificate(
            security.client_tls):
        raise CliError("--tls-require-client-cert needs --tls-client-cert and --tls-client-key "
                       "with `run`: its members dial its own servers, which require a client "
                       "certificate", DATA_ERROR)


def _lock_app(app_dir: Path, data_dir: Path, broker: str) -> ProcessLock:
    """One `run` per app folder, held for this process's life: a second one would start a
    second bundled broker on the app's data (refused, see broker/data_lock.py) and wait for
    ever for its members' names, which the first one's members hold."""
    lock = ProcessLock(data_dir / "run.lock")
    try:
        lock.acquire(f"broker {broker}")
    except Held as held:
        raise CliError(f"`streamkit run` already runs the app in {app_dir} "
                       f"({held.held_by.describe()}): stop it first (`streamkit serve` adds a "
                       "member to a running app)", DATA_ERROR) from None
    return lock


@click.command("serve")
@click.argument("app_dir", default=".", type=click.Path(file_okay=False, path_type=Path))
@click.option("--broker", required=True, metavar="HOST:PORT", envvar=list(BROKER_ENV),
              help="The broker the app's journals live on (https://HOST:PORT for TLS).")
@click.option("--keyspace", default=None,
              help="KeySpace (default: APP_DIR/.streamkit/keyspace.db).")
@click.option("--shards", type=click.IntRange(1, 1000), default=None,
              help="Number of shards (default: streamkit.yaml's); must be the deployed count.")
@click.option("--suffix", default=None,
              help="This member's name, 4 to 128 characters (default: host-pid).")
@click.option("--zone", default="local", show_default=True,
              help="This member's zone: a shard's primary and standbys go to different zones "
                   "where the members allow it.")
@lease_ttl_option
@click.option("--store", type=click.Choice(STORE_KINDS), default=None,
              help="Store kind, overriding streamkit.yaml (refused unless the shards were "
                   "deployed with it).")
@click.option("--file-root", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="The broker's file:// fragment root, read directly when on this machine.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address the Shard API and HTTP API bind (0.0.0.0: every address; beyond "
                   "loopback it needs --auth-keys, or --insecure).")
@click.option("--port", type=click.IntRange(0, 65534), default=0, show_default=True,
              help="Shard API port (HTTP on the next one); 0 picks a free pair.")
@click.option("--advertise", default=None, metavar="HOST",
              help="The host name other members and clients reach this member by "
                   "[default: --host, or the machine's name when it is 0.0.0.0].")
@click.option("--log-level", default="INFO", show_default=True, envvar="STREAMKIT_LOG_LEVEL",
              type=click.Choice(_LEVELS, case_sensitive=False), help="Log level.")
@click.option("--expect-members", type=click.IntRange(1, 64), default=1, show_default=True,
              metavar="N",
              help="Members started together (all of a cluster's, at once): the first "
                   "assignment waits for N to join (at most 10 s), so that shards don't "
                   "move (their first transactions fenced) right after the start.")
@click.option("--worker-of-run", is_flag=True, hidden=True,
              help="Started by `streamkit run`: once it is gone (killed), stop quickly.")
@security_options(serves=True, dials=True)
@async_command(interrupt_exit=0)
async def serve(app_dir: Path, broker: str, keyspace: str | None, shards: int | None,
                suffix: str | None, zone: str, lease_ttl: float, store: str | None,
                file_root: Path | None, host: str, port: int, advertise: str | None,
                log_level: str, expect_members: int, worker_of_run: bool,
                security: Security) -> None:
    """Run one member process of APP_DIR's shards until SIGTERM or Ctrl-C.

    Beyond loopback (--host 0.0.0.0, say) it needs --auth-keys (or client
    certificates required), unless --insecure.
    """
    hold_collections()  # until the member starts (`_member`)
    raise_open_file_limit()  # a store's files per shard
    from streamkit.app.layout import check_layout
    from streamkit.client import BrokerClient
    from streamkit.keyspace import open_keyspace
    from streamkit.protocol import pb
    from streamkit.protocol.conformance import problems_of

    configure_logging(log_level)
    try:
        security.check_exposure(host, port, "the member")
    except Exposed as err:
        raise CliError(f"refusing to serve: {err}", DATA_ERROR) from None
    if advertise:  # the HTTP API answers the name it is reached by
        security = replace(security, allowed_hosts=(*security.allowed_hosts, advertise))
    suffix = suffix or f"{os.uname().nodename}-{os.getpid()}"
    if problems := problems_of(pb.ProcessSpec.ID(zone=zone, suffix=suffix)):
        raise CliError("--zone/--suffix: " + "; ".join(problems), DATA_ERROR)
    config, app_class = app_config(app_dir, shards, None, store)
    keyspace = keyspace_url_of(config, keyspace)
    async with BrokerClient(broker, security) as client, open_keyspace(keyspace) as ks:
        # (A worker of `run` starts while run deploys: no layout yet is no news to it.)
        if await check_layout(config, ks) is None and not worker_of_run:  # a typo in a URL
            warn(f"app {config.name} has no shards deployed in KeySpace {keyspace} (under "
                 f"{config.keyspace_root}): this member serves none until `streamkit deploy "
                 f"{app_dir}` with this --keyspace puts them there (is the URL's prefix right?)")
        if not worker_of_run:  # (run deploys its store kind as its workers start)
            await _check_deployed_store(config, ks, store)
        await _check_broker_accepts(client, broker, security)
        async with _member(config, app_class, client, ks, suffix=suffix, zone=zone,
                           lease_ttl=lease_ttl, broker_file_root=file_root, security=security,
                           host=host, port=port, advertise=advertise,
                           expect_members=expect_members,
                           stop_timeout=_orphan_aware(os.getppid()) if worker_of_run
                           else _stop_timeout) as member:
            await _until_signalled(member=member)
