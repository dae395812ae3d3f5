"""Forwarding a query to the shard's primary, so that any member answers for any shard.

A member's HTTP API answers queries of its own primaries. Asked about a shard
whose primary runs elsewhere, it passes the request on to that member's HTTP
API, once: the forwarded request is marked, and a member receiving a marked
request for a shard it is not primary of answers 404 instead of forwarding it
on (the KeySpace moved the shard meanwhile; the client asks again). The
caller's `Authorization` header travels along, so the primary checks the
caller's own token, as if asked directly; but never in the clear from a member
serving TLS (to a member announcing a plaintext endpoint: a mixed deployment),
where the caller sent it encrypted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from urllib.parse import quote

from streamkit.app.http_server import Response, json_response
from streamkit.app.member_http import http_url
from streamkit.auth.settings import Security

__all__ = ["FORWARDED", "PrimaryOf", "forward_query"]

log = logging.getLogger(__name__)

FORWARDED = "X-Streamkit-Forwarded"
# Shard -> the Shard API endpoint of its primary when that is another member, else None.
PrimaryOf = Callable[[str], str | None]


async def forward_query(
    endpoint: str, shard: str, body: bytes, authorization: str | None, security: Security,
    timeout: float,
) -> Response:
    """The answer of the primary at Shard API `endpoint` to the query `body` about `shard`
    (its status and body as they are); 502 or 504 naming the primary when it can't be
    reached or doesn't answer within `timeout`; 502 too, without sending it, when the
    caller's token would leave a TLS member in the clear."""
    import aiohttp  # its client: on the first forwarded query, not at every member's start

    url = f"{http_url(endpoint)}/query/{quote(shard, safe='/')}"
    if authorization and security.server_tls is not None and not url.startswith("https://"):
        return json_response(
            {"error": f"shard {shard}'s primary at {endpoint} serves no TLS, while this member "
                      "does: the query's token is not forwarded in the clear (serve every "
                      "member with TLS, or ask that member directly)"}, 502)
    headers = {"Content-Type": "application/json", FORWARDED: "1"}
    if authorization:
        headers["Authorization"] = authorization
    tls = security.client_tls
    ssl_context = tls.ssl_context() if url.startswith("https://") and tls is not None else None
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
            session.post(url, data=body, headers=headers, ssl=ssl_context or True) as answer,
        ):
            return Response(answer.status, await answer.read(), answer.content_type)
    except TimeoutError:
        return json_response(
            {"error": f"shard {shard}'s primary at {endpoint} did not answer within "
                      f"{timeout:g}s"}, 504)
    except aiohttp.ClientError as err:
        log.info("forwarding a query of %s to %s failed: %s", shard, endpoint, err)
        return json_response(
            {"error": f"cannot reach shard {shard}'s primary at {endpoint}: {err}"}, 502)
