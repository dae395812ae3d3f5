"""`streamkit auth …`: mint authorization tokens for clients that cannot sign their own.

streamkit's own commands sign a token for each call from the keys they are
given. curl, grpcurl, a Prometheus scraper or a colleague's script are handed
a token instead: `streamkit auth token` signs one with the first key, for the
capabilities and selector asked, and prints it alone on stdout so that
`$(streamkit auth token …)` composes. What it grants goes to stderr.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import click

from streamkit.auth.settings import Security
from streamkit.auth.tokens import Capability, describe, sign
from streamkit.cli.errors import DATA_ERROR, CliError, reporting_errors
from streamkit.cli.journals import DurationType
from streamkit.cli.security_options import security_options
from streamkit.protocol.labels import format_selector, parse_selector

__all__ = ["auth"]

_NAMES = ", ".join([*(c.name for c in Capability if c.name), "ALL"])


class CapabilitiesType(click.ParamType):
    """Capability names or bit values, comma-separated: "LIST,READ", "APPEND,65536"."""

    name = "caps"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Capability:
        if isinstance(value, Capability):
            return value
        cap = 0
        for word in (w.strip() for w in str(value).split(",")):
            if not word:
                continue
            if word.upper() in Capability.__members__:
                cap |= Capability[word.upper()]
                continue
            try:
                bits = int(word, 0)
            except ValueError:
                self.fail(f"{word!r} is not a capability ({_NAMES}, or a number such as "
                          "65536 for application bit 1<<16)", param, ctx)
            if not 0 < bits <= Capability.ALL:
                self.fail(f"{word} is not a 32-bit capability mask", param, ctx)
            cap |= bits
        if not cap:
            self.fail("name at least one capability", param, ctx)
        return Capability(cap)


@click.group()
def auth() -> None:
    """Mint authorization tokens for curl, grpcurl and other clients."""


@auth.command("token")
@click.option("--cap", "cap", type=CapabilitiesType(), required=True, metavar="CAPS",
              help=f"What the token grants, comma-separated: {_NAMES}, or numbers "
                   "(application bits from 65536).")
@click.option("-l", "--selector", default="", metavar="SELECTOR",
              help='Label selector of the journals (or shards) it covers, e.g. "prefix=a/"; '
                   "all if omitted.")
@click.option("--ttl", type=DurationType(), default="1h", show_default=True,
              help="How long the token is valid.")
@security_options(dials=False)
def token_cmd(cap: Capability, selector: str, ttl: timedelta, security: Security) -> None:
    """Print a token signed with the first of the auth keys, for `Authorization: Bearer`."""
    with reporting_errors():
        if security.keys is None:
            raise CliError("no keys to sign with: give --auth-keys or set AUTH_KEYS", DATA_ERROR)
        if ttl.total_seconds() <= 0:
            raise CliError("--ttl must be positive", DATA_ERROR)
        parsed = parse_selector(selector)
        now = time.time()
        token = sign(security.keys, cap, parsed, ttl.total_seconds(), now=now)
    expiry = datetime.fromtimestamp(now + ttl.total_seconds(), UTC).isoformat(timespec="seconds")
    scope = format_selector(parsed) or "every journal and shard"
    grants = "ALL" if cap == Capability.ALL else describe(cap)
    click.echo(f"streamkit: token grants {grants} over {scope} until {expiry}", err=True)
    click.echo(token)
