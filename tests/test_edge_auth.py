"""Authentication per route, through real HTTP on real sockets: JWTs signed with RS256,
ES256 and EdDSA keys made here, the usual forgeries refused with 401 and
``WWW-Authenticate`` before any job exists, scopes (403), API keys (hashed in the file, or
in an environment variable), proxy routes refused before the service is called, and a
JWKS URL whose rotated key is picked up while tokens with made-up kids cannot make the
gateway fetch it more than once per ``jwks_min_refetch``."""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing

import pipework as pw
from pipework import ConfigError, Gateway, loads_config
from pipework._cli_config import check
from pipework._http import _auth
from pipework._http._auth import JwksFile, JwksUrl, JwtBearer
from pipework.container import BoundAddress

from ._edge_keys import (
    AUDIENCE,
    ISSUER,
    Signer,
    claims,
    forged_hs256,
    jwks,
    serving_jwks,
    unsigned,
)
from ._proxy_backend import Backend, running_backend
from ._proxy_gateway import gateway

#: Every state a pipe of these routes saw (a refused request must add none).
SEEN: list[dict[str, Any]] = []

CI_KEY = "ci-key-0123456789"
DEPLOY_KEY = "deploy-key-from-the-environment"


async def whoami(ctx: pw.Context) -> None:
    """The pipe behind the routes: who the job says the caller is."""
    SEEN.append(dict(ctx.state))
    ctx.state["who"] = ctx.state.get("identity")


async def tenant_header(ctx: pw.Context) -> None:
    """A proxy route's chain: the caller's tenant, from its identity, to the service."""
    tenant = ctx.state["identity"]["claims"]["tenant"]
    ctx.state["request"]["headers"].append(["x-tenant", tenant])


@pytest.fixture(autouse=True)
def _fresh() -> None:
    SEEN.clear()


@pytest.fixture(scope="module")
def signers() -> dict[str, Signer]:
    return {alg: Signer.make(alg, f"{alg.lower()}-1") for alg in ("RS256", "ES256", "EdDSA")}


def gateway_text(backend: Backend, auth_source: str, *, extra: str = "", service: str = "") -> str:
    ci_digest = hashlib.sha256(CI_KEY.encode()).hexdigest()
    return f"""
[pool]
max_workers = 4

[services.echo]
base_url = "{backend.url}"
timeout = 5
{service}

[auth.partners]
type = "jwt"
{auth_source}
algorithms = ["RS256", "ES256", "EdDSA"]
issuer = "{ISSUER}"
audience = "{AUDIENCE}"
leeway = 5
claims = ["tenant"]

[auth.ops]
type = "api_key"

[auth.ops.keys.ci]
sha256 = "{ci_digest}"
scopes = ["orders:write"]

[auth.ops.keys.deploy]
env = "EDGE_TEST_DEPLOY_KEY"

[pipes.whoami]
python = "tests.test_edge_auth:whoami"

[routes.orders]
path = "/orders"
chain = ["whoami"]
result = "who"
auth = ["partners", "ops"]

[routes.write]
path = "/write"
chain = ["whoami"]
result = "who"
auth = ["partners", "ops"]
scopes = ["orders:write"]

[routes.open]
path = "/open"
chain = ["whoami"]
result = "who"

[routes.api]
proxy = "echo"
prefix = "/api"
strip_prefix = true
auth = "partners"
{extra}
"""


@asynccontextmanager
async def edge(
    tmp_path: Path, signers: dict[str, Signer], monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[httpx.AsyncClient, Backend]]:
    monkeypatch.setenv("EDGE_TEST_DEPLOY_KEY", DEPLOY_KEY)
    (tmp_path / "jwks.json").write_text(json.dumps(jwks(*signers.values())))
    async with running_backend() as backend:
        text = gateway_text(backend, 'jwks_file = "jwks.json"')
        async with (
            gateway(tmp_path, text) as (_, address),
            httpx.AsyncClient(base_url=address.url, timeout=10) as client,
        ):
            yield client, backend


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def assert_unauthorized(answer: httpx.Response, error: str | None, says: str) -> None:
    assert answer.status_code == 401, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    challenge = answer.headers["www-authenticate"]
    assert challenge.startswith('Bearer realm="partners"')
    if error is None:
        assert "error=" not in challenge.split("ApiKey")[0]
    else:
        assert f'error="{error}"' in challenge
    problem = answer.json()
    assert problem["status"] == 401
    assert problem["type"] == "urn:pipework:problem:unauthorized"
    assert says in problem["detail"], problem["detail"]


async def test_tokens_signed_with_rs256_es256_and_eddsa_are_accepted_and_the_job_knows_who(
    tmp_path: Path, signers: dict[str, Signer], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with edge(tmp_path, signers, monkeypatch) as (client, _):
        for alg, signer in signers.items():
            answer = await client.post("/orders", json={}, headers=bearer(signer.sign(claims())))
            assert answer.status_code == 200, (alg, answer.text)
            assert answer.json() == {
                "subject": "alice",
                "scheme": "jwt",
                "auth": "partners",
                "scopes": ["orders:read"],
                "claims": {"tenant": "acme"},
            }
    assert len(SEEN) == 3


@pytest.mark.parametrize(
    ("forge", "says"),
    [
        pytest.param(lambda s: unsigned(claims(), s.kid), "signed with 'none'", id="alg-none"),
        pytest.param(lambda s: forged_hs256(claims(), s), "signed with 'HS256'", id="hs256-pubkey"),
        pytest.param(
            lambda s: s.sign(claims(exp=claims()["iat"] - 3600)), "has expired", id="expired"
        ),
        pytest.param(lambda s: s.sign(claims(aud="billing")), "audience", id="wrong-audience"),
        pytest.param(lambda s: s.sign(claims(iss="https://evil.example")), "issuer", id="issuer"),
        pytest.param(
            lambda s: s.sign(claims(nbf=claims()["iat"] + 3600)), "not valid yet", id="not-before"
        ),
        pytest.param(
            lambda s: Signer.make("ES256", "ghost").sign(claims()), "kid 'ghost'", id="unknown-kid"
        ),
        pytest.param(
            # A key of the JWKS, claimed under another key's kid: the signature fails.
            lambda s: Signer("ES256", "rs256-1", Signer.make("ES256", "x").private).sign(claims()),
            "does not suit its key",
            id="alg-not-the-keys",
        ),
        pytest.param(lambda s: "not-a-jwt", "not a JWT", id="garbage"),
        # JSON may escape one half of a pair: no text, so no identity (a store writes
        # owners as UTF-8, which it cannot be).
        pytest.param(
            lambda s: s.sign(claims(sub="al\udc80ice")), "not valid Unicode", id="lone-surrogate"
        ),
    ],
)
async def test_forgeries_are_401_with_www_authenticate_before_any_job(
    tmp_path: Path,
    signers: dict[str, Signer],
    monkeypatch: pytest.MonkeyPatch,
    forge: Any,
    says: str,
) -> None:
    async with edge(tmp_path, signers, monkeypatch) as (client, _):
        answer = await client.post("/orders", json={}, headers=bearer(forge(signers["RS256"])))
    assert_unauthorized(answer, "invalid_token", says)
    assert SEEN == []


async def test_a_signature_by_another_key_under_a_known_kid_is_refused(
    tmp_path: Path, signers: dict[str, Signer], monkeypatch: pytest.MonkeyPatch
) -> None:
    impostor = Signer("EdDSA", "eddsa-1", Signer.make("EdDSA", "x").private)
    async with edge(tmp_path, signers, monkeypatch) as (client, _):
        answer = await client.post("/orders", json={}, headers=bearer(impostor.sign(claims())))
    assert_unauthorized(answer, "invalid_token", "signature does not verify")
    assert SEEN == []


async def test_no_credential_is_401_naming_every_way_in_and_an_open_route_stays_open(
    tmp_path: Path, signers: dict[str, Signer], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with edge(tmp_path, signers, monkeypatch) as (client, _):
        answer = await client.post("/orders", json={})
        opened = await client.post("/open", json={})
    assert_unauthorized(answer, None, "a bearer token")
    assert 'ApiKey realm="ops", header="x-api-key"' in answer.headers["www-authenticate"]
    assert opened.status_code == 200
    assert opened.json() is None  # no identity on a route without auth
    assert len(SEEN) == 1


async def test_a_body_cannot_claim_an_identity(
    tmp_path: Path, signers: dict[str, Signer], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with edge(tmp_path, signers, monkeypatch) as (client, _):
        token = signers["ES256"].sign(claims())
        answer = await client.post(
            "/orders", json={"identity": {"subject": "root"}}, headers=bearer(token)
        )
    assert answer.status_code == 400
    assert answer.json()["key"] == "identity"
    assert SEEN == []


async def test_a_missing_scope_is_403_insufficient_scope(
    tmp_path: Path, signers: dict[str, Signer], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with edge(tmp_path, signers, monkeypatch) as (client, _):
        reader = bearer(signers["RS256"].sign(claims()))
        writer = bearer(signers["RS256"].sign(claims(scope="orders:read orders:write")))
        refused = await client.post("/write", json={}, headers=reader)
        allowed = await client.post("/write", json={}, headers=writer)
        deploy = await client.post("/write", json={}, headers={"X-API-Key": DEPLOY_KEY})
        ci = await client.post("/write", json={}, headers={"X-API-Key": CI_KEY})
    assert refused.status_code == 403
    assert refused.json()["type"] == "urn:pipework:problem:insufficient-scope"
    challenge = refused.headers["www-authenticate"]
    assert 'error="insufficient_scope"' in challenge
    assert 'scope="orders:write"' in challenge
    assert allowed.status_code == 200
    assert deploy.status_code == 403  # a key without the scope
    assert ci.status_code == 200
    assert ci.json()["subject"] == "ci"
    assert ci.json()["scheme"] == "api_key"
    assert len(SEEN) == 2


async def test_api_keys_from_the_file_and_the_environment(
    tmp_path: Path, signers: dict[str, Signer], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with edge(tmp_path, signers, monkeypatch) as (client, _):
        ci = await client.post("/orders", json={}, headers={"X-API-Key": CI_KEY})
        deploy = await client.post("/orders", json={}, headers={"X-API-Key": DEPLOY_KEY})
        wrong = await client.post("/orders", json={}, headers={"X-API-Key": CI_KEY + "x"})
        digest = hashlib.sha256(CI_KEY.encode()).hexdigest()
        the_digest = await client.post("/orders", json={}, headers={"X-API-Key": digest})
    assert ci.json()["subject"] == "ci"
    assert deploy.json()["subject"] == "deploy"
    for refused in (wrong, the_digest):  # the file's digest is no key
        assert refused.status_code == 401
        assert 'error="invalid_token"' in refused.headers["www-authenticate"]
        assert refused.headers["www-authenticate"].startswith('ApiKey realm="ops"')
    assert len(SEEN) == 2


async def test_a_proxy_route_refuses_before_the_service_is_called(
    tmp_path: Path, signers: dict[str, Signer], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with edge(tmp_path, signers, monkeypatch) as (client, backend):
        refused = await client.get("/api/echo", headers=bearer(unsigned(claims(), "rs256-1")))
        missing = await client.get("/api/echo")
        assert backend.requests == []
        token = signers["EdDSA"].sign(claims())
        allowed = await client.get("/api/echo", headers=bearer(token))
    assert_unauthorized(refused, "invalid_token", "signed with 'none'")
    assert_unauthorized(missing, None, "a bearer token")
    assert allowed.status_code == 200
    assert len(backend.requests) == 1
    # The token goes on to the service as it came.
    assert dict(allowed.json()["headers"])["authorization"] == f"Bearer {token}"


async def test_a_refused_proxied_request_waits_for_no_slot(
    tmp_path: Path, signers: dict[str, Signer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EDGE_TEST_DEPLOY_KEY", DEPLOY_KEY)
    (tmp_path / "jwks.json").write_text(json.dumps(jwks(*signers.values())))
    token = bearer(signers["RS256"].sign(claims()))
    async with running_backend() as backend:
        # One slot, and a wait for it longer than the test may take.
        text = gateway_text(
            backend, 'jwks_file = "jwks.json"', service="limit = 1\nwait_timeout = 3600"
        )
        async with (
            gateway(tmp_path, text) as (_, address),
            httpx.AsyncClient(base_url=address.url, timeout=30) as client,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(functools.partial(client.get, "/api/hang", headers=token))
            await backend.hung.wait()  # it holds the service's one slot
            refused = await client.get("/api/echo")  # answered, not parked behind it
            forged = await client.get("/api/echo", headers=bearer("not-a-jwt"))
            nursery.cancel_scope.cancel()
    assert_unauthorized(refused, None, "a bearer token")
    assert_unauthorized(forged, "invalid_token", "not a JWT")


async def test_a_proxy_routes_chain_sees_the_identity(
    tmp_path: Path, signers: dict[str, Signer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EDGE_TEST_DEPLOY_KEY", DEPLOY_KEY)
    (tmp_path / "jwks.json").write_text(json.dumps(jwks(*signers.values())))
    route = """
[pipes.tenant_header]
python = "tests.test_edge_auth:tenant_header"

[routes.tenant-api]
proxy = "echo"
prefix = "/tapi"
strip_prefix = true
auth = "partners"
chain = ["tenant_header"]
"""
    async with running_backend() as backend:
        text = gateway_text(backend, 'jwks_file = "jwks.json"') + route
        async with (
            gateway(tmp_path, text) as (_, address),
            httpx.AsyncClient(base_url=address.url, timeout=10) as client,
        ):
            token = signers["ES256"].sign(claims(tenant="globex"))
            answer = await client.get("/tapi/echo", headers=bearer(token))
    assert answer.status_code == 200, answer.text
    assert dict(answer.json()["headers"])["x-tenant"] == "globex"


# -- a JWKS URL ----------------------------------------------------------------------------


@asynccontextmanager
async def jwks_gateway(
    tmp_path: Path, text: str
) -> AsyncIterator[tuple[Gateway, BoundAddress, httpx.AsyncClient]]:
    async with (
        gateway(tmp_path, text) as (gw, address),
        # A connection per request: the test's clock jumps past the server's keep-alive
        # timeout, which closes idle connections as a reused one is written to.
        httpx.AsyncClient(
            base_url=address.url, timeout=None, limits=httpx.Limits(max_keepalive_connections=0)
        ) as client,
    ):
        yield gw, address, client


async def test_a_rotated_key_is_fetched_and_unknown_kids_refetch_at_most_once_per_bound(
    tmp_path: Path,
    signers: dict[str, Signer],
    monkeypatch: pytest.MonkeyPatch,
    mock_clock: trio.testing.MockClock,
) -> None:
    # The clock stands still but for the test's jumps: the bounds are crossed only then.
    monkeypatch.setenv("EDGE_TEST_DEPLOY_KEY", DEPLOY_KEY)
    old, new = signers["RS256"], Signer.make("ES256", "es256-rotated")
    async with serving_jwks(jwks(old)) as server, running_backend() as backend:
        source = f'jwks_url = "{server.url}"\njwks_max_age = 300\njwks_min_refetch = 30'
        text = gateway_text(backend, source)
        async with jwks_gateway(tmp_path, text) as (_, _, client):
            assert server.fetches == 0  # fetched on first use, not at start
            first = await client.post("/orders", json={}, headers=bearer(old.sign(claims())))
            assert first.status_code == 200
            assert server.fetches == 1
            # The provider rotates; a token with the new kid right away: the last fetch is
            # under jwks_min_refetch old, so no fetch yet, and the token is refused.
            server.document = jwks(old, new)
            early = await client.post("/orders", json={}, headers=bearer(new.sign(claims())))
            assert_unauthorized(early, "invalid_token", "kid 'es256-rotated'")
            assert server.fetches == 1
            mock_clock.jump(30)
            rotated = await client.post("/orders", json={}, headers=bearer(new.sign(claims())))
            assert rotated.status_code == 200, rotated.text
            assert server.fetches == 2
            # Many made-up kids at once, concurrently: at most one fetch per bound.
            ghosts = [Signer("ES256", f"ghost-{i}", new.private) for i in range(20)]
            answers: list[int] = []

            async def call(signer: Signer) -> None:
                answer = await client.post(
                    "/orders", json={}, headers=bearer(signer.sign(claims()))
                )
                answers.append(answer.status_code)

            mock_clock.jump(30)
            async with trio.open_nursery() as nursery:
                for ghost in ghosts:
                    nursery.start_soon(call, ghost)
            assert answers == [401] * 20
            assert server.fetches == 3
            for ghost in ghosts[:5]:
                await call(ghost)
            assert server.fetches == 3
            # Known keys still verify meanwhile, with no fetch.
            again = await client.post("/orders", json={}, headers=bearer(old.sign(claims())))
            assert again.status_code == 200
            assert server.fetches == 3
            # Past jwks_max_age the keys are fetched again on the next use.
            mock_clock.jump(300)
            later = await client.post("/orders", json={}, headers=bearer(new.sign(claims())))
            assert later.status_code == 200
            assert server.fetches == 4


async def test_an_unreachable_jwks_is_503_not_401(
    tmp_path: Path, signers: dict[str, Signer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EDGE_TEST_DEPLOY_KEY", DEPLOY_KEY)
    # A port nothing listens on: bound, then closed.
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with running_backend() as backend:
        text = gateway_text(backend, f'jwks_url = "http://127.0.0.1:{port}/jwks.json"')
        async with jwks_gateway(tmp_path, text) as (_, _, client):
            answer = await client.post(
                "/orders", json={}, headers=bearer(signers["RS256"].sign(claims()))
            )
    assert answer.status_code == 503
    assert answer.json()["type"] == "urn:pipework:problem:jwks-unavailable"
    assert "retry-after" in answer.headers
    assert SEEN == []


# -- the file ------------------------------------------------------------------------------


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        loads_config(text)
    return [f"{p.path}: {p.message}" for p in info.value.problems if p.severity == "error"]


BASE = """
[pipes.whoami]
python = "tests.test_edge_auth:whoami"
[routes.orders]
path = "/orders"
chain = ["whoami"]
"""


@pytest.mark.parametrize(
    ("text", "says"),
    [
        pytest.param(
            '[auth.p]\ntype = "jwt"\njwks_url = "https://id.example/jwks"\nalgorithms = ["none"]',
            "auth.p.algorithms[0]: 'none': an unsigned token proves nothing",
            id="alg-none",
        ),
        pytest.param(
            '[auth.p]\ntype = "jwt"\njwks_url = "https://id.example/jwks"\nalgorithms = ["HS256"]',
            "auth.p.algorithms[0]: 'HS256': an HMAC algorithm needs a shared secret",
            id="hs256",
        ),
        pytest.param(
            '[auth.p]\ntype = "jwt"\nalgorithms = ["RS256"]',
            "auth.p: a jwt auth needs jwks_file",
            id="no-keys",
        ),
        pytest.param(
            '[auth.p]\ntype = "jwt"\njwks_file = "/nonexistent/jwks.json"\nalgorithms = ["RS256"]',
            "auth.p.jwks_file: cannot read /nonexistent/jwks.json",
            id="missing-file",
        ),
        pytest.param(
            '[auth.k]\ntype = "api_key"\n[auth.k.keys.a]\nsha256 = "abc"',
            "auth.k.keys.a.sha256: expected a SHA-256 digest: 64 hex digits",
            id="short-digest",
        ),
        pytest.param(
            '[auth.k]\ntype = "api_key"\n[auth.k.keys.a]\nscopes = ["x"]',
            "auth.k.keys.a: a key needs sha256",
            id="key-without-secret",
        ),
        pytest.param('[auth.k]\ntype = "apikey"', "auth.k.type: unknown value 'apikey'", id="type"),
        pytest.param(
            '[cors.web]\norigins = ["https://app.example/path"]',
            "cors.web.origins[0]: 'https://app.example/path' is not an origin",
            id="origin-with-path",
        ),
        pytest.param(
            '[cors.web]\norigins = ["*"]\ncredentials = true',
            "cors.web: credentials = true needs the origins listed",
            id="any-origin-credentials",
        ),
    ],
)
def test_the_file_is_checked(text: str, says: str) -> None:
    found = problems(BASE + text)
    assert any(says in p for p in found), found


@pytest.mark.parametrize(
    ("route", "says"),
    [
        (
            'auth = "partnrs"',
            "routes.orders.auth: unknown auth 'partnrs'; did you mean 'partners'?",
        ),
        ('cors = "wbe"', "routes.orders.cors: unknown cors 'wbe'; did you mean 'web'?"),
        ('scopes = ["x"]', 'routes.orders.scopes: scopes need auth = "NAME"'),
    ],
)
def test_a_route_names_declared_policies(route: str, says: str, tmp_path: Path) -> None:
    (tmp_path / "jwks.json").write_text(json.dumps(jwks(Signer.make("EdDSA", "k"))))
    text = (
        BASE
        + route
        + f'\n[auth.partners]\ntype = "jwt"\njwks_file = "{tmp_path / "jwks.json"}"\n'
        + 'algorithms = ["EdDSA"]\n[cors.web]\norigins = ["https://app.example"]\n'
    )
    assert any(says in p for p in problems(text))


def test_a_jwks_file_with_a_private_key_or_a_shared_secret_is_refused(tmp_path: Path) -> None:
    signer = Signer.make("EdDSA", "k")
    private: Any = json.loads(__import__("jwt").algorithms.OKPAlgorithm.to_jwk(signer.private))
    for name, keys in (("private", [private]), ("secret", [{"kty": "oct", "k": "c2VjcmV0"}])):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"keys": keys}))
        text = f'[auth.p]\ntype = "jwt"\njwks_file = "{path}"\nalgorithms = ["EdDSA"]'
        found = problems(BASE + text)
        assert any("auth.p.jwks_file" in p for p in found), found


async def test_rate_limits_key_on_the_identity_and_claims_authentication_establishes(
    tmp_path: Path, signers: dict[str, Signer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EDGE_TEST_DEPLOY_KEY", DEPLOY_KEY)
    (tmp_path / "jwks.json").write_text(json.dumps(jwks(*signers.values())))
    limits = """
[rate_limits.per-tenant]
rate = 1
period = 3600
burst = 2
key = "claim:tenant"

[routes.tenants]
path = "/tenants"
chain = ["whoami"]
result = "who"
auth = "partners"
rate_limits = ["per-tenant"]
"""
    async with running_backend() as backend:
        text = gateway_text(backend, 'jwks_file = "jwks.json"') + limits
        async with (
            gateway(tmp_path, text) as (_, address),
            httpx.AsyncClient(base_url=address.url, timeout=10) as client,
        ):
            acme = [signers["RS256"].sign(claims(sub=f"user-{i}")) for i in range(3)]
            answers = [await client.post("/tenants", json={}, headers=bearer(t)) for t in acme]
            other = await client.post(
                "/tenants", json={}, headers=bearer(signers["ES256"].sign(claims(tenant="globex")))
            )
            forged = await client.post(
                "/tenants", json={}, headers=bearer(unsigned(claims(tenant="fresh"), "rs256-1"))
            )
    # One tenant's users share its budget, whoever they are; another tenant has its own.
    assert [a.status_code for a in answers] == [200, 200, 429]
    assert other.status_code == 200
    # Authentication comes first: a forged token is a 401, never counted in a limit.
    assert forged.status_code == 401
    assert len(SEEN) == 3


# -- remembered tokens ---------------------------------------------------------------------


class Counting:
    """A JwtBearer whose full verifications are counted."""

    def __init__(self, bearer: JwtBearer) -> None:
        self.bearer = bearer
        self.full = 0
        verify = bearer._verify

        async def counted(token: str) -> Any:
            self.full += 1
            return await verify(token)

        bearer._verify = counted  # type: ignore[method-assign]  # a spy on one instance

    async def identify(self, token: str) -> Any:
        return await self.bearer.identify({"authorization": f"Bearer {token}"})


def bearer_of(source: Any, **options: Any) -> JwtBearer:
    return JwtBearer(
        "partners",
        source,
        algorithms=("RS256", "ES256", "EdDSA"),
        issuer=ISSUER,
        audience=(AUDIENCE,),
        **options,
    )


async def test_a_verified_token_is_remembered_but_its_exp_still_checked(
    tmp_path: Path, signers: dict[str, Signer], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps(jwks(*signers.values())))
    spy = Counting(bearer_of(JwksFile(str(path))))
    token = signers["EdDSA"].sign(claims())
    for _ in range(3):
        assert (await spy.identify(token)).subject == "alice"
    assert spy.full == 1
    # Past its exp (by the wall clock the check reads), a remembered token is checked in
    # full again, not taken from memory.
    later = time.time() + 3600
    monkeypatch.setattr(_auth, "_wall_clock", lambda: later)
    await spy.identify(token)
    assert spy.full == 2
    # A refusal is never remembered.
    forged = unsigned(claims(), "eddsa-1")
    for _ in range(2):
        with pytest.raises(_auth.Refusal):
            await spy.identify(forged)
    assert spy.full == 4
    # The bound holds.
    small = Counting(bearer_of(JwksFile(str(path)), cache_size=2))
    tokens = [signers["ES256"].sign(claims(sub=f"u{i}")) for i in range(3)]
    for t in (*tokens, tokens[0]):
        await small.identify(t)
    assert len(small.bearer._verified) == 2
    assert small.full == 4  # the first token was dropped to make room


async def test_a_remembered_token_whose_key_was_rotated_out_is_refused(
    signers: dict[str, Signer], autojump_clock: trio.testing.MockClock
) -> None:
    document = jwks(signers["RS256"])

    async def fetch(url: str) -> bytes:
        return json.dumps(document).encode()

    source = JwksUrl("https://id.example/jwks", max_age=300, min_refetch=30, fetch=fetch)
    spy = Counting(bearer_of(source))
    token = signers["RS256"].sign(claims())
    await spy.identify(token)
    await spy.identify(token)
    assert (spy.full, source.fetches) == (1, 1)
    document = jwks(signers["ES256"])  # the provider drops the RS256 key
    await trio.sleep(300)  # the keys are due for a refresh: the token is checked again
    with pytest.raises(_auth.Refusal, match="no key for the token's kid 'rs256-1'"):
        await spy.identify(token)
    assert (spy.full, source.fetches) == (2, 2)


# -- pipework check --------------------------------------------------------------------------


async def test_check_fetches_jwks_urls_only_when_asked(
    tmp_path: Path,
    signers: dict[str, Signer],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("EDGE_TEST_DEPLOY_KEY", DEPLOY_KEY)
    with trio.socket.socket() as sock:  # a port nothing listens on: bound, then closed
        await sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    async with serving_jwks(jwks(signers["ES256"])) as server, running_backend() as backend:
        good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
        good.write_text(gateway_text(backend, f'jwks_url = "{server.url}"'))
        bad.write_text(gateway_text(backend, f'jwks_url = "http://127.0.0.1:{closed}/jwks"'))
        assert await trio.to_thread.run_sync(check, str(bad)) == 0
        assert server.fetches == 0
        assert await trio.to_thread.run_sync(functools.partial(check, str(good), fetch=True)) == 0
        assert server.fetches == 1
        server.document = {"keys": []}
        capsys.readouterr()  # the valid file's summary
        run = functools.partial(check, str(good), format="json", fetch=True)
        assert await trio.to_thread.run_sync(run) == 1
        refused = json.loads(capsys.readouterr().out)
        run = functools.partial(check, str(bad), fetch=True)
        assert await trio.to_thread.run_sync(run) == 1
    assert refused["valid"] is False
    assert refused["errors"][0]["path"] == "auth.partners.jwks_url"
    assert "the JWKS holds no key" in refused["errors"][0]["message"]
    err = capsys.readouterr().err
    assert "error: auth.partners.jwks_url: cannot use the JWKS" in err
