"""Gazette-compatible authorization tokens: capabilities plus a label selector, signed HS256.

A token is a JWT signed with the first pre-shared key (see `keys`); a server
accepts it when any of its keys verifies the signature, it has not expired, and
its capability bits include every bit the RPC needs. Its selector then limits
which journals (matched with their labels plus the meta-labels `name` and
`prefix`) or shards (their labels plus `id`) the bearer may touch.

The claims are Gazette's, field for field, so that tokens cross between the two
systems. What the Go code fixes, as read from gazette/core:

* `broker/protocol/auth.go`, `type Claims`: the capability is a uint32 under
  `"cap"`, the selector under `"sel"`, and `jwt.RegisteredClaims` (golang-jwt
  v5) is embedded, so its fields sit beside them at the top level, each left
  out when empty: `iss`, `sub`, `aud`, `exp`, `nbf`, `iat`, `jti`. The times
  are whole seconds since the epoch.
* `"sel"` is the Go struct JSON (encoding/json) of the gogo-generated
  `LabelSelector`, not the protobuf JSON mapping. From the struct tags in
  `broker/protocol/protocol.pb.go`: `{"include": LabelSet, "exclude":
  LabelSet}`, both always present (non-nullable fields, no omitempty); a
  LabelSet is `{"labels": [...]}` whose list is `null` when empty (a nil Go
  slice, no omitempty); a Label is `{"name": ..., "value": ..., "prefix":
  true}` where every field is omitted when empty/false (`prefix` arrived with
  gazette/core PR #388, selectors only).
* `auth/auth.go`, `KeyedAuth.Authorize`: a signer sets `iat` to now and `exp`
  to now plus the requested lifetime and nothing else, e.g.
  `{"cap":8,"sel":{"include":{"labels":[{"name":"name","value":"a/b"}]},
  "exclude":{"labels":null}},"exp":1700003600,"iat":1700000000}`.
  `verifyWithKeys` requires `exp`, checks `iat`/`nbf` when present, allows 5 s
  of clock skew, accepts HS256 or HS384, and needs `cap & required == required`.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import IntFlag
from typing import TYPE_CHECKING, Any

from streamkit.auth.keys import Keys
from streamkit.errors import StreamkitError
from streamkit.protocol import pb
from streamkit.protocol.labels import (
    format_selector,
    label_set,
    labels_with_meta,
    matches,
    parse_selector,
    union,
)

if TYPE_CHECKING:
    import jwt

__all__ = [
    "AuthError",
    "Capability",
    "Claims",
    "PermissionDenied",
    "TokenSource",
    "Unauthenticated",
    "app_capability",
    "bearer_token",
    "claims_from_json",
    "claims_json",
    "describe",
    "journal_labels",
    "selector_from_json",
    "selector_json",
    "shard_labels",
    "sign",
    "verify",
    "verify_bearer",
]

LEEWAY = 5.0  # seconds of clock skew tolerated, as Gazette does
_ALGORITHMS = ("HS256", "HS384")  # what Gazette's verifier accepts; tokens are signed HS256
_MAX_CAP = 0xFFFFFFFF  # `cap` is a uint32 on the Go side


class Capability(IntFlag):
    """What a token lets its bearer do (Gazette's bit values; applications use 1<<16 up)."""

    LIST = 1 << 1
    APPLY = 1 << 2
    READ = 1 << 3
    APPEND = 1 << 4
    REPLICATE = 1 << 5
    ALL = _MAX_CAP


def app_capability(n: int) -> Capability:
    """Application capability bit `n` (0..15), i.e. 1 << (16 + n)."""
    if not 0 <= n < 16:
        raise ValueError(f"application capability bit must be 0..15 (got {n})")
    return Capability(1 << (16 + n))


def describe(cap: int) -> str:
    """Bits by name, e.g. "READ|APPEND|bit 16"."""
    names = []
    for bit in range(32):
        if cap & (1 << bit):
            member = Capability(1 << bit)
            names.append(member.name if member.name and bit < 16 else f"bit {bit}")
    return "|".join(names) or "none"


class AuthError(StreamkitError, PermissionError):
    """A request was refused by authorization; the message says what is missing."""


class Unauthenticated(AuthError):
    """No usable token: missing, malformed, expired, or signed with an unknown key."""


class PermissionDenied(AuthError):
    """A valid token that does not grant this capability, journal or shard."""


def journal_labels(name: str, labels: pb.LabelSet | None = None) -> pb.LabelSet:
    """What a token's selector is matched against for a journal: its labels and meta-labels.
    A `;metadata` suffix of the name is dropped first, as Gazette's StripMeta does."""
    return labels_with_meta(labels or pb.LabelSet(), name.split(";", 1)[0])


def shard_labels(shard_id: str, labels: pb.LabelSet | None = None) -> pb.LabelSet:
    """What a token's selector is matched against for a shard: its labels and `id`."""
    return union(labels or pb.LabelSet(), label_set(("id", shard_id)))


@dataclass(frozen=True, eq=False)
class Claims:
    """A verified token: what it grants (`cap`), over what (`selector`), until when."""

    cap: Capability
    selector: pb.LabelSelector = field(default_factory=pb.LabelSelector)
    expiry: float = 0.0  # seconds since the epoch
    issued_at: float | None = None

    def covers(self, labels: pb.LabelSet) -> bool:
        return matches(self.selector, labels)

    def covers_journal(self, name: str, labels: pb.LabelSet | None = None) -> bool:
        return self.covers(journal_labels(name, labels))

    def covers_shard(self, shard_id: str, labels: pb.LabelSet | None = None) -> bool:
        return self.covers(shard_labels(shard_id, labels))

    def require_journal(self, name: str, labels: pb.LabelSet | None = None) -> None:
        if not self.covers_journal(name, labels):
            raise PermissionDenied(f"authorization does not cover journal {name} {self._scope()}")

    def require_shard(self, shard_id: str, labels: pb.LabelSet | None = None) -> None:
        if not self.covers_shard(shard_id, labels):
            raise PermissionDenied(f"authorization does not cover shard {shard_id} {self._scope()}")

    def require_everything(self, what: str) -> None:
        """Raise PermissionDenied unless the selector covers every journal and shard (it
        is empty): for answers that name them all, such as /metrics."""
        if format_selector(self.selector):
            raise PermissionDenied(f"{what} names every journal and shard: it needs a token "
                                   f"without a selector {self._scope()}")

    def _scope(self) -> str:
        return f"(its selector is {format_selector(self.selector) or 'empty'!r})"


# --- the JSON layout ---------------------------------------------------------------------


def _label_json(label: pb.Label) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if label.name:
        out["name"] = label.name
    if label.value:
        out["value"] = label.value
    if label.prefix:
        out["prefix"] = True
    return out


def selector_json(selector: pb.LabelSelector) -> dict[str, Any]:
    """The selector as Go's encoding/json writes Gazette's LabelSelector struct."""
    return {
        side: {"labels": [_label_json(lbl) for lbl in getattr(selector, side).labels] or None}
        for side in ("include", "exclude")
    }


def _str_field(obj: Mapping[str, Any], key: str, where: str) -> str:
    value = obj.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{where}.{key} must be a string")
    return value


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be an object")
    return value


def selector_from_json(value: Any) -> pb.LabelSelector:
    """Read `sel` as Go does: absent or null parts are empty; wrong types are errors."""
    obj = _object(value, "sel")
    selector = pb.LabelSelector()
    for side in ("include", "exclude"):
        labels = _object(obj.get(side), f"sel.{side}").get("labels") or []
        if not isinstance(labels, list):
            raise ValueError(f"sel.{side}.labels must be a list")
        for i, item in enumerate(labels):
            where = f"sel.{side}.labels[{i}]"
            item = _object(item, where)
            prefix = item.get("prefix", False)
            if not isinstance(prefix, bool):
                raise ValueError(f"{where}.prefix must be a boolean")
            getattr(selector, side).labels.add(
                name=_str_field(item, "name", where),
                value=_str_field(item, "value", where),
                prefix=prefix,
            )
    return selector


def claims_json(claims: Claims) -> dict[str, Any]:
    """The JWT payload, in Gazette's field order: cap, sel, exp, iat."""
    out: dict[str, Any] = {"cap": int(claims.cap), "sel": selector_json(claims.selector)}
    out["exp"] = int(claims.expiry)
    if claims.issued_at is not None:
        out["iat"] = int(claims.issued_at)
    return out


_MAX_TIME = 253402300799  # 9999-12-31T23:59:59Z


def _number(payload: Mapping[str, Any], key: str) -> float | None:
    value = payload.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key} must be a number of seconds")
    # NaN compares false with every time (a NaN exp would never expire); Gazette's decoder
    # refuses NaN and Infinity, and times beyond year 9999 (either way) are no times at all.
    if not -_MAX_TIME <= value <= _MAX_TIME:
        raise ValueError(f"{key} must be seconds since 1970, within 10,000 years of it")
    return float(value)


def claims_from_json(payload: Any) -> Claims:
    """Claims from a decoded payload; raises ValueError naming a malformed field."""
    if not isinstance(payload, Mapping):
        raise ValueError("the payload must be a JSON object")
    cap = payload.get("cap", 0)
    if isinstance(cap, bool) or not isinstance(cap, int) or not 0 <= cap <= _MAX_CAP:
        raise ValueError("cap must be an unsigned 32-bit integer")
    expiry = _number(payload, "exp")
    if expiry is None:
        raise ValueError("exp (expiry) is required")
    return Claims(
        cap=Capability(cap),
        selector=selector_from_json(payload.get("sel")),
        expiry=expiry,
        issued_at=_number(payload, "iat"),
    )


# --- signing and verifying ---------------------------------------------------------------


@functools.cache
def _jws() -> jwt.PyJWS:
    """The JWS codec, built on first use: pyjwt pulls in `cryptography`, which a process
    without keys (most of them) never needs."""
    import jwt
    from jwt.algorithms import HMACAlgorithm

    class _AnyLengthHMAC(HMACAlgorithm):
        """HMAC without pyjwt's per-token short-key warning: Gazette accepts short keys,
        and `keys.parse_keys` already warns once about them."""

        def check_key_length(self, key: bytes) -> str | None:
            return None

    jws = jwt.PyJWS(algorithms=[])
    jws.register_algorithm("HS256", _AnyLengthHMAC(HMACAlgorithm.SHA256))
    jws.register_algorithm("HS384", _AnyLengthHMAC(HMACAlgorithm.SHA384))
    return jws


def sign(
    keys: Keys,
    cap: Capability | int,
    selector: pb.LabelSelector | str | None = None,
    ttl: float = 60.0,
    *,
    now: float | None = None,
) -> str:
    """A token granting `cap` over `selector` (a message or gazctl text) for `ttl` seconds."""
    if isinstance(selector, str):
        selector = parse_selector(selector)
    issued = time.time() if now is None else now
    claims = Claims(Capability(cap), selector or pb.LabelSelector(), issued + ttl, issued)
    # Compact and UTF-8 as Go writes it, so equal claims sign to the same bytes.
    payload = json.dumps(claims_json(claims), separators=(",", ":"), ensure_ascii=False).encode()
    return _jws().encode(payload, keys.signing, algorithm="HS256")


def _check_times(claims: Claims, not_before: float | None, now: float, leeway: float) -> None:
    if not_before is not None and not_before > now + leeway:
        raise Unauthenticated("authorization token is not valid yet (its nbf is in the future)")
    if claims.expiry < now - leeway:
        raise Unauthenticated(
            f"authorization token expired {now - claims.expiry:.0f}s ago; sign a new one"
        )
    if claims.issued_at is not None and claims.issued_at > now + leeway:
        raise Unauthenticated(
            "authorization token is issued in the future (are the clocks in step?)"
        )


def verify(
    keys: Keys,
    token: str | None,
    required: Capability | int,
    *,
    now: float | None = None,
    leeway: float = LEEWAY,
) -> Claims:
    """The token's claims if it is valid and grants `required`, else Unauthenticated or
    PermissionDenied. No token passes only with the `AA==` key, and then grants `required`
    over everything for an hour, as Gazette's rollout mode does."""
    now = time.time() if now is None else now
    required = Capability(required)
    if not token:
        if keys.allow_missing:
            return Claims(required, pb.LabelSelector(), now + 3600.0)
        raise Unauthenticated("missing authorization: send 'authorization: Bearer <token>'")
    try:
        payload = json.loads(_verified_payload(keys, token))
        claims = claims_from_json(payload)
        not_before = _number(payload, "nbf")
    except ValueError as err:  # also json.JSONDecodeError
        raise Unauthenticated(f"malformed authorization token claims: {err}") from None
    _check_times(claims, not_before, now, leeway)
    missing = required & ~claims.cap
    if missing:
        raise PermissionDenied(f"authorization is missing required capability {describe(missing)}")
    return claims


def _verified_payload(keys: Keys, token: str) -> bytes:
    import jwt  # imported by _jws() already: only a name lookup here

    jws = _jws()
    for key in keys.verifying:
        try:
            return jws.decode(token, key, algorithms=list(_ALGORITHMS))
        except jwt.InvalidSignatureError:
            continue
        except jwt.InvalidAlgorithmError:
            raise Unauthenticated(
                f"authorization token must be signed with {' or '.join(_ALGORITHMS)}"
            ) from None
        except jwt.DecodeError as err:
            raise Unauthenticated(f"malformed authorization token: {err}") from None
    raise Unauthenticated("authorization token signature matches none of this server's keys")


def bearer_token(header: str | None) -> str | None:
    """The token of an `authorization` value ("Bearer <token>"); None when absent."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("unsupported authorization (expected 'Bearer <token>')")
    return token.strip()


def verify_bearer(
    keys: Keys, header: str | None, required: Capability | int, *, now: float | None = None
) -> Claims:
    """`verify` for an `authorization` metadata value or HTTP header."""
    return verify(keys, bearer_token(header), required, now=now)


class TokenSource:
    """A client's token: signed once, reused, and signed anew before it expires.

    Gazette's clients sign a token per call, living one minute for unary calls and an
    hour for streams (a Gazette broker ends a stream when its token expires). One cached
    token living `ttl` (an hour) and replaced once less than `refresh` (half of it)
    remains gives every call at least that long. Thread-safe: gRPC may ask from its own
    threads.
    """

    def __init__(
        self,
        keys: Keys,
        cap: Capability | int,
        selector: pb.LabelSelector | str | None = None,
        ttl: float = 3600.0,
        refresh: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.keys, self.cap, self.selector = keys, Capability(cap), selector
        self.ttl = ttl
        self.refresh = ttl / 2 if refresh is None else refresh
        self._clock = clock
        self._lock = threading.Lock()
        self._token = ""
        self._expiry = 0.0

    def token(self) -> str:
        with self._lock:
            now = self._clock()
            if self._expiry - now < self.refresh:
                self._token = sign(self.keys, self.cap, self.selector, self.ttl, now=now)
                self._expiry = now + self.ttl
            return self._token

    def authorization(self) -> str:
        """The `authorization` metadata / header value."""
        return f"Bearer {self.token()}"
