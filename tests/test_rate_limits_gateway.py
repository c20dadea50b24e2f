"""Rate limits through a served gateway, over real sockets with real clients.

The gateway runs on trio's ``MockClock`` without autojump: the sockets are real, and time
moves only when a test moves it, so the counts are exact whatever the machine's load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from ._proxy_backend import Backend, running_backend
from ._proxy_gateway import gateway, gateway_file

LIMITS = """
[rate_limits.per-client]
rate = 1
burst = 5
"""
PIPE_ROUTE = """
[pipes.call]
service = "echo"
path = "/echo"
method = "GET"
into = "echo"

[routes.go]
method = "GET"
path = "/go/{sku}"
chain = ["call"]
result = "echo"
rate_limits = ["per-client"]
"""
PROXY_ROUTE = """
[routes.api]
proxy = "echo"
prefix = "/api"
strip_prefix = true
rate_limits = ["per-client"]
"""


async def burst(
    client: httpx.AsyncClient, path: str, n: int, **kwargs: Any
) -> list[httpx.Response]:
    """``n`` requests at once, each on a connection of its own."""
    answers: list[httpx.Response] = []

    async def one() -> None:
        async with httpx.AsyncClient(base_url=str(client.base_url)) as fresh:
            answers.append(await fresh.get(path, **kwargs))

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)
    return answers


def statuses(answers: list[httpx.Response]) -> dict[int, int]:
    found: dict[int, int] = {}
    for answer in answers:
        found[answer.status_code] = found.get(answer.status_code, 0) + 1
    return found


def backend_calls(backend: Backend) -> int:
    return len(backend.requests)


@pytest.mark.parametrize("route", ["pipe", "proxy"])
async def test_concurrent_clients_exact_counts(
    tmp_path: Path, mock_clock: trio.testing.MockClock, route: str
) -> None:
    """20 clients at once: the burst of 5 passes, 15 are refused 429 before any job or
    slot (the backend sees 5); one second later exactly one more passes, five seconds
    later five."""
    async with running_backend() as backend:
        text = gateway_file(backend, LIMITS + (PIPE_ROUTE if route == "pipe" else PROXY_ROUTE))
        path = "/go/lamp" if route == "pipe" else "/api/echo/lamp"
        async with (
            gateway(tmp_path, text) as (gw, address),
            httpx.AsyncClient(base_url=address.url) as client,
        ):
            answers = await burst(client, path, 20)
            assert statuses(answers) == {200: 5, 429: 15}
            assert backend_calls(backend) == 5
            refused = next(a for a in answers if a.status_code == 429)
            assert refused.headers["content-type"] == "application/problem+json"
            assert refused.headers["RateLimit-Policy"] == '"per-client";q=5;w=5'
            assert refused.headers["RateLimit"] == '"per-client";r=0;t=5'
            assert refused.headers["Retry-After"] == "1"
            problem = refused.json()
            assert problem["status"] == 429
            assert problem["type"] == "urn:pipework:problem:rate-limited"
            assert problem["limit"] == "per-client"
            assert "'per-client'" in problem["detail"]
            # Nothing else was started for the refused: no job, no pool slot.
            assert gw.engine is not None
            admitted = gw.engine.pool.statistics().admitted  # type: ignore[attr-defined]  # the weighted pool's
            assert admitted == 5

            mock_clock.jump(1.0)
            assert statuses(await burst(client, path, 4)) == {200: 1, 429: 3}
            mock_clock.jump(5.0)
            assert statuses(await burst(client, path, 8)) == {200: 5, 429: 3}
            assert backend_calls(backend) == 11

            metrics = (await client.get("/metrics")).text
            assert (
                'pipework_rate_limit_decisions_total{decision="allowed",limit="per-client"} '
                "11.0" in metrics
            )
            assert (
                'pipework_rate_limit_decisions_total{decision="limited",limit="per-client"} '
                "21.0" in metrics
            )


async def test_a_service_limit_is_one_budget_for_every_route_reaching_it(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """The limit named by the service counts a chain route calling it and a proxy route to
    it together; a header keys it, one budget per key."""
    limits = """
[rate_limits.per-key]
rate = 1
period = 60
burst = 3
key = "header:X-Api-Key"
"""
    pipe_route = PIPE_ROUTE.replace('rate_limits = ["per-client"]\n', "")
    proxy_route = PROXY_ROUTE.replace('rate_limits = ["per-client"]\n', "")
    async with running_backend() as backend:
        text = gateway_file(
            backend, limits + pipe_route + proxy_route, service='limit = 4\nrate_limits = "per-key"'
        )
        async with (
            gateway(tmp_path, text) as (_, address),
            httpx.AsyncClient(base_url=address.url) as client,
        ):
            a = {"X-Api-Key": "a"}
            assert (await client.get("/go/1", headers=a)).status_code == 200
            assert (await client.get("/api/echo/2", headers=a)).status_code == 200
            assert (await client.get("/go/3", headers=a)).status_code == 200
            assert (await client.get("/api/echo/4", headers=a)).status_code == 429
            assert (await client.get("/go/5", headers=a)).status_code == 429
            b = {"X-Api-Key": "b"}
            assert statuses(await burst(client, "/go/6", 5, headers=b)) == {200: 3, 429: 2}
            refused = await client.get("/go/7", headers=b)
            assert refused.headers["RateLimit-Policy"] == '"per-key";q=3;w=180'
            assert refused.headers["Retry-After"] == "60"


async def test_a_limit_keyed_by_identity_reads_the_identity_mapping(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """A limit keyed by ``claim:tenant`` counts each tenant apart, reading the request's
    identity mapping (set here by an ASGI layer in front, as authentication would)."""
    from pipework._http._identity import set_identity

    limits = """
[rate_limits.per-tenant]
rate = 1
period = 60
burst = 2
key = "claim:tenant"
missing = "shared"
"""
    async with running_backend() as backend:
        text = gateway_file(backend, limits + PROXY_ROUTE.replace("per-client", "per-tenant"))
        async with gateway(tmp_path, text) as (gw, address):
            assert gw.container is not None
            layer = gw.container.app.asgi_app

            async def authenticate(scope: Any, receive: Any, send: Any) -> None:
                for name, value in scope.get("headers", ()):
                    if name == b"x-tenant":
                        set_identity(scope, "user", {"tenant": value.decode()})
                await layer(scope, receive, send)

            gw.container.app.asgi_app = authenticate  # type: ignore[method-assign]  # a test shim
            async with httpx.AsyncClient(base_url=address.url) as client:
                for tenant, expected in (("t1", {200: 2, 429: 1}), ("t2", {200: 2, 429: 1})):
                    answers = await burst(client, "/api/echo/x", 3, headers={"X-Tenant": tenant})
                    assert statuses(answers) == expected
                # Without the claim: one bucket shared by all such requests.
                assert statuses(await burst(client, "/api/echo/x", 3)) == {200: 2, 429: 1}


async def test_a_reload_keeps_the_state_of_an_unchanged_limit_and_changes_its_rate(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with running_backend() as backend:
        text = gateway_file(backend, LIMITS + PROXY_ROUTE)
        async with (
            gateway(tmp_path, text) as (gw, address),
            httpx.AsyncClient(base_url=address.url) as client,
        ):
            assert statuses(await burst(client, "/api/echo/x", 7)) == {200: 5, 429: 2}
            # The same limit, a larger burst: what was used stays used.
            (tmp_path / "gateway.toml").write_text(text.replace("burst = 5", "burst = 8"))
            await gw.reload()
            assert statuses(await burst(client, "/api/echo/x", 5)) == {200: 3, 429: 2}
            refused = await client.get("/api/echo/x")
            assert refused.headers["RateLimit-Policy"] == '"per-client";q=8;w=8'
            # Keyed otherwise: the limit starts afresh.
            keyed = text.replace("burst = 5", 'burst = 2\nkey = "header:X-Api-Key"')
            (tmp_path / "gateway.toml").write_text(keyed)
            await gw.reload()
            answers = await burst(client, "/api/echo/x", 3, headers={"X-Api-Key": "k"})
            assert statuses(answers) == {200: 2, 429: 1}
            # No limit left: nothing refused.
            (tmp_path / "gateway.toml").write_text(
                gateway_file(backend, PROXY_ROUTE.replace('rate_limits = ["per-client"]\n', ""))
            )
            await gw.reload()
            assert statuses(await burst(client, "/api/echo/x", 6)) == {200: 6}


async def test_the_admin_api_sets_a_limit_live(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    auth = {"Authorization": "Bearer proxy-admin"}
    async with running_backend() as backend:
        text = gateway_file(backend, LIMITS + PROXY_ROUTE)
        async with (
            gateway(tmp_path, text) as (gw, address),
            httpx.AsyncClient(base_url=address.url) as client,
        ):
            listed = (await client.get("/admin/rate_limits", headers=auth)).json()
            assert listed["limits"]["per-client"]["burst"] == 5
            assert listed["limits"]["per-client"]["routes"] == ["api"]
            assert statuses(await burst(client, "/api/echo/x", 5)) == {200: 5}
            changed = await client.put(
                "/admin/rate_limits/per-client", headers=auth, json={"burst": 7}
            )
            assert changed.status_code == 200, changed.text
            assert changed.json()["limit"]["burst"] == 7
            assert statuses(await burst(client, "/api/echo/x", 3)) == {200: 2, 429: 1}
            bad = await client.put("/admin/rate_limits/per-client", headers=auth, json={"burst": 0})
            assert bad.status_code == 400
            assert "burst" in bad.json()["detail"]
            unknown = await client.put(
                "/admin/rate_limits/per-clint", headers=auth, json={"burst": 3}
            )
            assert unknown.status_code == 404
            assert "per-client" in unknown.json()["detail"]
            # A reload that leaves the limit alone keeps the live value...
            await gw.reload()
            listed = (await client.get("/admin/rate_limits", headers=auth)).json()
            assert listed["limits"]["per-client"]["burst"] == 7
            assert listed["overrides"] == {"per-client": {"burst": 7}}
            # ...and DELETE puts the file's back.
            cleared = await client.delete("/admin/rate_limits/per-client", headers=auth)
            assert cleared.json()["limit"]["burst"] == 5
            assert json.loads(cleared.text)["cleared"] == {"burst": 7}


async def test_a_flood_of_client_addresses_keeps_at_most_max_keys(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """Behind a trusted proxy each X-Forwarded-For address is a client of its own: 50 of
    them pass once each, and the limit keeps the 10 most recent keys, no more."""
    limits = """
[rate_limits.per-client]
rate = 1
period = 3600
burst = 1
max_keys = 10
"""
    auth = {"Authorization": "Bearer proxy-admin"}
    async with running_backend() as backend:
        text = gateway_file(backend, limits + PROXY_ROUTE, server='trusted_proxies = ["127.0.0.1"]')
        async with (
            gateway(tmp_path, text) as (_, address),
            httpx.AsyncClient(base_url=address.url) as client,
        ):
            for i in range(50):
                forwarded = {"X-Forwarded-For": f"10.0.0.{i}"}
                assert (await client.get("/api/echo/x", headers=forwarded)).status_code == 200
            shown = (await client.get("/admin/rate_limits", headers=auth)).json()
            assert shown["limits"]["per-client"]["keys_held"] == 10
            assert shown["limits"]["per-client"]["keys_evicted"] == 40
            # A kept key is still drained; an evicted one starts with a full bucket again.
            recent = {"X-Forwarded-For": "10.0.0.49"}
            assert (await client.get("/api/echo/x", headers=recent)).status_code == 429
            evicted = {"X-Forwarded-For": "10.0.0.0"}
            assert (await client.get("/api/echo/x", headers=evicted)).status_code == 200
            # The proxy's own address is trusted, not the forwarded chain before it: a
            # client cannot pick its key by sending a trusted address first.
            chained = {"X-Forwarded-For": "127.0.0.1, 10.0.0.49"}
            assert (await client.get("/api/echo/x", headers=chained)).status_code == 429


async def test_an_untrusted_peer_cannot_choose_its_key(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    limits = LIMITS.replace("burst = 5", "burst = 2")
    async with running_backend() as backend:
        text = gateway_file(backend, limits + PROXY_ROUTE)
        async with (
            gateway(tmp_path, text) as (_, address),
            httpx.AsyncClient(base_url=address.url) as client,
        ):
            codes = [
                (
                    await client.get("/api/echo/x", headers={"X-Forwarded-For": f"10.1.0.{i}"})
                ).status_code
                for i in range(3)
            ]
            assert codes == [200, 200, 429]


@pytest.mark.parametrize("fail_open", [True, False])
async def test_a_store_that_cannot_be_reached_is_decided_by_fail_open(
    tmp_path: Path, mock_clock: trio.testing.MockClock, fail_open: bool
) -> None:
    store = f"""
[rate_limits]
store = "redis"
url = "redis://127.0.0.1:1/0"
fail_open = {"true" if fail_open else "false"}
"""
    async with running_backend() as backend:
        text = gateway_file(backend, store + LIMITS + PROXY_ROUTE)
        async with (
            gateway(tmp_path, text) as (_, address),
            httpx.AsyncClient(base_url=address.url) as client,
        ):
            answer = await client.get("/api/echo/x")
            if fail_open:
                assert answer.status_code == 200
            else:
                assert answer.status_code == 503
                assert answer.json()["type"] == "urn:pipework:problem:rate-limit-store-unavailable"
                assert answer.headers["Retry-After"] == "1"
            assert len(backend.requests) == (1 if fail_open else 0)
            metrics = (await client.get("/metrics")).text
            assert (
                'pipework_rate_limit_decisions_total{decision="error",limit="per-client"} 1.0'
                in (metrics)
            )


async def test_limits_keyed_by_a_jwt_subject_and_claim(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """Route authentication puts the identity where the limits read it: a limit keyed by
    ``identity`` counts each token subject apart, one keyed by ``claim:tenant`` each
    tenant; authentication refuses first (a 401 takes nothing from the limit)."""
    from ._edge_keys import AUDIENCE, ISSUER, Signer, claims, jwks

    signer = Signer.make("ES256", "es-1")
    (tmp_path / "jwks.json").write_text(json.dumps(jwks(signer)))
    edge = f"""
[auth.partners]
type = "jwt"
jwks_file = "jwks.json"
algorithms = ["ES256"]
issuer = "{ISSUER}"
audience = "{AUDIENCE}"
claims = ["tenant"]

[rate_limits.per-user]
rate = 1
period = 3600
burst = 2
key = "identity"

[rate_limits.per-tenant]
rate = 1
period = 3600
burst = 3
key = "claim:tenant"

[routes.api]
proxy = "echo"
prefix = "/api"
strip_prefix = true
auth = "partners"
rate_limits = ["per-user", "per-tenant"]
"""

    def token(sub: str, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {signer.sign(claims(sub=sub, tenant=tenant))}"}

    async with (
        running_backend() as backend,
        gateway(tmp_path, gateway_file(backend, edge)) as (_, address),
        httpx.AsyncClient(base_url=address.url) as client,
    ):
        assert (await client.get("/api/echo/x")).status_code == 401
        alice, bob, carol = token("alice", "acme"), token("bob", "acme"), token("carol", "zeta")
        codes = [
            (await client.get("/api/echo/x", headers=who)).status_code
            for who in (alice, alice, alice, bob, bob, carol)
        ]
        # alice: her 2; bob: one, then acme's 3 are spent; carol: zeta's own.
        assert codes == [200, 200, 429, 200, 429, 200]
        refused = await client.get("/api/echo/x", headers=bob)
        assert refused.json()["limit"] == "per-tenant"
        assert len(backend.requests) == 4
