"""Metrics an operator can trust: every backend call is counted (cancelled ones too), every
HTTP response is counted (refusals before any job too), a call cut at its timeout is
estimated at that timeout, and the readiness probe is no route anywhere, the dashboard's
route variable included."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

import pipework as pw
from pipework import Backends, ContainerConfig, HttpCall, Metrics, Service, http_pipe

from .test_container_harness import HANG_GUARD, SECRET, serving

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana-dashboard.json"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(found: Samples, name: str, **labels: str) -> float:
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_a_call_cancelled_by_an_any_of_winner_is_counted() -> None:
    # The winner answers only once the loser's call is under way: a loser cancelled before
    # its call began made no call, and the branches' start order is the scheduler's.
    slow_called = trio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "slow.internal":
            slow_called.set()
            await trio.sleep_forever()
        await slow_called.wait()
        return httpx.Response(200, json={"fast": True})

    backends = Backends(
        [Service("fast", "http://fast.internal"), Service("slow", "http://slow.internal")],
        transport=httpx.MockTransport(handler),
    )
    engine = pw.Engine()
    backends.metrics = engine.metrics
    engine.registry.add_pipe(http_pipe("slow", HttpCall.of("slow", "/", into="x"), backends))
    engine.registry.add_pipe(http_pipe("fast", HttpCall.of("fast", "/", into="x"), backends))
    engine.chain("race", pw.any_of("slow", "fast"), result="x")
    with trio.fail_after(HANG_GUARD):
        async with backends, engine:
            assert await engine.run("race") == {"fast": True}
    found = samples(engine.metrics.exposition().decode())
    assert value(found, "pipework_backend_calls_total", service="fast", outcome="ok") == 1
    assert value(found, "pipework_backend_calls_total", service="slow", outcome="cancelled") == 1
    assert (
        value(found, "pipework_backend_latency_seconds_count", service="slow", outcome="cancelled")
        == 1
    )
    # A cancelled call is no error of the backend's.
    assert not any(
        name == "pipework_backend_errors_total" and ("service", "slow") in labels and v
        for (name, labels), v in found.items()
    )


def test_buckets_have_each_configured_timeout_and_one_just_above() -> None:
    metrics = Metrics(timeouts=[1.0, 4.0])
    for _ in range(10):
        metrics.backend_latency.labels("users", "timeout").observe(1.003)
        metrics.pipe_duration.labels("get_user", "timeout").observe(1.004)
    found = samples(metrics.exposition().decode())
    for name, labels in (
        ("pipework_backend_latency_seconds_bucket", {"service": "users", "outcome": "timeout"}),
        ("pipework_pipe_duration_seconds_bucket", {"pipe": "get_user", "outcome": "timeout"}),
    ):
        assert value(found, name, le="1.0", **labels) == 0
        # Every cut call is in the bucket ending 5% above the timeout: p99 reads <= 1.05 s.
        assert value(found, name, le="1.05", **labels) == 10
    bounds = {
        dict(labels)["le"]
        for (name, labels) in found
        if name == "pipework_backend_latency_seconds_bucket"
    }
    assert {"4.0", "4.2"} <= bounds


async def test_every_response_is_counted_by_route_or_endpoint() -> None:
    registry = pw.Registry()
    engine = pw.Engine(registry=registry)

    @engine.pipe
    async def echo(ctx: pw.Context) -> None:
        ctx.state["out"] = ctx.state.get("n")

    engine.chain("echo", echo, result="out")
    registry.route("echo", path="/echo", chain="echo", method="POST")
    config = ContainerConfig(callback_secret=SECRET, shutdown_grace=1.0, max_body=64)
    with trio.fail_after(HANG_GUARD):
        async with serving(engine, config=config) as served:
            client = served.client
            assert (await client.post("/echo", json={"n": 1})).status_code == 200
            assert (await client.post("/echo", content=b"{", headers=_JSON)).status_code == 400
            assert (await client.post("/echo", content=b"1" * 100, headers=_JSON)).status_code == (
                413
            )
            assert (await client.post("/echo", content=b"x")).status_code == 415
            assert (await client.get("/nowhere")).status_code == 404
            assert (await client.get("/echo")).status_code == 405
            assert (await client.get("/readyz")).status_code == 200
            assert (await client.get("/jobs/nope")).status_code == 404
            served.container.begin_shutdown()  # new submissions: 503 before any job
            assert (await client.post("/echo", json={"n": 2})).status_code == 503
            text = (await client.get("/metrics")).text
    found = samples(text)
    route = "pipework_route_responses_total"
    assert value(found, route, route="echo", status_class="2xx") == 1
    assert value(found, route, route="echo", status_class="4xx") == 3
    assert value(found, route, route="echo", status_class="5xx") == 1
    http = "pipework_http_responses_total"
    assert value(found, http, endpoint="unmatched", status_class="4xx") == 2
    assert value(found, http, endpoint="readyz", status_class="2xx") == 1
    assert value(found, http, endpoint="jobs", status_class="4xx") == 1


_JSON = {"Content-Type": "application/json"}


async def test_the_dashboards_route_variable_never_offers_the_readiness_probe() -> None:
    registry = pw.Registry()
    engine = pw.Engine(registry=registry)

    @engine.pipe
    async def hello(ctx: pw.Context) -> None:
        ctx.state["hello"] = "world"

    engine.chain("hello", hello, result="hello")
    registry.route("hello", path="/hello", chain="hello", method="GET")
    with trio.fail_after(HANG_GUARD):
        async with serving(engine) as served:
            assert (await served.client.get("/hello")).status_code == 200
            for _ in range(3):
                assert (await served.client.get("/readyz")).status_code == 200
            text = (await served.client.get("/metrics")).text
    found = samples(text)
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "route"]
    query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
    match = re.fullmatch(r"label_values\((\w+)(?:\{[^}]*\})?, (\w+)\)", query)
    assert match is not None, query
    family, label = match.groups()
    offered = {dict(labels)[label] for (name, labels) in found if name == family}
    assert offered == {"hello"}
    # Nor is it a route in any other family.
    routes = {dict(labels)["route"] for (_, labels) in found if "route" in dict(labels)}
    assert routes == {"hello"}


@asynccontextmanager
async def hanging_backend() -> AsyncIterator[str]:
    """A real server that accepts connections and reads requests, and never answers."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    async def hang(stream: trio.SocketStream) -> None:
        async with stream:
            while await stream.receive_some():
                pass

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, hang, listeners)
        yield f"http://127.0.0.1:{port}"
        nursery.cancel_scope.cancel()


async def demo_under_a_hanging_backend(calls: int) -> str:
    """The demo's shape: a service with a 1 s timeout that hangs, called ``calls`` times
    at once; the exposition afterwards."""
    async with hanging_backend() as url:
        backends = Backends([Service("users", url, timeout=1.0)])
        engine = pw.Engine(metrics=Metrics(timeouts=[1.0]))
        backends.metrics = engine.metrics
        engine.registry.add_pipe(
            http_pipe("get_user", HttpCall.of("users", "/users/1", into="user"), backends)
        )
        engine.chain("user", "get_user", result="user")
        failures: list[BaseException] = []

        async def one() -> None:
            try:
                await engine.run("user")
            except pw.PipeworkError as exc:
                failures.append(exc)

        with trio.fail_after(HANG_GUARD):
            async with backends, engine, trio.open_nursery() as nursery:
                for _ in range(calls):
                    nursery.start_soon(one)
    assert len(failures) == calls
    return engine.metrics.exposition().decode()


async def test_the_request_id_and_trace_context_reach_every_backend_call() -> None:
    seen: list[httpx.Headers] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers)
        return httpx.Response(200, json={"ok": True})

    backends = Backends(
        [
            Service("users", "http://users.internal"),
            Service("audit", "http://audit.internal", request_id_header="X-Correlation-ID"),
            Service("quiet", "http://quiet.internal", request_id_header=None),
        ],
        transport=httpx.MockTransport(handler),
    )
    registry = pw.Registry()
    engine = pw.Engine(registry=registry)
    backends.metrics = engine.metrics
    for name in ("users", "audit", "quiet"):
        registry.add_pipe(http_pipe(name, HttpCall.of(name, "/", into=name), backends))
    engine.chain("fan", pw.all_of("users", "audit"), "quiet", result="users")
    registry.route("fan", path="/fan", chain="fan", method="GET")
    trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with trio.fail_after(HANG_GUARD):
        async with backends, serving(engine) as served:
            traced = await served.client.get(
                "/fan", headers={"X-Request-ID": "req-42", "traceparent": trace}
            )
            plain = await served.client.get("/fan", headers={"traceparent": "garbage"})
    assert traced.status_code == plain.status_code == 200
    first, second = seen[:3], seen[3:]
    by_host = {h["host"]: h for h in first}
    assert by_host["users.internal"]["x-request-id"] == "req-42"
    assert by_host["audit.internal"]["x-correlation-id"] == "req-42"
    assert "x-request-id" not in by_host["audit.internal"]
    assert "x-request-id" not in by_host["quiet.internal"]
    assert all(h["traceparent"] == trace for h in first)
    generated = plain.headers["X-Request-ID"]
    assert {h.get("x-request-id") for h in second if h["host"] == "users.internal"} == {generated}
    assert not any("traceparent" in h for h in second)  # a malformed one is not passed on


def test_the_request_id_header_is_configurable_in_the_gateway_file() -> None:
    from pipework.registry._config import loads_config

    config = loads_config(
        '[services.a]\nbase_url = "http://a.internal"\nrequest_id_header = "X-Correlation-ID"\n'
        '[services.b]\nbase_url = "http://b.internal"\nrequest_id_header = false\n'
        '[services.c]\nbase_url = "http://c.internal"\n'
    )
    assert config.services["a"].request_id_header == "X-Correlation-ID"
    assert config.services["b"].request_id_header is None
    assert config.services["c"].request_id_header == "X-Request-ID"


async def test_a_call_cancelled_by_a_client_that_hung_up_is_counted() -> None:
    entered = trio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        entered.set()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    backends = Backends(
        [Service("slow", "http://slow.internal")], transport=httpx.MockTransport(handler)
    )
    registry = pw.Registry()
    engine = pw.Engine(registry=registry)
    backends.metrics = engine.metrics
    registry.add_pipe(http_pipe("slow", HttpCall.of("slow", "/", into="x"), backends))
    engine.chain("slow", "slow")
    registry.route("slow", path="/slow", chain="slow", method="GET")
    name = "pipework_backend_calls_total"
    with trio.fail_after(HANG_GUARD):
        async with backends, serving(engine) as served:
            impatient = httpx.AsyncClient(base_url=served.address.url)
            async with impatient, trio.open_nursery() as nursery:
                nursery.start_soon(impatient.get, "/slow")
                await entered.wait()
                nursery.cancel_scope.cancel()  # the client hangs up mid-request
            while True:
                found = samples((await served.client.get("/metrics")).text)
                if value(found, name, service="slow", outcome="cancelled"):
                    break
                await trio.sleep(0.01)
    assert value(found, name, service="slow", outcome="cancelled") == 1
    assert value(found, name, service="slow", outcome="error") == 0
