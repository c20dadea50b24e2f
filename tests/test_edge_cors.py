"""CORS per route and for the container's job, board and jobs-page endpoints, through real
HTTP: preflights answered without a job (and without credentials, on a route that needs
them), refusals that say what is not allowed, the real answers' headers, ``Vary: Origin``
on every answer of a route with a policy, and proxy routes answered by the gateway, not
the service."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

import pipework as pw

from ._proxy_backend import Backend, running_backend
from ._proxy_gateway import gateway

APP = "https://app.example"
KEY = "cors-test-key"

#: Every state a pipe of these routes saw (a preflight must add none).
SEEN: list[dict[str, Any]] = []


async def note(ctx: pw.Context) -> None:
    SEEN.append(dict(ctx.state))
    ctx.state["ok"] = True


@pytest.fixture(autouse=True)
def _fresh() -> None:
    SEEN.clear()


def gateway_text(backend: Backend) -> str:
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    return f"""
[server]
cors = "web"

[pool]
max_workers = 4

[services.echo]
base_url = "{backend.url}"
timeout = 5

[cors.web]
origins = ["{APP}", "http://localhost:3000"]
methods = ["GET", "POST", "DELETE"]
headers = ["X-Trace", "Authorization", "X-API-Key", "Content-Type"]
expose = ["X-Request-ID"]
credentials = true
max_age = 600

[cors.anyone]
origins = ["*"]

[auth.keys]
type = "api_key"
[auth.keys.keys.k]
sha256 = "{digest}"

[pipes.note]
python = "tests.test_edge_cors:note"

[routes.orders]
path = "/orders"
chain = ["note"]
result = "ok"
cors = "web"
auth = "keys"

[routes.public]
method = "GET"
path = "/public"
chain = ["note"]
result = "ok"
cors = "anyone"

[routes.plain]
path = "/plain"
chain = ["note"]
result = "ok"

[routes.job]
path = "/later"
chain = ["note"]
mode = "async"

[routes.api]
proxy = "echo"
prefix = "/api"
strip_prefix = true
cors = "web"
"""


@asynccontextmanager
async def served(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Backend]]:
    async with (
        running_backend() as backend,
        gateway(tmp_path, gateway_text(backend)) as (_, address),
        httpx.AsyncClient(base_url=address.url, timeout=10) as client,
    ):
        yield client, backend


def preflight(method: str, origin: str = APP, headers: str | None = None) -> dict[str, str]:
    found = {"Origin": origin, "Access-Control-Request-Method": method}
    if headers is not None:
        found["Access-Control-Request-Headers"] = headers
    return found


def vary(answer: httpx.Response) -> set[str]:
    return {v.strip().lower() for v in ",".join(answer.headers.get_list("vary")).split(",")}


async def test_a_preflight_is_answered_without_a_job_or_credentials(tmp_path: Path) -> None:
    async with served(tmp_path) as (client, _):
        answer = await client.options(
            "/orders", headers=preflight("POST", headers="x-trace, content-type, x-api-key")
        )
    assert answer.status_code == 204, answer.text
    h = answer.headers
    assert h["access-control-allow-origin"] == APP
    assert h["access-control-allow-credentials"] == "true"
    assert h["access-control-allow-methods"] == "GET, POST, DELETE"
    assert h["access-control-allow-headers"] == "x-trace, content-type, x-api-key"
    assert h["access-control-max-age"] == "600"
    assert "origin" in vary(answer)
    assert SEEN == []


@pytest.mark.parametrize(
    ("path", "asked", "says"),
    [
        ("/orders", preflight("POST", origin="https://evil.example"), "origin"),
        ("/orders", preflight("POST", headers="x-trace, x-secret"), "x-secret"),
        ("/public", preflight("GET", headers="x-trace"), "x-trace"),
        ("/plain", preflight("POST"), "no CORS policy"),
    ],
)
async def test_a_refused_preflight_is_403_saying_what(
    tmp_path: Path, path: str, asked: dict[str, str], says: str
) -> None:
    async with served(tmp_path) as (client, _):
        answer = await client.options(path, headers=asked)
    assert answer.status_code == 403
    assert answer.headers["content-type"] == "application/problem+json"
    assert "access-control-allow-origin" not in answer.headers
    assert says in answer.json()["detail"]
    assert "origin" in vary(answer)
    assert SEEN == []


async def test_a_plain_options_still_lists_the_methods(tmp_path: Path) -> None:
    async with served(tmp_path) as (client, _):
        answer = await client.options("/orders")
    assert answer.status_code == 204
    assert answer.headers["allow"] == "POST"


async def test_the_real_answer_carries_the_policys_headers(tmp_path: Path) -> None:
    async with served(tmp_path) as (client, _):
        allowed = await client.post("/orders", json={}, headers={"Origin": APP, "X-API-Key": KEY})
        other = await client.post(
            "/orders", json={}, headers={"Origin": "https://evil.example", "X-API-Key": KEY}
        )
        refused = await client.post("/orders", json={}, headers={"Origin": APP})
        anyone = await client.get("/public", headers={"Origin": "https://any.example"})
        none = await client.get("/public")
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == APP
    assert allowed.headers["access-control-allow-credentials"] == "true"
    assert allowed.headers["access-control-expose-headers"] == "X-Request-ID"
    assert "origin" in vary(allowed)
    # Served (CORS is the browser's check), but without a header that lets a page read it.
    assert other.status_code == 200
    assert "access-control-allow-origin" not in other.headers
    assert "origin" in vary(other)
    # A refusal is readable by the page that was refused, so it can say why.
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == APP
    assert anyone.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-credentials" not in anyone.headers
    assert "origin" in vary(none)
    assert "access-control-allow-origin" not in none.headers


async def test_the_job_endpoints_follow_the_servers_policy(tmp_path: Path) -> None:
    async with served(tmp_path) as (client, _):
        accepted = (await client.post("/later", json={})).json()
        token = {"Authorization": f"Bearer {accepted['token']}"}
        asked = await client.options(
            f"/jobs/{accepted['id']}", headers=preflight("GET", headers="authorization")
        )
        status = await client.get(f"/jobs/{accepted['id']}", headers={"Origin": APP, **token})
        page = await client.get("/ui/jobs", headers={"Origin": APP})
        metrics = await client.options("/metrics", headers=preflight("GET"))
    assert asked.status_code == 204
    assert asked.headers["access-control-allow-origin"] == APP
    assert asked.headers["access-control-allow-headers"] == "authorization"
    assert status.status_code == 200
    assert status.headers["access-control-allow-origin"] == APP
    assert "origin" in vary(status)
    assert page.headers["access-control-allow-origin"] == APP
    assert metrics.status_code == 403  # not a job, board or jobs-page endpoint


async def test_a_proxy_routes_preflight_is_the_gateways(tmp_path: Path) -> None:
    async with served(tmp_path) as (client, backend):
        asked = await client.options("/api/echo", headers=preflight("POST", headers="x-trace"))
        refused = await client.options(
            "/api/echo", headers=preflight("POST", origin="https://evil.example")
        )
        assert backend.requests == []
        answer = await client.post("/api/echo", content=b"{}", headers={"Origin": APP})
    assert asked.status_code == 204
    assert asked.headers["access-control-allow-origin"] == APP
    assert asked.headers["access-control-allow-headers"] == "x-trace"
    assert refused.status_code == 403
    assert "origin" in refused.json()["detail"]
    assert answer.status_code == 200
    assert answer.headers["access-control-allow-origin"] == APP
    assert "origin" in vary(answer)
    assert len(backend.requests) == 1
