"""`streamkit query`: ask a running application's shards, where their primaries run.

With auth keys each request carries a token for READ of its one shard; a member
on TLS (an `https://` endpoint) is asked over https, trusting --tls-ca.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.error
from pathlib import Path
from typing import Any

import click

from streamkit.app.config import load_config
from streamkit.app.layout import deployed_config, read_layout
from streamkit.app.loader import app_location
from streamkit.app.member_http import open_member_url
from streamkit.app.resolver import Primary, Resolver
from streamkit.auth.settings import Security
from streamkit.auth.tls import presents_certificate, tls_trouble
from streamkit.auth.tokens import Capability
from streamkit.cli.app_keyspace import app_keyspace
from streamkit.cli.errors import DATA_ERROR, CliError, async_command, warn
from streamkit.cli.output import plural
from streamkit.cli.params import Seconds
from streamkit.cli.security_options import security_options
from streamkit.keyspace import open_keyspace
from streamkit.keyspace.keyspace import KeySpace
from streamkit.protocol import consumer_pb

__all__ = ["query"]


def _ask(primary: Primary, request: dict[str, Any], timeout: float,
         security: Security) -> Any:
    """The shard's answer; a CliError if it gave none within `timeout` seconds (a member
    whose query hook, or any other hook, blocks it answers nothing)."""
    url = f"{primary.http_url}/query/{primary.shard}"
    body = json.dumps(request).encode()
    try:
        with open_member_url(security, url, body, cap=Capability.READ, shard=primary.shard,
                             timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as err:
        detail = " ".join(err.read().decode(errors="replace").split())
        refused = {401: "refused (no valid token: give --auth-keys or AUTH_KEYS): ",
                   403: "refused: "}.get(err.code, "")
        raise CliError(f"shard {primary.shard}: {refused}{detail or err.reason}",
                       DATA_ERROR if err.code == 400 else 1) from None
    except TimeoutError:
        raise CliError(f"shard {primary.shard}: no answer from {url} within {timeout:g}s "
                       "(is a hook of the app stuck? see the member's log)") from None
    except OSError as err:
        if "CERTIFICATE_VERIFY_FAILED" in str(err):  # reached, but not trusted
            raise CliError(f"shard {primary.shard}: the certificate of {url} is not trusted "
                           f"({err}): give --tls-ca the CA that signed it") from None
        if url.startswith("https://") and (advice := tls_trouble(
                str(err), tls=True, peer="member",
                client_cert=presents_certificate(security.client_tls))):  # reached; TLS failed
            raise CliError(f"shard {primary.shard}: TLS with {url} failed: {advice} "
                           f"({err})") from None
        if isinstance(getattr(err, "reason", None), TimeoutError):  # timed out connecting
            raise MemberOutOfReach(f"shard {primary.shard}: cannot reach {url} within "
                                   f"{timeout:g}s") from None
        raise MemberOutOfReach(f"shard {primary.shard}: cannot reach {url}: {err}") from None


class MemberOutOfReach(CliError):
    """A shard's member could not be reached (rather than answering with an error)."""


@click.command("query")
@click.argument("app_dir", type=click.Path(file_okay=False, path_type=Path))
@click.argument("request")
@click.option("--key", default=None, help="Ask only the shard owning this key.")
@click.option("--shard", default=None, help="Ask only this shard.")
@click.option("--keyspace", default=None, envvar="STREAMKIT_KEYSPACE", show_envvar=True,
              help="KeySpace file, sqlite:/// or etcd://host:port/prefix URL "
                   "(default: APP_DIR/.streamkit/keyspace.db).")
@click.option("--timeout", type=Seconds(min=0, min_open=True), default=10.0,
              show_default=True, metavar="SECONDS",
              help="How long to wait for each shard's answer.")
@security_options(dials=True)
@async_command()
async def query(app_dir: Path, request: str, key: str | None, shard: str | None,
                keyspace: str | None, timeout: float, security: Security) -> None:
    """Send REQUEST (a JSON object) to APP_DIR's shards and print the answer.

    Without --key or --shard every shard of the app as deployed is asked,
    and the application's `combine_answers` merges their answers. Shards that
    did not answer (within --timeout) are named, and the command then exits
    with code 1 (the answer printed combines the others' only).
    """
    try:
        parsed = json.loads(request)
    except ValueError as err:
        raise CliError(f"REQUEST is not JSON: {err}", DATA_ERROR) from None
    if not isinstance(parsed, dict):
        raise CliError("REQUEST must be a JSON object, like '{\"word\": \"hello\"}'", DATA_ERROR)
    if key is not None and shard is not None:
        raise click.UsageError("--key and --shard each name the shard to ask: give one")
    config = load_config(app_dir)
    keyspace = app_keyspace(config, app_dir, keyspace)
    app_class = config.load_application()
    async with open_keyspace(keyspace) as ks:
        config = await deployed_config(config, ks)  # the shards as deployed, not the file's
        resolver = Resolver(config, ks)
        primaries = await resolver.primaries()
        if not primaries and await read_layout(ks, config.keyspace_root) is None:  # a typo?
            raise CliError(f"app {config.name} has no shards in KeySpace {keyspace} (under "
                           f"{config.keyspace_root}): is --keyspace's prefix right, or has "
                           f"the app not run with it yet?")
        if key is not None:
            try:
                shard = resolver.shard_of(key)
            except LookupError as error:
                raise CliError(f"--key {key!r}: {error}", DATA_ERROR) from None
        if shard is not None and shard not in config.shard_ids():
            raise CliError(f"no shard {shard}: app {config.name} has "
                           f"{plural(config.shards, 'shard')} (shard-000 … "
                           f"{config.shard_ids()[-1]})", DATA_ERROR)
        wanted = [shard] if shard is not None else config.shard_ids()
        asked = [s for s in wanted if s in primaries]
        disabled = await _disabled(ks, config.keyspace_root) if len(asked) < len(wanted) else set()
        results = await asyncio.gather(
            *(asyncio.to_thread(_ask, primaries[s], parsed, timeout, security) for s in asked),
            return_exceptions=True)
    by_shard: dict[str, Any] = {}
    failures = {s: ("it is disabled (its spec's `disable`)" if s in disabled
                    else "no primary is serving it") for s in wanted if s not in primaries}
    for shard_id, result in zip(asked, results, strict=True):
        if isinstance(result, CliError) and result.exit_code != DATA_ERROR:
            failures[shard_id] = str(result).removeprefix(f"shard {shard_id}: ")
        elif isinstance(result, BaseException):
            raise result  # a bad request (the app's QueryError) is the same on every shard
        else:
            by_shard[shard_id] = result
    if not by_shard:
        reasons = "; ".join(f"{s}: {why}" for s, why in failures.items())
        # Asking whether the app runs only helps when a shard was out of reach: an error the
        # app's query hook raised comes from a running app.
        reached = all(s in primaries or s in disabled for s in wanted) and not any(
            isinstance(r, MemberOutOfReach) for r in results)
        raise CliError(f"no shard answered ({reasons})" + (
            "" if reached else f": is the app running (streamkit run {app_dir})?"))
    for shard_id, reason in failures.items():  # (before combining: it may fail for them)
        warn(f"shard {shard_id} did not answer: {reason}")
    answer = by_shard[shard] if shard is not None else _combined(app_class, by_shard,
                                                                      app_dir)
    try:
        shown = json.dumps(answer, indent=None if isinstance(answer, int | float | str) else 2,
                           default=str, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError) as err:
        made = "the app's combine_answers" if shard is None else f"shard {shard}"
        raise CliError(f"{made} answered what is not JSON: {err}") from None
    click.echo(shown)
    if failures:
        raise CliError(f"the answer combines {len(by_shard)} of {plural(len(wanted), 'shard')}: "
                       f"{', '.join(failures)} did not answer")


def _combined(app_class: type, by_shard: dict[str, Any], app_dir: Path) -> Any:
    """The app's combine_answers over the shards' answers, its failure named as its own."""
    try:
        return app_class().combine_answers(by_shard)
    except Exception as err:
        raise CliError(f"the app's combine_answers failed: {type(err).__name__}: {err}"
                       f"{app_location(err, app_dir)}") from None


async def _disabled(keyspace: KeySpace, root: str) -> set[str]:
    """The shards whose specs disable them: no primary serves them, whether the app runs
    or not (not something for `is the app running?`)."""
    kvs, _ = await keyspace.range(f"{root}/items/")
    disabled = set()
    for kv in kvs:
        with contextlib.suppress(Exception):  # (an unreadable spec: not known disabled)
            spec = consumer_pb.ShardSpec.FromString(kv.value)
            if spec.disable:
                disabled.add(spec.id)
    return disabled
