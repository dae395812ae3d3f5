"""`streamkit shards prune`: delete recovery-log fragments no shard's playback needs.

For each selected shard: its hints (the primary's latest and the backups,
from the KeySpace), its recovery log's persisted fragments (from the broker),
and the fragments none of those hints read (`recoverylog.prune`), which are
deleted from their stores as `journals prune` deletes expired ones. A shard
without hints yet keeps its whole log. `--every` repeats it on a schedule.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from streamkit.app.app_folder import bundled_fragments
from streamkit.app.shard_ops import get_hints, list_shards
from streamkit.auth.settings import Security
from streamkit.cli.errors import CliError, async_command, warn
from streamkit.cli.journal_fragments import Removal
from streamkit.cli.journals import broker_option
from streamkit.cli.output import plural
from streamkit.cli.security_options import security_options
from streamkit.cli.shards import app_options, opened
from streamkit.client import BrokerClient, list_fragments
from streamkit.keyspace import KeySpace
from streamkit.protocol import consumer_pb, pb
from streamkit.protocol.durations import parse_duration
from streamkit.protocol.fragments import content_name
from streamkit.protocol.labels import parse_selector
from streamkit.recoverylog.prune import prunable_fragments
from streamkit.recoverylog.segments import SegmentError

__all__ = ["prune_cmd"]


def _every(_ctx: click.Context, _param: click.Parameter, value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = parse_duration(value).total_seconds()
    except ValueError as err:
        raise click.BadParameter(str(err)) from None
    if seconds <= 0:
        raise click.BadParameter(f"must be more than 0s (got {value})")
    return seconds


@click.command("prune")
@click.option("-l", "--selector", metavar="SELECTOR", default="",
              help='Label selector of the shards whose logs to prune; all if omitted.')
@click.option("--dry-run", is_flag=True, help="List what would be deleted; delete nothing.")
@click.option("--every", metavar="DURATION", callback=_every,
              help='Prune again every DURATION (e.g. "1h") until interrupted.')
@click.option("--file-root", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where file:/// stores live: the broker's --file-root (default: the "
                   "bundled broker's, in the --app folder's .streamkit/broker/fragments).")
@broker_option
@app_options
@security_options(dials=True)
@async_command()
async def prune_cmd(selector: str, dry_run: bool, every: float | None, file_root: Path | None,
                    broker: str, app_dir: Path, keyspace_url: str | None,
                    root: str | None, security: Security) -> None:
    """Delete recovery-log fragments that no playback of the shards can need.

    A fragment is kept while it holds ops of a file live in the primary's latest
    hints or in any backup hints, or ops recorded after them. Shards without hints
    keep their whole log.
    """
    parsed = parse_selector(selector)
    if file_root is None:  # the bundled broker's, wherever this command runs from
        file_root = bundled_fragments(app_dir)
    while True:
        async with opened(app_dir, keyspace_url, root) as (keyspace, app_root), \
                BrokerClient(broker, security) as client:
            listed = (await list_shards(keyspace, app_root, parsed)).shards
            removal = Removal(file_root, dry_run=dry_run)
            for shard in listed:
                for fragment in await _prunable(client, keyspace, app_root, shard.spec):
                    if await removal.remove(fragment):
                        click.echo(f"{removal.verb} {fragment.journal} "
                                   f"[{fragment.begin}, {fragment.end}) "
                                   f"{fragment.backing_store} {content_name(fragment)}")
        click.echo(f"{removal.verb} {plural(removal.count, 'fragment')} "
                   f"({plural(removal.size, 'byte')} of recovery log) of "
                   f"{plural(len(listed), 'shard')}")
        removal.check()
        if every is None:
            return
        await asyncio.sleep(every)


async def _prunable(client: BrokerClient, keyspace: KeySpace, root: str,
                    spec: consumer_pb.ShardSpec) -> list[pb.Fragment]:
    """The fragments of `spec`'s recovery log that none of its hints need."""
    log = f"{spec.recovery_log_prefix}/{spec.id}"
    response = await get_hints(keyspace, root, spec.id)
    if not response.primary_hints.HasField("hints"):
        warn(f"{spec.id}: no hints recorded yet; its log {log} is kept whole")
        return []
    hints = [response.primary_hints.hints]
    hints += [h.hints for h in response.backup_hints if h.HasField("hints")]
    fragments = [f.spec for f in (await list_fragments(client, log)).fragments]
    try:
        return prunable_fragments(log, fragments, hints)
    except SegmentError as err:
        raise CliError(f"{spec.id}: its hints are inconsistent ({err}); nothing pruned") from None
