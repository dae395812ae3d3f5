"""Authorization and TLS: Gazette-compatible keyed tokens, their gRPC and HTTP guards,
and TLS credentials.

`keys` reads the pre-shared keys, `tokens` signs and verifies tokens, `signer`
scopes a client's tokens to each call, `scope` holds the claims of the request
being served, `grpc_auth` and `http_auth` enforce them, `tls` parses addresses
and builds credentials, and `settings` gathers a process's choices into one
`Security` that servers and clients are built from. Only `streamkit.protocol` and
`streamkit.errors` are imported, so every server and client may use this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamkit import lazy_exports

if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from streamkit.auth.grpc_auth import (  # noqa: F401
        JOURNAL_CAPABILITIES,
        SHARD_CAPABILITIES,
        ServerAuth,
        call_credentials,
        client_interceptors,
        open_channel,
    )
    from streamkit.auth.http_auth import LOOPBACK_HOSTS, auth_middleware, by_method, request_claims  # noqa: F401
    from streamkit.auth.keys import AUTH_KEYS_ENV, AuthKeysError, Keys, load_keys, parse_keys  # noqa: F401
    from streamkit.auth.scope import (  # noqa: F401
        current_claims,
        journal_allowed,
        require_journal,
        require_shard,
        shard_allowed,
    )
    from streamkit.auth.settings import Exposed, Security  # noqa: F401
    from streamkit.auth.signer import Signer  # noqa: F401
    from streamkit.auth.tls import (  # noqa: F401
        Address,
        AddressError,
        ClientTls,
        ServerTls,
        TlsError,
        parse_address,
    )
    from streamkit.auth.tokens import (  # noqa: F401
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

# Imported on first use: importing any module of this package runs this file, and most
# users need one or two of them (a gRPC-only client neither jwt nor aiohttp, say).
_EXPORTS = {
    "streamkit.auth.grpc_auth": ("JOURNAL_CAPABILITIES", "SHARD_CAPABILITIES", "ServerAuth",
                                 "call_credentials", "client_interceptors", "open_channel"),
    "streamkit.auth.http_auth": ("LOOPBACK_HOSTS", "auth_middleware", "by_method",
                                 "request_claims"),
    "streamkit.auth.keys": ("AUTH_KEYS_ENV", "AuthKeysError", "Keys", "load_keys", "parse_keys"),
    "streamkit.auth.scope": ("current_claims", "journal_allowed", "require_journal",
                             "require_shard", "shard_allowed"),
    "streamkit.auth.settings": ("Exposed", "Security"),
    "streamkit.auth.signer": ("Signer",),
    "streamkit.auth.tls": ("Address", "AddressError", "ClientTls", "ServerTls", "TlsError",
                           "parse_address"),
    "streamkit.auth.tokens": ("AuthError", "Capability", "Claims", "PermissionDenied",
                              "TokenSource", "Unauthenticated", "app_capability", "sign",
                              "verify", "verify_bearer"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(name for names in _EXPORTS.values() for name in names)
