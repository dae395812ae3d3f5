"""Authorization and TLS: Gazette-compatible keyed tokens, their gRPC and HTTP guards,
and TLS credentials.

`keys` reads the pre-shared keys, `tokens` signs and verifies tokens, `signer`
scopes a client's tokens to each call, `scope` holds the claims of the request
being served, `grpc_auth` and `http_auth` enforce them, `tls` parses addresses
and builds credentials, and `settings` gathers a process's choices into one
`Security` that servers and clients are built from. Only `streamkit.protocol` and
`streamkit.errors` are imported, so every server and client may use this package.
"""

from typing import Any

from streamkit.auth.grpc_auth import (
    JOURNAL_CAPABILITIES,
    SHARD_CAPABILITIES,
    ServerAuth,
    call_credentials,
    client_interceptors,
    open_channel,
)
from streamkit.auth.keys import AUTH_KEYS_ENV, AuthKeysError, Keys, load_keys, parse_keys
from streamkit.auth.scope import (
    current_claims,
    journal_allowed,
    require_journal,
    require_shard,
    shard_allowed,
)
from streamkit.auth.settings import Exposed, Security
from streamkit.auth.signer import Signer
from streamkit.auth.tls import Address, AddressError, ClientTls, ServerTls, TlsError, parse_address
from streamkit.auth.tokens import (
    AuthError,
    Capability,
    Claims,
    PermissionDenied,
    TokenSource,
    Unauthenticated,
    app_capability,
    sign,
    verify,
    verify_bearer,
)

__all__ = [
    "AUTH_KEYS_ENV",
    "JOURNAL_CAPABILITIES",
    "LOOPBACK_HOSTS",
    "SHARD_CAPABILITIES",
    "Address",
    "AddressError",
    "AuthError",
    "AuthKeysError",
    "Capability",
    "Claims",
    "ClientTls",
    "Exposed",
    "Keys",
    "PermissionDenied",
    "Security",
    "ServerAuth",
    "ServerTls",
    "Signer",
    "TlsError",
    "TokenSource",
    "Unauthenticated",
    "app_capability",
    "auth_middleware",
    "by_method",
    "call_credentials",
    "client_interceptors",
    "current_claims",
    "journal_allowed",
    "load_keys",
    "open_channel",
    "parse_address",
    "parse_keys",
    "request_claims",
    "require_journal",
    "require_shard",
    "shard_allowed",
    "sign",
    "verify",
    "verify_bearer",
]

# The HTTP side imports aiohttp, which gRPC-only clients should not pay for at import.
_HTTP_NAMES = frozenset({"LOOPBACK_HOSTS", "auth_middleware", "by_method", "request_claims"})


def __getattr__(name: str) -> Any:
    if name in _HTTP_NAMES:
        from streamkit.auth import http_auth

        return getattr(http_auth, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
