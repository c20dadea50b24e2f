"""A route's ``pool_key``, through real HTTP with JWTs: each tenant's steps run under a key
of its own (``tenant:VALUE``), so one tenant's held slots do not block another's; and
``pipework check`` says where a pool key is wrong."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

import pipework as pw
from pipework import ConfigError, loads_config

from ._edge_keys import AUDIENCE, ISSUER, Signer, claims, jwks
from ._proxy_gateway import gateway

#: By request name: set when its pipe runs. By tenant: what lets its pipes end.
ENTERED: dict[str, trio.Event] = {}
RELEASE: dict[str, trio.Event] = {}


async def hold(ctx: pw.Context) -> None:
    """The route's pipe (no key of its own): holds its slot until its tenant is released."""
    ENTERED[ctx.state["name"]].set()
    claims_kept = ctx.state["identity"]["claims"]
    await RELEASE[claims_kept.get("tenant") or "none"].wait()
    ctx.state["done"] = ctx.state["name"]


AUTH = f"""
[auth.partners]
type = "jwt"
jwks_file = "jwks.json"
algorithms = ["ES256"]
issuer = "{ISSUER}"
audience = "{AUDIENCE}"
claims = ["tenant"]
"""

TEXT = f"""
[server]
admin_token = "edge-admin"

[pool]
max_workers = 8

[pool.keys."tenant:acme"]
limit = 1

[pool.keys."tenant:globex"]
limit = 1

{AUTH}

[pipes.hold]
python = "tests.test_edge_pool_keys:hold"

[routes.work]
path = "/work"
chain = ["hold"]
result = "done"
auth = "partners"
pool_key = "claim:tenant"
"""


async def until(condition: Callable[[], bool]) -> None:
    """Wait for ``condition``; the test's guard bounds it."""
    while not condition():  # noqa: ASYNC110 - the pool has no event to wait on
        await trio.sleep(0.01)


@pytest.fixture(autouse=True)
def _fresh() -> None:
    ENTERED.clear()
    RELEASE.clear()


async def test_one_tenants_held_slot_does_not_block_another(tmp_path: Path) -> None:
    signer = Signer.make("ES256", "es-1")
    (tmp_path / "jwks.json").write_text(json.dumps(jwks(signer)))
    for tenant in ("acme", "globex", "none"):
        RELEASE[tenant] = trio.Event()
    for name in ("acme-1", "acme-2", "globex-1", "anonymous-1"):
        ENTERED[name] = trio.Event()
    answers: dict[str, httpx.Response] = {}

    async with (
        gateway(tmp_path, TEXT) as (gw, address),
        httpx.AsyncClient(base_url=address.url, timeout=30) as client,
        trio.open_nursery() as nursery,
    ):
        assert gw.engine is not None
        pool: Any = gw.engine.pool

        def keys() -> Any:
            return pool.statistics().keys

        async def call(name: str, **token: Any) -> None:
            answers[name] = await client.post(
                "/work",
                json={"name": name},
                headers={"Authorization": f"Bearer {signer.sign(claims(**token))}"},
            )

        nursery.start_soon(call, "acme-1")  # claims() says tenant "acme"
        await ENTERED["acme-1"].wait()
        nursery.start_soon(call, "acme-2")
        await until(lambda: "tenant:acme" in keys() and keys()["tenant:acme"].waiting == 1)
        # Globex's limit is its own: its request runs and is answered while acme's waits.
        RELEASE["globex"].set()
        await call("globex-1", tenant="globex", sub="bob")
        assert answers["globex-1"].status_code == 200, answers["globex-1"].text
        assert answers["globex-1"].json() == "globex-1"
        assert not ENTERED["acme-2"].is_set()
        stats = keys()
        assert (stats["tenant:acme"].in_use, stats["tenant:acme"].waiting) == (1, 1)
        assert stats["tenant:globex"].admitted == 1
        # A token without the claim: the chain's own key, under no tenant's limit.
        RELEASE["none"].set()
        await call("anonymous-1", tenant=None)
        assert answers["anonymous-1"].status_code == 200, answers["anonymous-1"].text
        assert keys()["default"].admitted == 1
        RELEASE["acme"].set()
    assert answers["acme-1"].status_code == answers["acme-2"].status_code == 200
    assert answers["acme-2"].json() == "acme-2"
    assert keys()["tenant:acme"].admitted == 2


async def test_an_auth_requiring_the_claim_refuses_a_token_without_it(tmp_path: Path) -> None:
    """What docs/edge-policy.md offers for tokens lacking the pool key's claim: the auth's
    ``require`` makes them a 401, before any job, instead of the chain's key."""
    signer = Signer.make("ES256", "es-1")
    (tmp_path / "jwks.json").write_text(json.dumps(jwks(signer)))
    text = TEXT.replace('claims = ["tenant"]', 'claims = ["tenant"]\nrequire = ["exp", "tenant"]')
    RELEASE["acme"] = trio.Event()
    RELEASE["acme"].set()
    ENTERED["ok"] = trio.Event()
    async with (
        gateway(tmp_path, text) as (gw, address),
        httpx.AsyncClient(base_url=address.url, timeout=30) as client,
    ):
        missing = claims()
        del missing["tenant"]
        answer = await client.post(
            "/work",
            json={"name": "no"},
            headers={"Authorization": f"Bearer {signer.sign(missing)}"},
        )
        assert answer.status_code == 401, answer.text
        assert "tenant" in answer.json()["detail"]
        answer = await client.post(
            "/work",
            json={"name": "ok"},
            headers={"Authorization": f"Bearer {signer.sign(claims())}"},
        )
        assert answer.status_code == 200, answer.text
        assert gw.engine is not None
        pool: Any = gw.engine.pool
        assert "tenant:acme" in pool.statistics().keys
        assert "default" not in pool.statistics().keys


async def test_a_tenants_weights_change_live_through_the_admin_api(tmp_path: Path) -> None:
    signer = Signer.make("ES256", "es-1")
    (tmp_path / "jwks.json").write_text(json.dumps(jwks(signer)))
    async with (
        gateway(tmp_path, TEXT) as (gw, address),
        httpx.AsyncClient(base_url=address.url, timeout=30) as client,
    ):
        admin = {"Authorization": "Bearer edge-admin"}
        changed = await client.put("/admin/pool/keys/tenant:acme", json={"limit": 3}, headers=admin)
        unknown = await client.put(
            "/admin/pool/keys/tenant:nobody", json={"limit": 3}, headers=admin
        )
        assert gw.engine is not None
        pool: Any = gw.engine.pool
        assert pool.config.keys["tenant:acme"].limit == 3
    assert changed.status_code == 200, changed.text
    assert changed.json()["key"]["limit"] == 3
    assert unknown.status_code == 404, unknown.text  # only keys the file names


def problems_of(text: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        loads_config(text)
    return {p.path: p.message for p in info.value.problems}


@pytest.mark.parametrize(
    ("route", "says"),
    [
        pytest.param('pool_key = "claim:tenant"', 'needs auth = "NAME"', id="no-auth"),
        pytest.param(
            'pool_key = "tenant"\nauth = "partners"', '"identity" or "claim:NAME"', id="form"
        ),
        pytest.param(
            'pool_key = "claim:"\nauth = "partners"', '"identity" or "claim:NAME"', id="no-claim"
        ),
    ],
)
def test_check_names_a_wrong_pool_key_at_its_path(route: str, says: str) -> None:
    text = f"""
{AUTH.replace('jwks_file = "jwks.json"', 'jwks_url = "https://id.example/jwks"')}
[pipes.hold]
python = "tests.test_edge_pool_keys:hold"

[routes.work]
path = "/work"
chain = ["hold"]
{route}
"""
    problems = problems_of(text)
    assert says in problems["routes.work.pool_key"], problems


def test_check_names_a_wrong_tenant_key_at_its_path() -> None:
    problems = problems_of('[pool.keys."tenant:"]\nlimit = 1\n[pool.keys."a:b"]\nlimit = 1\n')
    assert "tenant's key" in problems['pool.keys."tenant:"']
    assert "may use only" in problems['pool.keys."a:b"']


def test_a_tenant_key_and_max_keys_reach_the_pool() -> None:
    config = loads_config('[pool]\nmax_keys = 50\n[pool.keys."tenant:acme corp"]\nreserve = 2\n')
    pool = config.pool.pool_config()
    assert pool.max_keys == 50
    assert pool.keys["tenant:acme corp"].reserve == 2
