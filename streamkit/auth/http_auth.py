"""Authorization for aiohttp servers (the broker's gateway): `http_guards`' checks as
middleware, with the verified claims bound for the handler (see `scope`; a
PermissionDenied it raises becomes a 403).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

from aiohttp import web

from streamkit.auth.http_guards import (
    LOOPBACK_HOSTS,
    SAFE_METHODS,
    Refusal,
    by_method,
    guarded,
    request_guard,
)
from streamkit.auth.keys import Keys
from streamkit.auth.scope import current_claims
from streamkit.auth.tokens import Capability, Claims

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

CapabilityFor = Callable[[web.Request], Capability | None]


def request_claims(request: web.Request) -> Claims | None:
    """The claims the middleware verified for `request`; None when none were checked."""
    return request.get(CLAIMS_KEY)


def refused(refusal: Refusal) -> web.Response:
    return web.Response(status=refusal.status, text=refusal.message + "\n",
                        headers=refusal.headers() or None)


def auth_middleware(
    keys: Keys | None,
    capability_for: CapabilityFor | Mapping[str, Capability],
    *,
    allowed_hosts: Collection[str] | None = LOOPBACK_HOSTS,
    cross_origin_writes: bool = False,
    trusted_origins: Collection[str] = (),
    clock: Callable[[], float] = time.time,
):
    """Middleware guarding every route of an aiohttp app (the options: `request_guard`)."""
    check = request_guard(keys, capability_for, allowed_hosts=allowed_hosts,
                          cross_origin_writes=cross_origin_writes,
                          trusted_origins=trusted_origins, clock=clock)

    @web.middleware
    async def middleware(request: web.Request, handler):
        async def with_claims(request: web.Request) -> web.StreamResponse:
            request[CLAIMS_KEY] = current_claims()
            return await handler(request)

        return await guarded(check, request, with_claims, refused)

    return middleware
