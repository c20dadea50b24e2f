"""Thousands of requests parked at once on one engine, each answered with its own result.

The clients are bare trio sockets (one connection each), not httpx: a client library's
pool is the bottleneck at this scale, and the point is the server holding the requests.
"""

from __future__ import annotations

import json

import pytest
import trio
import trio.testing

import pipework as pw

from .test_container_harness import raw_client, serving

PARKED = 2000


# 2,000 connections' set-up and answers take most of a minute on a busy 2-core machine: the
# guard is for a hang, not a bound on the time.
@pytest.mark.hang_guard(real_seconds=300)
async def test_thousands_of_parked_sync_requests_are_all_answered() -> None:
    # Every resumed job queues for a worker at once: let them all wait rather than refuse.
    registry = pw.Registry()
    engine = pw.Engine(
        registry=registry, pool=pw.WeightedPool(64, default=pw.Weights(max_waiting=PARKED))
    )
    all_suspended = trio.Event()
    suspended = 0

    @engine.pipe
    async def wait_for_go(ctx: pw.Context) -> None:
        nonlocal suspended
        suspended += 1
        if suspended == PARKED:
            all_suspended.set()
        await ctx.suspend("go")  # the job holds no worker while its request is parked

    @engine.pipe
    async def answer(ctx: pw.Context) -> None:
        ctx.state["answer"] = ctx.state["n"] * 2

    engine.chain("park", wait_for_go, answer, result="answer")
    # The job's deadline (30 s by default) is not what this tests: on a busy machine the
    # 2,000 connections take longer than that to set up.
    registry.route("park", path="/park", chain="park", timeout=600)
    answers: dict[int, tuple[int, object]] = {}

    async with serving(engine, hypercorn_options={"backlog": 4096}) as served:

        async def request(n: int) -> None:
            async with raw_client(served.address) as raw:
                await raw.send(
                    "POST",
                    "/park",
                    body=json.dumps({"n": n}).encode(),
                    headers=[("Content-Type", "application/json")],
                )
                response, body = await raw.receive()
                answers[n] = (response.status_code, json.loads(body))

        async with trio.open_nursery() as nursery:
            for n in range(PARKED):
                nursery.start_soon(request, n)
            await all_suspended.wait()
            # A request parks in its own task and its job suspends in the engine's: wait
            # until both have happened for every one (the pipe counts before it suspends).
            while True:
                await trio.testing.wait_all_tasks_blocked(cushion=0.05)
                jobs = await engine.store.list(pw.Status.SUSPENDED)
                if served.container.parking.parked == len(jobs) == PARKED:
                    break
            assert not answers
            for job in jobs:
                await engine.signal(job.id, "go")
    assert answers == {n: (200, n * 2) for n in range(PARKED)}
