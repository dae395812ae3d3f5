"""Reaching a member's HTTP API (/status, /query) from its announced Shard API endpoint.

Members announce only their gRPC endpoint; their HTTP API listens on the next
port, with TLS when the endpoint is `https://`. Callers with keys sign a token
for the one thing they ask (READ of one shard for a query, LIST for /status),
as they do for the broker, so a leaked token opens no more than that.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from streamkit.auth.settings import Security
from streamkit.auth.tls import parse_address
from streamkit.auth.tokens import Capability

if TYPE_CHECKING:
    import ssl

__all__ = ["http_url", "open_member_url"]


def http_url(endpoint: str) -> str:
    """`http(s)://host:port+1` of the member announcing Shard API `endpoint`."""
    where = parse_address(endpoint)
    host = f"[{where.host}]" if ":" in where.host else where.host
    return f"{'https' if where.tls else 'http'}://{host}:{where.port + 1}"


def _ssl_context(security: Security, url: str) -> ssl.SSLContext | None:
    if not url.startswith("https://") or security.client_tls is None:
        return None  # plaintext, or the system's roots (urllib's default)
    return security.client_tls.ssl_context()


def open_member_url(
    security: Security,
    url: str,
    body: bytes | None = None,
    *,
    cap: Capability,
    shard: str | None = None,
    timeout: float,
) -> Any:
    """urllib's response for `url` (POST when `body` is given), with a token for `cap` over
    `shard` (every shard when None) when `security` has keys, and its CA for https://."""
    import urllib.request  # on use: members import this module to name URLs only

    headers = {"Content-Type": "application/json"} if body is not None else {}
    signer = security.signer()
    if signer is not None:
        metadata = (signer.for_shard(cap, shard) if shard is not None
                    else signer.for_selector(cap))
        headers["Authorization"] = metadata[0][1]
    request = urllib.request.Request(url, body, headers)
    return urllib.request.urlopen(request, timeout=timeout, context=_ssl_context(security, url))
