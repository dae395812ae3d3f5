"""Keys, Gazette-compatible tokens, the request's claims, and the HTTP middleware."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from streamkit.auth import (
    AuthKeysError,
    Capability,
    PermissionDenied,
    TokenSource,
    Unauthenticated,
    app_capability,
    auth_middleware,
    load_keys,
    parse_keys,
    request_claims,
    require_journal,
    sign,
    verify,
    verify_bearer,
)
from streamkit.auth.scope import claims_bound, journal_allowed, shard_allowed
from streamkit.auth.tokens import claims_from_json, describe, selector_json
from streamkit.protocol import pb
from streamkit.protocol.labels import format_selector, label_set, parse_selector

SECRET, OTHER = "c2VjcmV0", "b3RoZXI="  # base64 of b"secret" and b"other", as Gazette's tests
NOW = 1_700_000_000.0


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def hand_made_token(payload: bytes, key: bytes, alg: str = "HS256") -> str:
    """A JWT built from the claim rules alone, not with streamkit's signer."""
    header = json.dumps({"alg": alg, "typ": "JWT"}, separators=(",", ":")).encode()
    signing_input = f"{b64url(header)}.{b64url(payload)}".encode()
    digest = hashlib.sha256 if alg == "HS256" else hashlib.sha384
    return f"{signing_input.decode()}.{b64url(hmac.new(key, signing_input, digest).digest())}"


def payload_of(token: str) -> dict:
    return json.loads(base64.urlsafe_b64decode(token.split(".")[1] + "=="))


# --- keys -----------------------------------------------------------------------------------


def test_keys_are_split_on_spaces_and_commas_and_the_first_signs():
    keys = parse_keys(f" {SECRET},\n {OTHER}\t,AA== ")
    assert keys.verifying == (b"secret", b"other")
    assert keys.signing == b"secret"
    assert keys.allow_missing
    assert "secret" not in repr(keys)


def test_a_bad_key_is_named_by_position_without_showing_it():
    with pytest.raises(AuthKeysError, match=r"key 2 of 3 is not valid base64") as caught:
        parse_keys(f"{SECRET} not*base64! {OTHER}", "AUTH_KEYS")
    assert "not*base64" not in str(caught.value)
    assert str(caught.value).startswith("AUTH_KEYS:")
    with pytest.raises(AuthKeysError, match="key 1 of 1"):
        parse_keys("c2VjcmV0=")  # wrong padding


def test_allow_missing_alone_is_not_a_key_set():
    with pytest.raises(AuthKeysError, match="at least one key besides AA=="):
        parse_keys("AA==")
    with pytest.raises(AuthKeysError, match="at least one key"):
        parse_keys(" , ")


def test_keys_come_from_the_argument_else_the_environment():
    assert load_keys(None, {}) is None
    assert load_keys("", {"AUTH_KEYS": "  "}) is None
    assert load_keys(None, {"AUTH_KEYS": OTHER}).signing == b"other"
    assert load_keys(SECRET, {"AUTH_KEYS": OTHER}).signing == b"secret"
    with pytest.raises(AuthKeysError, match=r"^AUTH_KEYS: key 1"):
        load_keys(None, {"AUTH_KEYS": "%%%"})


# --- capabilities ---------------------------------------------------------------------------


def test_capabilities_have_gazettes_values():
    assert [int(c) for c in (Capability.LIST, Capability.APPLY, Capability.READ)] == [2, 4, 8]
    assert [int(c) for c in (Capability.APPEND, Capability.REPLICATE)] == [16, 32]
    assert int(Capability.ALL) == 0xFFFFFFFF
    assert int(app_capability(0)) == 1 << 16 and int(app_capability(15)) == 1 << 31
    assert describe(Capability.READ | Capability.APPEND | app_capability(1)) == "READ|APPEND|bit 17"
    with pytest.raises(ValueError):
        app_capability(16)


# --- signing and verifying ------------------------------------------------------------------


def test_sign_with_one_key_set_and_verify_with_another_sharing_a_key():
    signer, verifier = parse_keys(f"{SECRET},{OTHER}"), parse_keys(f"{OTHER},{SECRET}")
    token = sign(signer, Capability.APPEND | Capability.LIST, "hi=there", ttl=60, now=NOW)
    claims = verify(verifier, token, Capability.APPEND, now=NOW + 30)
    assert claims.cap == Capability.APPEND | Capability.LIST
    assert format_selector(claims.selector) == "hi=there"
    assert (claims.issued_at, claims.expiry) == (NOW, NOW + 60)


def test_claims_json_has_exactly_gazettes_fields():
    token = sign(parse_keys(SECRET), Capability.READ, "app=wc, !old, name:prefix=a/", 60, now=NOW)
    header = json.loads(base64.urlsafe_b64decode(token.split(".")[0] + "=="))
    assert header == {"alg": "HS256", "typ": "JWT"}
    assert payload_of(token) == {
        "cap": 8,
        "sel": {
            "include": {
                "labels": [
                    {"name": "app", "value": "wc"},
                    {"name": "name", "value": "a/", "prefix": True},
                ]
            },
            "exclude": {"labels": [{"name": "old"}]},
        },
        "exp": int(NOW) + 60,
        "iat": int(NOW),
    }
    assert list(payload_of(token)) == ["cap", "sel", "exp", "iat"]
    empty = payload_of(sign(parse_keys(SECRET), Capability.APPLY, None, 60, now=NOW))
    assert empty["sel"] == {"include": {"labels": None}, "exclude": {"labels": None}}


def test_a_hand_computed_gazette_token_is_accepted_and_matches_sign_byte_for_byte():
    # What gazette's KeyedAuth.Authorize writes for READ on journal acme/orders, one hour.
    payload = (
        b'{"cap":8,"sel":{"include":{"labels":[{"name":"name","value":"acme/orders"}]},'
        b'"exclude":{"labels":null}},"exp":1700003600,"iat":1700000000}'
    )
    token = hand_made_token(payload, b"secret")
    keys = parse_keys(f"{OTHER} {SECRET}")  # verified by the second key
    claims = verify(keys, token, Capability.READ, now=NOW + 10)
    assert claims.cap == Capability.READ
    assert claims.covers_journal("acme/orders")
    assert not claims.covers_journal("acme/other")
    ours = sign(parse_keys(SECRET), Capability.READ, "name=acme/orders", 3600, now=NOW)
    assert ours == token


def test_gazette_variants_are_read_leniently():
    # HS384, no "sel", no iat, labels null: all valid from a Go signer.
    token = hand_made_token(b'{"cap":2,"exp":1700000100}', b"secret", alg="HS384")
    claims = verify(parse_keys(SECRET), token, Capability.LIST, now=NOW)
    assert claims.selector == pb.LabelSelector() and claims.issued_at is None
    sel = {"include": {"labels": None}, "exclude": None}
    assert claims_from_json({"cap": 2, "exp": 1, "sel": sel}).selector == pb.LabelSelector()


def test_expired_token_is_unauthenticated():
    token = sign(parse_keys(SECRET), Capability.READ, None, ttl=60, now=NOW)
    verify(parse_keys(SECRET), token, Capability.READ, now=NOW + 64)  # within the 5 s leeway
    with pytest.raises(Unauthenticated, match=r"expired 40s ago"):
        verify(parse_keys(SECRET), token, Capability.READ, now=NOW + 100)


def test_token_from_the_future_or_not_yet_valid_is_unauthenticated():
    keys = parse_keys(SECRET)
    with pytest.raises(Unauthenticated, match="issued in the future"):
        verify(keys, sign(keys, Capability.READ, None, 60, now=NOW + 30), Capability.READ, now=NOW)
    early = hand_made_token(b'{"cap":8,"exp":1700000600,"nbf":1700000300}', b"secret")
    with pytest.raises(Unauthenticated, match="not valid yet"):
        verify(keys, early, Capability.READ, now=NOW)


def test_unknown_key_and_garbage_are_unauthenticated():
    token = sign(parse_keys(OTHER), Capability.READ, None, 60, now=NOW)
    with pytest.raises(Unauthenticated, match="matches none of this server's keys"):
        verify(parse_keys(SECRET), token, Capability.READ, now=NOW)
    with pytest.raises(Unauthenticated, match="malformed"):
        verify(parse_keys(SECRET), "not-a-token", Capability.READ, now=NOW)
    unsigned = b64url(b'{"alg":"none"}') + "." + b64url(b'{"cap":8,"exp":1800000000}') + "."
    with pytest.raises(Unauthenticated):
        verify(parse_keys(SECRET), unsigned, Capability.READ, now=NOW)
    no_exp = hand_made_token(b'{"cap":8}', b"secret")
    with pytest.raises(Unauthenticated, match="exp"):
        verify(parse_keys(SECRET), no_exp, Capability.READ, now=NOW)
    bad_cap = hand_made_token(b'{"cap":-1,"exp":1800000000}', b"secret")
    with pytest.raises(Unauthenticated, match="cap must be"):
        verify(parse_keys(SECRET), bad_cap, Capability.READ, now=NOW)
    # NaN compares false with every time: such an exp (or nbf) would never expire.
    for times in (b'"exp":NaN', b'"exp":Infinity', b'"exp":1e308', b'"exp":1800000000,"nbf":NaN',
                  b'"exp":1800000000,"iat":-Infinity', b'"exp":-1e308'):
        odd = hand_made_token(b'{"cap":8,' + times + b"}", b"secret")
        with pytest.raises(Unauthenticated, match="must be seconds since 1970"):
            verify(parse_keys(SECRET), odd, Capability.READ, now=NOW)
    early = hand_made_token(b'{"cap":8,"exp":1800000000,"nbf":-5,"iat":-5}', b"secret")
    assert verify(parse_keys(SECRET), early, Capability.READ, now=NOW).expiry == 1800000000


def test_missing_capability_is_denied_naming_it():
    keys = parse_keys(SECRET)
    token = sign(keys, Capability.APPEND | Capability.LIST, None, 60, now=NOW)
    with pytest.raises(PermissionDenied, match=r"missing required capability REPLICATE$"):
        verify(keys, token, Capability.REPLICATE, now=NOW)
    with pytest.raises(PermissionDenied, match=r"READ\|bit 16"):
        verify(keys, token, Capability.READ | app_capability(0) | Capability.LIST, now=NOW)


def test_missing_token_is_unauthenticated_unless_rolling_out():
    with pytest.raises(Unauthenticated, match="missing authorization"):
        verify(parse_keys(SECRET), None, Capability.READ, now=NOW)
    rollout = parse_keys(f"{SECRET},AA==")
    claims = verify(rollout, None, Capability.READ, now=NOW)
    assert claims.cap == Capability.READ and claims.covers_journal("any/journal")
    # A token that is present is still checked in full.
    stranger = sign(parse_keys(OTHER), Capability.READ, None, 60, now=NOW)
    with pytest.raises(Unauthenticated):
        verify(rollout, stranger, Capability.READ, now=NOW)
    weak = sign(rollout, Capability.LIST, None, 60, now=NOW)
    with pytest.raises(PermissionDenied):
        verify(rollout, weak, Capability.READ, now=NOW)


def test_bearer_header_forms():
    keys = parse_keys(SECRET)
    token = sign(keys, Capability.READ, None, 60, now=NOW)
    assert verify_bearer(keys, f"Bearer {token}", Capability.READ, now=NOW).cap == Capability.READ
    with pytest.raises(Unauthenticated, match="expected 'Bearer <token>'"):
        verify_bearer(keys, f"Basic {token}", Capability.READ, now=NOW)
    with pytest.raises(Unauthenticated, match="missing"):
        verify_bearer(keys, "", Capability.READ, now=NOW)


# --- selectors: journals and shards ---------------------------------------------------------


def test_journal_selectors_match_labels_and_name_meta_labels():
    keys = parse_keys(SECRET)

    def claims(selector: str):
        return verify(keys, sign(keys, Capability.READ, selector, 60, now=NOW), 8, now=NOW)

    labels = label_set(("app", "wordcount"))
    assert claims("name=acme/orders").covers_journal("acme/orders")
    assert claims("name=acme/orders").covers_journal("acme/orders;pivot=1")
    assert claims("prefix=acme/").covers_journal("acme/x/orders")
    assert claims("name:prefix=acme/").covers_journal("acme/orders")
    assert not claims("name:prefix=acme/").covers_journal("other/orders")
    assert claims("app=wordcount").covers_journal("a/b", labels)
    assert not claims("app=wordcount").covers_journal("a/b")
    assert not claims("app=wordcount, name!=a/b").covers_journal("a/b", labels)
    with pytest.raises(PermissionDenied, match=r"does not cover journal x/y .*'app=wordcount'"):
        claims("app=wordcount").require_journal("x/y")
    assert claims("id=shard-1").covers_shard("shard-1")
    assert claims("app=wordcount").covers_shard("shard-2", labels)
    with pytest.raises(PermissionDenied, match="does not cover shard shard-2"):
        claims("id=shard-1").require_shard("shard-2")


def test_scope_checks_pass_without_claims_and_apply_bound_ones():
    assert journal_allowed("x/y") and shard_allowed("s1")
    require_journal("x/y")
    keys = parse_keys(SECRET)
    claims = verify(keys, sign(keys, Capability.READ, "prefix=a/", 60, now=NOW), 8, now=NOW)
    with claims_bound(claims):
        assert journal_allowed("a/b") and not journal_allowed("x/y")
        with pytest.raises(PermissionDenied):
            require_journal("x/y")
    assert journal_allowed("x/y")


# --- the client's cached token --------------------------------------------------------------


def test_token_source_reuses_its_token_and_re_signs_before_expiry():
    keys, clock = parse_keys(SECRET), [NOW]
    source = TokenSource(keys, Capability.READ, "app=wc", ttl=600, clock=lambda: clock[0])
    first = source.token()
    clock[0] += 299
    assert source.token() == first  # more than half of its life left
    clock[0] += 2
    second = source.token()
    assert second != first
    claims = verify(keys, second, Capability.READ, now=clock[0])
    assert claims.expiry == int(NOW + 301 + 600)
    assert format_selector(claims.selector) == "app=wc"
    assert source.authorization() == f"Bearer {second}"


# --- HTTP middleware ------------------------------------------------------------------------

KEYS = parse_keys(SECRET)


async def _read(request: web.Request) -> web.Response:
    journal = request.match_info["journal"]
    require_journal(journal)
    return web.Response(text=f"read {journal}")


async def _append(request: web.Request) -> web.Response:
    claims = request_claims(request)
    assert claims is not None and claims.cap & Capability.APPEND
    return web.Response(text="appended")


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(text="metrics")


def _app(**kwargs) -> web.Application:
    def needs(request: web.Request) -> Capability | None:
        if request.path == "/metrics":
            return None
        return {"GET": Capability.READ, "PUT": Capability.APPEND, "POST": Capability.APPEND}.get(
            request.method
        )

    app = web.Application(middlewares=[auth_middleware(KEYS, needs, **kwargs)])
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/{journal:.+}", _read)
    app.router.add_put("/{journal:.+}", _append)
    app.router.add_post("/{journal:.+}", _append)
    return app


def _bearer(cap: Capability, selector: str | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {sign(KEYS, cap, selector)}"}


async def test_http_tokens_are_checked_per_route():
    async with TestClient(TestServer(_app())) as client:
        resp = await client.get("/acme/orders")
        assert resp.status == 401
        assert resp.headers["WWW-Authenticate"] == "Bearer"
        assert "missing authorization" in await resp.text()

        resp = await client.get("/acme/orders", headers=_bearer(Capability.APPEND))
        assert resp.status == 403
        assert "missing required capability READ" in await resp.text()

        resp = await client.get("/acme/orders", headers=_bearer(Capability.READ, "prefix=other/"))
        assert resp.status == 403
        assert "does not cover journal acme/orders" in await resp.text()

        resp = await client.get("/acme/orders", headers=_bearer(Capability.READ, "prefix=acme/"))
        assert (resp.status, await resp.text()) == (200, "read acme/orders")

        resp = await client.put("/acme/orders", data=b"x", headers=_bearer(Capability.APPEND))
        assert resp.status == 200

        assert (await client.get("/metrics")).status == 200  # a public route


async def test_http_refuses_a_rebinding_host_header():
    async with TestClient(TestServer(_app())) as client:
        port = client.port
        evil = {"Host": f"attacker.example:{port}", **_bearer(Capability.READ)}
        resp = await client.get("/acme/orders", headers=evil)
        assert resp.status == 403
        assert "not a name of this server" in await resp.text()
        assert (await client.get("/metrics", headers={"Host": "attacker.example"})).status == 403
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST."):
            resp = await client.get("/metrics", headers={"Host": host})
            assert resp.status == 200, host
    async with TestClient(TestServer(_app(allowed_hosts=["broker.internal:8080"]))) as client:
        assert (
            await client.get("/metrics", headers={"Host": "broker.internal:8080"})
        ).status == 200
        assert (await client.get("/metrics", headers={"Host": "broker.internal:9"})).status == 403
    async with TestClient(TestServer(_app(allowed_hosts=None))) as client:
        assert (await client.get("/metrics", headers={"Host": "anything.example"})).status == 200


async def test_http_refuses_cross_origin_writes_and_allows_same_origin():
    async with TestClient(TestServer(_app())) as client:
        token = _bearer(Capability.APPEND)
        same = f"http://127.0.0.1:{client.port}"

        resp = await client.post(
            "/a/b", data=b"x", headers={"Origin": "https://evil.example", **token}
        )
        assert resp.status == 403
        assert "cross-origin POST refused (Origin: https://evil.example)" in await resp.text()

        headers = {"Sec-Fetch-Site": "cross-site", **token}
        resp = await client.put("/a/b", data=b"x", headers=headers)
        assert resp.status == 403 and "Sec-Fetch-Site: cross-site" in await resp.text()

        headers = {"Origin": "null", **token}
        assert (await client.post("/a/b", data=b"x", headers=headers)).status == 403

        headers = {"Origin": same, "Sec-Fetch-Site": "same-origin", **token}
        assert (await client.post("/a/b", data=b"x", headers=headers)).status == 200
        assert (await client.post("/a/b", data=b"x", headers=token)).status == 200  # no browser

        read = {"Origin": "https://evil.example", **_bearer(Capability.READ)}
        assert (await client.get("/a/b", headers=read)).status == 200  # reads are not writes

    trusted = _app(trusted_origins=["https://console.example/"])
    async with TestClient(TestServer(trusted)) as client:
        headers = {"Origin": "https://console.example", "Sec-Fetch-Site": "cross-site"}
        headers.update(_bearer(Capability.APPEND))
        assert (await client.post("/a/b", data=b"x", headers=headers)).status == 200


def test_selector_json_of_a_parsed_selector_round_trips():
    selector = parse_selector("aa in (x, y), bb:prefix=q/, !cc")
    assert claims_from_json({"cap": 0, "exp": 1, "sel": selector_json(selector)}).selector == (
        selector
    )
