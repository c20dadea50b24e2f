"""``GET /metrics`` on a real server: parked requests counted while they wait, back to 0."""

from __future__ import annotations

import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

import pipework as pw

from .test_container_harness import HANG_GUARD, serving


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_metrics_endpoint_counts_parked_requests() -> None:
    registry = pw.Registry()
    engine = pw.Engine(registry=registry)
    release = trio.Event()
    all_started = trio.Event()
    started = 0

    @engine.pipe
    async def slow(ctx: pw.Context) -> None:
        nonlocal started
        started += 1
        if started == 5:
            all_started.set()
        await release.wait()
        ctx.state["done"] = True

    engine.chain("slow", slow)
    registry.route("slow", path="/slow", chain="slow", method="POST", mode="sync")
    with trio.fail_after(HANG_GUARD):
        async with serving(engine) as served:
            statuses: list[int] = []

            async def call() -> None:
                response = await served.client.post("/slow", json={})
                statuses.append(response.status_code)

            async with trio.open_nursery() as nursery:
                for _ in range(5):
                    nursery.start_soon(call)
                await all_started.wait()
                await trio.testing.wait_all_tasks_blocked()  # every handler is parked
                during = await served.client.get("/metrics")
                release.set()
            after = await served.client.get("/metrics")
    assert statuses == [200] * 5
    assert during.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert samples(during.text)[("pipework_parked_requests", ())] == 5
    values = samples(after.text)
    assert values[("pipework_parked_requests", ())] == 0
    assert values[("pipework_event_queue_depth", ())] == 0
    done = ("pipework_job_duration_seconds_count", (("outcome", "done"), ("route", "slow")))
    assert values[done] == 5


async def test_readiness_probes_leave_no_route_or_pipe_series_and_no_trace_in_the_registry() -> (
    None
):
    engine = pw.Engine(registry=pw.Registry())

    @engine.pipe
    async def hello(ctx: pw.Context) -> None:
        ctx.state["hello"] = "world"

    engine.chain("hello", hello, result="hello")
    registry = engine.registry
    assert isinstance(registry, pw.Registry)
    registry.route("hello", path="/hello", chain="hello", method="GET")
    with trio.fail_after(HANG_GUARD):
        async with serving(engine) as served:
            assert (await served.client.get("/hello")).status_code == 200
            for _ in range(3):
                ready = await served.client.get("/readyz")
                assert ready.status_code == 200, ready.text
            text = (await served.client.get("/metrics")).text
            jobs = await engine.store.list()
    labelled = {
        (key, value)
        for (_, labels), _ in samples(text).items()
        for key, value in labels
        if key in ("route", "pipe")
    }
    assert labelled == {("route", "hello"), ("pipe", "hello")}
    assert set(engine.registry.chains) == {"hello"}  # the container added nothing
    assert set(engine.registry.pipes) == {"hello"}
    assert [job.chain for job in jobs] == ["hello"]  # probes leave no job records
