"""Graceful shutdown: stop accepting, let parked requests finish within the grace period,
answer the rest 503 (cancelling their jobs), and return."""

from __future__ import annotations

import functools

import pytest
import trio
import trio.testing

import pipework as pw
from pipework.container import BoundAddress, Container, ContainerConfig

from .test_container_harness import HANG_GUARD, raw_client, serving, sse_events

# Each test runs on each HTTP/1.1 server serve() has (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("http1_server")


class Held:
    def __init__(self) -> None:
        self.entered = trio.Event()
        self.release = trio.Event()
        self.cleaned_up = trio.Event()
        self.parked = 0
        self.job_ids: list[str] = []


def make_engine(held: Held, parked_target: int = 1) -> pw.Engine:
    registry = pw.Registry()
    engine = pw.Engine(registry=registry)

    @engine.pipe
    async def hold(ctx: pw.Context) -> None:
        held.job_ids.append(ctx.job_id)
        held.parked += 1
        if held.parked == parked_target:
            held.entered.set()
        try:
            await held.release.wait()
        finally:
            held.cleaned_up.set()

    @engine.pipe
    async def chunk_then_hold(ctx: pw.Context) -> None:
        await ctx.emit("first")
        await hold.fn(ctx)  # type: ignore[misc]  # an async pipe: PipeFunction also allows sync

    engine.chain("hold", hold)
    engine.chain("stream", chunk_then_hold)
    registry.route("hold", path="/hold", chain="hold")
    registry.route("auto", path="/auto", chain="hold", mode="auto", sync_wait=60)
    registry.route("stream", path="/stream", chain="stream", mode="stream")
    return engine


async def test_parked_requests_finish_within_the_grace_period() -> None:
    held = Held()
    stop = trio.Event()
    config = ContainerConfig(shutdown_grace=HANG_GUARD)
    with trio.fail_after(HANG_GUARD):
        async with make_engine(held, parked_target=2) as engine:
            container = Container(engine, config=config)
            async with trio.open_nursery() as nursery:
                address: BoundAddress = await nursery.start(
                    functools.partial(container.serve, shutdown_trigger=stop)
                )
                async with raw_client(address) as first, raw_client(address) as second:
                    await first.send("POST", "/hold")
                    await second.send("POST", "/auto")
                    await held.entered.wait()
                    stop.set()
                    await trio.testing.wait_all_tasks_blocked()
                    # No new connections while the parked requests finish.
                    with trio.socket.socket() as sock, pytest.raises(ConnectionRefusedError):
                        await sock.connect((address.host, address.port))
                    held.release.set()
                    answers = [await first.receive(), await second.receive()]
            # Leaving the nursery means serve() returned.
    assert [response.status_code for response, _ in answers] == [200, 200]


async def test_requests_still_parked_after_the_grace_get_503_and_their_jobs_end() -> None:
    held = Held()
    config = ContainerConfig(shutdown_grace=0.2)
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(held), config=config) as served:
            async with raw_client(served.address) as raw:
                await raw.send("POST", "/hold")
                await held.entered.wait()
                served.stop.set()
                response, body = await raw.receive()
            await held.cleaned_up.wait()
            with pytest.raises(pw.JobCancelled):
                await served.engine.wait(held.job_ids[0])
    assert response.status_code == 503
    assert (b"retry-after", b"1") in response.headers
    assert b"urn:pipework:problem:shutting-down" in body


async def test_a_stream_past_the_grace_ends_with_an_error_event() -> None:
    held = Held()
    config = ContainerConfig(shutdown_grace=0.2)
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(held), config=config) as served:
            async with raw_client(served.address) as raw:
                await raw.send("POST", "/stream")
                await held.entered.wait()
                served.stop.set()
                response, body = await raw.receive()
            await held.cleaned_up.wait()
    assert response.status_code == 200
    events = sse_events(body.decode())
    assert events[0] == ("chunk", "first")
    assert events[1][0] == "error"
    assert events[1][1]["status"] == 503


async def test_while_draining_new_jobs_and_readiness_are_refused() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(Held())) as served:
            served.container.begin_shutdown()
            submitted = await served.client.post("/hold")
            ready = await served.client.get("/readyz")
            alive = await served.client.get("/healthz")
    for response in (submitted, ready):
        assert response.status_code == 503
        assert response.json()["type"] == "urn:pipework:problem:shutting-down"
    assert alive.status_code == 200
