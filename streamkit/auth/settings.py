"""A process's security settings, and the pieces its servers and clients are built from.

Every command that serves or dials takes the same options (see
`streamkit.cli.security_options`) and turns them into one `Security`; servers
and clients ask it for what they need instead of reading options themselves,
so the broker, the client library and the members agree on what each
setting means. `Security()` is the loopback default: plaintext, no tokens,
and no interceptor on any call path.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import ssl
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from streamkit.errors import StreamkitError
from streamkit.sockets import listen

if TYPE_CHECKING:
    # Imported where used: a command parses its options into a Security before it needs
    # gRPC or the token stack (`streamkit run` starts its broker first thing).
    import grpc

    from streamkit.auth.http_auth import CapabilityFor
    from streamkit.auth.http_guards import GuardedRequest, Refusal
    from streamkit.auth.keys import Keys
    from streamkit.auth.signer import Signer
    from streamkit.auth.tls import ClientTls, ServerTls
    from streamkit.auth.tokens import Capability, Claims

__all__ = ["ANY_HOST", "DEFAULT_MAX_BODY", "DEFAULT_MAX_MESSAGE", "Exposed", "Security",
           "body_too_large", "is_loopback", "is_wildcard"]

DEFAULT_MAX_MESSAGE = 64 << 20  # a gRPC message a server accepts (an append's chunk, a spec...)
DEFAULT_MAX_BODY = 64 << 20  # an HTTP request's body (a gateway PUT, a member query)
ANY_HOST = "*"  # as an allowed host: answer any Host header (behind a proxy that checks it)
_WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]"})
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


class Exposed(StreamkitError):
    """A server would listen beyond loopback while checking nobody's identity."""


def is_wildcard(host: str) -> bool:
    """Whether binding `host` listens on every address of the machine."""
    return host.strip() in _WILDCARDS


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (names other than localhost are
    not resolved: they count as exposed)."""
    host = host.strip().strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _machine_names() -> set[str]:
    """This machine's names and addresses, as Host headers may carry them."""
    names: set[str] = set()
    with contextlib.suppress(OSError):
        hostname = socket.gethostname()
        names |= {hostname, socket.getfqdn(hostname)}
        for *_, sockaddr in socket.getaddrinfo(hostname, None):
            names.add(str(sockaddr[0]))
    return {name.lower() for name in names if name}


@dataclass(frozen=True)
class Security:
    """Keys, TLS on either side, and extra names the HTTP servers answer to."""

    keys: Keys | None = None  # None: no tokens are checked or sent
    server_tls: ServerTls | None = None  # None: servers speak plaintext
    client_tls: ClientTls | None = None  # for https:// addresses; None: the system's roots
    allowed_hosts: tuple[str, ...] = ()  # Host names beyond the server's own; "*": any
    insecure: bool = False  # serving beyond loopback without authorization was asked for
    max_message: int = DEFAULT_MAX_MESSAGE  # bytes of one gRPC message a server receives
    max_body: int = DEFAULT_MAX_BODY  # bytes of one HTTP request body a server reads

    def describe(self) -> str:
        """For a server's startup log line, e.g. "TLS, authorization (2 keys)"."""
        parts = []
        if self.server_tls is not None:
            mutual = " with client certificates" if self.server_tls.require_client_cert else ""
            parts.append(f"TLS{mutual}")
        if self.keys is not None:
            rollout = ", token-less requests allowed" if self.keys.allow_missing else ""
            parts.append(f"authorization ({len(self.keys.verifying)} keys{rollout})")
        return ", ".join(parts) or "no TLS, no authorization"

    def grpc_server_options(self) -> list[tuple[str, Any]]:
        """Message limits for a grpc.aio server: a larger message is refused with
        RESOURCE_EXHAUSTED, whose details give both sizes."""
        return [("grpc.max_receive_message_length", self.max_message),
                ("grpc.max_send_message_length", max(self.max_message, DEFAULT_MAX_MESSAGE)),
                ("grpc.so_reuseport", 0)]  # else a second server could bind the same port

    def validate(self) -> None:
        """Read every certificate, key and CA file now, so that a bad one is reported
        at startup (TlsError) rather than at the first connection."""
        if self.server_tls is not None:
            self.server_tls.ssl_context()
            self.server_tls.grpc_credentials()
        if self.client_tls is not None:
            self.client_tls.ssl_context()
            self.client_tls.grpc_credentials()

    # --- clients -------------------------------------------------------------------------

    def signer(self) -> Signer | None:
        """Per-call tokens for a client; None when there are no keys to sign with."""
        from streamkit.auth.signer import Signer

        return Signer(self.keys) if self.keys is not None else None

    def open_channel(
        self, address: str, options: Sequence[tuple[str, Any]] = ()
    ) -> grpc.aio.Channel:
        """A channel to `address`: TLS for `https://` (trusting `client_tls`'s CA and
        presenting its certificate), plaintext otherwise. Tokens go per call (`signer`)."""
        from streamkit.auth.grpc_auth import open_channel

        return open_channel(address, tls=self.client_tls, options=options)

    # --- servers -------------------------------------------------------------------------

    def check_exposure(self, host: str, port: int, what: str = "server") -> None:
        """Raise Exposed if listening on `host` would let anyone who reaches it in: a
        non-loopback address needs keys or required client certificates, or `insecure`."""
        if is_loopback(host) or self.keys is not None or self.insecure:
            return
        if self.server_tls is not None and self.server_tls.require_client_cert:
            return
        where = "every address" if is_wildcard(host) else host
        raise Exposed(
            f"listening on {where} (port {port}) without authorization would let anyone "
            f"who reaches {what} read, append and delete journals; give --auth-keys (or "
            "AUTH_KEYS), or --tls-require-client-cert, or --insecure to accept that"
        )

    def interceptors(
        self, capabilities: Mapping[str, Capability]
    ) -> list[grpc.aio.ServerInterceptor]:
        """The token check for a gRPC server, or nothing when there are no keys."""
        from streamkit.auth.grpc_auth import ServerAuth

        return [ServerAuth(self.keys, capabilities)] if self.keys is not None else []

    def add_port(self, server: grpc.aio.Server, host: str, port: int) -> int:
        """Listen on host:port with TLS if configured; the port. OSError naming the address
        and why when it can't: a port something listens on is found out first, as gRPC's
        core would print its own failure on stderr (in the middle of a command's output)."""
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if port > 0:
            try:
                listen(host, port).close()
            except OSError as err:
                raise OSError(f"cannot listen on {address} for gRPC: "
                              f"{err.strerror or err}") from None
        try:
            if self.server_tls is not None:
                bound = server.add_secure_port(address, self.server_tls.grpc_credentials())
            else:
                bound = server.add_insecure_port(address)
        except RuntimeError:  # gRPC's "Failed to bind"
            bound = 0
        if not bound:
            raise OSError(f"cannot listen on {address} for gRPC (is the port in use?)")
        return bound

    def endpoint(self, host: str, port: int) -> str:
        """The address a server listening on `host` advertises: `https://` with TLS, else
        `grpc://`; a wildcard bind advertises the machine's name, as Gazette's do."""
        if is_wildcard(host):
            host = socket.gethostname()
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{'https' if self.server_tls is not None else 'grpc'}://{host}:{port}"

    def certificate_concerns(self, host: str) -> list[str]:
        """Why clients dialling a server that advertises `host` would refuse its TLS
        certificate (see `tls.certificate_concerns`); for its startup log."""
        from streamkit.auth.tls import certificate_concerns

        if self.server_tls is None:
            return []
        return certificate_concerns(self.server_tls.cert,
                                    socket.gethostname() if is_wildcard(host) else host)

    def own_hosts(self, host: str) -> Collection[str] | None:
        """Host header values an HTTP server bound to `host` answers (None: any): loopback
        names, the bound address (every name of the machine for a wildcard bind), and
        `allowed_hosts`."""
        if ANY_HOST in self.allowed_hosts:
            return None
        names = set(_LOOPBACK_NAMES) | {h.lower() for h in self.allowed_hosts}
        if is_wildcard(host):
            names |= _machine_names()
        else:
            names.add(host.strip().strip("[]").lower())
        return frozenset(names)

    def http_middleware(self, capability_for: CapabilityFor, host: str) -> Any:
        """aiohttp middleware: Host allow-list and cross-origin write refusal always, token
        checks when there are keys."""
        from streamkit.auth.http_auth import auth_middleware  # aiohttp: servers only

        return auth_middleware(self.keys, capability_for, allowed_hosts=self.own_hosts(host))

    def http_guard(
        self, capability_for: Callable[[Any], Capability | None], host: str
    ) -> Callable[[GuardedRequest], Claims | Refusal | None]:
        """The same checks as `http_middleware`, for a server of our own (`http_guards`)."""
        from streamkit.auth.http_guards import request_guard

        return request_guard(self.keys, capability_for, allowed_hosts=self.own_hosts(host))

    def http_ssl_context(self) -> ssl.SSLContext | None:
        """For an HTTP server (aiohttp's TCPSite, asyncio's start_server); None for
        plaintext."""
        return self.server_tls.ssl_context() if self.server_tls is not None else None


def body_too_large(limit: int) -> str:
    """The one-line reason an HTTP server gives (with status 413) for a body over `limit`."""
    return (f"the request body is larger than the server's limit of {limit} bytes "
            "(--max-body-size)")
