"""An app with TLS and authorization on, end to end: `streamkit run` of the wordcount example
with auth keys and a certificate made here (its bundled broker gets them too), a feeder
signing its appends, counts exact; then what each client gets with and without the keys:
`streamkit query`, `shards stat`, the members' Shard API and HTTP API; and the refusal to
serve beyond loopback without keys."""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from streamkit.app.member_http import http_url
from streamkit.auth import Capability, ClientTls, Security, parse_keys, sign
from streamkit.auth.grpc_auth import AUTHORIZATION
from streamkit.client.broker_client import normalize_address
from streamkit.protocol import consumer_pb, pb
from streamkit.protocol import consumer_pb2_grpc as consumer_grpc
from tests.brokerproc import BrokerProcess, free_port
from tests.e2e import (
    VOCABULARY,
    AppView,
    Feeder,
    Proc,
    cli,
    copy_wordcount,
    expected_counts,
    totals_of_updates,
)
from tests.test_auth_tls import Pki, make_pki, pki  # noqa: F401 (pki is a fixture: the test's CA)
from tests.waiting import eventually

KEYS_TEXT = base64.b64encode(b"streamkit-app-security-test-key!").decode()
KEYS = parse_keys(KEYS_TEXT)
STRANGER = base64.b64encode(b"a-key-the-members-have-never-had").decode()


@dataclass
class SecureApp:
    app: Path
    broker: str
    pki: Pki
    run: Proc
    security: Security  # the keys, trusting the test's CA
    serving: dict[str, str]  # shard -> its primary's endpoint
    ids: range  # the lines published, all acknowledged


def _tls(pki: Pki) -> list[str]:  # noqa: F811
    return ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
            "--tls-ca", str(pki.ca)]


@pytest.fixture(scope="module")
def secure_app(tmp_path_factory: pytest.TempPathFactory,
               pki: Pki) -> Iterator[SecureApp]:  # noqa: F811
    """`streamkit run` with a worker process and its bundled broker, all on TLS and requiring
    tokens (the worker and the broker get the settings through their environment); 400
    lines fed by a feeder signing with the keys, and processed."""
    tmp = tmp_path_factory.mktemp("secure-app")
    app = copy_wordcount(tmp / "wordcount")
    port = free_port()
    broker = f"https://127.0.0.1:{port}"
    run = Proc.streamkit(["run", str(app), "--port", str(port), "--workers", "2", "--no-status",
                          "--log-level", "INFO", "--auth-keys", KEYS_TEXT, *_tls(pki),
                          "--max-body-size", "4KiB"],
                         tmp / "run.log").start()
    security = Security(keys=KEYS, client_tls=ClientTls(ca=pki.ca))

    async def fed() -> tuple[range, dict[str, str]]:
        async with AppView(app, broker, security) as view:
            await view.wait_serving(timeout=90)
            feeder = Feeder(app, broker, tmp / "feeder.log", count=400, batch=40,
                            extra=["--auth-keys", KEYS_TEXT, "--tls-ca", str(pki.ca)]).start()
            try:
                ids = await asyncio.to_thread(feeder.finish, 90)
            finally:
                feeder.proc.stop()
            return ids, await view.wait_caught_up(timeout=60)

    try:
        ids, serving = asyncio.run(fed())
        yield SecureApp(app, broker, pki, run, security, serving, ids)
    except BaseException:
        print(run.log())
        raise
    finally:
        run.stop()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return cli(*args, timeout=60)


# --- the app runs, exactly once ----------------------------------------------------------------


async def test_counts_exact_with_tls_and_auth(secure_app: SecureApp) -> None:
    expected = expected_counts(secure_app.ids)
    assert len(secure_app.ids) == 400
    assert all(e.startswith("https://") for e in secure_app.serving.values())
    assert len(set(secure_app.serving.values())) == 2  # run's member and its worker
    async with AppView(secure_app.app, secure_app.broker, secure_app.security) as view:
        assert await view.query_counts(secure_app.serving) == expected
        assert totals_of_updates(await view.output_updates()) == expected
    assert "authorization" in secure_app.run.text()


def test_bundled_broker_requires_tokens(secure_app: SecureApp) -> None:
    ca = str(secure_app.pki.ca)
    refused = _cli("journals", "list", "--broker", secure_app.broker, "--tls-ca", ca)
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr, refused.stderr
    listed = _cli("journals", "list", "--broker", secure_app.broker, "--tls-ca", ca,
                  "--auth-keys", KEYS_TEXT)
    assert listed.returncode == 0, listed.stderr


# --- streamkit query and shards stat ---------------------------------------------------------


def test_query_with_keys_answers(secure_app: SecureApp) -> None:
    word = VOCABULARY[0]
    done = _cli("query", str(secure_app.app), json.dumps({"word": word}),
                "--auth-keys", KEYS_TEXT, "--tls-ca", str(secure_app.pki.ca))
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == expected_counts(secure_app.ids)[word]


def test_query_not_trusting_the_members_says_so(secure_app: SecureApp) -> None:
    """Without the CA, the members answer but aren't trusted: the error says to give
    --tls-ca, not that the app might not be running."""
    done = _cli("query", str(secure_app.app), '{"word": "w1"}', "--shard", "shard-000",
                "--auth-keys", KEYS_TEXT)
    assert done.returncode == 1, done.stderr
    assert "is not trusted" in done.stderr and "--tls-ca" in done.stderr, done.stderr
    assert "is the app running" not in done.stderr, done.stderr


@pytest.mark.parametrize("keys", [None, STRANGER])
def test_query_without_the_keys_is_refused(secure_app: SecureApp, keys: str | None) -> None:
    args = ["query", str(secure_app.app), '{"word": "w1"}', "--shard", "shard-000",
            "--tls-ca", str(secure_app.pki.ca)]
    done = _cli(*args, *(["--auth-keys", keys] if keys else []))
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert any("shard-000" in line and "refused" in line for line in lines), done.stderr


def test_shards_stat_signs_its_call(secure_app: SecureApp) -> None:
    args = ["shards", "stat", "shard-000", "--app", str(secure_app.app),
            "--tls-ca", str(secure_app.pki.ca)]
    done = _cli(*args, "--auth-keys", KEYS_TEXT)
    assert done.returncode == 0, done.stderr
    refused = _cli(*args)
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr, refused.stderr


# --- the members' Shard API ---------------------------------------------------------------------


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return ((AUTHORIZATION, f"Bearer {token}"),)


async def test_shard_api_checks_selectors(secure_app: SecureApp) -> None:
    endpoint = secure_app.serving["shard-000"]
    tls = ClientTls(ca=secure_app.pki.ca)
    async with Security(client_tls=tls).open_channel(normalize_address(endpoint)) as channel:
        stub = consumer_grpc.ShardStub(channel)
        only_001 = _bearer(sign(KEYS, Capability.READ | Capability.LIST, "id=shard-001"))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Stat(consumer_pb.StatRequest(shard="shard-000"), metadata=only_001,
                            timeout=10)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "shard-000" in (refused.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as unsigned:
            await stub.List(consumer_pb.ListRequest(), timeout=10)
        assert unsigned.value.code() == grpc.StatusCode.UNAUTHENTICATED
        listed = await stub.List(consumer_pb.ListRequest(selector=pb.LabelSelector()),
                                 metadata=only_001, timeout=10)
        assert [s.spec.id for s in listed.shards] == ["shard-001"]
        with pytest.raises(grpc.aio.AioRpcError) as hints:
            await stub.GetHints(consumer_pb.GetHintsRequest(shard="shard-000"),
                                metadata=only_001, timeout=10)
        assert hints.value.code() == grpc.StatusCode.PERMISSION_DENIED
        appliers = _bearer(sign(KEYS, Capability.APPLY, "id=shard-001"))
        with pytest.raises(grpc.aio.AioRpcError) as unassign:
            await stub.Unassign(consumer_pb.UnassignRequest(shards=["shard-000"], dry_run=True),
                                metadata=appliers, timeout=10)
        assert unassign.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # A shard whose primary is the other member: this one forwards the Stat, signing
        # its own token for it.
        elsewhere = next(s for s, e in secure_app.serving.items() if e != endpoint)
        reader = _bearer(sign(KEYS, Capability.READ, f"id={elsewhere}"))
        forwarded = await stub.Stat(consumer_pb.StatRequest(shard=elsewhere), metadata=reader,
                                    timeout=10)
        assert forwarded.status == consumer_pb.OK


# --- the members' HTTP API ----------------------------------------------------------------------


def _http(secure_app: SecureApp, path: str, headers: dict[str, str],
          body: bytes | None = None, shard: str = "shard-000") -> tuple[int, str]:
    url = f"{http_url(secure_app.serving[shard])}{path}"
    context = ssl.create_default_context(cafile=str(secure_app.pki.ca))
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=10,
                                    context=context) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_member_http_api_refuses(secure_app: SecureApp) -> None:
    lister = {"Authorization": f"Bearer {sign(KEYS, Capability.LIST)}"}
    assert _http(secure_app, "/status", lister)[0] == 200
    assert _http(secure_app, "/status", {})[0] == 401
    assert _http(secure_app, "/metrics", lister)[0] == 200
    one_shard = {"Authorization": f"Bearer {sign(KEYS, Capability.LIST, 'id=shard-000')}"}
    code, text = _http(secure_app, "/metrics", one_shard)  # it names every shard
    assert code == 403 and "needs a token without a selector" in text, (code, text)
    code, text = _http(secure_app, "/status", {**lister, "Host": "attacker.example:80"})
    assert code == 403 and "DNS rebinding" in text
    query = json.dumps({"word": "w1"}).encode()
    wrong = {"Authorization": f"Bearer {sign(KEYS, Capability.READ, 'id=shard-001')}"}
    code, text = _http(secure_app, "/query/shard-000", wrong, query)
    assert code == 403 and "shard-000" in text
    right = {"Authorization": f"Bearer {sign(KEYS, Capability.READ, 'id=shard-000')}"}
    assert _http(secure_app, "/query/shard-000", right, query)[0] == 200


def test_member_http_api_limits_bodies(secure_app: SecureApp) -> None:
    """`run --max-body-size 4KiB` holds in its own member and in its worker process."""
    members = {endpoint: shard for shard, endpoint in secure_app.serving.items()}
    assert len(members) == 2
    big = json.dumps({"word": "w" * 5000}).encode()
    for shard in members.values():
        reader = {"Authorization": f"Bearer {sign(KEYS, Capability.READ, f'id={shard}')}"}
        code, text = _http(secure_app, f"/query/{shard}", reader, big, shard)
        assert code == 413 and "limit of 4096 bytes (--max-body-size)" in text, (code, text)


# --- safe defaults ------------------------------------------------------------------------------


def test_serve_beyond_loopback_without_keys_refuses(tmp_path: Path) -> None:
    app = copy_wordcount(tmp_path / "wordcount")
    done = _cli("serve", str(app), "--broker", "127.0.0.1:1", "--host", "0.0.0.0")
    assert done.returncode == 2
    assert "without authorization" in done.stderr and "--insecure" in done.stderr


# --- backfill ------------------------------------------------------------------------------------


def test_backfill_plan_dials_with_the_keys(secure_app: SecureApp) -> None:
    """The driver dials the broker with the keys (a plan needs only the driver; Spark's
    executors rebuild the same Security from the plan, as the next test checks)."""
    args = ["backfill", str(secure_app.app), "--plan", "--json", "--broker", secure_app.broker,
            "--tls-ca", str(secure_app.pki.ca)]
    done = _cli(*args, "--auth-keys", KEYS_TEXT)
    assert done.returncode == 0, done.stderr
    assert KEYS_TEXT not in done.stdout  # the plan printed holds no keys
    refused = _cli(*args)
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr, refused.stderr


def test_backfill_plan_carries_security_as_plain_data(pki: Pki) -> None:  # noqa: F811
    from streamkit.backfill.plan import BackfillPlan, security_data

    given = Security(keys=parse_keys(f"{KEYS_TEXT} AA=="), client_tls=ClientTls(ca=pki.ca))
    plan = BackfillPlan(app_dir="", config={}, broker="", keyspace="", fragment_root=None,
                        txn_size=0, shards=[], security=security_data(given))
    rebuilt = plan.client_security()
    assert rebuilt.keys == given.keys and rebuilt.client_tls == given.client_tls
    assert "security" not in json.loads(plan.to_json())


def test_spark_backfill_with_the_keys(secure_app: SecureApp) -> None:
    """Last in this module, as it fences the running primaries: `backfill --spark` against the
    TLS broker that requires tokens. Spark's executors read the history through the broker
    with the plan's keys and CA, hand their state over, and the app's restarted shards answer
    with exactly the counts they had."""
    done = cli("backfill", str(secure_app.app), "--spark", "--master", "local[2]",
               "--broker", secure_app.broker, "--tls-ca", str(secure_app.pki.ca),
               "--auth-keys", KEYS_TEXT, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()  # the plan's table, then the results' table
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["SHARD", "MESSAGES"])
    rows = [line.split() for line in lines[header + 1:] if line.strip()]
    assert len(rows) == 8 and sum(int(row[1]) for row in rows) == len(secure_app.ids), done.stdout
    assert "handed over 8 shards" in done.stderr, done.stderr

    async def counted() -> None:
        async with AppView(secure_app.app, secure_app.broker, secure_app.security) as view:
            serving = await view.wait_caught_up(timeout=120)
            assert await view.query_counts(serving) == expected_counts(secure_app.ids)

    asyncio.run(counted())


def test_a_member_the_broker_refuses_does_not_start(secure_app: SecureApp) -> None:
    """`serve` with a key the broker doesn't know, or without trusting its certificate,
    exits 2 at once naming the cause, instead of joining and taking shards it can't serve
    (they failed in a loop, a traceback each, or stalled in BACKFILL)."""
    app, ca = secure_app.app, str(secure_app.pki.ca)
    common = ["serve", str(app), "--broker", secure_app.broker, "--keyspace",
              str(app / ".streamkit" / "keyspace.db"), "--suffix", "stranger"]
    stranger = _cli(*common, "--auth-keys", STRANGER, "--tls-ca", ca)
    assert stranger.returncode == 2, stranger.stderr
    assert "refuses this member's token" in stranger.stderr, stranger.stderr
    untrusting = _cli(*common, "--auth-keys", KEYS_TEXT)
    assert untrusting.returncode == 2, untrusting.stderr
    assert "does not trust the certificate" in untrusting.stderr, untrusting.stderr
    for refused in (stranger, untrusting):
        assert "Traceback" not in refused.stderr, refused.stderr


def test_a_plain_dial_of_a_tls_broker_is_told_to_use_https(secure_app: SecureApp) -> None:
    """gRPC says only "Socket closed" when a client speaks plain text to a TLS port; the
    error says what it most likely means."""
    plain = secure_app.broker.removeprefix("https://")
    listed = _cli("journals", "list", "--broker", plain, "--auth-keys", KEYS_TEXT)
    assert listed.returncode == 1, listed.stderr
    assert f"cannot reach broker at {plain}" in listed.stderr, listed.stderr
    assert "dial https://HOST:PORT" in listed.stderr, listed.stderr


# --- TLS mistakes, named: client certificates required, refused; https:// to plaintext ------


@dataclass
class TlsBrokers:
    mutual: BrokerProcess  # TLS, requiring client certificates signed by the test's CA
    plain: BrokerProcess
    stranger: Pki  # another CA, its client certificate, which `mutual` refuses


@pytest.fixture(scope="module")
def tls_brokers(tmp_path_factory: pytest.TempPathFactory,
                pki: Pki) -> Iterator[TlsBrokers]:  # noqa: F811
    tmp = tmp_path_factory.mktemp("tls-brokers")
    (tmp / "stranger").mkdir()
    stranger = make_pki(tmp / "stranger")
    mutual = BrokerProcess(tmp / "mutual", extra_args=[*_tls(pki), "--tls-require-client-cert"])
    plain = BrokerProcess(tmp / "plain")
    try:
        yield TlsBrokers(mutual.start(), plain.start(), stranger)
    finally:
        mutual.kill()
        plain.kill()


def _client_cert(cert: Path, key: Path) -> list[str]:
    return ["--tls-client-cert", str(cert), "--tls-client-key", str(key)]


def _tls_mistakes(brokers: TlsBrokers, pki: Pki) -> dict[str, tuple[str, list[str], str]]:  # noqa: F811
    """Each mistake: the broker dialled, the options, and what the error must say."""
    ca = ["--tls-ca", str(pki.ca)]
    mutual, plain = brokers.mutual.address, f"https://{brokers.plain.address}"
    return {
        "no client certificate": (mutual, ca, "it likely requires a client certificate (give "
                                              "--tls-client-cert and --tls-client-key)"),
        "another CA's client certificate": (
            mutual, [*ca, *_client_cert(brokers.stranger.client_cert,
                                        brokers.stranger.client_key)],
            "it likely refused this {me}'s certificate (check that it is signed by"),
        "an expired client certificate": (
            mutual, [*ca, *_client_cert(pki.expired_cert, pki.expired_key)],
            "it likely refused this {me}'s certificate"),
        "https:// to plaintext": (plain, ca, "does not serve TLS there: dial it as "
                                             "http://HOST:PORT (or HOST:PORT), without https://"),
    }


MISTAKES = ["no client certificate", "another CA's client certificate",
            "an expired client certificate", "https:// to plaintext"]


@pytest.mark.parametrize("mistake", MISTAKES)
def test_client_commands_name_the_tls_mistake(tls_brokers: TlsBrokers, pki: Pki,  # noqa: F811
                                              mistake: str) -> None:
    """gRPC says "Socket closed", or a handshake failure ending in ": OK", for each: the
    error says which setting to change, with the client commands' own option names."""
    broker, options, says = _tls_mistakes(tls_brokers, pki)[mistake]
    done = _cli("journals", "list", "--broker", broker, *options)
    assert done.returncode == 1, done.stderr
    error = next(line for line in done.stderr.splitlines() if line.startswith("streamkit: "))
    assert f"TLS with the broker at {broker} failed" in error, done.stderr
    assert says.format(me="client") in error, done.stderr
    assert "--tls-cert and --tls-key" not in error and not error.endswith(": OK)"), error
    assert "ssl_transport_security" not in done.stderr, done.stderr  # gRPC core's own line


def test_a_broker_not_trusted_is_not_out_of_reach(tls_brokers: TlsBrokers, pki: Pki  # noqa: F811
                                                  ) -> None:
    done = _cli("journals", "list", "--broker", tls_brokers.mutual.address,
                "--tls-ca", str(tls_brokers.stranger.ca),
                *_client_cert(pki.client_cert, pki.client_key))
    assert done.returncode == 1, done.stderr
    error = done.stderr.strip().splitlines()[-1]
    assert "cannot reach" not in error and "does not trust the certificate" in error, error
    assert "--tls-ca" in error and not error.endswith(": OK)"), error


@pytest.mark.parametrize("mistake", MISTAKES)
def test_serve_refuses_a_broker_it_cannot_speak_tls_with(tmp_path: Path, pki: Pki,  # noqa: F811
                                                         tls_brokers: TlsBrokers,
                                                         mistake: str) -> None:
    """Rather than join, take shards, and retry their appends for ever ("Socket closed")."""
    broker, options, says = _tls_mistakes(tls_brokers, pki)[mistake]
    app = copy_wordcount(tmp_path / "wordcount")
    done = _cli("serve", str(app), "--broker", broker, "--tls-cert", str(pki.server_cert),
                "--tls-key", str(pki.server_key), *options)
    assert done.returncode == 2, done.stderr
    assert f"refusing to serve: TLS with the broker at {broker} failed" in done.stderr
    assert says.format(me="member") in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_serve_leaves_a_broker_out_of_reach_to_retries(tmp_path: Path,
                                                       pki: Pki) -> None:  # noqa: F811
    """Refused connections (a broker not listening yet) are no TLS mistake: the member joins
    and its shards retry, as ever."""
    app = copy_wordcount(tmp_path / "wordcount")
    broker = f"https://127.0.0.1:{free_port()}"
    serve = Proc.streamkit(["serve", str(app), "--broker", broker, "--tls-ca", str(pki.ca),
                            "--suffix", "patient"], tmp_path / "serve.log").start()

    async def joined() -> None:
        async with AppView(app, broker) as view:
            await eventually(lambda: not serve.alive or _has_member(view, "patient"), 60,
                             "the member to join")

    try:
        asyncio.run(joined())
        assert serve.alive, serve.log()
    finally:
        serve.stop()


def test_serve_warns_of_a_plaintext_dial_closed_and_retries(
        tmp_path: Path, tls_brokers: TlsBrokers) -> None:
    """A plaintext dial the far end closes at once may be a TLS-only broker, or as well a
    proxy with no broker behind it for now: said, not refused (exit 2) as a mistake."""
    app = copy_wordcount(tmp_path / "wordcount")
    broker = tls_brokers.mutual.address.removeprefix("https://")
    serve = Proc.streamkit(["serve", str(app), "--broker", broker, "--suffix", "behind-proxy"],
                           tmp_path / "serve.log").start()
    try:
        said = f"the broker at {broker} closed the connection"
        asyncio.run(eventually(lambda: said in serve.text() or not serve.alive, 30, said))
        assert serve.alive, serve.log()
        assert "dial https://HOST:PORT" in serve.text(), serve.log()
    finally:
        serve.stop()


async def _has_member(view: AppView, suffix: str) -> bool:
    return any(member.suffix == suffix for member in (await view.state()).members)


def test_run_requiring_client_certificates_needs_its_own(tmp_path: Path,
                                                         pki: Pki) -> None:  # noqa: F811
    """`run`'s members dial its bundled broker and each other: requiring client certificates
    without one of their own, each of their calls fails (the first after half a minute)."""
    app = copy_wordcount(tmp_path / "wordcount")
    done = _cli("run", str(app), "--port", str(free_port()), "--no-status", *_tls(pki),
                "--tls-require-client-cert")
    assert done.returncode == 2, done.stderr
    assert "--tls-require-client-cert needs --tls-client-cert and --tls-client-key" \
        in done.stderr, done.stderr
    assert not (app / ".streamkit" / "broker").exists()  # refused before starting anything


@pytest.fixture(scope="module")
def mutual_app(tmp_path_factory: pytest.TempPathFactory,
               pki: Pki) -> Iterator[Path]:  # noqa: F811
    """`streamkit run` requiring client certificates, its members presenting the test's
    client certificate; serving every shard."""
    tmp = tmp_path_factory.mktemp("mutual-app")
    app = copy_wordcount(tmp / "wordcount", shards=2)
    port = free_port()
    run = Proc.streamkit(["run", str(app), "--port", str(port), "--no-status", *_tls(pki),
                          "--tls-require-client-cert",
                          *_client_cert(pki.client_cert, pki.client_key)],
                         tmp / "run.log").start()
    security = Security(client_tls=ClientTls(ca=pki.ca, cert=pki.client_cert,
                                             key=pki.client_key))

    async def serving() -> None:
        async with AppView(app, f"https://127.0.0.1:{port}", security) as view:
            await view.wait_serving(timeout=90)

    try:
        asyncio.run(serving())
        yield app
    except BaseException:
        print(run.log())
        raise
    finally:
        run.stop()


@pytest.mark.parametrize("command", ["query", "shards stat"])
def test_members_requiring_client_certificates_say_so(mutual_app: Path,
                                                      pki: Pki, command: str) -> None:  # noqa: F811
    """Not "cannot reach … is the app running?" (it is), nor a bare "Socket closed"."""
    args = (["query", str(mutual_app), '{"word": "w1"}', "--shard", "shard-000"]
            if command == "query" else ["shards", "stat", "shard-000", "--app", str(mutual_app)])
    ca = ["--tls-ca", str(pki.ca)]
    answered = _cli(*args, *ca, *_client_cert(pki.client_cert, pki.client_key))
    assert answered.returncode == 0, answered.stderr
    done = _cli(*args, *ca)
    assert done.returncode == 1, done.stderr
    assert "the member closed the TLS connection: it likely requires a client certificate " \
           "(give --tls-client-cert and --tls-client-key)" in done.stderr, done.stderr
    assert "is the app running" not in done.stderr, done.stderr
    refused = _cli(*args, *ca, *_client_cert(pki.expired_cert, pki.expired_key))
    assert refused.returncode == 1, refused.stderr
    assert "it likely refused this client's certificate" in refused.stderr, refused.stderr


async def test_a_tls_member_does_not_forward_a_token_in_the_clear(pki: Pki) -> None:  # noqa: F811
    """A member serving TLS asked about a shard whose primary announces a plaintext endpoint
    (a mixed deployment) answers 502 naming it, and sends nothing there: the caller's token,
    sent encrypted, would have crossed the network in the clear. Without a token, or from a
    plaintext member, the query is forwarded as before."""
    from aiohttp import web

    from streamkit.app.query_forward import forward_query
    from streamkit.auth import ServerTls

    seen: list[str | None] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"n": 1})

    app = web.Application()
    app.router.add_post("/query/{shard:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port + 1).start()
    endpoint = f"grpc://127.0.0.1:{port}"
    tls = Security(server_tls=ServerTls(pki.server_cert, pki.server_key))
    try:
        refused = await forward_query(endpoint, "s-1", b"{}", "Bearer secret", tls, 5)
        assert refused.status == 502
        assert f"primary at {endpoint} serves no TLS" in refused.body.decode()
        assert seen == []
        untokened = await forward_query(endpoint, "s-1", b"{}", None, tls, 5)
        plain = await forward_query(endpoint, "s-1", b"{}", "Bearer secret", Security(), 5)
        assert (untokened.status, plain.status) == (200, 200)
        assert seen == [None, "Bearer secret"]
    finally:
        await runner.cleanup()
