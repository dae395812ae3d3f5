"""Authorization for aiohttp servers, plus two guards that matter because browsers reach
HTTP servers on loopback and private networks.

* Host allow-listing. A web page can point a DNS name it controls at 127.0.0.1
  (DNS rebinding) and then read the server as if it were its own origin; the
  browser still sends the page's name as `Host`. Answering only Host names that
  are the server's own defeats it.
* Cross-origin writes. A page can send a POST or PUT to any address without
  reading the reply. Browsers label such requests with `Sec-Fetch-Site` and
  `Origin`; a write that says it comes from another origin is refused. Clients
  that are not browsers send neither header and are unaffected.

Then, when keys are set, the `Authorization: Bearer <token>` header is verified
for the capability the route needs (401 without a usable token, 403 without the
capability), and the claims are bound for the handler (see `scope`; a
PermissionDenied it raises becomes a 403).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from streamkit.auth.keys import Keys
from streamkit.auth.scope import claims_bound
from streamkit.auth.tokens import AuthError, Capability, Claims, Unauthenticated, verify_bearer

__all__ = [
    "CLAIMS_KEY",
    "LOOPBACK_HOSTS",
    "SAFE_METHODS",
    "auth_middleware",
    "by_method",
    "request_claims",
]

# request[CLAIMS_KEY]: the verified Claims, or None (a typed key where aiohttp has them).
CLAIMS_KEY: Any = (
    web.RequestKey("streamkit.auth.claims", object)
    if hasattr(web, "RequestKey")
    else "streamkit.auth.claims"
)
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})  # no side effects, so no origin check
_BROWSER_SAME_ORIGIN = frozenset({"same-origin", "none"})  # "none": typed by the user

CapabilityFor = Callable[[web.Request], Capability | None]


def by_method(table: Mapping[str, Capability], default: Capability | None = None) -> CapabilityFor:
    """Required capability by HTTP method, e.g. {"GET": READ, "HEAD": READ, "PUT": APPEND}.
    None means the route is public (no token needed)."""
    return lambda request: table.get(request.method, default)


def request_claims(request: web.Request) -> Claims | None:
    """The claims the middleware verified for `request`; None when none were checked."""
    return request.get(CLAIMS_KEY)


def _split_host(value: str) -> tuple[str, int | None]:
    """("host", port) of a Host header or allow-list entry (IPv6: "[::1]:80" or "::1")."""
    value = value.strip()
    if value.count(":") > 1 and not value.startswith("["):
        return value.lower(), None  # a bare IPv6 address
    try:
        parts = urlsplit(f"//{value}")
        host, port = parts.hostname or "", parts.port
    except ValueError:
        return "", None
    return host.rstrip(".").lower(), port


def _host_refusal(request: web.Request, allowed: Collection[str]) -> str | None:
    header = request.headers.get("Host", "")
    host, port = _split_host(header)
    for entry in allowed:
        want_host, want_port = _split_host(entry)
        if host == want_host and (want_port is None or want_port == port):
            return None
    return (
        f"Host {header!r} is not a name of this server; "
        "add it to the server's allowed hosts if it is (refused to prevent DNS rebinding)"
    )


def _origin_refusal(request: web.Request, trusted_origins: Collection[str]) -> str | None:
    fetch_site = request.headers.get("Sec-Fetch-Site", "").lower()
    origin = request.headers.get("Origin")
    if origin is not None and origin.rstrip("/") in trusted_origins:
        return None
    if fetch_site and fetch_site not in _BROWSER_SAME_ORIGIN:
        return f"cross-origin {request.method} refused (Sec-Fetch-Site: {fetch_site})"
    if origin is not None:
        parts = urlsplit(origin)
        try:
            origin_port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
        except ValueError:
            origin_port = None
        host, port = _split_host(request.headers.get("Host", ""))
        port = port or {"http": 80, "https": 443}.get(request.scheme)
        if (parts.hostname or "", origin_port) != (host, port):
            return f"cross-origin {request.method} refused (Origin: {origin})"
    return None


def _refused(status: int, message: str) -> web.Response:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return web.Response(status=status, text=message + "\n", headers=headers)


def _auth_refusal(err: AuthError) -> web.Response:
    return _refused(401 if isinstance(err, Unauthenticated) else 403, str(err))


def auth_middleware(
    keys: Keys | None,
    capability_for: CapabilityFor | Mapping[str, Capability],
    *,
    allowed_hosts: Collection[str] | None = LOOPBACK_HOSTS,
    cross_origin_writes: bool = False,
    trusted_origins: Collection[str] = (),
    clock: Callable[[], float] = time.time,
):
    """Middleware guarding every route of an aiohttp app.

    `capability_for` gives the capability a request needs (None: public), or is a
    {method: capability} table. `keys` None turns token checks off. `allowed_hosts`
    are names and addresses (optionally with `:port`) the server answers to; None
    turns that check off. Writes from other origins are refused unless
    `cross_origin_writes`, or their Origin is one of `trusted_origins` (e.g.
    "https://console.example.com").
    """
    needs = by_method(capability_for) if isinstance(capability_for, Mapping) else capability_for
    trusted = frozenset(origin.rstrip("/") for origin in trusted_origins)

    @web.middleware
    async def middleware(request: web.Request, handler):
        if allowed_hosts is not None and (problem := _host_refusal(request, allowed_hosts)):
            return _refused(403, problem)
        writes = request.method not in SAFE_METHODS and not cross_origin_writes
        if writes and (problem := _origin_refusal(request, trusted)):
            return _refused(403, problem)
        claims = None
        required = needs(request)
        if keys is not None and required is not None:
            try:
                claims = verify_bearer(
                    keys, request.headers.get("Authorization"), required, now=clock()
                )
            except AuthError as err:
                return _auth_refusal(err)
        request[CLAIMS_KEY] = claims
        with claims_bound(claims):
            try:
                return await handler(request)
            except AuthError as err:
                return _auth_refusal(err)

    return middleware
