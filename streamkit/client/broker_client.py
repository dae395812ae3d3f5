"""BrokerClient: one gRPC channel per broker endpoint, and a cache of journal routes.

Every broker response header carries the journal's route (its members and
their endpoints). Remembering it lets later RPCs on that journal go straight
to a broker that serves it instead of being proxied, which is what Gazette's
RouteCache does. With the single bundled broker the route usually names the
default address again, and the cache costs a dictionary lookup.

Addresses take Gazette's forms: `https://host:port` is dialled over TLS,
`http://host:port`, `grpc://host:port` and `host:port` in plaintext; a route's
endpoint keeps its scheme, so a TLS broker's peers are dialled with TLS too.
With a `Security` holding keys, every call carries a token scoped to what it
does (see `streamkit.auth.signer`); without one, calls go exactly as before.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict

import grpc

from streamkit.auth.settings import Security
from streamkit.auth.signer import Metadata
from streamkit.auth.tls import AddressError, parse_address
from streamkit.auth.tokens import Capability
from streamkit.client.closing import AsyncClosing
from streamkit.client.environment import BROKER_ENV, DEFAULT_ADDRESS
from streamkit.protocol import pb, pb_grpc

__all__ = ["BROKER_ENV", "DEFAULT_ADDRESS", "MAX_MESSAGE", "BrokerClient", "normalize_address"]

MAX_MESSAGE = 64 << 20
_ROUTE_CACHE_SIZE = 1024
_BAD_ENDPOINT_TTL = 60.0  # don't route to an endpoint for this long after it failed

# Reconnect quickly after a broker restart: gRPC's default backoff climbs to 2 minutes.
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


_PLAINTEXT_SCHEMES = ("grpc://", "http://")
_NO_SECURITY = Security()


def normalize_address(address: str) -> str:
    """One spelling per endpoint: 'host:port' for plaintext ('grpc://host:port/',
    'http://host:port' or 'host:port'), 'https://host:port' for TLS."""
    address = address.strip().rstrip("/")
    lowered = address.lower()
    for scheme in _PLAINTEXT_SCHEMES:
        if lowered.startswith(scheme):
            return address[len(scheme) :]
    if lowered.startswith("https://"):
        return "https://" + address[len("https://") :]
    return address


def _route_endpoint(route: pb.Route) -> str:
    """The endpoint to prefer: the primary's (appends must reach it), else the first."""
    endpoints = route.endpoints
    if not endpoints:
        return ""
    if 0 <= route.primary < len(endpoints) and endpoints[route.primary]:
        return endpoints[route.primary]
    return endpoints[0]


class BrokerClient(AsyncClosing):
    """Channels and Journal stubs to brokers, routed per journal where known.

    Use as `async with BrokerClient("host:port") as client:`; the address
    defaults to $STREAMKIT_BROKER, else gazctl's $BROKER_ADDRESS, else
    127.0.0.1:8080. `security` gives the keys to sign tokens with and the TLS
    settings for `https://` addresses; None is plaintext without tokens (an
    `https://` address then trusts the system's CAs).
    """

    def __init__(self, address: str | None = None, security: Security | None = None) -> None:
        self.address = normalize_address(
            address or next(filter(None, map(os.environ.get, BROKER_ENV)), DEFAULT_ADDRESS)
        )
        parse_address(self.address)  # a malformed address is an AddressError now, not later
        self.security = security or _NO_SECURITY
        self._signer = self.security.signer()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, pb_grpc.JournalStub] = {}
        self._routes: OrderedDict[str, str] = OrderedDict()  # journal -> target
        self._bad: dict[str, float] = {}  # target -> monotonic time it may be used again

    def _stub_of(self, target: str) -> pb_grpc.JournalStub:
        stub = self._stubs.get(target)
        if stub is None:
            # Dialled lazily: grpc.aio channels belong to the loop they are made in.
            channel = self.security.open_channel(target, options=_CHANNEL_OPTIONS)
            self._channels[target] = channel
            stub = self._stubs[target] = pb_grpc.JournalStub(channel)
        return stub

    def auth(
        self, cap: Capability, journal: str | None = None,
        selector: pb.LabelSelector | None = None,
    ) -> Metadata | None:
        """Call metadata carrying a token for `cap` over `journal` (else over `selector`,
        else over every journal); None without keys, which leaves the call as it was."""
        if self._signer is None:
            return None
        if journal is not None:
            return self._signer.for_journal(cap, journal)
        return self._signer.for_selector(cap, selector)

    @property
    def stub(self) -> pb_grpc.JournalStub:
        """The Journal stub of the default address."""
        return self._stub_of(self.address)

    def stub_for(self, journal: str) -> pb_grpc.JournalStub:
        """The Journal stub of the broker last seen serving `journal`."""
        target = self._routes.get(journal)
        return self.stub if target is None else self._stub_of(target)

    def route_of(self, journal: str) -> str:
        """The target RPCs on `journal` go to."""
        return self._routes.get(journal, self.address)

    def update_route(self, journal: str, route: pb.Route | None) -> None:
        """Remember the route from a response header (an empty route forgets it). Routes
        that would leave TLS for plaintext, or that name no usable address, are ignored:
        tokens must not travel in the clear because a header said so."""
        endpoint = _route_endpoint(route) if route is not None else ""
        target = normalize_address(endpoint) if endpoint else ""
        if (not target or target == self.address or self._is_bad(target)
                or not self._usable(target)):
            self._routes.pop(journal, None)
            return
        self._routes[journal] = target
        self._routes.move_to_end(journal)
        if len(self._routes) > _ROUTE_CACHE_SIZE:
            self._routes.popitem(last=False)

    def _usable(self, target: str) -> bool:
        if target in self._stubs:
            return True
        if self.address.startswith("https://") and not target.startswith("https://"):
            return False
        try:
            parse_address(target)
        except AddressError:
            return False
        return True

    def forget_route(self, journal: str) -> None:
        """Called after an RPC on `journal` failed: fall back to the default address."""
        target = self._routes.pop(journal, None)
        if target is not None:
            self._bad[target] = time.monotonic() + _BAD_ENDPOINT_TTL

    def _is_bad(self, target: str) -> bool:
        until = self._bad.get(target)
        if until is None:
            return False
        if time.monotonic() < until:
            return True
        del self._bad[target]
        return False

    async def close(self) -> None:
        """Close every channel; RPCs still running on them are cancelled."""
        channels, self._channels, self._stubs = self._channels, {}, {}
        self._routes.clear()
        for channel in channels.values():
            await channel.close()
