"""The broker with TLS and authorization on, end to end: real broker processes on 127.0.0.1
with certificates made here; the client library, the `journals` commands and the HTTP
gateway against them; the answer each wrong or missing token gets; `AA==` rollout; and
the refusal to listen beyond loopback without keys."""

from __future__ import annotations

import base64
import json
import os
import re
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from streamkit.auth import (
    Capability,
    ClientTls,
    Security,
    open_channel,
    parse_keys,
    sign,
    verify,
)
from streamkit.auth.grpc_auth import AUTHORIZATION
from streamkit.client import (
    Appender,
    AppendService,
    BrokerClient,
    TransportError,
    list_fragments,
    list_journals,
)
from streamkit.client.broker_client import normalize_address
from streamkit.protocol import pb, pb_grpc
from streamkit.protocol.labels import label_set
from tests.brokerproc import BrokerProcess, free_port
from tests.helpers_client import create_journal, read_range, unique_name
from tests.test_auth_tls import Pki, pki  # noqa: F401 (pki is a fixture: the test's CA)

KEYS_TEXT = base64.b64encode(b"streamkit-broker-security-tests!").decode()
KEYS = parse_keys(KEYS_TEXT)
STRANGER = parse_keys(base64.b64encode(b"a-key-the-broker-has-never-seen!").decode())
CLI = [sys.executable, "-m", "streamkit.cli.main"]


# --- brokers --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secure_broker(tmp_path_factory: pytest.TempPathFactory, pki: Pki  # noqa: F811
                  ) -> Iterator[BrokerProcess]:
    """TLS on both ports, and auth keys given the way operators should: by environment."""
    tls = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)]
    broker = BrokerProcess(tmp_path_factory.mktemp("secure") / "broker", extra_args=tls,
                           env={"AUTH_KEYS": KEYS_TEXT}).start()
    yield broker
    broker.kill()


def security(pki: Pki, keys=KEYS) -> Security:  # noqa: F811
    return Security(keys=keys, client_tls=ClientTls(ca=pki.ca))


@pytest.fixture
async def client(secure_broker: BrokerProcess, pki: Pki  # noqa: F811
                 ) -> AsyncIterator[BrokerClient]:
    async with BrokerClient(secure_broker.address, security(pki)) as c:
        yield c


# --- the client library ---------------------------------------------------------------------


async def test_client_appends_and_reads_over_tls_with_keys(
    client: BrokerClient, secure_broker: BrokerProcess
) -> None:
    assert secure_broker.address.startswith("https://")
    name = unique_name("acme")
    await create_journal(client, name)
    async with Appender(client, name) as appender:
        await appender.write(b"hello\n")
    async with AppendService(client) as service:
        await (await service.append(name, b"world\n"))
    assert await read_range(client, name, 0, 12) == b"hello\nworld\n"

    [listed] = await list_journals(client, f"name={name}")
    assert list(listed.route.endpoints) == [secure_broker.address]  # Gazette's https:// form
    assert client.route_of(name) == client.address  # the route names the broker dialled
    assert (await list_fragments(client, name)).fragments


async def test_clients_sign_a_token_per_call_scoped_to_it(client: BrokerClient) -> None:
    [(key, value)] = client.auth(Capability.READ, "acme/orders;meta") or ()
    assert key == AUTHORIZATION and value.startswith("Bearer ")
    claims = verify(KEYS, value.removeprefix("Bearer "), Capability.READ)
    assert claims.cap == Capability.READ
    assert claims.covers_journal("acme/orders") and not claims.covers_journal("acme/users")
    assert client.auth(Capability.READ, "acme/orders;meta") == ((key, value),)  # signed once

    app_x = pb.LabelSelector(include=label_set(("app", "x")))
    [(_, value)] = client.auth(Capability.LIST, selector=app_x) or ()
    claims = verify(KEYS, value.removeprefix("Bearer "), Capability.LIST)
    assert claims.covers_journal("any", label_set(("app", "x")))
    assert not claims.covers_journal("any", label_set(("app", "y")))
    async with BrokerClient("127.0.0.1:1") as plain:
        assert plain.auth(Capability.READ, "acme/orders") is None  # no keys: calls unchanged


async def test_wrong_or_missing_keys_are_refused_through_the_library(
    secure_broker: BrokerProcess, pki: Pki  # noqa: F811
) -> None:
    async with BrokerClient(secure_broker.address, security(pki, STRANGER)) as stranger:
        with pytest.raises(TransportError) as caught:
            await list_journals(stranger)
        assert caught.value.code == "UNAUTHENTICATED"
        assert "matches none of this server's keys" in caught.value.details
    async with BrokerClient(secure_broker.address, security(pki, None)) as tokenless:
        with pytest.raises(TransportError) as caught:
            await list_journals(tokenless)
        assert caught.value.code == "UNAUTHENTICATED"
        assert "missing authorization" in caught.value.details
    async with BrokerClient(secure_broker.address) as untrusting:  # the system's CAs only
        with pytest.raises(TransportError) as caught:
            await list_journals(untrusting)
        assert caught.value.code == "UNAVAILABLE"


# --- each refusal, on the wire --------------------------------------------------------------


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return ((AUTHORIZATION, f"Bearer {token}"),)


async def _refused(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value.code(), caught.value.details() or ""


async def test_each_wrong_token_gets_gazettes_answer(
    client: BrokerClient, secure_broker: BrokerProcess, pki: Pki  # noqa: F811
) -> None:
    acme, other = unique_name("acme"), unique_name("other")
    await create_journal(client, acme)
    await create_journal(client, other, labels={"team": "b"})
    async with Appender(client, acme) as appender:
        await appender.write(b"acme data\n")

    async with open_channel(secure_broker.address, tls=ClientTls(ca=pki.ca)) as channel:
        stub = pb_grpc.JournalStub(channel)

        async def read(metadata) -> list[pb.ReadResponse]:
            request = pb.ReadRequest(journal=acme, offset=0, end_offset=10)
            return [r async for r in stub.Read(request, metadata=metadata)]

        code, details = await _refused(read(None))
        assert (code, details) == (grpc.StatusCode.UNAUTHENTICATED,
                                   "missing authorization: send 'authorization: Bearer <token>'")
        code, details = await _refused(read(_bearer(sign(STRANGER, Capability.READ))))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert "matches none of this server's keys" in details
        code, details = await _refused(read(_bearer(sign(KEYS, Capability.READ, ttl=-60))))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "expired" in details
        lister = _bearer(sign(KEYS, Capability.LIST | Capability.APPEND))
        code, details = await _refused(read(lister))
        assert (code, details) == (
            grpc.StatusCode.PERMISSION_DENIED,
            "authorization is missing required capability READ (for /protocol.Journal/Read)")

        # The right capability over the wrong journals: the journal is absent, as in Gazette.
        elsewhere = _bearer(sign(KEYS, Capability.ALL, "prefix=nowhere/"))
        [response] = await read(elsewhere)
        assert response.status == pb.JOURNAL_NOT_FOUND
        fragments = await stub.ListFragments(pb.FragmentsRequest(journal=acme),
                                             metadata=elsewhere)
        assert fragments.status == pb.JOURNAL_NOT_FOUND

        async def chunks():
            yield pb.AppendRequest(journal=acme)
            yield pb.AppendRequest(content=b"sneaky\n")
            yield pb.AppendRequest()

        appended = await stub.Append(chunks(), metadata=elsewhere)
        assert appended.status == pb.JOURNAL_NOT_FOUND
        reader = _bearer(sign(KEYS, Capability.READ, f"name={acme}"))
        assert b"".join(r.content for r in await read(reader)) == b"acme data\n"

        # List leaves out what the token does not cover.
        listing = _bearer(sign(KEYS, Capability.LIST, f"prefix={acme.split('/')[0]}/"))
        names = [j.spec.name async for r in stub.List(pb.ListRequest(), metadata=listing)
                 for j in r.journals]
        assert acme in names and other not in names

        # Apply refuses, naming the journal, a change outside the token's selector, before
        # or after it: relabelling another team's journal into one's own is refused too.
        team_a = _bearer(sign(KEYS, Capability.APPLY, "team=a"))
        taken = pb.JournalSpec()
        taken.CopyFrom((await list_journals(client, f"name={other}"))[0].spec)
        taken.labels.CopyFrom(label_set(("team", "a")))
        change = pb.ApplyRequest.Change(expect_mod_revision=-1, upsert=taken)
        code, details = await _refused(stub.Apply(pb.ApplyRequest(changes=[change]),
                                                  metadata=team_a))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert f"authorization does not cover journal {other}" in details
        delete = pb.ApplyRequest.Change(expect_mod_revision=-1, delete=other)
        code, _ = await _refused(stub.Apply(pb.ApplyRequest(changes=[delete]), metadata=team_a))
        assert code == grpc.StatusCode.PERMISSION_DENIED
    assert [j.spec.name for j in await list_journals(client, f"name={other}")] == [other]


# --- AA==: rolling authorization out ----------------------------------------------------------


async def test_rollout_key_lets_tokenless_clients_in_but_checks_tokens(tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path / "broker", env={"AUTH_KEYS": f"{KEYS_TEXT} AA=="}).start()
    try:
        address = f"http://127.0.0.1:{broker.port}"  # Gazette's plaintext form
        async with BrokerClient(address) as tokenless:  # a client not given keys yet
            name = unique_name("rollout")
            await create_journal(tokenless, name)
            async with Appender(tokenless, name) as appender:
                await appender.write(b"no token needed\n")
            assert await read_range(tokenless, name, 0, 16) == b"no token needed\n"
        async with BrokerClient(address, Security(keys=KEYS)) as keyed:
            assert await read_range(keyed, name, 0, 3) == b"no "
        async with BrokerClient(address, Security(keys=STRANGER)) as stranger:
            with pytest.raises(TransportError) as caught:
                await read_range(stranger, name, 0, 3)
            assert caught.value.code == "UNAUTHENTICATED"
        async with open_channel(address) as channel:  # a token lacking READ: refused
            stub = pb_grpc.JournalStub(channel)
            weak = _bearer(sign(KEYS, Capability.LIST))
            code, _ = await _refused(
                _collect(stub.Read(pb.ReadRequest(journal=name), metadata=weak)))
            assert code == grpc.StatusCode.PERMISSION_DENIED
    finally:
        broker.kill()


async def _collect(call) -> list:
    return [r async for r in call]


# --- the CLI ------------------------------------------------------------------------------


def _cli(*args: str, env: dict[str, str] | None = None, input: str | None = None
         ) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([*CLI, *args], capture_output=True, text=True, input=input,
                            env={**os.environ, **(env or {})}, timeout=60)
    assert "Traceback" not in result.stderr, result.stderr
    return result


# gRPC core's own log lines ("I1123 17:48:25.593902 10539 ssl_transport_security.cc:…"),
# which it prints on a failed TLS handshake unless GRPC_VERBOSITY is set before it loads.
_GRPC_LOG = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")


def _one_error_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    assert result.returncode == code, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.strip().splitlines() if not _GRPC_LOG.match(line)]
    assert len(lines) == 1 and lines[0].startswith("streamkit: error: "), result.stderr
    return lines[0]


SPECS = """
name: {p}
fragment: {{length: 1024, compression_codec: NONE, refresh_interval: 1s}}
children:
  - name: {p}logs
"""


def test_journals_commands_with_keys_and_ca(secure_broker: BrokerProcess, pki: Pki,  # noqa: F811
                                            tmp_path: Path) -> None:
    p = unique_name("cli") + "/"
    specs = tmp_path / "specs.yaml"
    specs.write_text(SPECS.format(p=p))
    dial = ["--broker", secure_broker.address, "--tls-ca", str(pki.ca)]
    keyed = {"AUTH_KEYS": KEYS_TEXT}

    applied = _cli("journals", "apply", "--specs", str(specs), *dial, env=keyed)
    assert applied.returncode == 0 and f"created {p}logs" in applied.stdout, applied.stderr
    appended = _cli("journals", "append", f"{p}logs", *dial, "--auth-keys", KEYS_TEXT,
                    input="one\ntwo\n")
    assert appended.returncode == 0, appended.stderr
    read = _cli("journals", "read", f"{p}logs", *dial, env=keyed)
    assert (read.returncode, read.stdout) == (0, "one\ntwo\n"), read.stderr
    listed = _cli("journals", "list", "-l", f"prefix={p}", "-o", "json", *dial, env=keyed)
    assert [j["name"] for j in json.loads(listed.stdout)] == [f"{p}logs"]
    fragments = _cli("journals", "fragments", f"{p}logs", *dial, env=keyed)
    assert fragments.returncode == 0, fragments.stderr
    # The environment variables do as the options do.
    by_env = _cli("journals", "read", f"{p}logs", "--broker", secure_broker.address,
                  env={**keyed, "STREAMKIT_TLS_CA": str(pki.ca)})
    assert by_env.stdout == "one\ntwo\n", by_env.stderr

    line = _one_error_line(_cli("journals", "list", *dial, env={"AUTH_KEYS": ""}), 1)
    assert "UNAUTHENTICATED" in line and "missing authorization" in line and "AUTH_KEYS" in line
    stranger = base64.b64encode(b"a-key-the-broker-has-never-seen!").decode()
    line = _one_error_line(_cli("journals", "list", *dial, "--auth-keys", stranger), 1)
    assert "matches none of this server's keys" in line
    line = _one_error_line(_cli("journals", "list", "--broker", secure_broker.address,
                                env=keyed), 1)
    assert f"TLS with the broker at {secure_broker.address} failed" in line  # no CA
    assert "does not trust the certificate" in line
    line = _one_error_line(_cli("journals", "list", "--broker", secure_broker.address,
                                "--tls-ca", str(tmp_path / "missing.pem"), env=keyed), 2)
    assert "missing.pem" in line and "No such file" in line
    line = _one_error_line(_cli("journals", "list", *dial, "--auth-keys", "not base64!"), 2)
    assert "--auth-keys: key 1 of 2 is not valid base64" in line


# --- the HTTP gateway ---------------------------------------------------------------------


def _http(broker: BrokerProcess, pki: Pki, method: str, path: str,  # noqa: F811
          body: bytes | None = None, **headers: str) -> tuple[int, bytes]:
    context = ssl.create_default_context(cafile=str(pki.ca))
    request = urllib.request.Request(f"{broker.http_url}{path}", data=body, method=method,
                                     headers={k.replace("_", "-"): v for k, v in headers.items()})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


async def test_http_gateway_checks_host_origin_and_tokens(
    secure_broker: BrokerProcess, client: BrokerClient, pki: Pki  # noqa: F811
) -> None:
    name = unique_name("web")
    minted = _cli("auth", "token", "--cap", "READ,APPEND,LIST", "-l", "prefix=web/",
                  "--ttl", "10m", env={"AUTH_KEYS": KEYS_TEXT})
    assert minted.returncode == 0 and "grants LIST|READ|APPEND over prefix=web/" in minted.stderr
    bearer = f"Bearer {minted.stdout.strip()}"

    await create_journal(client, name)

    status, body = _http(secure_broker, pki, "PUT", f"/{name}", b"from curl\n",
                         Authorization=bearer, Host="rebind.attacker.example")
    assert status == 403 and b"DNS rebinding" in body
    status, body = _http(secure_broker, pki, "PUT", f"/{name}", b"from a page\n",
                         Authorization=bearer, Origin="https://attacker.example")
    assert status == 403 and b"cross-origin PUT refused" in body
    status, body = _http(secure_broker, pki, "PUT", f"/{name}", b"from a page\n",
                         Sec_Fetch_Site="cross-site", Content_Type="text/plain")
    assert status == 403 and b"cross-origin" in body
    status, body = _http(secure_broker, pki, "PUT", f"/{name}", b"no token\n")
    assert status == 401 and b"missing authorization" in body

    status, _ = _http(secure_broker, pki, "PUT", f"/{name}", b"from curl\n",
                      Authorization=bearer)
    assert status == 204
    status, body = _http(secure_broker, pki, "GET", f"/{name}?offset=0", Authorization=bearer)
    assert (status, body) == (206, b"from curl\n")
    narrow = f"Bearer {sign(KEYS, Capability.READ, 'prefix=elsewhere/')}"
    status, _ = _http(secure_broker, pki, "GET", f"/{name}?offset=0", Authorization=narrow)
    assert status == 404  # not covered: absent, as over gRPC
    status, _ = _http(secure_broker, pki, "GET", "/metrics")
    assert status == 401
    # The metrics name every journal: a token limited to some (prefix=web/) may not read
    # them, one without a selector may.
    status, body = _http(secure_broker, pki, "GET", "/metrics", Authorization=bearer)
    assert status == 403 and b"needs a token without a selector" in body, body
    everything = f"Bearer {sign(KEYS, Capability.LIST)}"
    status, body = _http(secure_broker, pki, "GET", "/metrics", Authorization=everything)
    assert status == 200 and b"streamkit_broker" in body


def test_loopback_gateway_without_keys_still_refuses_rebinding(
    shared_broker: BrokerProcess,
) -> None:
    request = urllib.request.Request(f"{shared_broker.http_url}/metrics",
                                     headers={"Host": "rebind.attacker.example:80"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    assert caught.value.code == 403
    with urllib.request.urlopen(f"{shared_broker.http_url}/metrics", timeout=10) as response:
        assert response.status == 200  # no keys: no token needed on loopback


# --- mutual TLS -------------------------------------------------------------------------------


async def test_mutual_tls_needs_the_client_certificate(tmp_path: Path,
                                                       pki: Pki) -> None:  # noqa: F811
    tls = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
           "--tls-ca", str(pki.ca), "--tls-require-client-cert"]
    broker = BrokerProcess(tmp_path / "broker", extra_args=tls).start()
    try:
        with_cert = Security(client_tls=ClientTls(ca=pki.ca, cert=pki.client_cert,
                                                  key=pki.client_key))
        async with BrokerClient(broker.address, with_cert) as c:
            assert await list_journals(c) == []
        async with BrokerClient(broker.address, Security(client_tls=ClientTls(ca=pki.ca))) as c:
            with pytest.raises(TransportError) as caught:
                await list_journals(c)
            assert caught.value.code == "UNAVAILABLE"
    finally:
        broker.kill()


def test_a_certificate_for_other_hosts_is_warned_of_at_start(tmp_path: Path,
                                                              pki: Pki) -> None:  # noqa: F811
    """Clients dial the advertised host; a certificate that does not name it would fail
    every verifying client, so the broker says so in its first lines."""
    tls = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)]
    named = BrokerProcess(tmp_path / "named", extra_args=tls).start()
    other = BrokerProcess(tmp_path / "other",
                          extra_args=[*tls, "--advertise", "broker.example"]).start()
    try:
        assert "server certificate" not in named.log()
        assert (f"server certificate {pki.server_cert} names localhost, 127.0.0.1 but not "
                "'broker.example'") in other.log()
    finally:
        named.kill()
        other.kill()


# --- listening beyond loopback --------------------------------------------------------------


def test_non_loopback_without_keys_is_refused_in_one_line(tmp_path: Path) -> None:
    data_dir = tmp_path / "broker"
    result = _cli("broker", "serve", "--host", "0.0.0.0", "--port", str(free_port()),
                  "--data-dir", str(data_dir), env={"AUTH_KEYS": ""})
    assert result.returncode == 2  # a setting to change, as every bad option combination
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "listening on every address" in lines[0] and "without authorization" in lines[0]
    assert "--auth-keys" in lines[0] and "--insecure" in lines[0]
    assert not data_dir.exists()  # refused before touching anything

    for setting in (["--insecure"], ["--auth-keys", KEYS_TEXT]):
        broker = BrokerProcess(tmp_path / f"broker{setting[0]}",
                               extra_args=["--host", "0.0.0.0", *setting]).start()
        assert broker.terminate() == 0


def test_bad_security_settings_are_one_line(tmp_path: Path, pki: Pki) -> None:  # noqa: F811
    serve = ["broker", "serve", "--data-dir", str(tmp_path / "b"), "--port", str(free_port())]
    missing = tmp_path / "nope.pem"
    line = _one_error_line(_cli(*serve, "--tls-cert", str(missing), "--tls-key",
                                str(pki.server_key)), 2)
    assert f"server certificate file {missing}" in line
    line = _one_error_line(_cli(*serve, "--tls-cert", str(pki.server_cert)), 2)
    assert "--tls-cert and --tls-key go together" in line
    line = _one_error_line(_cli(*serve, "--tls-cert", str(pki.server_cert), "--tls-key",
                                str(pki.client_key)), 2)  # a key of another certificate
    assert "server certificate file" in line
    line = _one_error_line(_cli(*serve, "--auth-keys", "abc"), 2)
    assert "--auth-keys: key 1 of 1 is not valid base64" in line
    line = _one_error_line(_cli("auth", "token", "--cap", "READ", env={"AUTH_KEYS": ""}), 2)
    assert "no keys to sign with" in line


# --- addresses ------------------------------------------------------------------------------


@pytest.mark.parametrize(("given", "normal"), [
    ("127.0.0.1:8080", "127.0.0.1:8080"),
    ("grpc://127.0.0.1:8080/", "127.0.0.1:8080"),
    ("http://broker:8080", "broker:8080"),
    ("HTTPS://broker:8443/", "https://broker:8443"),
])
def test_address_forms(given: str, normal: str) -> None:
    assert normalize_address(given) == normal


async def test_routes_keep_tls_and_never_downgrade() -> None:
    def route(endpoint: str) -> pb.Route:
        member = pb.ProcessSpec.ID(zone="z", suffix="s")
        return pb.Route(members=[member], primary=0, endpoints=[endpoint])

    async with BrokerClient("https://broker-a:8443") as c:
        c.update_route("j", route("https://broker-b:8443"))
        assert c.route_of("j") == "https://broker-b:8443"
        c.update_route("j", route("http://broker-c:8080"))  # would send tokens in the clear
        assert c.route_of("j") == c.address
        c.update_route("j", route("not an address"))
        assert c.route_of("j") == c.address
    async with BrokerClient("broker-a:8080") as c:
        c.update_route("j", route("https://broker-b:8443"))
        assert c.route_of("j") == "https://broker-b:8443"
