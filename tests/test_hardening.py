"""Inputs a client can send that once got a 500, a side effect before a 4xx, or a throttled
service: each is refused before anything runs, with a problem a client can act on."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
import trio.testing

import pipework as pw
from pipework import Backends, HttpCall, Service, http_pipe
from pipework.container import ContainerConfig

from .test_container_harness import HANG_GUARD, SECRET, assert_problem, bearer, serving

JSON = {"Content-Type": "application/json"}
TOKEN = "admin-token-for-hardening"


def make_engine(calls: list[str], **kwargs: Any) -> pw.Engine:
    registry = pw.Registry()
    engine = pw.Engine(registry=registry, **kwargs)

    @engine.pipe
    async def count(ctx: pw.Context) -> None:
        calls.append(ctx.job_id)

    engine.chain("count", count)
    for mode in ("sync", "async", "stream", "auto"):
        registry.route(mode, path=f"/{mode}", chain="count", mode=mode)
    return engine


async def jobs_of(engine: pw.Engine) -> list[Any]:
    return list(await engine.store.list())


# -- 1. Prefer ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["wait=\u00b2", "wait=\u00b9", "wait=1e3", "wait=99999999999"])
async def test_an_unparseable_prefer_is_ignored_and_the_job_runs_once(value: str) -> None:
    calls: list[str] = []
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(calls)) as served:
            # Sent as Latin-1, which is how the server decodes header bytes.
            response = await served.client.post(
                "/auto", headers={b"Prefer": value.encode("latin-1")}
            )
    assert response.status_code == 200, response.text
    assert "preference-applied" not in response.headers
    assert len(calls) == 1


# -- 2. Idempotency-Key with invalid state ----------------------------------------------


@pytest.mark.parametrize(
    ("body", "slug", "words"),
    [
        pytest.param(b'{"n": 18446744073709551616}', "invalid-state", "out of range", id="2**64"),
        pytest.param(b'{"s": "\\udc80"}', "invalid-state", "lone surrogate", id="surrogate"),
        pytest.param(b'{"a": ' + b"[" * 600 + b"]" * 600 + b"}", "malformed", "deeper", id="deep"),
    ],
)
async def test_invalid_state_with_an_idempotency_key_is_a_400_and_starts_nothing(
    body: bytes, slug: str, words: str, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[str] = []
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(calls)) as served:
            keyed = await served.client.post(
                "/async", content=body, headers={**JSON, "Idempotency-Key": "k-1"}
            )
            plain = await served.client.post("/async", content=body, headers=JSON)
            assert await jobs_of(served.engine) == []
    for response in (keyed, plain):
        problem = assert_problem(response, 400, slug)
        assert words in problem["detail"]
        assert "NoneType" not in problem["detail"]
    assert calls == []
    assert not [r for r in caplog.records if r.exc_info]


# -- 3. the callback endpoint ------------------------------------------------------------


@pytest.mark.parametrize("query", ["exp=%C2%B2&sig=a", "exp=1&sig=%C3%A9", "exp=-1&sig=a"])
async def test_a_malformed_callback_query_is_a_403(query: str) -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine([])) as served:
            response = await served.client.post(f"/callbacks/job/paid?{query}")
    assert_problem(response, 403, "callback-refused")


# -- 4. the admin API's credentials ------------------------------------------------------


def admin_config() -> ContainerConfig:
    return ContainerConfig(callback_secret=SECRET, shutdown_grace=1.0, admin_token=TOKEN)


@pytest.mark.parametrize(
    "header", ["Bearer \u00e9".encode(), b"Bearer \xff\xfe", b"Bearer", b"\xe9", b"Basic x"]
)
async def test_a_malformed_admin_credential_is_a_401(header: bytes) -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine([]), config=admin_config()) as served:
            response = await served.client.get("/admin/pool", headers={b"Authorization": header})
    assert_problem(response, 401, "admin-unauthorized")


# -- 5. forwarded headers are the client's mistake, not the backend's ---------------------


@pytest.mark.parametrize(
    "headers",
    [
        {"x y": "v"},
        {"x\r\ny": "v"},
        {"X-A": " leading"},
        {"X-A": "trailing "},
        {"X-\u00e9": "v"},
        {"X-A": "caf\u00e9"},
    ],
)
async def test_a_header_httpx_would_refuse_is_a_400_not_counted_against_the_backend(
    headers: dict[str, str],
) -> None:
    sent: list[httpx.Request] = []

    def backend(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, json={"ok": True})

    adaptive = pw.Adaptive(min_limit=1)
    pool = pw.WeightedPool(16, keys={"users": pw.Weights(limit=8, adaptive=adaptive)})
    backends = Backends(
        [Service("users", "http://users.test")], transport=httpx.MockTransport(backend)
    )
    registry = pw.Registry()
    engine = pw.Engine(registry=registry, pool=pool)
    backends.metrics = engine.metrics
    call = HttpCall.of("users", "/u", forward_headers="headers", into="answer")
    registry.add_pipe(http_pipe("call_users", call, backends))
    registry.chain("call", "call_users")
    registry.route("call", path="/call", chain="call")
    with trio.fail_after(HANG_GUARD):
        async with backends, serving(engine) as served:
            responses = [
                await served.client.post("/call", json={"headers": headers}) for _ in range(10)
            ]
            good = await served.client.post("/call", json={"headers": {"X-A": "b c"}})
            stats = pool.statistics().keys["users"]
    for response in responses:
        problem = assert_problem(response, 400, "backend-request-refused")
        assert "header" in problem["detail"]
    assert good.status_code == 200, good.text
    assert len(sent) == 1
    assert stats.adaptive_limit == 8
    assert b"pipework_backend_errors_total{" not in engine.metrics.exposition()


# -- 7. an accepted async job is never failed for load -----------------------------------


async def test_async_admission_is_decided_before_the_202() -> None:
    release = trio.Event()
    registry = pw.Registry()
    # One worker; a waiting step gives up after 0.2 s; at most one may wait.
    pool = pw.WeightedPool(1, wait_timeout=0.2, default=pw.Weights(max_waiting=1))
    engine = pw.Engine(registry=registry, pool=pool)

    @engine.pipe
    async def hold(ctx: pw.Context) -> None:
        await release.wait()

    engine.chain("hold", hold, timeout=30)
    registry.route("hold", path="/hold", chain="hold", mode="async")
    with trio.fail_after(HANG_GUARD):
        async with serving(engine) as served:
            first = await served.client.post("/hold")
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)
            second = await served.client.post("/hold")
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)
            third = await served.client.post("/hold")
            assert len(await jobs_of(served.engine)) == 2
            await trio.sleep(0.5)  # past the wait timeout: the accepted job still waits
            release.set()
            ids = [first.headers["x-job-id"], second.headers["x-job-id"]]
            for job_id in ids:
                await served.engine.wait(job_id)
                assert (await served.engine.status(job_id)).status is pw.Status.DONE
    assert first.status_code == second.status_code == 202
    problem = assert_problem(third, 503, "rejected")
    assert problem["reason"] == "queue_full"
    assert int(third.headers["retry-after"]) >= 1


# -- 8. readiness under load ---------------------------------------------------------------


async def test_readyz_is_ready_while_traffic_fills_the_pool() -> None:
    release = trio.Event()
    registry = pw.Registry()
    engine = pw.Engine(registry=registry, pool=pw.WeightedPool(2, wait_timeout=None))

    @engine.pipe
    async def hold(ctx: pw.Context) -> None:
        await release.wait()

    engine.chain("hold", hold)
    # Ready answers as soon as the canary is through: a generous bound costs nothing here.
    config = ContainerConfig(callback_secret=SECRET, shutdown_grace=1.0, readiness_timeout=10.0)
    with trio.fail_after(HANG_GUARD):
        async with serving(engine, config=config) as served:
            for _ in range(20):
                await served.engine.submit("hold")
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)
            ready = await served.client.get("/readyz")
            release.set()
    assert ready.status_code == 200, ready.text


# -- 9. the smaller ones ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "content_type", "status", "slug", "words"),
    [
        pytest.param(b"null", "application/json", 400, "body-not-an-object", "null", id="null"),
        pytest.param(
            "{}".encode("utf-16"), "application/json", 400, "malformed", "JSON", id="utf-16"
        ),
        pytest.param(
            b"{}",
            "application/json; charset=utf-16",
            415,
            "unsupported-media-type",
            "UTF-8",
            id="charset",
        ),
        pytest.param(
            b"{}", ";;;", 415, "unsupported-media-type", "not a media type", id="malformed-ct"
        ),
        pytest.param(
            b"{}", "json", 415, "unsupported-media-type", "not a media type", id="no-subtype"
        ),
    ],
)
async def test_bodies_are_json_objects_in_utf_8_with_a_real_media_type(
    content: bytes, content_type: str, status: int, slug: str, words: str
) -> None:
    calls: list[str] = []
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(calls)) as served:
            response = await served.client.post(
                "/sync", content=content, headers={"Content-Type": content_type}
            )
    problem = assert_problem(response, status, slug)
    assert words in problem["detail"]
    assert calls == []


@pytest.mark.parametrize("target", ["/sync%ff", "/sync?x=%ff", "/sync?%ff=1", "/jobs/%ff"])
async def test_percent_encoding_that_is_not_utf_8_is_a_400(target: str) -> None:
    calls: list[str] = []
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(calls)) as served:
            response = await served.client.post(target)
    assert_problem(response, 400, "bad-encoding")
    assert calls == []


async def test_percent_encoded_utf_8_reaches_the_job_decoded() -> None:
    registry = pw.Registry()
    engine = pw.Engine(registry=registry)

    @engine.pipe
    async def echo(ctx: pw.Context) -> None:
        return None

    engine.chain("echo", echo)
    registry.route("echo", path="/echo/{name}", chain="echo")
    with trio.fail_after(HANG_GUARD):
        async with serving(engine) as served:
            response = await served.client.post("/echo/caf%C3%A9?q=%E2%82%AC")
    assert response.json() == {"name": "caf\u00e9", "q": "\u20ac"}


@pytest.mark.parametrize(
    ("key", "body", "words"),
    [
        ("users", {"limit": 1.5}, "limit must be a whole number or null, got a decimal number"),
        ("users", {"limit": True}, "limit must be a whole number or null, got a boolean"),
        ("users", {"reserve": 10**23}, "reserve must be between 0 and"),
        ("users", {"max_waiting": "3"}, "max_waiting must be a whole number, got a string"),
        ("users", {"wait_timeout": 0}, "wait_timeout must be above 0"),
        ("users", {"wait_timeout": [1]}, "wait_timeout must be a number of seconds or null"),
        ("users", {"nope": 1}, "unknown field(s) 'nope'"),
        ("users", {}, "send a JSON object"),
        ("x y", {"limit": 1}, "cannot name a key"),
    ],
)
async def test_admin_put_refuses_weights_of_the_wrong_type_or_name(
    key: str, body: dict[str, Any], words: str
) -> None:
    # "users" is a declared key: PUT on an undeclared one is a 404 before any field is read.
    pool = pw.WeightedPool(8, keys={"users": pw.Weights(limit=4)})
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine([], pool=pool), config=admin_config()) as served:
            before = (await served.client.get("/admin/pool", headers=bearer(TOKEN))).json()
            response = await served.client.put(
                f"/admin/pool/keys/{key}",
                content=json.dumps(body),
                headers={**JSON, **bearer(TOKEN)},
            )
            after = (await served.client.get("/admin/pool", headers=bearer(TOKEN))).json()
    problem = assert_problem(response, 400, "admin-bad-weights")
    assert words in problem["detail"]
    assert "TypeError" not in problem["detail"]
    assert after["config_generation"] == before["config_generation"]
