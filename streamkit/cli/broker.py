"""`streamkit broker …`: run the bundled journal broker."""

from __future__ import annotations

from pathlib import Path

import click

from streamkit.broker.server import DEFAULT_PORT, BrokerConfig, serve


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
@click.option("--file-root", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Root of file:/// store URLs [default: DATA_DIR/fragments].")
@click.option("--keyspace", default=None,
              help="KeySpace URL for journal specs [default: DATA_DIR/keyspace.db].")
def serve_cmd(data_dir: Path, port: int, http_port: int | None, host: str,
              file_root: Path | None, keyspace: str | None) -> None:
    """Serve journals until SIGTERM or Ctrl-C."""
    serve(BrokerConfig(data_dir=data_dir.resolve(), port=port, http_port=http_port, host=host,
                       file_root=file_root.resolve() if file_root else None, keyspace=keyspace))
