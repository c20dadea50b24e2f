"""Every bad input and every failure gets its status and an RFC 9457 problem body; an
overloaded engine refuses new work with 503 + Retry-After while accepted jobs finish."""

from __future__ import annotations

import datetime
from collections.abc import AsyncIterator
from typing import NoReturn

import msgpack
import pytest
import trio
import trio.testing

import pipework as pw
from pipework import MemoryEventQueue
from pipework.container import ContainerConfig
from pipework.dispatcher._events import Event

from .test_container_harness import HANG_GUARD, assert_problem, bearer, raw_client, serving

JSON = {"Content-Type": "application/json"}


class Refused(Exception):
    """What a pipe raises to reject its input on purpose."""

    http_status = 422


def make_engine(**kwargs: object) -> pw.Engine:
    registry = pw.Registry()
    engine = pw.Engine(registry=registry, **kwargs)  # type: ignore[arg-type]  # options vary by test

    @engine.pipe
    async def echo(ctx: pw.Context) -> None:
        return None

    @engine.pipe
    async def crash(ctx: pw.Context) -> None:
        raise KeyError("db password is hunter2")

    @engine.pipe
    async def backend(ctx: pw.Context) -> None:
        raise pw.BackendError("service 'users' answered 500", service="users", status=500)

    @engine.pipe
    async def refuse(ctx: pw.Context) -> None:
        raise Refused("quantity must be positive")

    @engine.pipe
    async def store_set(ctx: pw.Context) -> None:
        ctx.state["bad"] = {1, 2}

    engine.chain("echo", echo)
    engine.chain("crash", crash)
    engine.chain("backend", backend)
    engine.chain("refuse", refuse)
    engine.chain("store_set", store_set)
    for name in ("echo", "crash", "backend", "refuse", "store_set"):
        registry.route(name, path=f"/{name}/{{id}}", chain=name)
    registry.route("tiny", path="/tiny", chain="echo", max_body=8)
    return engine


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status", "slug"),
    [
        pytest.param("POST", "/nowhere", {}, 404, None, id="unknown-route"),
        pytest.param("GET", "/echo/1", {}, 405, None, id="wrong-method"),
        pytest.param(
            "POST", "/echo/1", {"content": b"{nope", "headers": JSON}, 400, "malformed",
            id="malformed-json",
        ),
        pytest.param(
            "POST", "/echo/1", {"content": b"NaN", "headers": JSON}, 400, "malformed",
            id="json-nan",
        ),
        pytest.param(
            "POST", "/echo/1",
            {"content": b"\xc1", "headers": {"Content-Type": "application/msgpack"}},
            400, "malformed", id="malformed-msgpack",
        ),
        pytest.param(
            "POST", "/echo/1", {"json": [1, 2]}, 400, "body-not-an-object", id="not-an-object",
        ),
        pytest.param(
            "POST", "/echo/1", {"json": {"id": "2"}}, 400, "conflicting-input",
            id="body-conflicts-with-path",
        ),
        pytest.param(
            "POST", "/echo/1", {"content": b"a=1", "headers": {"Content-Type": "text/plain"}},
            415, "unsupported-media-type", id="unsupported-type",
        ),
        pytest.param(
            "POST", "/echo/1", {"content": b"{}"}, 415, "unsupported-media-type",
            id="no-content-type",
        ),
        pytest.param(
            "POST", "/tiny", {"json": {"long": "x" * 20}}, 413, "body-too-large",
            id="too-large",
        ),
        pytest.param(
            "POST", "/echo/1", {"headers": {"Idempotency-Key": "x" * 300}}, 400,
            "bad-idempotency-key", id="bad-idempotency-key",
        ),
    ],
)  # fmt: skip
async def test_bad_input(
    method: str, path: str, kwargs: dict[str, object], status: int, slug: str | None
) -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine()) as served:
            response = await served.client.request(method, path, **kwargs)  # type: ignore[arg-type]  # per-case options
    body = assert_problem(response, status, slug)
    assert body["instance"] == path
    if status == 405:
        assert "POST" in response.headers["allow"]


MSGPACK = {"Content-Type": "application/msgpack"}


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(msgpack.packb({b"k": 1}), id="bytes-key"),
        pytest.param(msgpack.packb({"a": [{b"k": 1}]}), id="nested-bytes-key"),
        pytest.param(msgpack.packb({1: 2}), id="int-key"),
        pytest.param(msgpack.packb({"a": {1: 2}}), id="nested-int-key"),
        pytest.param(msgpack.packb({(1, 2): 3}), id="array-key"),
        pytest.param(b"\x81\x80\x01", id="map-key"),
    ],
)
async def test_a_msgpack_map_key_that_is_not_a_string_is_malformed(body: bytes) -> None:
    """docs/http-api.md: non-string map keys are ``400 malformed``, at any depth; job state
    (and JSON, which answers carry) has string keys only."""
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine()) as served:
            response = await served.client.post("/echo/1", content=body, headers=MSGPACK)
    problem = assert_problem(response, 400, "malformed")
    assert problem["title"] == "Malformed body"
    assert "map key" in problem["detail"]


async def test_body_over_the_limit_without_content_length_is_413() -> None:
    async def body() -> AsyncIterator[bytes]:
        for _ in range(4):
            yield b"[1,2,3,4,5]"

    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine()) as served:
            response = await served.client.post(
                "/tiny", content=body(), headers={"Content-Type": "application/json"}
            )
    assert "content-length" not in response.request.headers
    assert_problem(response, 413, "body-too-large")


async def test_msgpack_value_that_state_cannot_hold_is_400_with_its_path() -> None:
    when = datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC)
    body = msgpack.packb({"at": {"when": when}}, datetime=True)
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine()) as served:
            response = await served.client.post(
                "/echo/1", content=body, headers={"Content-Type": "application/msgpack"}
            )
    assert assert_problem(response, 400, "invalid-state")["path"] == "state.at.when"


async def test_oversized_headers_are_431() -> None:
    config = ContainerConfig(max_header_bytes=1024, shutdown_grace=1.0)
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(), config=config) as served:
            response = await served.client.post("/echo/1", headers={"X-Big": "x" * 2048})
            fits = await served.client.post("/echo/1", headers={"X-Big": "x" * 512})
    assert_problem(response, 431, "headers-too-large")
    assert fits.status_code == 200


async def test_headers_arriving_in_pieces_are_bounded_by_the_server() -> None:
    config = ContainerConfig(max_header_bytes=1024, shutdown_grace=1.0)
    with trio.fail_after(HANG_GUARD):
        async with (
            serving(make_engine(), config=config) as served,
            raw_client(served.address) as raw,
        ):
            await raw.stream.send_all(b"POST /echo/1 HTTP/1.1\r\nHost: t\r\n")
            for _ in range(8):
                await raw.stream.send_all(b"X-Big: " + b"x" * 200 + b"\r\n")
            # Refused before the app sees it: hypercorn's own plain answer.
            response, _ = await raw.receive()
    assert response.status_code == 431


async def test_pipe_failure_is_500_with_type_and_stage_but_no_message() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine()) as served:
            response = await served.client.post("/crash/1")
    body = assert_problem(response, 500, "pipe-failed")
    assert body["error_type"] == "KeyError"
    assert body["where"] == "chain 'crash' > pipe 'crash'"
    assert body["job_id"] == response.headers["x-job-id"]
    assert "hunter2" not in response.text
    assert "Traceback" not in response.text


async def test_backend_failure_is_502() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine()) as served:
            response = await served.client.post("/backend/1")
    body = assert_problem(response, 502, "backend-failed")
    assert body["service"] == "users"
    assert body["backend_status"] == 500
    assert body["detail"] == "service 'users' answered 500"


async def test_a_pipe_can_refuse_input_with_a_4xx() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine()) as served:
            response = await served.client.post("/refuse/1")
    body = assert_problem(response, 422, "pipe-refused")
    assert body["detail"] == "quantity must be positive"


async def test_overload_is_503_with_retry_after_and_accepted_jobs_finish() -> None:
    registry = pw.Registry()
    engine = pw.Engine(registry=registry, pool=pw.WeightedPool(1), queue_capacity=2)
    release = trio.Event()

    @engine.pipe
    async def work(ctx: pw.Context) -> None:
        await release.wait()

    engine.chain("work", work)
    registry.route("work", path="/work", chain="work", mode="async")
    with trio.fail_after(HANG_GUARD):
        async with serving(engine) as served:
            accepted = []
            first = await served.client.post("/work")
            accepted.append(first.json())
            await trio.testing.wait_all_tasks_blocked()  # the first job holds the one slot
            for _ in range(2):
                accepted.append((await served.client.post("/work")).json())
            refused = await served.client.post("/work")
            body = assert_problem(refused, 503, "overloaded")
            assert refused.headers["retry-after"] == "1"
            assert body["reason"] == "queue_full"
            release.set()
            for job in accepted:
                await served.engine.wait(job["id"])
                status = await served.client.get(f"/jobs/{job['id']}", headers=bearer(job["token"]))
                assert status.json()["status"] == "done"


async def test_pool_rejection_is_503_with_reason() -> None:
    registry = pw.Registry()
    engine = pw.Engine(
        registry=registry, pool=pw.WeightedPool(1, default=pw.Weights(max_waiting=0))
    )
    release = trio.Event()

    @engine.pipe
    async def work(ctx: pw.Context) -> None:
        await release.wait()

    engine.chain("work", work)
    registry.route("work", path="/work", chain="work")
    with trio.fail_after(HANG_GUARD):
        async with serving(engine) as served, trio.open_nursery() as nursery:
            nursery.start_soon(served.client.post, "/work")
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)
            refused = await served.client.post("/work")
            release.set()
    body = assert_problem(refused, 503, "rejected")
    assert body["reason"] == "queue_full"
    assert "retry-after" in refused.headers


class GatedQueue(MemoryEventQueue):
    """An event queue whose dispatcher can be held: a batch taken while ``gate`` is closed
    is handed over only once it opens (a stuck dispatcher, as far as jobs can tell)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = trio.Event()
        self.gate.set()

    async def get_batch(self, limit: int = 256) -> list[Event]:
        batch = await super().get_batch(limit)
        await self.gate.wait()
        return batch


async def test_healthz_and_readyz() -> None:
    queue = GatedQueue()
    engine = pw.Engine(pool=pw.WeightedPool(1), queue=queue)
    release = trio.Event()
    entered = trio.Event()

    @engine.pipe
    async def hog(ctx: pw.Context) -> None:
        entered.set()
        await release.wait()

    engine.chain("hog", hog)
    # The canary's bound: "not ready" below waits it out; "ready" must not need it all,
    # however busy the machine.
    config = ContainerConfig(readiness_timeout=1.0, shutdown_grace=1.0)
    with trio.fail_after(HANG_GUARD):
        async with serving(engine, config=config) as served:
            assert (await served.client.get("/readyz")).json() == {"status": "ready"}
            hog_job = await served.engine.submit("hog")
            await entered.wait()
            # The only worker is busy: the canary has a lane of its own, so still ready.
            busy = await served.client.get("/readyz")
            # The dispatcher takes no events: the canary cannot get through, so not ready.
            queue.gate = trio.Event()
            not_ready = await served.client.get("/readyz")
            alive = await served.client.get("/healthz")
            queue.gate.set()
            release.set()
            await served.engine.wait(hog_job)
            ready_again = await served.client.get("/readyz")
    assert busy.json() == {"status": "ready"}
    assert_problem(not_ready, 503, "not-ready")
    assert alive.json() == {"status": "ok"}
    assert ready_again.status_code == 200


async def test_unhandled_bug_is_a_500_problem_and_logged(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*args: object) -> NoReturn:
        raise RuntimeError("internal detail")

    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine()) as served:
            monkeypatch.setattr(served.container.submissions, "_accept", broken)
            response = await served.client.post("/echo/1")
    body = assert_problem(response, 500)
    assert "internal detail" not in response.text
    logged = [r for r in caplog.records if body["correlation_id"] in r.getMessage()]
    assert logged
    assert logged[0].exc_info is not None
