"""Pre-shared signing keys, given as `--auth-keys` or `AUTH_KEYS`.

The format is Gazette's (`NewKeyedAuth` in gazette/core `auth/auth.go`), so one
setting serves both systems: standard, padded base64 keys separated by
whitespace and/or commas. The first key signs; every key verifies, which lets
operators rotate keys by prepending the new one, then dropping the old one once
no tokens signed by it remain. The pseudo-key `AA==` (one zero byte) is not a
key: it lets requests that carry no token through, for turning authorization
on across a running cluster one process at a time.
"""

from __future__ import annotations

import binascii
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from streamkit.errors import StreamkitError

__all__ = ["ALLOW_MISSING_KEY", "AUTH_KEYS_ENV", "AuthKeysError", "Keys", "load_keys", "parse_keys"]

log = logging.getLogger(__name__)

AUTH_KEYS_ENV = "AUTH_KEYS"
ALLOW_MISSING_KEY = "AA=="
_SEPARATORS = re.compile(r"[\s,]+")
# HS256 keys shorter than its digest are weak; Gazette accepts them, so do we, with a warning.
_WEAK_KEY_LEN = 32


class AuthKeysError(StreamkitError, ValueError):
    """The auth keys setting cannot be used; the message names the bad key's position."""


@dataclass(frozen=True)
class Keys:
    """Decoded keys: `signing` signs, any of `verifying` verifies."""

    verifying: tuple[bytes, ...]
    allow_missing: bool = False  # `AA==` was given: requests without a token pass

    def __post_init__(self) -> None:
        if not self.verifying:
            raise AuthKeysError("auth keys: at least one key besides AA== is needed")

    @property
    def signing(self) -> bytes:
        return self.verifying[0]

    def __repr__(self) -> str:  # never print key material
        return f"Keys({len(self.verifying)} keys, allow_missing={self.allow_missing})"


def parse_keys(text: str, source: str = "auth keys") -> Keys:
    """Decode a keys setting; `source` names it in errors (e.g. "AUTH_KEYS")."""
    keys: list[bytes] = []
    allow_missing = False
    words = [w for w in _SEPARATORS.split(text.strip()) if w]
    for position, word in enumerate(words, start=1):
        if word == ALLOW_MISSING_KEY:
            allow_missing = True
            continue
        try:
            if len(word) % 4:  # padded, as Go's base64.StdEncoding insists
                raise ValueError("its length is not a multiple of 4")
            key = binascii.a2b_base64(word.encode(), strict_mode=True)
        except (binascii.Error, ValueError) as err:
            # The key itself stays out of the message: it is a secret.
            raise AuthKeysError(
                f"{source}: key {position} of {len(words)} is not valid base64 "
                f"(standard alphabet, with '=' padding): {err}"
            ) from None
        if len(key) < _WEAK_KEY_LEN:
            log.warning("%s: key %d has only %d bytes (weak)", source, position, len(key))
        keys.append(key)
    if not keys:
        raise AuthKeysError(f"{source}: at least one key besides {ALLOW_MISSING_KEY} is needed")
    return Keys(tuple(keys), allow_missing)


def load_keys(arg: str | None = None, environ: Mapping[str, str] | None = None) -> Keys | None:
    """Keys from the `--auth-keys` argument, else `$AUTH_KEYS`; None when neither is set
    (authorization off, as on a loopback-only setup)."""
    if arg is not None and arg.strip():
        return parse_keys(arg, "--auth-keys")
    value = (os.environ if environ is None else environ).get(AUTH_KEYS_ENV, "")
    return parse_keys(value, AUTH_KEYS_ENV) if value.strip() else None
