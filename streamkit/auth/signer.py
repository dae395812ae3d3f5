"""Tokens scoped to each call, the way Gazette's clients scope theirs.

A Gazette client signs, for every call, a token granting only what that call
needs: READ over `name=<journal>` for a Read, APPEND over the journal for an
Append, LIST over the request's own selector for a List, APPLY for an Apply.
A token seen by whoever should not see it (a proxy's log, a broker a stale
route pointed at) then lets its holder do that one thing to that one journal
for a while, not everything the keys allow. Brokers see the same claims from
streamkit's clients as from Gazette's.

Signing costs an HMAC and a JSON encoding, so each scope's token is signed
once and reused until it is half spent (see `TokenSource`); a bounded cache
holds the scopes a client used recently.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from streamkit.auth.grpc_auth import AUTHORIZATION
from streamkit.auth.keys import Keys
from streamkit.auth.tokens import Capability, TokenSource
from streamkit.protocol import pb
from streamkit.protocol.labels import label_set

__all__ = ["Metadata", "Signer", "journal_selector", "shard_selector"]

Metadata = tuple[tuple[str, str], ...]  # gRPC call metadata

_SCOPES = 4096  # scopes kept signed; a client touching more re-signs the least recent


def journal_selector(journal: str) -> pb.LabelSelector:
    """`name=<journal>`, without a `;metadata` suffix (as Gazette's StripMeta)."""
    return pb.LabelSelector(include=label_set(("name", journal.split(";", 1)[0])))


def shard_selector(shard_id: str) -> pb.LabelSelector:
    """`id=<shard>`: what a call about one shard needs (a Stat, a query)."""
    return pb.LabelSelector(include=label_set(("id", shard_id)))


class Signer:
    """Per-call `authorization` metadata from the keys' signing key."""

    def __init__(self, keys: Keys, ttl: float = 3600.0, scopes: int = _SCOPES) -> None:
        self.keys = keys
        self.ttl = ttl  # streams (blocking reads, watches) may outlive a short token
        self._scopes = scopes
        self._sources: OrderedDict[tuple[int, bytes | str], TokenSource] = OrderedDict()
        self._lock = threading.Lock()

    def for_journal(self, cap: Capability, journal: str) -> Metadata:
        """Metadata for a call needing `cap` on `journal` alone."""
        return self._metadata((int(cap), journal), cap, lambda: journal_selector(journal))

    def for_shard(self, cap: Capability, shard_id: str) -> Metadata:
        """Metadata for a call needing `cap` on shard `shard_id` alone."""
        return self.for_selector(cap, shard_selector(shard_id))

    def for_selector(self, cap: Capability, selector: pb.LabelSelector | None = None) -> Metadata:
        """Metadata for a call needing `cap` over `selector` (None: every journal)."""
        chosen = selector or pb.LabelSelector()
        key = chosen.SerializeToString(deterministic=True)
        return self._metadata((int(cap), key), cap, lambda: chosen)

    def _metadata(
        self, key: tuple[int, bytes | str], cap: Capability,
        selector: Callable[[], pb.LabelSelector],
    ) -> Metadata:
        with self._lock:
            source = self._sources.get(key)
            if source is None:
                source = TokenSource(self.keys, cap, selector(), ttl=self.ttl)
                self._sources[key] = source
                if len(self._sources) > self._scopes:
                    self._sources.popitem(last=False)
            else:
                self._sources.move_to_end(key)
        return ((AUTHORIZATION, source.authorization()),)
