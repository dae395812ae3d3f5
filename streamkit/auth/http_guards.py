"""The checks every HTTP request to a streamkit server passes, free of any HTTP framework.

Two guards matter because browsers reach HTTP servers on loopback and private networks:

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
capability). The broker's gateway applies these through aiohttp middleware
(`http_auth`), a member's HTTP API through its own small server.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar
from urllib.parse import urlsplit

from streamkit.auth.keys import Keys
from streamkit.auth.scope import claims_bound
from streamkit.auth.tokens import AuthError, Capability, Claims, Unauthenticated, verify_bearer

__all__ = ["LOOPBACK_HOSTS", "SAFE_METHODS", "GuardedRequest", "Refusal", "by_method",
           "guarded", "request_guard"]

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})  # no side effects, so no origin check
_BROWSER_SAME_ORIGIN = frozenset({"same-origin", "none"})  # "none": typed by the user
_DEFAULT_PORTS = {"http": 80, "https": 443}


class _Headers(Protocol):
    def get(self, name: str, default: str | None = None, /) -> str | None: ...


class GuardedRequest(Protocol):
    """What the guards read of a request (an aiohttp request has it, as does ours)."""

    @property
    def method(self) -> str: ...

    @property
    def scheme(self) -> str: ...

    @property
    def headers(self) -> _Headers: ...


R = TypeVar("R", bound=GuardedRequest)
A = TypeVar("A")  # a server's answer


@dataclass(frozen=True)
class Refusal:
    """A request refused before its handler ran: the status and the reason to send."""

    status: int
    message: str

    @classmethod
    def of(cls, err: AuthError) -> Refusal:
        return cls(401 if isinstance(err, Unauthenticated) else 403, str(err))

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}


def by_method(table: Mapping[str, Capability],
              default: Capability | None = None) -> Callable[[GuardedRequest], Capability | None]:
    """Required capability by HTTP method, e.g. {"GET": READ, "HEAD": READ, "PUT": APPEND}.
    None means the route is public (no token needed)."""
    return lambda request: table.get(request.method, default)


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


def _host_refusal(request: GuardedRequest, allowed: Collection[str]) -> str | None:
    header = request.headers.get("Host") or ""
    host, port = _split_host(header)
    for entry in allowed:
        want_host, want_port = _split_host(entry)
        if host == want_host and (want_port is None or want_port == port):
            return None
    return (
        f"Host {header!r} is not a name of this server; "
        "add it to the server's allowed hosts if it is (refused to prevent DNS rebinding)"
    )


def _origin_refusal(request: GuardedRequest, trusted_origins: Collection[str]) -> str | None:
    fetch_site = (request.headers.get("Sec-Fetch-Site") or "").lower()
    origin = request.headers.get("Origin")
    if origin is not None and origin.rstrip("/") in trusted_origins:
        return None
    if fetch_site and fetch_site not in _BROWSER_SAME_ORIGIN:
        return f"cross-origin {request.method} refused (Sec-Fetch-Site: {fetch_site})"
    if origin is not None:
        parts = urlsplit(origin)
        try:
            origin_port = parts.port or _DEFAULT_PORTS.get(parts.scheme)
        except ValueError:
            origin_port = None
        host, port = _split_host(request.headers.get("Host") or "")
        port = port or _DEFAULT_PORTS.get(request.scheme)
        if (parts.hostname or "", origin_port) != (host, port):
            return f"cross-origin {request.method} refused (Origin: {origin})"
    return None


def request_guard(
    keys: Keys | None,
    capability_for: Callable[[R], Capability | None] | Mapping[str, Capability],
    *,
    allowed_hosts: Collection[str] | None = LOOPBACK_HOSTS,
    cross_origin_writes: bool = False,
    trusted_origins: Collection[str] = (),
    clock: Callable[[], float] = time.time,
) -> Callable[[R], Claims | Refusal | None]:
    """A check of each request: a Refusal, else the verified claims (None when no token
    was checked: no keys, or a public route).

    `capability_for` gives the capability a request needs (None: public), or is a
    {method: capability} table. `keys` None turns token checks off. `allowed_hosts`
    are names and addresses (optionally with `:port`) the server answers to; None
    turns that check off. Writes from other origins are refused unless
    `cross_origin_writes`, or their Origin is one of `trusted_origins` (e.g.
    "https://console.example.com").
    """
    needs = by_method(capability_for) if isinstance(capability_for, Mapping) else capability_for
    trusted = frozenset(origin.rstrip("/") for origin in trusted_origins)

    def check(request: R) -> Claims | Refusal | None:
        if allowed_hosts is not None and (problem := _host_refusal(request, allowed_hosts)):
            return Refusal(403, problem)
        writes = request.method not in SAFE_METHODS and not cross_origin_writes
        if writes and (problem := _origin_refusal(request, trusted)):
            return Refusal(403, problem)
        required = needs(request)
        if keys is None or required is None:
            return None
        try:
            return verify_bearer(keys, request.headers.get("Authorization"), required,
                                 now=clock())
        except AuthError as err:
            return Refusal.of(err)

    return check


async def guarded(check: Callable[[R], Claims | Refusal | None], request: R,
                  handler: Callable[[R], Awaitable[A]], refuse: Callable[[Refusal], A]) -> A:
    """`handler`'s answer to `request` if `check` lets it through, with the verified claims
    bound for it (see `scope`; a PermissionDenied it raises is refused too); else the
    refusal as `refuse` words it."""
    claims = check(request)
    if isinstance(claims, Refusal):
        return refuse(claims)
    with claims_bound(claims):
        try:
            return await handler(request)
        except AuthError as err:
            return refuse(Refusal.of(err))
