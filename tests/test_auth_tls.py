"""Addresses, TLS credentials, and the gRPC interceptor on real grpc.aio servers on 127.0.0.1,
over plaintext and over (mutual) TLS with certificates made here."""

from __future__ import annotations

import asyncio
import base64
import datetime
import ipaddress
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from streamkit.auth import (
    JOURNAL_CAPABILITIES,
    AddressError,
    Capability,
    ClientTls,
    ServerAuth,
    ServerTls,
    TlsError,
    TokenSource,
    journal_allowed,
    open_channel,
    parse_address,
    parse_keys,
    require_journal,
    sign,
)
from streamkit.auth.grpc_auth import AUTHORIZATION
from streamkit.auth.tls import _name_matches, certificate_concerns
from streamkit.protocol import pb, pb_grpc
from streamkit.protocol.labels import parse_selector

KEYS = parse_keys("c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0LXNlY3JldA==")
STRANGER = parse_keys("b3RoZXIta2V5LW90aGVyLWtleS1vdGhlci1rZXk=")
JOURNALS = ("acme/orders", "acme/users", "other/logs")

# --- addresses ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "host", "port", "tls"),
    [
        ("https://broker.example:8443", "broker.example", 8443, True),
        ("HTTPS://broker.example:8443/", "broker.example", 8443, True),
        ("http://127.0.0.1:8080", "127.0.0.1", 8080, False),
        ("127.0.0.1:8080", "127.0.0.1", 8080, False),
        ("grpc://localhost:8080/", "localhost", 8080, False),
        ("[::1]:9000", "::1", 9000, False),
        ("https://[::1]:9000", "::1", 9000, True),
    ],
)
def test_address_forms(text: str, host: str, port: int, tls: bool):
    address = parse_address(text)
    assert (address.host, address.port, address.tls) == (host, port, tls)


def test_address_targets_and_defaults():
    assert parse_address("https://[::1]:9000").target == "[::1]:9000"
    assert parse_address("https://h:1").url == "https://h:1"
    assert parse_address("localhost", default_port=8080).target == "localhost:8080"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("ftp://host:21", "scheme must be https:// .* got ftp://"),
        ("unix:///tmp/sock", "scheme must be"),
        ("host", "missing port"),
        ("https://:8080", "missing host"),
        ("http://host:8080/journals", "only host:port"),
        ("host:port", "Port could not be cast"),
        ("host:99999", "out of range"),
    ],
)
def test_bad_addresses_say_what_is_wrong(text: str, problem: str):
    with pytest.raises(AddressError, match=problem):
        parse_address(text)


# --- certificates made for the test ---------------------------------------------------------


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    expired_cert: Path  # a client certificate of the CA, expired an hour ago
    expired_key: Path


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path


def _builder(subject: str, issuer: x509.Name, key, ca_key,
             expired: bool = False) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    if expired:
        now -= datetime.timedelta(days=1, hours=1)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A CA, a server certificate for 127.0.0.1 and localhost, and a client certificate."""
    return make_pki(tmp_path_factory.mktemp("pki"))


def make_pki(folder: Path) -> Pki:
    """The files of `pki` in `folder` (bench/broker_bench.py --secure makes them too)."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "streamkit test CA")])
    ca_cert = (
        _builder("streamkit test CA", ca_name, ca_key, ca_key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), True
        )
        .sign(ca_key, hashes.SHA256())
    )
    (folder / "ca.pem").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))

    def issue(name: str, usage: x509.ObjectIdentifier, sans: list[x509.GeneralName],
              expired: bool = False) -> Path:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            _builder(name, ca_name, key, ca_key, expired)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), True)
            .add_extension(x509.ExtendedKeyUsage([usage]), False)
            .add_extension(x509.SubjectAlternativeName(sans), False)
            .sign(ca_key, hashes.SHA256())
        )
        _write_key(folder / f"{name}.key", key)
        (folder / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return folder / f"{name}.pem"

    loopback = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    issue("server", ExtendedKeyUsageOID.SERVER_AUTH, loopback)
    issue("client", ExtendedKeyUsageOID.CLIENT_AUTH, [x509.DNSName("client.test")])
    issue("expired", ExtendedKeyUsageOID.CLIENT_AUTH, [x509.DNSName("client.test")], True)
    return Pki(
        ca=folder / "ca.pem",
        server_cert=folder / "server.pem",
        server_key=folder / "server.key",
        client_cert=folder / "client.pem",
        client_key=folder / "client.key",
        expired_cert=folder / "expired.pem",
        expired_key=folder / "expired.key",
    )


# --- a Journal servicer that leaves authorization to the interceptor and scope --------------


class Journals(pb_grpc.JournalServicer):
    """Serves three journals; checks each request's journal as the real broker will."""

    async def List(self, request: pb.ListRequest, context) -> AsyncIterator[pb.ListResponse]:
        for name in JOURNALS:
            if journal_allowed(name):
                spec = pb.JournalSpec(name=name)
                yield pb.ListResponse(journals=[pb.ListResponse.Journal(spec=spec)])

    async def Apply(self, request: pb.ApplyRequest, context) -> pb.ApplyResponse:
        for change in request.changes:
            require_journal(change.upsert.name or change.delete, change.upsert.labels)
        return pb.ApplyResponse()

    async def Read(self, request: pb.ReadRequest, context) -> AsyncIterator[pb.ReadResponse]:
        require_journal(request.journal)
        yield pb.ReadResponse(offset=request.offset, content=b"hello")

    async def Append(self, request_iterator, context) -> pb.AppendResponse:
        first = None
        async for request in request_iterator:
            first = first or request
        assert first is not None
        require_journal(first.journal)
        return pb.AppendResponse()


async def _ping(request: bytes, context) -> bytes:
    return request


async def _serve(keys=KEYS, tls: ServerTls | None = None) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(interceptors=[ServerAuth(keys, JOURNAL_CAPABILITIES)])
    pb_grpc.add_JournalServicer_to_server(Journals(), server)
    ping = grpc.unary_unary_rpc_method_handler(_ping)
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("test.Ping", {"Ping": ping})]
    )
    if tls is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", tls.grpc_credentials())
    await server.start()
    return server, port


def _metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((AUTHORIZATION, f"Bearer {token}"),)


async def _read(channel: grpc.aio.Channel, journal: str, metadata=None) -> list[pb.ReadResponse]:
    stub = pb_grpc.JournalStub(channel)
    return [r async for r in stub.Read(pb.ReadRequest(journal=journal), metadata=metadata)]


async def _status(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value.code(), caught.value.details() or ""


# --- gRPC over plaintext -------------------------------------------------------------------


async def test_grpc_refuses_calls_without_a_usable_token():
    server, port = await _serve()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            code, details = await _status(_read(channel, "acme/orders"))
            assert code == grpc.StatusCode.UNAUTHENTICATED
            assert "missing authorization" in details

            stranger = sign(STRANGER, Capability.READ)
            code, details = await _status(_read(channel, "acme/orders", _metadata(stranger)))
            assert code == grpc.StatusCode.UNAUTHENTICATED
            assert "matches none of this server's keys" in details

            expired = sign(KEYS, Capability.READ, ttl=-60)
            code, details = await _status(_read(channel, "acme/orders", _metadata(expired)))
            assert (code, "expired" in details) == (grpc.StatusCode.UNAUTHENTICATED, True)

            stub = pb_grpc.JournalStub(channel)
            code, details = await _status(
                stub.Apply(pb.ApplyRequest(), metadata=(("authorization", "Basic abc"),))
            )
            assert code == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in details
    finally:
        await server.stop(None)


async def test_grpc_checks_capability_and_selector_per_method():
    server, port = await _serve()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.JournalStub(channel)
            appender = _metadata(sign(KEYS, Capability.APPEND | Capability.LIST))
            code, details = await _status(_read(channel, "acme/orders", appender))
            assert code == grpc.StatusCode.PERMISSION_DENIED
            assert details == (
                "authorization is missing required capability READ (for /protocol.Journal/Read)"
            )

            acme_reader = _metadata(sign(KEYS, Capability.READ, "prefix=acme/"))
            assert [r.content for r in await _read(channel, "acme/orders", acme_reader)] == [
                b"hello"
            ]
            code, details = await _status(_read(channel, "other/logs", acme_reader))
            assert code == grpc.StatusCode.PERMISSION_DENIED
            assert "does not cover journal other/logs" in details

            lister = _metadata(sign(KEYS, Capability.LIST, "name:prefix=acme/"))
            listed = [
                r.journals[0].spec.name async for r in stub.List(pb.ListRequest(), metadata=lister)
            ]
            assert listed == ["acme/orders", "acme/users"]

            async def chunks():
                yield pb.AppendRequest(journal="acme/orders")
                yield pb.AppendRequest(content=b"data")

            assert await stub.Append(chunks(), metadata=appender) == pb.AppendResponse()
            code, _ = await _status(stub.Append(chunks(), metadata=acme_reader))
            assert code == grpc.StatusCode.PERMISSION_DENIED

            applier = _metadata(sign(KEYS, Capability.APPLY, parse_selector("prefix=acme/")))
            change = pb.ApplyRequest.Change(upsert=pb.JournalSpec(name="other/new"))
            code, details = await _status(
                stub.Apply(pb.ApplyRequest(changes=[change]), metadata=applier)
            )
            assert (code, "other/new" in details) == (grpc.StatusCode.PERMISSION_DENIED, True)

            # Replicate needs REPLICATE, which no client token here has: refused before
            # the servicer (which does not implement it) is reached.
            code, details = await _status(stub.Replicate(iter(()), metadata=appender).read())
            assert code == grpc.StatusCode.PERMISSION_DENIED and "REPLICATE" in details

            # A method missing from the table is refused, whatever the token grants.
            ping = channel.unary_unary("/test.Ping/Ping")
            all_caps = _metadata(sign(KEYS, Capability.ALL))
            code, details = await _status(ping(b"x", metadata=all_caps))
            assert code == grpc.StatusCode.PERMISSION_DENIED
            assert "/test.Ping/Ping is not in this server's authorization table" in details
    finally:
        await server.stop(None)


async def test_concurrent_calls_each_see_their_own_claims():
    server, port = await _serve()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.JournalStub(channel)

            async def names(selector: str) -> list[str]:
                metadata = _metadata(sign(KEYS, Capability.LIST, selector))
                call = stub.List(pb.ListRequest(), metadata=metadata)
                return [r.journals[0].spec.name async for r in call]

            results = await asyncio.gather(
                *(names(s) for s in ["prefix=acme/", "prefix=other/"] * 5)
            )
            assert results == [["acme/orders", "acme/users"], ["other/logs"]] * 5
    finally:
        await server.stop(None)


async def test_grpc_rollout_key_lets_token_less_calls_through_but_checks_tokens():
    server, port = await _serve(keys=parse_keys(f"{_b64(KEYS.signing)},AA=="))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert len(await _read(channel, "other/logs")) == 1
            weak = _metadata(sign(KEYS, Capability.LIST))
            code, _ = await _status(_read(channel, "other/logs", weak))
            assert code == grpc.StatusCode.PERMISSION_DENIED
            stranger = _metadata(sign(STRANGER, Capability.READ))
            code, _ = await _status(_read(channel, "other/logs", stranger))
            assert code == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await server.stop(None)


async def test_client_interceptors_sign_tokens_on_plaintext_channels():
    server, port = await _serve()
    try:
        tokens = TokenSource(KEYS, Capability.READ | Capability.LIST, "prefix=acme/")
        async with open_channel(f"http://127.0.0.1:{port}", tokens=tokens) as channel:
            assert len(await _read(channel, "acme/users")) == 1
            code, _ = await _status(_read(channel, "other/logs"))
            assert code == grpc.StatusCode.PERMISSION_DENIED
            # A token the caller passes explicitly wins over the channel's.
            wider = _metadata(sign(KEYS, Capability.READ))
            assert len(await _read(channel, "other/logs", wider)) == 1
        async with open_channel(f"127.0.0.1:{port}") as channel:  # no tokens: none sent
            code, _ = await _status(_read(channel, "acme/users"))
            assert code == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await server.stop(None)


def _b64(key: bytes) -> str:
    return base64.b64encode(key).decode()


# --- gRPC over TLS --------------------------------------------------------------------------


async def test_grpc_over_tls_with_call_credentials(pki: Pki):
    server, port = await _serve(tls=ServerTls(pki.server_cert, pki.server_key))
    try:
        tokens = TokenSource(KEYS, Capability.READ)
        client_tls = ClientTls(ca=pki.ca)
        async with open_channel(f"https://127.0.0.1:{port}", tls=client_tls, tokens=tokens) as ch:
            assert len(await _read(ch, "other/logs")) == 1
        async with open_channel(f"https://localhost:{port}", tls=client_tls) as channel:
            code, _ = await _status(_read(channel, "other/logs"))
            assert code == grpc.StatusCode.UNAUTHENTICATED  # TLS is fine, the token missing
        async with open_channel(f"http://127.0.0.1:{port}", tokens=tokens) as channel:
            code, _ = await _status(_read(channel, "other/logs"))
            assert code == grpc.StatusCode.UNAVAILABLE  # plaintext to a TLS port
    finally:
        await server.stop(None)


async def test_grpc_mutual_tls_requires_a_client_certificate(pki: Pki):
    server_tls = ServerTls(pki.server_cert, pki.server_key, ca=pki.ca, require_client_cert=True)
    server, port = await _serve(tls=server_tls)
    try:
        tokens = TokenSource(KEYS, Capability.READ)
        with_cert = ClientTls(ca=pki.ca, cert=pki.client_cert, key=pki.client_key)
        async with open_channel(f"https://127.0.0.1:{port}", tls=with_cert, tokens=tokens) as ch:
            assert len(await _read(ch, "acme/orders")) == 1
        without = ClientTls(ca=pki.ca)
        async with open_channel(f"https://127.0.0.1:{port}", tls=without, tokens=tokens) as ch:
            code, _ = await _status(_read(ch, "acme/orders"))
            assert code == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)


def test_tls_settings_name_what_is_wrong(tmp_path: Path, pki: Pki):
    with pytest.raises(TlsError, match="needs a trusted CA"):
        ServerTls(pki.server_cert, pki.server_key, require_client_cert=True)
    with pytest.raises(TlsError, match="needs its key"):
        ClientTls(cert=pki.client_cert)
    missing = tmp_path / "nope.pem"
    with pytest.raises(TlsError, match=f"server certificate file {missing}: No such file"):
        ServerTls(missing, pki.server_key).grpc_credentials()
    with pytest.raises(TlsError, match="trusted CA file"):
        ClientTls(ca=missing).ssl_context()
    with pytest.raises(TlsError, match="server certificate file"):
        ServerTls(pki.server_cert, pki.client_key).ssl_context()  # key of another certificate


def test_a_file_that_is_not_pem_is_named(tmp_path: Path, pki: Pki):
    """OpenSSL says "PEM lib" for a certificate and key loaded together, whichever of the
    two is garbage: the error names the one that is."""
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("hello, this is no PEM file\n")
    with pytest.raises(TlsError) as bad_key:
        ClientTls(cert=pki.client_cert, key=garbage).ssl_context()
    assert f"key file {garbage}: not a PEM private key" in str(bad_key.value)
    with pytest.raises(TlsError) as bad_cert:
        ServerTls(garbage, pki.server_key).ssl_context()
    assert f"server certificate file {garbage}: not a PEM certificate" in str(bad_cert.value)
    with pytest.raises(TlsError) as key_as_cert:  # the two files swapped
        ClientTls(cert=pki.client_key, key=pki.client_cert).ssl_context()
    assert f"{pki.client_key}: not a PEM certificate" in str(key_as_cert.value)
    with pytest.raises(TlsError, match="is not this certificate's private key"):
        ServerTls(pki.server_cert, pki.client_key).ssl_context()


# --- HTTP over TLS --------------------------------------------------------------------------


async def test_aiohttp_over_mutual_tls(pki: Pki):
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello")

    app = web.Application()
    app.router.add_get("/", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    server_tls = ServerTls(pki.server_cert, pki.server_key, ca=pki.ca, require_client_cert=True)
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_tls.ssl_context())
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        client_tls = ClientTls(ca=pki.ca, cert=pki.client_cert, key=pki.client_key)
        connector = aiohttp.TCPConnector(ssl=client_tls.ssl_context())
        async with (
            aiohttp.ClientSession(connector=connector) as session,
            session.get(f"https://localhost:{port}/") as resp,
        ):
            assert await resp.text() == "hello"
        connector = aiohttp.TCPConnector(ssl=ClientTls(ca=pki.ca).ssl_context())
        async with aiohttp.ClientSession(connector=connector) as session:
            with pytest.raises((aiohttp.ClientError, ssl.SSLError)):
                async with session.get(f"https://localhost:{port}/") as resp:
                    await resp.read()
    finally:
        await runner.cleanup()


# --- a server's own certificate, checked at start -------------------------------------------


def test_certificate_concerns_name_the_host_and_the_dates(pki: Pki):
    for host in ("127.0.0.1", "localhost", "LOCALHOST", "[127.0.0.1]"):
        assert certificate_concerns(pki.server_cert, host) == [], host
    [concern] = certificate_concerns(pki.server_cert, "broker.example")
    assert "names localhost, 127.0.0.1 but not 'broker.example'" in concern
    assert "--advertise" in concern
    in_a_week = time.time() + 7 * 86400
    [concern] = certificate_concerns(pki.server_cert, "localhost", now=in_a_week)
    assert f"server certificate {pki.server_cert} expired on" in concern
    [concern] = certificate_concerns(pki.server_cert, "localhost", now=time.time() - 86400)
    assert "is not valid before" in concern
    assert certificate_concerns(pki.ca.parent / "missing.pem", "localhost") == []


@pytest.mark.parametrize(("name", "host", "matches"), [
    ("*.example.com", "a.example.com", True),
    ("*.example.com", "a.b.example.com", False),
    ("*.example.com", "example.com", False),
    ("Broker.Example", "broker.example.", True),
    ("::1", "[0:0:0:0:0:0:0:1]", True),
    ("127.0.0.1", "127.0.0.2", False),
    ("127.0.0.1", "localhost", False),
])
def test_certificate_names_match_as_clients_check_them(name: str, host: str, matches: bool):
    assert _name_matches(name, host) is matches
