"""The claims of the request being served, for servicers and handlers to check.

The gRPC interceptor and the HTTP middleware verify a request's token before its
handler runs, and bind the claims here. A handler then asks whether they cover
the journal or shard it is about to touch; it never parses tokens itself. With no
claims bound (authorization off, or a server without the interceptor) every
check passes, so the same servicer code serves both setups.

Gazette's semantics, which servicers should follow: a journal the claims do not
cover is treated as absent by Read, Append, Replicate and ListFragments
(JOURNAL_NOT_FOUND); List leaves it out; Apply refuses to touch it. Shards
likewise, by their id and labels.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from streamkit.auth.tokens import Claims
from streamkit.protocol import pb

__all__ = [
    "bind_claims",
    "claims_bound",
    "current_claims",
    "journal_allowed",
    "require_everything",
    "require_journal",
    "require_shard",
    "shard_allowed",
]

_CLAIMS: ContextVar[Claims | None] = ContextVar("streamkit_auth_claims", default=None)


def current_claims() -> Claims | None:
    """The verified claims of the request in progress; None when none were checked."""
    return _CLAIMS.get()


def bind_claims(claims: Claims | None) -> None:
    """Bind claims for the rest of the current task (each gRPC call runs in its own)."""
    _CLAIMS.set(claims)


@contextmanager
def claims_bound(claims: Claims | None) -> Iterator[None]:
    """Bind claims for a block, restoring the previous ones after (for shared tasks, such
    as an HTTP connection serving several requests)."""
    token = _CLAIMS.set(claims)
    try:
        yield
    finally:
        _CLAIMS.reset(token)


def journal_allowed(name: str, labels: pb.LabelSet | None = None) -> bool:
    """Whether the current request may see journal `name` (with its `labels`)."""
    claims = _CLAIMS.get()
    return claims is None or claims.covers_journal(name, labels)


def shard_allowed(shard_id: str, labels: pb.LabelSet | None = None) -> bool:
    """Whether the current request may see shard `shard_id` (with its `labels`)."""
    claims = _CLAIMS.get()
    return claims is None or claims.covers_shard(shard_id, labels)


def require_journal(name: str, labels: pb.LabelSet | None = None) -> None:
    """Raise PermissionDenied unless the current request may touch journal `name`; the
    interceptor and middleware turn it into PERMISSION_DENIED / 403."""
    claims = _CLAIMS.get()
    if claims is not None:
        claims.require_journal(name, labels)


def require_shard(shard_id: str, labels: pb.LabelSet | None = None) -> None:
    """Raise PermissionDenied unless the current request may touch shard `shard_id`."""
    claims = _CLAIMS.get()
    if claims is not None:
        claims.require_shard(shard_id, labels)


def require_everything(what: str) -> None:
    """Raise PermissionDenied unless the current request may see every journal and shard
    (its token has no selector): `what` names them all."""
    claims = _CLAIMS.get()
    if claims is not None:
        claims.require_everything(what)
