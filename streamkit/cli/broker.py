"""`streamkit broker …`: run the bundled journal broker."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import click

from streamkit.auth.settings import Exposed, Security
from streamkit.broker.pace import DEFAULT_MIN_APPEND_RATE
from streamkit.broker.server import DEFAULT_PORT, BrokerConfig, StartupFailed, serve
from streamkit.cli.errors import DATA_ERROR, CliError, reporting_errors
from streamkit.cli.logs import configure_logging
from streamkit.cli.params import Seconds
from streamkit.cli.security_options import security_options
from streamkit.keyspace import KeySpaceError


@click.group()
def broker() -> None:
    """Run the bundled, single-node journal broker."""


@broker.command("serve")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path(".streamkit/broker"), show_default=True,
              help="Spools, the embedded keyspace and (by default) the file:// fragment root.")
@click.option("--port", type=click.IntRange(1, 65535), default=DEFAULT_PORT, show_default=True,
              help="gRPC port.")
@click.option("--http-port", type=click.IntRange(0, 65535), default=None,
              help="HTTP gateway and /metrics port [default: --port + 1; 0 disables].")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--advertise", default=None, metavar="HOST",
              help="The host name clients reach this broker by, announced in routes "
                   "[default: --host, or the machine's name when it is 0.0.0.0].")
@click.option("--file-root", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Root of file:/// store URLs [default: DATA_DIR/fragments].")
@click.option("--keyspace", default=None,
              help="KeySpace URL for journal specs [default: DATA_DIR/keyspace.db].")
@click.option("--append-timeout", type=Seconds(min=0.1), default=30.0,
              show_default=True,
              help="Seconds an appender may stall mid-append before it is rolled back.")
@click.option("--min-append-rate", type=click.IntRange(min=0), default=DEFAULT_MIN_APPEND_RATE,
              show_default=True,
              help="Bytes per second an appender must keep up, or its append is rolled back "
                   "(it holds the journal meanwhile); 0: no minimum.")
@click.option("--log-level", default="INFO", show_default=True, envvar="STREAMKIT_LOG_LEVEL",
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@click.option("--log-format", default="text", show_default=True, envvar="STREAMKIT_LOG_FORMAT",
              type=click.Choice(["text", "json"]), help="json: one structured object per line.")
@security_options(serves=True, dials=False)
def serve_cmd(data_dir: Path, port: int, http_port: int | None, host: str,
              advertise: str | None, file_root: Path | None, keyspace: str | None,
              append_timeout: float, min_append_rate: int, log_level: str, log_format: str,
              security: Security) -> None:
    """Serve journals until SIGTERM or Ctrl-C.

    Beyond loopback (--host 0.0.0.0, say) it needs --auth-keys (or client
    certificates required), unless --insecure.
    """
    configure_logging(log_level, log_format)
    with reporting_errors():  # a setting to change, said as `serve` says it, touching nothing
        try:
            security.check_exposure(host, port, "the broker")
        except Exposed as err:
            raise CliError(f"refusing to serve: {err}", DATA_ERROR) from None
    if advertise:  # the HTTP gateway answers the name it is reached by
        security = replace(security, allowed_hosts=(*security.allowed_hosts, advertise))
    config = BrokerConfig(data_dir=data_dir.resolve(), port=port, http_port=http_port, host=host,
                          advertise=advertise,
                          file_root=file_root.resolve() if file_root else None, keyspace=keyspace,
                          append_timeout=append_timeout, min_append_rate=min_append_rate,
                          security=security)
    try:
        serve(config)
    except StartupFailed as err:
        # Startup problems (port taken, unwritable data dir, bad keyspace URL) are the
        # user's to fix: say what and where, without a traceback.
        raise click.ClickException(f"broker could not start: {err}") from None
    except (OSError, RuntimeError, KeySpaceError) as err:
        raise click.ClickException(f"broker stopped on an error: {err}") from None
