"""The `streamkit` command."""

from __future__ import annotations

import click

from streamkit.cli.broker import broker
from streamkit.cli.journals import journals
from streamkit.cli.publish import publish


@click.group()
@click.version_option(package_name="streamkit")
def cli() -> None:
    """streamkit: stateful, exactly-once stream processing over journals."""


cli.add_command(broker)
cli.add_command(journals)
cli.add_command(publish)


def main() -> None:
    cli(prog_name="streamkit")


if __name__ == "__main__":
    main()
