"""Each route mode end to end over a real socket: sync, async, stream and auto, the request
shape that becomes job state, body negotiation, correlation ids and client disconnects."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any, cast

import msgpack
import pytest
import trio
import trio.testing

import pipework as pw
from pipework.container import ContainerConfig

from ._copying_store import CopyingJobStore
from .test_container_harness import (
    HANG_GUARD,
    assert_problem,
    bearer,
    raw_client,
    serving,
    sse_events,
)


class Gate:
    """What a test pipe reports and waits on."""

    def __init__(self) -> None:
        self.entered = trio.Event()
        self.release = trio.Event()
        self.cleaned_up = trio.Event()
        self.job_ids: list[str] = []


def make_engine(gate: Gate, **kwargs: Any) -> pw.Engine:
    registry = pw.Registry()
    engine = pw.Engine(registry=registry, **kwargs)

    @engine.pipe
    async def echo(ctx: pw.Context) -> None:
        ctx.state["seen"] = sorted(ctx.state)

    @engine.pipe
    async def held(ctx: pw.Context) -> None:
        gate.job_ids.append(ctx.job_id)
        gate.entered.set()
        try:
            await gate.release.wait()
        finally:
            gate.cleaned_up.set()
        ctx.state["released"] = True

    @engine.pipe
    async def chunks(ctx: pw.Context) -> None:
        for i in range(ctx.state.get("n", 3)):
            await ctx.emit({"row": i})
        ctx.state["rows"] = ctx.state.get("n", 3)

    @engine.pipe
    async def chunk_then_hold(ctx: pw.Context) -> None:
        await ctx.emit({"row": 0})
        await held.fn(ctx)  # type: ignore[misc]  # an async pipe: PipeFunction also allows sync

    @engine.pipe
    async def chunk_then_fail(ctx: pw.Context) -> None:
        await ctx.emit({"row": 0})
        raise ValueError("secret internal detail")

    @engine.pipe
    async def fail(ctx: pw.Context) -> None:
        raise ValueError("secret internal detail")

    engine.chain("echo", echo)
    engine.chain("held", held, result="released")
    engine.chain("chunks", chunks, result="rows")
    engine.chain("chunk_then_hold", chunk_then_hold)
    engine.chain("chunk_then_fail", chunk_then_fail)
    engine.chain("fail", fail)
    route = registry.route
    route("echo", path="/echo/{item}", chain="echo")
    route("get_echo", method="GET", path="/echo", chain="echo")
    route("held", path="/held", chain="held")
    route("held_continue", path="/held-continue", chain="held", on_disconnect="continue")
    route("held_short", path="/held-short", chain="held", timeout=0.3)
    route("async", path="/async", chain="held", mode="async")
    route("async_echo", path="/async-echo", chain="echo", mode="async")
    route("auto", path="/auto", chain="held", mode="auto", sync_wait=0.2)
    route("auto_echo", path="/auto-echo", chain="echo", mode="auto", sync_wait=5)
    route("stream", path="/stream", chain="chunks", mode="stream")
    route("stream_hold", path="/stream-hold", chain="chunk_then_hold", mode="stream")
    route("stream_fail", path="/stream-fail", chain="chunk_then_fail", mode="stream")
    route("stream_fail_first", path="/stream-fail-first", chain="fail", mode="stream")
    return engine


# -- sync ----------------------------------------------------------------------------------


async def test_sync_answers_with_the_result_and_state_shape() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(Gate())) as served:
            response = await served.client.post(
                "/echo/book?page=2&tag=a&tag=b", json={"title": "Dune"}
            )
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.headers["x-job-id"]
    state = response.json()
    # Body members, query and path parameters, all at the top level of the job state.
    assert state == {
        "title": "Dune",
        "page": "2",
        "tag": ["a", "b"],
        "item": "book",
        "seen": ["item", "page", "tag", "title"],
    }


async def test_get_route_without_body_takes_query_parameters() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(Gate())) as served:
            response = await served.client.get("/echo", params={"q": "x"})
    assert response.json() == {"q": "x", "seen": ["q"]}


async def test_msgpack_in_and_out() -> None:
    body = msgpack.packb({"blob": b"\x00\x01", "n": 1})
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(Gate())) as served:
            sent = await served.client.post(
                "/echo/x",
                content=body,
                headers={"Content-Type": "application/msgpack", "Accept": "application/msgpack"},
            )
            as_json = await served.client.post(
                "/echo/x", content=body, headers={"Content-Type": "application/msgpack"}
            )
    assert sent.headers["content-type"] == "application/msgpack"
    assert msgpack.unpackb(sent.content) == {
        "blob": b"\x00\x01",
        "n": 1,
        "item": "x",
        "seen": ["blob", "item", "n"],
    }
    # JSON has no bytes: they are answered as base64.
    assert as_json.json()["blob"] == "AAE="


async def test_correlation_id_is_taken_when_valid_and_replaced_when_not() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(Gate())) as served:
            given = await served.client.post("/echo/x", headers={"X-Request-ID": "req-42.a:b"})
            bad = await served.client.post("/echo/x", headers={"X-Request-ID": "bad id\twith"})
            none = await served.client.get("/healthz")
            job = await served.client.post(
                "/async-echo", headers={"X-Request-ID": "trace-7"}, json={}
            )
    assert given.headers["x-request-id"] == "req-42.a:b"
    assert bad.headers["x-request-id"] not in ("", "bad id\twith")
    assert len(none.headers["x-request-id"]) == 32
    # The job carries the request's correlation id.
    assert job.json()["correlation_id"] == "trace-7"


async def test_sync_deadline_answers_504() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(Gate())) as served:
            response = await served.client.post("/held-short")
    body = assert_problem(response, 504, "deadline-exceeded")
    assert body["job_id"] == response.headers["x-job-id"]
    assert body["where"] == "chain 'held' > pipe 'held'"


async def test_sync_waits_on_a_store_that_hands_out_copies() -> None:
    """A shared store's record cannot be waited on in this process: the request waits in
    the engine, in a cancel scope of its own, with the same answers."""
    gate = Gate()
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(gate, store=CopyingJobStore())) as served:
            assert served.container.engine.wake("nothing") is None  # no wake to park on
            response = await served.client.post("/echo/1", json={"a": 1})
            assert response.status_code == 200
            assert response.json()["seen"] == ["a", "item"]
            late = await served.client.post("/held-short")
            assert_problem(late, 504, "deadline-exceeded")
            async with raw_client(served.address) as raw:
                await raw.send("POST", "/held")
                await trio.testing.wait_all_tasks_blocked(cushion=0.05)
                assert served.container.parking.parked == 1
            # The socket is closed: the handler is cancelled, and cancels the job.
            with pytest.raises(pw.JobCancelled):
                await served.engine.wait(gate.job_ids[-1])
            assert served.container.parking.parked == 0


# -- client disconnects --------------------------------------------------------------------


async def test_client_disconnect_while_parked_cancels_the_job() -> None:
    gate = Gate()
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(gate)) as served:
            async with raw_client(served.address) as raw:
                await raw.send("POST", "/held")
                await gate.entered.wait()
            # The socket is closed: the handler is cancelled, and cancels the job.
            await gate.cleaned_up.wait()
            with pytest.raises(pw.JobCancelled):
                await served.engine.wait(gate.job_ids[0])
            assert not gate.release.is_set()


async def test_on_disconnect_continue_keeps_the_job_running() -> None:
    gate = Gate()
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(gate)) as served:
            async with raw_client(served.address) as raw:
                await raw.send("POST", "/held-continue")
                await gate.entered.wait()
            # Let the server notice the closed socket and unpark the request.
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)
            assert served.container.parking.parked == 0
            job_id = gate.job_ids[0]
            assert (await served.engine.status(job_id)).status is pw.Status.RUNNING
            gate.release.set()
            assert await served.engine.wait(job_id) is True


# -- async ---------------------------------------------------------------------------------


async def test_async_answers_202_with_location_and_token() -> None:
    gate = Gate()
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(gate)) as served:
            response = await served.client.post("/async", headers={"Prefer": "respond-async"})
            assert response.status_code == 202
            body = response.json()
            job_id, token = body["id"], body["token"]
            assert response.headers["location"] == f"/jobs/{job_id}"
            assert response.headers["x-job-token"] == token
            assert response.headers["preference-applied"] == "respond-async"
            assert body["links"] == {"self": f"/jobs/{job_id}", "cancel": f"/jobs/{job_id}"}
            await gate.entered.wait()
            gate.release.set()
            await served.engine.wait(job_id)
            status = await served.client.get(f"/jobs/{job_id}", headers=bearer(token))
            result = await served.client.get(f"/jobs/{job_id}/result", headers=bearer(token))
    assert status.json()["status"] == "done"
    assert status.json()["links"]["result"] == f"/jobs/{job_id}/result"
    assert result.json() is True


# -- auto ----------------------------------------------------------------------------------


async def test_auto_answers_sync_when_the_job_is_quick() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(Gate())) as served:
            response = await served.client.post("/auto-echo", json={"a": 1})
    assert response.status_code == 200
    assert response.json() == {"a": 1, "seen": ["a"]}
    assert "preference-applied" not in response.headers


async def test_auto_hands_over_a_202_for_the_same_job_after_sync_wait() -> None:
    gate = Gate()
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(gate)) as served:
            response = await served.client.post("/auto")
            assert response.status_code == 202
            job_id, token = response.json()["id"], response.json()["token"]
            assert gate.job_ids == [job_id]
            # Handing over did not cancel the job: it finishes and its result is there.
            gate.release.set()
            await served.engine.wait(job_id)
            result = await served.client.get(f"/jobs/{job_id}/result", headers=bearer(token))
    assert result.status_code == 200
    assert result.json() is True


@pytest.mark.parametrize(
    ("prefer", "applied"),
    [
        pytest.param("respond-async", "respond-async", id="respond-async"),
        pytest.param("respond-async, wait=0", "respond-async, wait=0", id="with-wait"),
    ],
)
async def test_auto_honours_prefer_respond_async(prefer: str, applied: str) -> None:
    gate = Gate()
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(gate)) as served:
            response = await served.client.post("/auto", headers={"Prefer": prefer})
            gate.release.set()
    assert response.status_code == 202
    assert response.headers["preference-applied"] == applied


async def test_auto_prefer_wait_beyond_sync_wait_is_not_applied() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(Gate())) as served:
            response = await served.client.post("/auto-echo", headers={"Prefer": "wait=600"})
    assert response.status_code == 200
    assert "preference-applied" not in response.headers


# -- stream --------------------------------------------------------------------------------


async def test_stream_sends_each_chunk_then_the_end() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(Gate())) as served:
            response = await served.client.post("/stream", json={"n": 3})
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["cache-control"] == "no-cache"
    assert sse_events(response.text) == [
        ("chunk", {"row": 0}),
        ("chunk", {"row": 1}),
        ("chunk", {"row": 2}),
        ("end", {"status": "done", "result": 3}),
    ]
    assert "id: 3\n" in response.text


async def test_stream_chunks_arrive_while_the_job_runs() -> None:
    gate = Gate()
    with trio.fail_after(HANG_GUARD):
        async with (
            serving(make_engine(gate)) as served,
            served.client.stream("POST", "/stream-hold") as response,
            aclosing(cast(AsyncGenerator[str], response.aiter_lines())) as lines,
        ):
            # The first chunk is flushed before the pipe goes on.
            assert await anext(lines) == "id: 1"
            assert await anext(lines) == "event: chunk"
            assert await anext(lines) == 'data: {"row":0}'
            assert not gate.release.is_set()
            gate.release.set()
            rest = "\n".join([line async for line in lines])
    assert "event: end" in rest


async def test_stream_error_after_the_first_chunk_ends_with_an_error_event() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(Gate())) as served:
            response = await served.client.post("/stream-fail")
    assert response.status_code == 200
    events = sse_events(response.text)
    assert events[0] == ("chunk", {"row": 0})
    kind, problem = events[1]
    assert kind == "error"
    assert problem["status"] == 500
    assert problem["type"] == "urn:pipework:problem:pipe-failed"
    assert problem["error_type"] == "ValueError"
    assert problem["where"] == "chain 'chunk_then_fail' > pipe 'chunk_then_fail'"
    assert "secret" not in response.text
    assert len(events) == 2


async def test_stream_that_fails_before_any_chunk_is_a_plain_problem() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(Gate())) as served:
            response = await served.client.post("/stream-fail-first")
    body = assert_problem(response, 500, "pipe-failed")
    assert body["error_type"] == "ValueError"
    assert "secret" not in body["detail"]


async def test_stream_client_disconnect_cancels_the_job() -> None:
    gate = Gate()
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(gate)) as served:
            async with raw_client(served.address) as raw:
                await raw.send("POST", "/stream-hold")
                assert b'data: {"row":0}' in await raw.receive_until(b'data: {"row":0}')
                await gate.entered.wait()
            await gate.cleaned_up.wait()
            with pytest.raises(pw.JobCancelled):
                await served.engine.wait(gate.job_ids[0])


async def test_expose_errors_shows_pipe_messages() -> None:
    config = ContainerConfig(expose_errors=True, shutdown_grace=1.0)
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(Gate()), config=config) as served:
            response = await served.client.post("/stream-fail-first")
    assert assert_problem(response, 500, "pipe-failed")["detail"] == "secret internal detail"


async def test_one_keep_alive_connection_serves_every_mode_in_turn() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(Gate())) as served, raw_client(served.address) as raw:
            answers = []
            for path in ("/echo/a", "/stream", "/async-echo", "/auto-echo"):
                await raw.send("POST", path)
                response, _ = await raw.receive()
                answers.append(response.status_code)
                raw.conn.start_next_cycle()
    assert answers == [200, 200, 202, 200]
