"""Authorization and TLS: Gazette-compatible keyed tokens, their gRPC and HTTP guards,
and TLS credentials.

`keys` reads the pre-shared keys, `tokens` signs and verifies tokens, `scope` holds
the claims of the request being served, `grpc_auth` and `http_auth` enforce them,
and `tls` parses addresses and builds credentials. Only `streamkit.protocol` and
`streamkit.errors` are imported, so every server and client may use this package.
"""

from streamkit.auth.grpc_auth import (
    JOURNAL_CAPABILITIES,
    SHARD_CAPABILITIES,
    ServerAuth,
    call_credentials,
    client_interceptors,
    open_channel,
)
from streamkit.auth.http_auth import LOOPBACK_HOSTS, auth_middleware, by_method, request_claims
from streamkit.auth.keys import AUTH_KEYS_ENV, AuthKeysError, Keys, load_keys, parse_keys
from streamkit.auth.scope import (
    current_claims,
    journal_allowed,
    require_journal,
    require_shard,
    shard_allowed,
)
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
    "Keys",
    "PermissionDenied",
    "ServerAuth",
    "ServerTls",
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
