"""The `streamkit` command.

Each subcommand's module is imported only when that command runs (or when help
lists them all): they pull in very different stacks (the broker's server, Spark
and the backfill planner, the auth tooling), and `streamkit run` and the bundled
broker it starts should not pay for the others at every start.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator, MutableMapping

# gRPC core's own log lines (a failed TLS handshake, at INFO) would print before a
# command's one-line error; read once, when grpc is first imported. GRPC_VERBOSITY=INFO
# (or DEBUG) brings them back.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import click

from streamkit.cli import stacks

Loader = Callable[[], click.Command]


def _attr(spec: str) -> Loader:
    """A loader for "module:name"."""
    module, _, name = spec.partition(":")
    return lambda: getattr(importlib.import_module(module), name)


def _shards() -> click.Command:
    from streamkit.cli.shard_forget import forget_cmd
    from streamkit.cli.shard_prune import prune_cmd
    from streamkit.cli.shards import shards

    # Defined apart: prune needs the broker as well as the KeySpace, forget the app's database.
    for command in (prune_cmd, forget_cmd):
        if command.name not in shards.commands:
            shards.add_command(command)
    return shards


class LazyCommands(MutableMapping[str, click.Command]):
    """A group's `commands`, each imported on first access by name.

    Listing the names imports nothing; click asks for a command by name to run it, and
    for every one only to list them in help."""

    def __init__(self, loaders: dict[str, Loader]) -> None:
        self._loaders = loaders
        self._loaded: dict[str, click.Command] = {}

    def __getitem__(self, name: str) -> click.Command:
        if name not in self._loaded:
            self._loaded[name] = self._loaders[name]()
        return self._loaded[name]

    def __setitem__(self, name: str, command: click.Command) -> None:
        self._loaders[name] = lambda: command
        self._loaded[name] = command

    def __delitem__(self, name: str) -> None:
        del self._loaders[name]
        self._loaded.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaders)

    def __len__(self) -> int:
        return len(self._loaders)


COMMANDS = LazyCommands({
    "auth": _attr("streamkit.cli.auth:auth"),
    "backfill": _attr("streamkit.cli.backfill:backfill"),
    "broker": _attr("streamkit.cli.broker:broker"),
    "deploy": _attr("streamkit.cli.deploy:deploy"),
    "journals": _attr("streamkit.cli.journals:journals"),
    "new": _attr("streamkit.cli.new:new"),
    "publish": _attr("streamkit.cli.publish:publish"),
    "query": _attr("streamkit.cli.query:query"),
    "run": _attr("streamkit.cli.run:run"),
    "serve": _attr("streamkit.cli.run:serve"),
    "shards": _shards,
    "spark": _attr("streamkit.cli.spark:spark"),
})


@click.group(commands=COMMANDS)
@click.version_option(package_name="streamkit")
def cli() -> None:
    """streamkit: stateful, exactly-once stream processing over journals."""


def main() -> None:
    stacks.install()  # `kill -USR1 PID`: every thread's stack, to stderr
    cli(prog_name="streamkit")


if __name__ == "__main__":
    main()
