"""`streamkit backfill [APP] --spark`: recompute an app's state from its journals' history.

The backfill plans what each shard reads (its source journals up to their
write heads, or `--end` offsets), runs one Spark task per shard (or, with
`--processes N`, the same tasks in N processes of this machine), and hands
every shard's result to its recovery log (or SQL database) with a checkpoint
at the plan's end, so that `streamkit run` goes on live from exactly there.
Primaries of a `streamkit run` going on meanwhile are fenced by the
hand-over; once every shard is handed over, their assignments are removed,
so the app's allocator starts them afresh on the backfilled state.

Like `run`, it talks to the bundled broker of the app's folder: the one a
running `streamkit run` started (on `--port`), or one it starts for the
duration of the backfill. `--broker` names any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from streamkit.app.app_folder import bundled_fragments
from streamkit.app.config import AppConfig, load_config, shard_id
from streamkit.app.layout import Layout, read_layout
from streamkit.app.member import deploy
from streamkit.app.store_kinds import STORE_KINDS
from streamkit.auth.settings import Security, is_loopback
from streamkit.auth.tls import parse_address
from streamkit.broker.data_lock import data_dir_holder
from streamkit.cli.app_keyspace import app_keyspace
from streamkit.cli.backfill_progress import Progress
from streamkit.cli.children import Child, port_in_use
from streamkit.cli.errors import DATA_ERROR, CliError, async_command, warn
from streamkit.cli.logs import configure_logging
from streamkit.cli.output import echo_json, echo_table, format_size, plural
from streamkit.cli.run import DEFAULT_BROKER_PORT, app_config, keyspace_url_of, start_bundled_broker
from streamkit.cli.security_options import security_options
from streamkit.client import BrokerClient
from streamkit.keyspace import open_keyspace
from streamkit.keyspace.keyspace import KeySpace
from streamkit.protocol import consumer_pb
from streamkit.tasks import wait_finished

if TYPE_CHECKING:
    from streamkit.backfill.driver_link import DriverLink

__all__ = ["backfill"]


async def _shard_specs(config: AppConfig, keyspace: KeySpace) -> list[consumer_pb.ShardSpec]:
    """The app's shard specs as the runtime would find them: the KeySpace's, else derived."""
    kvs, _ = await keyspace.range(f"{config.keyspace_root}/items/")
    stored = {}
    for kv in kvs:
        spec = consumer_pb.ShardSpec.FromString(kv.value)
        stored[spec.id] = spec
    return [stored.get(spec.id, spec) for spec in config.shard_specs()]


@contextlib.asynccontextmanager
async def _broker(config: AppConfig, broker: str | None, port: int, keyspace_url: str,
                  fragment_root: Path | None, security: Security,
                  ) -> AsyncIterator[tuple[str, Path | None]]:
    """(address, fragment root): the named broker, the app's running one, or one started here
    (requiring tokens when `security` has keys)."""
    if broker is not None:
        yield broker, fragment_root
        return
    bundled_root = bundled_fragments(config.app_dir)
    root = fragment_root or bundled_root
    if port_in_use(port):
        yield f"127.0.0.1:{port}", root if root.is_dir() else None
        return
    running = data_dir_holder(config.data_dir / "broker")
    if running is not None:  # the app's broker, on another port than --port
        click.echo(f"using the app's bundled broker at {running.note} (pid {running.pid})",
                   err=True)
        yield running.note, root
        return
    child: Child = start_bundled_broker(config, port, keyspace_url, security)
    try:
        yield f"127.0.0.1:{port}", root
    finally:
        await asyncio.to_thread(child.stop)


async def _restart_running_shards(config: AppConfig, keyspace: KeySpace, plan: Any
                                  ) -> list[str]:
    """Unassign the handed-over shards' (fenced) primaries: the app's allocator, if the
    app runs, assigns them afresh, and the new primaries recover the backfilled state."""
    from streamkit.app.shard_ops import unassign_shards

    response = await unassign_shards(keyspace, config.keyspace_root,
                                     [shard.shard_id for shard in plan.shards])
    if response.status != consumer_pb.OK:
        warn("could not restart the app's running shards "
             f"({consumer_pb.Status.Name(response.status)}): restart `streamkit run`")
        return []
    return list(response.shards)


def _echo_plan(summary: dict[str, Any]) -> None:
    rows = []
    for shard in summary["shards"]:
        for j in shard["journals"]:
            via = format_size(j["bytes_via_broker"]) if j["bytes_via_broker"] else "-"
            rows.append([shard["shard"], j["journal"], f"[{j['begin']}, {j['end']})",
                         format_size(j["end"] - j["begin"]),
                         f"{j['fragments']} ({j['direct_fragments']} direct)", via])
    echo_table(["SHARD", "JOURNAL", "OFFSETS", "BYTES", "FRAGMENTS", "VIA BROKER"], rows)
    total = sum(j["end"] - j["begin"] for s in summary["shards"] for j in s["journals"])
    broker = sum(j["bytes_via_broker"] for s in summary["shards"] for j in s["journals"])
    missing = sum(j["bytes_missing"] for s in summary["shards"] for j in s["journals"])
    notes = [f"{plural(len(summary['shards']), 'shard')}, {format_size(total)} to read",
             f"{format_size(total - broker - missing)} from fragment files",
             f"{format_size(broker)} through the broker"]
    if missing:
        notes.append(f"{format_size(missing)} no longer in any fragment (skipped)")
    size = summary["txn_size"]
    txns = f"{size} messages per transaction" if size else "transactions of max_duration"
    click.echo(f"{', '.join(notes)}; store {summary['store']}, {txns}", err=True)


def _missing(summary: dict[str, Any], most: int = 5) -> str:
    """The journals whose planned range is not all in fragments, with how much is gone
    ("" if none): the first `most` of them."""
    gone = [f"{j['journal']} ({format_size(j['bytes_missing'])} of "
            f"[{j['begin']}, {j['end']}))"
            for shard in summary["shards"] for j in shard["journals"] if j["bytes_missing"]]
    more = f" and {len(gone) - most} more journals" if len(gone) > most else ""
    return ", ".join(gone[:most]) + more


def _echo_results(results: list[dict[str, Any]]) -> None:
    rows = [[r["shard_id"], r["messages"], r["transactions"],
             ", ".join(f"{j}@{o}" for j, o in sorted(r["read_through"].items())),
             f"{plural(r['files'], 'file')}, {format_size(r['state_bytes'])}"
             if r["files"] else "-", f"{r['seconds']:.1f}s"]
            for r in sorted(results, key=lambda r: r["shard_id"])]
    echo_table(["SHARD", "MESSAGES", "TXNS", "READ THROUGH", "STATE", "TIME"], rows)


@click.command("backfill")
@click.argument("app_dir", default=".", type=click.Path(file_okay=False, path_type=Path))
@click.option("--spark", "use_spark", is_flag=True,
              help="Run the backfill on Spark (PySpark and Java 17+ needed).")
@click.option("--processes", type=click.IntRange(1, 256), default=None, metavar="N",
              help="Instead of Spark, run the shards' tasks in N processes of this machine "
                   "(no JVM to start: quicker for short histories).")
@click.option("--plan", "plan_only", is_flag=True,
              help="Print the plan (shards, journals, offsets, fragments) and stop.")
@click.option("--json", "as_json", is_flag=True, help="With --plan: the plan as JSON.")
@click.option("--master", default=None,
              help="Spark master: local[*], local[N], or a cluster's URL [default: the "
                   "running driver's (`streamkit spark start`), else local[*]].")
@click.option("--spark-conf", multiple=True, metavar="KEY=VALUE",
              help="Extra Spark configuration (repeatable; starts a Spark of its own).")
@click.option("--broker", default=None, metavar="HOST:PORT",
              help="The broker serving the app's journals (default: the app's bundled one).")
@click.option("--port", type=click.IntRange(1, 65534), default=DEFAULT_BROKER_PORT,
              show_default=True, help="Port of the bundled broker.")
@click.option("--keyspace", default=None, help="KeySpace (default: .streamkit/keyspace.db).")
@click.option("--fragment-root", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the broker's file:// fragment store is (read directly by executors; "
                   "default for the bundled broker: .streamkit/broker/fragments).")
@click.option("--end", "ends", multiple=True, metavar="JOURNAL=OFFSET",
              help="Stop reading JOURNAL at OFFSET (repeatable; default: the write heads).")
@click.option("--store", type=click.Choice(STORE_KINDS), default=None,
              help="Store kind, overriding streamkit.yaml (as for `run`).")
@click.option("--shards", type=click.IntRange(1, 1000), default=None,
              help="Reshard: recompute the state for this many shards from the whole history "
                   "(the app stopped; default: the deployed count).")
@click.option("--txn-size", type=click.IntRange(1), default=None,
              help="Messages per transaction (default: transactions last the shards' "
                   "max_duration, as live ones).")
@click.option("--skip-missing", is_flag=True,
              help="Backfill though part of the history is in no fragment any more (removed "
                   "by retention or a prune): the state is computed without it.")
@click.option("--log-level", default="WARNING", show_default=True,
              envvar="STREAMKIT_LOG_LEVEL")
@security_options(dials=True)
@async_command()
async def backfill(app_dir: Path, use_spark: bool, processes: int | None, plan_only: bool,
                   as_json: bool, master: str | None,
                   spark_conf: tuple[str, ...], broker: str | None, port: int,
                   keyspace: str | None, fragment_root: Path | None, ends: tuple[str, ...],
                   store: str | None, shards: int | None, txn_size: int | None,
                   skip_missing: bool, log_level: str, security: Security) -> None:
    """Recompute APP_DIR's state (default: the current folder) from its journals' history.

    With --spark, the job goes to the Spark driver `streamkit spark start` keeps up, if one
    runs (and neither --master nor --spark-conf is given); otherwise this command starts
    Spark for the backfill and stops it after. The security options dial the broker, from
    here and from Spark's executors (which get the keys and the certificate paths with the
    plan).
    """
    from streamkit.backfill.errors import BackfillError
    from streamkit.backfill.plan import make_plan, parse_ends, security_data
    from streamkit.backfill.reshard import apply_layout, finish_layout, next_layout

    configure_logging(log_level)
    if use_spark and processes is not None:
        raise CliError("--spark and --processes: choose one (Spark, or processes of this "
                       "machine)", DATA_ERROR)
    if not use_spark and processes is None and not plan_only:
        raise CliError("a backfill runs on Spark or on this machine: add --spark or "
                       "--processes N (or --plan to see what it would read)", DATA_ERROR)
    started = time.monotonic()
    spark: asyncio.Future[Any] | None = None
    driver = _running_driver(use_spark and not plan_only and master is None and not spark_conf)
    master = master or (driver.master if driver else "local[*]")
    try:
        conf = dict(_key_value(item) for item in spark_conf)
        try:
            end_offsets = parse_ends(ends)
        except BackfillError as error:  # a malformed option: bad input
            raise CliError(str(error), DATA_ERROR) from None
        config, app_class = app_config(app_dir, shards, None, store)
        usual = load_config(app_dir).for_application(app_class).store_kind
        if store is not None and store != usual and not plan_only:
            warn(f"--store {store}: the app's store is {usual} (streamkit.yaml, or the app's "
                 f"class): run it with --store {store} too, or its shards will not find the "
                 "state this backfill hands over, and will read their sources afresh")
        if keyspace is not None:  # a file named must be there (opening would make one)
            keyspace = app_keyspace(config, app_dir, keyspace)
        keyspace_url = keyspace_url_of(config, keyspace)
        async with (
            _broker(config, broker, port, keyspace_url, fragment_root,
                    security) as (address, root),
            BrokerClient(address, security) as client,
            open_keyspace(keyspace_url) as ks,
        ):
            layout = await read_layout(ks, config.keyspace_root)
            resharding = _resharding(config, layout, shards)
            if use_spark and not plan_only:
                _warn_local_only(master, address, keyspace_url)
            if use_spark and not plan_only and driver is None:  # started while planning
                spark = asyncio.ensure_future(asyncio.to_thread(_start_spark, master, conf))
            resharded: Layout | None = None
            retired: list[str] = []
            if resharding:
                assert layout is not None
                resharded = await next_layout(config, client, ks, layout)
                epochs = [epoch.ends for epoch in resharded.history]
                specs = config.shard_specs()
            else:
                epochs = [epoch.ends for epoch in layout.history] if layout else []
                specs = await _shard_specs(config, ks)
            if epochs and end_offsets:
                raise CliError("--end can't be used on a resharded app: its history spans "
                               "several layouts", DATA_ERROR)
            plan = await make_plan(config, client, specs, broker=address,
                                   keyspace=_absolute(keyspace_url), fragment_root=root,
                                   ends=end_offsets, txn_size=txn_size or 0, epochs=epochs)
            plan = replace(plan, security=security_data(security))
            if missing := _missing(plan.summary()):
                if not (plan_only or skip_missing):
                    raise CliError(
                        f"part of the history is in no fragment any more (removed by retention "
                        f"or a prune): {missing}; a backfill would replace the shards' state "
                        "with one computed without it. Give --skip-missing to backfill what is "
                        "left anyway")
                warn(f"part of the history is in no fragment any more, and skipped: {missing}")
            if plan_only:
                if as_json:
                    echo_json(plan.summary())
                else:
                    _echo_plan(plan.summary())
                return
            sc, spark_seconds = None, 0.0
            if spark is not None:
                starting, spark = spark, None  # awaited here: not for the `finally` to again
                sc, spark_seconds = await starting  # Java and PySpark work: now change things
            if resharded is not None:  # new partitions, recovery logs and shard specs
                retired = await apply_layout(config, client, ks, resharded)
            else:
                await deploy(config, client, ks)  # recovery logs, outputs, shard specs
            _echo_plan(plan.summary())
            handed: list[str] | None = None  # shards handed over, where the engine tells
            try:
                ran = time.monotonic()
                with Progress(len(plan.shards)) as progress:
                    plan = replace(plan, progress_dir=str(progress.folder))
                    if driver is not None:
                        results = await _run_on_driver(driver.link, plan, progress.show)
                    elif sc is not None:
                        results = await asyncio.to_thread(_run_spark, plan, sc, progress.show)
                    else:
                        assert processes is not None
                        handed = []
                        results = await _run_locally(plan, processes, handed, progress.show)
                ran = time.monotonic() - ran
            except BackfillError as error:
                raise CliError(f"{error}\n{_part_way(plan, handed)}") from None
            except asyncio.CancelledError:
                click.echo(f"streamkit: backfill interrupted: {_part_way(plan, handed)}",
                           err=True)
                raise
            finally:
                if sc is not None:
                    await asyncio.to_thread(_stop_spark, sc)
            if resharded is not None:
                await finish_layout(ks, config.keyspace_root, resharded)
            restarted = await _restart_running_shards(config, ks, plan)
        _echo_results(results)
        if resharded is not None:
            _echo_resharded(config, resharded, retired)
        click.echo(f"handed over {plural(len(results), 'shard')}: `streamkit run` continues "
                   "from the offsets above", err=True)
        if restarted:
            click.echo(f"restarted {plural(len(restarted), 'running shard')} on the backfilled "
                       "state (their primaries were fenced)", err=True)
        engine = (f"{processes} local process{'es' if processes > 1 else ''}" if processes
                  else f"Spark driver pid {driver.pid}" if driver
                  else f"Spark start {spark_seconds:.1f}s")
        click.echo(f"backfill took {time.monotonic() - started:.1f}s ({engine}, shards "
                   f"{ran:.1f}s)", err=True)
    except BackfillError as error:
        raise CliError(str(error)) from None
    finally:
        if spark is not None:  # started, but planning failed: stop it again
            started_spark = await wait_finished(spark, "starting Spark")
            if started_spark is not None:
                stopping = asyncio.ensure_future(asyncio.to_thread(_stop_spark, started_spark[0]))
                await wait_finished(stopping, "stopping Spark")


def _part_way(plan: Any, handed: list[str] | None) -> str:
    """One line on a backfill stopped part-way: which shards were handed over (`handed`;
    None where the engine can't tell), which not, and that running it again is safe."""
    again = ("running the same `streamkit backfill` again is safe: it backfills every shard "
             "again")
    if handed is None:
        return ("shards handed over before this keep their backfilled state, the others "
                f"their previous one (restart a running `streamkit run` to serve them); {again}")
    done = set(handed)
    rest = [shard.shard_id for shard in plan.shards if shard.shard_id not in done]
    served = " (restart a running `streamkit run` to serve them)" if handed else ""
    return (f"handed over {len(handed)} of {plural(len(plan.shards), 'shard')}: "
            f"{_names(sorted(handed))}{served}; not finished: {_names(rest)}; {again}")


def _names(ids: list[str], most: int = 20) -> str:
    """Shard ids for a line: all of a few, the first `most` of many ("none" for none)."""
    if len(ids) <= most:
        return ", ".join(ids) or "none"
    return f"{', '.join(ids[:most])} and {len(ids) - most} more"


def _resharding(config: AppConfig, layout: Layout | None, shards: int | None) -> bool:
    """Whether this backfill reshards; refuses a count that differs by accident."""
    if layout is None:
        return False
    if layout.resharding and shards is None and config.shards != layout.shards:
        # streamkit.yaml's count is not the one the unfinished reshard was going to.
        raise CliError(
            f"resharding app {config.name} to {layout.shards} shards did not finish: pass "
            f"--shards {layout.shards} to complete it (streamkit.yaml says {config.shards})",
            DATA_ERROR,
        )
    if layout.resharding or (shards is not None and shards != layout.shards):
        return True
    if config.shards != layout.shards:
        raise CliError(
            f"app {config.name} is deployed with {layout.shards} shards but streamkit.yaml says "
            f"{config.shards}: pass --shards {config.shards} to reshard it to {config.shards}, "
            f"or --shards {layout.shards} to backfill its {layout.shards} shards",
            DATA_ERROR,
        )
    return False


def _echo_resharded(config: AppConfig, layout: Layout, retired: list[str]) -> None:
    before = layout.history[-1].shards
    n = config.shards
    click.echo(f"resharded app {config.name} from {before} to {n} shards", err=True)
    if retired:
        click.echo(f"retired (read-only) partitions: {', '.join(retired)}", err=True)
    removed = [config.recovery_log(shard_id(i)) for i in range(n, before)]
    if removed and removed[0]:
        click.echo(f"kept: the recovery logs of the removed shards ({', '.join(removed)}), "
                   "their state before the reshard; once it is not needed, delete them with "
                   "`streamkit journals apply` (`delete: true`)", err=True)
    click.echo(f"next: set `shards: {n}` in streamkit.yaml (or pass --shards {n}), start the "
               f"app, then restart its publishers so they route over the {n} partitions",
               err=True)


def _warn_local_only(master: str, broker: str, keyspace_url: str) -> None:
    """Warn when a cluster's executors are to dial a loopback broker or open a KeySpace file.

    Executors dial the broker and open the KeySpace themselves (to read and hand over).
    On other machines, `127.0.0.1:PORT` (the bundled broker's) is not our broker and a file
    path is not our KeySpace: their tasks fail or wait on a connection, late and far from
    the cause. Only warned: a standalone cluster on this very machine does reach them.
    """
    if master.startswith("local"):
        return
    if is_loopback(parse_address(broker).host):  # a host name may resolve everywhere
        warn(f"Spark's executors dial the broker at {broker}: on other machines than this "
             "one, pass --broker with an address they reach")
    if "://" not in keyspace_url:
        warn(f"Spark's executors open the KeySpace {keyspace_url}, a file of this machine: "
             "on other machines, use a shared one (--keyspace etcd://HOST:PORT/PREFIX)")


def _absolute(keyspace_url: str) -> str:
    """A KeySpace file path made absolute (executors needn't share our working directory)."""
    return keyspace_url if "://" in keyspace_url else str(Path(keyspace_url).resolve())


def _key_value(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise CliError(f"--spark-conf {item!r}: expected KEY=VALUE", DATA_ERROR)
    return key, value


@dataclass(frozen=True)
class _Driver:
    """The running Spark driver a backfill hands its job to."""

    link: DriverLink
    master: str
    pid: int


def _running_driver(wanted: bool) -> _Driver | None:
    """The driver of `streamkit spark start`, if `wanted` and one runs."""
    if not wanted:
        return None
    from streamkit.backfill.driver_link import code_fingerprint, find_driver, other_code

    link = find_driver()
    if link is None:
        return None
    status = link.status_once_up(lambda: click.echo(
        f"waiting for the Spark driver at {link.path} to finish starting...", err=True))
    if status.get("fingerprint") != code_fingerprint():  # refused before anything changes
        raise CliError(f"{other_code(link.path)} (or pass --master to use a Spark of this "
                       "command's own)")
    click.echo(f"using the Spark driver at {link.path} ({status['master']}, pid "
               f"{status['pid']})", err=True)
    return _Driver(link, str(status["master"]), int(status["pid"]))


async def _run_on_driver(link: DriverLink, plan: Any, progress: Callable[[Any], None]
                         ) -> list[dict[str, Any]]:
    """The plan run by the driver; cancelled here, its job is cancelled there."""
    try:
        return await asyncio.to_thread(link.backfill, plan, progress)
    except asyncio.CancelledError:
        link.cancel()
        raise


def _start_spark(master: str, conf: dict[str, str]) -> tuple[Any, float]:
    """A SparkContext, started while the plan is made; (context, seconds it took)."""
    from streamkit.backfill.spark import spark_context

    started = time.monotonic()
    click.echo(f"starting Spark ({master})...", err=True)
    return spark_context(master, conf), time.monotonic() - started


def _stop_spark(sc: Any) -> None:
    from streamkit.backfill.spark import stop_context

    stop_context(sc, exiting=True)  # the command ends right after


async def _run_locally(plan: Any, processes: int, handed: list[str],
                       progress: Callable[[Any], None]) -> list[dict[str, Any]]:
    """The plan run in processes of this machine, adding each shard handed over to `handed`;
    cancelled here (Ctrl-C), they are stopped before this command goes on to stop the broker
    they use."""
    from streamkit.backfill.local import run_locally

    cancelled = threading.Event()
    running = asyncio.ensure_future(asyncio.to_thread(
        run_locally, plan, processes, progress=progress, cancelled=cancelled,
        handed_over=lambda result: handed.append(result["shard_id"])))
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        cancelled.set()
        await asyncio.wait((running,))  # quick: it terminates the processes
        if not running.cancelled():
            running.exception()  # Cancelled, as asked (retrieved: not logged as unseen)
        raise


def _run_spark(plan: Any, sc: Any, progress: Callable[[Any], None]) -> list[dict[str, Any]]:
    from streamkit.backfill.spark import run_on_spark

    return run_on_spark(plan, sc=sc, progress=progress)
