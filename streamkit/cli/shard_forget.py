"""`streamkit shards forget`: let SQL-store shards start over from their sources' start.

An SQL store's checkpoint is a row of `streamkit_checkpoints` in the app's
database, and the KeySpace marks each shard that committed one
(`app.commit_marks`), so that a lost row fails the shard rather than have it
count its history again. Starting over on purpose deletes both; the app's
own tables are the user's to empty first. Shards must not be running.
"""

from __future__ import annotations

from pathlib import Path

import click
import sqlalchemy as sa

from streamkit.app.assignment import (
    assign_prefix,
    item_key,
    items_prefix,
    parse_assignment_key,
)
from streamkit.app.commit_marks import forget_commits
from streamkit.app.config import load_config
from streamkit.cli.errors import DATA_ERROR, CliError, async_command
from streamkit.cli.output import plural
from streamkit.cli.shards import app_options, opened
from streamkit.stores.sql import CHECKPOINTS

__all__ = ["forget_cmd"]


def _delete_rows(url: str, fqns: list[str]) -> int:
    """Delete the shards' checkpoint rows; how many there were (none without the table)."""
    engine = sa.create_engine(url, hide_parameters=True)
    try:
        with engine.begin() as conn:
            if not sa.inspect(conn).has_table(CHECKPOINTS.name):
                return 0
            return conn.execute(
                sa.delete(CHECKPOINTS).where(CHECKPOINTS.c.shard_fqn.in_(fqns))).rowcount
    except sa.exc.DBAPIError as error:
        shown = engine.url.render_as_string(hide_password=True)
        raise CliError(f"{shown}: {' '.join(str(error.orig or error).split())}") from None
    finally:
        engine.dispose()


@click.command("forget")
@click.argument("shard_ids", metavar="SHARD...", nargs=-1, required=True)
@app_options
@async_command()
async def forget_cmd(shard_ids: tuple[str, ...], app_dir: Path, keyspace_url: str | None,
                     root: str | None) -> None:
    """Let SHARDs of an SQL-store app start over from their sources' start: delete their
    checkpoints from the database and the KeySpace's record that they committed.

    Empty the app's own tables of the shards' state first: the shards count everything
    again. Stop the app first: shards with a member assigned are refused.
    """
    config = load_config(app_dir)
    if config.store.kind is None:  # (the app's class names it, or the default does)
        config = config.for_application(config.load_application())
    if config.store_kind != "sql":
        raise CliError(f"shards forget is for apps with the sql store ({app_dir} has "
                       f"{config.store_kind}, kept in its recovery logs)", DATA_ERROR)
    async with opened(app_dir, keyspace_url, root) as (keyspace, app_root):
        kvs, _ = await keyspace.range(items_prefix(app_root))
        known = {kv.key.removeprefix(items_prefix(app_root)) for kv in kvs}
        if missing := [s for s in shard_ids if s not in known]:
            raise CliError(f"shard not found: {', '.join(missing)}", DATA_ERROR)
        kvs, _ = await keyspace.range(assign_prefix(app_root))
        parsed = (parse_assignment_key(app_root, kv.key) for kv in kvs)
        if running := sorted({a[0] for a in parsed if a is not None and a[0] in shard_ids}):
            raise CliError(f"{', '.join(running)} still assigned to members: stop the app "
                           "(or its members) first")
        rows = _delete_rows(config.sql_url(), [item_key(app_root, s) for s in shard_ids])
        marked = await forget_commits(keyspace, app_root, list(shard_ids))
    click.echo(f"forgot {plural(len(shard_ids), 'shard')}: {plural(rows, 'checkpoint row')} "
               f"and {plural(len(marked), 'KeySpace mark')} deleted", err=True)
