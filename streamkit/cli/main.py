"""The `streamkit` command."""

from __future__ import annotations

import click

from streamkit.cli.auth import auth
from streamkit.cli.backfill import backfill
from streamkit.cli.broker import broker
from streamkit.cli.deploy import deploy
from streamkit.cli.journals import journals
from streamkit.cli.new import new
from streamkit.cli.publish import publish
from streamkit.cli.query import query
from streamkit.cli.run import run, serve
from streamkit.cli.shard_prune import prune_cmd
from streamkit.cli.shards import shards


@click.group()
@click.version_option(package_name="streamkit")
def cli() -> None:
    """streamkit: stateful, exactly-once stream processing over journals."""


cli.add_command(auth)
cli.add_command(backfill)
cli.add_command(broker)
cli.add_command(deploy)
cli.add_command(journals)
cli.add_command(new)
cli.add_command(publish)
cli.add_command(query)
cli.add_command(run)
cli.add_command(serve)
cli.add_command(shards)
shards.add_command(prune_cmd)  # defined apart: it needs the broker as well as the KeySpace


def main() -> None:
    cli(prog_name="streamkit")


if __name__ == "__main__":
    main()
