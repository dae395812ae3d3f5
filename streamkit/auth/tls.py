"""Endpoint addresses and TLS credentials for gRPC and HTTP, servers and clients.

Addresses take Gazette's forms: `https://host:port` is served over TLS, while
`http://host:port` and a bare `host:port` are plaintext. (`grpc://host:port`,
the form streamkit's own endpoints have used, is read as plaintext too.) The
scheme alone decides, so one flag value tells a client how to dial.

A server needs its certificate and key; given a trusted CA as well it checks
client certificates, and with `require_client_cert` refuses clients without one
(mutual TLS). A client trusts the CA given (else the system's roots) and may
present its own certificate.
"""

from __future__ import annotations

import ipaddress
import re
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from streamkit.errors import StreamkitError

if TYPE_CHECKING:
    import grpc

__all__ = ["Address", "AddressError", "ClientTls", "ServerTls", "TlsError", "certificate_concerns",
           "parse_address", "presents_certificate", "tls_trouble", "without_ok"]

_PLAINTEXT_SCHEMES = frozenset({"http", "grpc"})


class AddressError(StreamkitError, ValueError):
    """An endpoint address in none of the accepted forms."""


class TlsError(StreamkitError, ValueError):
    """TLS settings that cannot be used: a missing or unreadable file, or a missing part."""


@dataclass(frozen=True)
class Address:
    """Where to dial or listen, and whether TLS is spoken there."""

    host: str
    port: int
    tls: bool = False

    @property
    def target(self) -> str:
        """`host:port` as gRPC and sockets take it (IPv6 hosts in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.target}"


def parse_address(text: str, default_port: int | None = None) -> Address:
    """Read `https://host:port`, `http://host:port` or `host:port` (see the module doc)."""
    raw = text.strip()
    scheme = ""
    if "://" in raw:
        scheme = raw.split("://", 1)[0].lower()
        if scheme != "https" and scheme not in _PLAINTEXT_SCHEMES:
            raise AddressError(
                f"address {text!r}: scheme must be https:// (TLS) or http:// (plaintext), "
                f"got {scheme}://"
            )
    try:
        parts = urlsplit(raw if scheme else f"//{raw}")
        host, port = parts.hostname, parts.port
    except ValueError as err:
        raise AddressError(f"address {text!r}: {err}") from None
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise AddressError(f"address {text!r}: expected only host:port after the scheme")
    if not host:
        raise AddressError(f"address {text!r}: missing host (expected host:port)")
    if port is None:
        if default_port is None:
            raise AddressError(f"address {text!r}: missing port (expected host:port)")
        port = default_port
    return Address(host, port, tls=scheme == "https")


def _read(path: Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise TlsError(f"{what} {path}: {err.strerror or err}") from None


def _load_chain(context: ssl.SSLContext, cert: Path, key: Path, what: str) -> None:
    """Load `cert` and its `key`, naming the file at fault: OpenSSL says "PEM lib" whichever
    of the two is not PEM, so the certificate is read alone first."""
    try:  # a scratch context: only whether the file holds certificates matters here
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=cert)
    except OSError as err:
        raise TlsError(f"{what} {cert}: {_why(err, 'not a PEM certificate')}") from None
    try:
        context.load_cert_chain(cert, key)
    except OSError as err:
        if "KEY_VALUES_MISMATCH" in str(err):
            problem = f"key {key} is not this certificate's private key"
        else:
            problem = f"key file {key}: {_why(err, 'not a PEM private key')}"
        raise TlsError(f"{what} {cert}: {problem}") from None


def _why(err: OSError, not_pem: str) -> str:
    """An unreadable file's reason, or `not_pem` with OpenSSL's words (an ssl.SSLError)."""
    if isinstance(err, ssl.SSLError) or not err.strerror:
        return f"{not_pem} ({err})"
    return err.strerror


def _load_ca(context: ssl.SSLContext, ca: Path) -> None:
    try:
        context.load_verify_locations(cafile=ca)
    except (OSError, ssl.SSLError) as err:
        raise TlsError(f"trusted CA file {ca}: {err}") from None


def certificate_concerns(cert: Path, host: str, now: float | None = None) -> list[str]:
    """What would make clients refuse the server certificate in `cert` when they dial it
    by `host`: a certificate expired or not yet valid, or one naming other hosts. Empty
    when it looks right, or when the file cannot be decoded here (loading it is checked
    elsewhere). A server logs these at start rather than refusing to: clients may dial
    it by a name of their own, and the clock may be what is wrong."""
    decode = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)
    try:  # CPython's own decoder (its test helper; no public API reads a certificate)
        fields = decode(str(cert)) if decode is not None else None
    except (OSError, ssl.SSLError, ValueError):
        fields = None
    if not fields:
        return []
    concerns = []
    now = time.time() if now is None else now
    ends, begins = fields.get("notAfter"), fields.get("notBefore")
    if ends and ssl.cert_time_to_seconds(ends) < now:
        concerns.append(f"server certificate {cert} expired on {ends}: clients will refuse it")
    elif begins and ssl.cert_time_to_seconds(begins) > now:
        concerns.append(f"server certificate {cert} is not valid before {begins}: clients "
                        "will refuse it until then (or this machine's clock is wrong)")
    names = _certificate_names(fields)
    if names and not any(_name_matches(name, host) for name in names):
        concerns.append(f"server certificate {cert} names {', '.join(names)} but not {host!r}, "
                        "the host this server advertises: clients that dial it there will "
                        "refuse it (give --advertise a name the certificate holds)")
    return concerns


def _certificate_names(fields: dict) -> list[str]:
    """The DNS names and IP addresses a certificate is for (its common name when it has
    no subject alternative names, as older verifiers still accept)."""
    names = [value for kind, value in fields.get("subjectAltName", ())
             if kind in ("DNS", "IP Address")]
    if names:
        return names
    return [value for rdn in fields.get("subject", ()) for key, value in rdn
            if key == "commonName"]


def _name_matches(name: str, host: str) -> bool:
    """RFC 6125's rules: case-insensitive; a `*` only as the whole leftmost label, matching
    exactly one label; addresses compare as addresses."""
    host = host.strip("[]").rstrip(".").lower()
    try:
        return ipaddress.ip_address(host) == ipaddress.ip_address(name.strip())
    except ValueError:
        pass
    name = name.rstrip(".").lower()
    if name.startswith("*."):
        first, _, rest = host.partition(".")
        return bool(first) and rest == name[2:]
    return name == host


# How a server closing the TLS handshake reaches a client: gRPC says only "Socket closed";
# Python's ssl an EOF, or the alert the server sent (TLS 1.3 sends it after the client's
# side of the handshake is done, so http.client may see the connection closed first).
_CLOSED = ("socket closed", "eof occurred in violation of protocol",
           "remote end closed connection", "alert certificate required",
           "alert unknown ca", "alert bad certificate", "alert certificate expired",
           "alert certificate unknown", "alert handshake failure")


def without_ok(details: str) -> str:
    """gRPC's error details on one line, without the ": OK" its core appends to a failed
    handshake's reason (the status of a step that did not fail)."""
    return re.sub(r"(?::\s*OK)+\s*$", "", " ".join(details.split()))


def presents_certificate(tls: ClientTls | None) -> bool:
    """Whether a client with these settings shows servers a certificate of its own."""
    return tls is not None and tls.cert is not None


def tls_trouble(error: str, *, tls: bool, client_cert: bool, peer: str = "broker",
                me: str = "client") -> str | None:
    """What a failed dial most likely means when TLS is to blame, as advice to the user; None
    when nothing says so (the peer refused the connection, or is not listening yet: a retry
    may do). `error` is gRPC's details or Python's error text; `tls`: whether the address
    was https://; `client_cert`: whether this side presented a certificate. Peers tell
    clients only that they closed the connection, so these settings tell the causes apart."""
    text = error.lower().replace("_", " ")
    if "hostname verification" in text or "doesn't match" in text:
        return (f"the certificate of the {peer} does not name the host dialled: dial a name "
                "it holds")
    if "certificate verify failed" in text and ("expired" in text or "not yet valid" in text):
        return (f"the certificate of the {peer} has expired, or is not valid yet (or this "
                "machine's clock is wrong)")
    if "certificate verify failed" in text:
        return (f"this {me} does not trust the certificate of the {peer}: give --tls-ca the CA "
                "that signed it")
    if "wrong version number" in text:  # a TLS hello answered in plaintext
        return (f"the {peer} does not serve TLS there: dial it as http://HOST:PORT (or "
                "HOST:PORT), without https://")
    if not any(words in text for words in _CLOSED):
        return None
    if not tls:
        return (f"if the {peer} serves TLS, dial https://HOST:PORT, with --tls-ca if its "
                "certificate isn't signed by a CA this machine trusts")
    if client_cert:
        return (f"the {peer} closed the TLS connection: it likely refused this {me}'s "
                f"certificate (check that it is signed by the CA the {peer} trusts, its "
                "--tls-ca, and has not expired)")
    return (f"the {peer} closed the TLS connection: it likely requires a client certificate "
            "(give --tls-client-cert and --tls-client-key)")


@dataclass(frozen=True)
class ServerTls:
    """A server's TLS settings: its certificate and key; a CA to check client certificates."""

    cert: Path
    key: Path
    ca: Path | None = None
    require_client_cert: bool = False

    def __post_init__(self) -> None:
        if self.require_client_cert and self.ca is None:
            raise TlsError("requiring client certificates needs a trusted CA file to check them")

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """For `server.add_secure_port(address, ...)`."""
        import grpc  # on use: a command's options are parsed before gRPC is needed

        cert = _read(self.cert, "server certificate file")
        key = _read(self.key, "server key file")
        return grpc.ssl_server_credentials(
            [(key, cert)],
            root_certificates=_read(self.ca, "trusted CA file"),
            require_client_auth=self.require_client_cert,
        )

    def ssl_context(self) -> ssl.SSLContext:
        """For aiohttp's `web.TCPSite(..., ssl_context=...)`."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        _load_chain(context, self.cert, self.key, "server certificate file")
        if self.ca is not None:
            _load_ca(context, self.ca)
            context.verify_mode = (
                ssl.CERT_REQUIRED if self.require_client_cert else ssl.CERT_OPTIONAL
            )
        return context


@dataclass(frozen=True)
class ClientTls:
    """A client's TLS settings: the CA it trusts (else the system's), and its own
    certificate and key for servers that require one."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise TlsError("a client certificate needs its key, and a key its certificate")

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        """For `grpc.aio.secure_channel`."""
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "trusted CA file"),
            private_key=_read(self.key, "client key file"),
            certificate_chain=_read(self.cert, "client certificate file"),
        )

    def ssl_context(self) -> ssl.SSLContext:
        """For aiohttp's `ClientSession(connector=TCPConnector(ssl=...))`."""
        if self.ca is None:
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        else:  # the CA replaces the system's roots, as it does for gRPC
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            _load_ca(context, self.ca)
        if self.cert is not None and self.key is not None:
            _load_chain(context, self.cert, self.key, "client certificate file")
        return context
