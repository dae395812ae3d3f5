"""`streamkit deploy`: create or update an app's journals and shard specs, and exit.

`streamkit run` does this before its member starts; an app whose members run
elsewhere (`streamkit serve` on other machines) needs it on its own: once
before the members first start, and again after a change to streamkit.yaml.
"""

from __future__ import annotations

from pathlib import Path

import click

from streamkit.auth.settings import Security
from streamkit.cli.errors import async_command
from streamkit.cli.output import plural
from streamkit.cli.run import app_config, deploy_when_ready, keyspace_url_of
from streamkit.cli.security_options import security_options
from streamkit.client import BrokerClient
from streamkit.client.environment import BROKER_ENV
from streamkit.keyspace import open_keyspace

__all__ = ["deploy"]


@click.command("deploy")
@click.argument("app_dir", default=".", type=click.Path(file_okay=False, path_type=Path))
@click.option("--broker", required=True, metavar="URL", envvar=list(BROKER_ENV),
              help="The broker the app's journals live on (https://HOST:PORT for TLS).")
@click.option("--keyspace", default=None,
              help="KeySpace (default: APP_DIR/.streamkit/keyspace.db; etcd://HOST:PORT/PREFIX "
                   "for members on several machines).")
@click.option("--shards", type=click.IntRange(1, 1000), default=None,
              help="Number of shards (default: streamkit.yaml's); must be the deployed count.")
@click.option("--standbys", type=click.IntRange(0, 8), default=None,
              help="Hot standbys per shard (default: streamkit.yaml's).")
@click.option("--adopt-recovery-logs", "adopt", is_flag=True,
              help="Take over recovery logs another KeySpace's deployment of the app made "
                   "(only when this KeySpace replaces that one, which was lost).")
@security_options(dials=True)
@async_command()
async def deploy(app_dir: Path, broker: str, keyspace: str | None, shards: int | None,
                 standbys: int | None, adopt: bool, security: Security) -> None:
    """Create or update APP_DIR's journals and shard specs, then exit.

    For apps whose members run elsewhere (`streamkit serve`); `streamkit run`
    does it by itself. Idempotent: run it again after changing streamkit.yaml.
    """
    config, _ = app_config(app_dir, shards, standbys, None)
    async with BrokerClient(broker, security) as client, open_keyspace(
            keyspace_url_of(config, keyspace)) as ks:
        await deploy_when_ready(config, client, ks, broker, adopt=adopt)
    journals = len(config.journal_specs())
    click.echo(f"app {config.name}: {plural(journals, 'journal')} and "
               f"{plural(config.shards, 'shard')} deployed", err=True)
