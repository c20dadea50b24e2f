"""Logs an operator can read, and public errors that say what the client can do:
one WARNING line per failed backend call (traceback only at DEBUG), an access log line
per request, JSON on every line with ``--log-format json``; refusals without the pool's
numbers; OPTIONS with the Allow of the 405."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

import pipework as pw
from pipework import Backends, HttpCall, Service, http_pipe

from .test_container_harness import HANG_GUARD, assert_no_content, assert_problem, serving

ROOT = Path(__file__).resolve().parent.parent


def failing_engine() -> tuple[pw.Engine, Backends]:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/down":
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(503, json={"busy": True})

    backends = Backends(
        [Service("users", "http://users.internal")], transport=httpx.MockTransport(handler)
    )
    registry = pw.Registry()
    engine = pw.Engine(registry=registry)
    backends.metrics = engine.metrics
    registry.add_pipe(http_pipe("down", HttpCall.of("users", "/down", into="x"), backends))
    registry.add_pipe(http_pipe("busy", HttpCall.of("users", "/busy", into="x"), backends))
    engine.chain("down", "down")
    engine.chain("busy", "busy")
    registry.route("down", path="/down", chain="down", method="GET")
    registry.route("busy", path="/busy", chain="busy", method="GET")
    return engine, backends


@pytest.mark.parametrize("level", [logging.INFO, logging.DEBUG])
async def test_a_failed_backend_call_is_one_warning_line(
    caplog: pytest.LogCaptureFixture, level: int
) -> None:
    caplog.set_level(level, logger="pipework")
    engine, backends = failing_engine()
    with trio.fail_after(HANG_GUARD):
        async with backends, serving(engine) as served:
            down = await served.client.get("/down", headers={"X-Request-ID": "req-down"})
            busy = await served.client.get("/busy", headers={"X-Request-ID": "req-busy"})
    assert (down.status_code, busy.status_code) == (502, 502)
    failed = [r for r in caplog.records if getattr(r, "event", None) == "backend call failed"]
    assert [(r.levelno, r.service, r.kind, r.correlation_id) for r in failed] == [  # type: ignore[attr-defined]  # fields set through `extra`
        (logging.WARNING, "users", "connect", "req-down"),
        (logging.WARNING, "users", "status", "req-busy"),
    ]
    assert failed[1].status == 503  # type: ignore[attr-defined]  # set through `extra`
    assert all(r.job_id for r in failed)  # type: ignore[attr-defined]  # set through `extra`
    with_traceback = [r for r in caplog.records if r.exc_info]
    if level == logging.DEBUG:
        assert {getattr(r, "event", None) for r in with_traceback} >= {"backend call failed"}
    else:
        assert with_traceback == []  # no chained httpx traceback at INFO


async def test_refusals_tell_the_client_what_to_do_not_the_pools_numbers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="pipework")
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
    detail = body["detail"]
    assert "max_waiting" not in detail
    assert "raise" not in detail
    assert "waiting steps" not in detail
    assert detail.startswith("the server is too busy to take this request now")
    assert f"retry after {refused.headers['retry-after']} s" in detail
    # The operator's version is in the log, under the request's correlation id.
    assert any(
        "max_waiting" in record.getMessage()
        and getattr(record, "correlation_id", None) == body["correlation_id"]
        for record in caplog.records
    )


async def test_options_answers_with_the_allow_of_the_405() -> None:
    registry = pw.Registry()
    engine = pw.Engine(registry=registry)

    @engine.pipe
    async def noop(ctx: pw.Context) -> None:
        pass

    engine.chain("noop", noop)
    registry.route("read", path="/things/{id}", chain="noop", method="GET")
    registry.route("write", path="/things/{id}", chain="noop", method="PUT")
    with trio.fail_after(HANG_GUARD):
        async with serving(engine) as served:
            refused = await served.client.delete("/things/1")
            options = await served.client.options("/things/1")
            nowhere = await served.client.options("/nowhere")
    assert refused.status_code == 405
    assert options.status_code == 204
    assert_no_content(options)
    assert options.headers["allow"] == refused.headers["allow"]
    assert set(options.headers["allow"].split(", ")) == {"GET", "HEAD", "PUT"}
    assert nowhere.status_code == 404


def test_serve_with_json_logs_writes_only_json_lines_with_an_access_log() -> None:
    lines = _serve_and_call(["--log-format", "json"])
    records = [json.loads(line) for line in lines]  # every line parses
    assert any(r["message"].startswith("pipework serving on http://") for r in records)
    (access,) = [r for r in records if r.get("event") == "request"]
    assert (access["method"], access["path"], access["status"]) == ("POST", "/hello/ada", 200)
    assert access["correlation_id"] == "req-7"
    assert access["duration"] >= 0


def test_the_access_log_is_one_text_line_and_goes_off_with_a_flag() -> None:
    on = [line for line in _serve_and_call([]) if "pipework.access" in line]
    assert len(on) == 1
    assert "POST /hello/ada 200 " in on[0]
    assert on[0].endswith("request_id=req-7")
    off = _serve_and_call(["--no-access-log"])
    assert not any("pipework.access" in line for line in off)


def _serve_and_call(flags: list[str]) -> list[str]:
    command = [
        sys.executable,
        "-m",
        "pipework",
        "serve",
        "tests.test_container_cli:build_engine",
        "--port",
        "0",
        *flags,
    ]
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    assert process.stderr is not None
    lines: list[str] = []
    try:
        for line in process.stderr:
            lines.append(line.rstrip("\n"))
            if "pipework serving on " in line:
                url = line.split("pipework serving on ", 1)[1].split('"', 1)[0].strip()
                answer = httpx.post(
                    url + "/hello/ada",
                    headers={"X-Request-ID": "req-7"},
                    timeout=HANG_GUARD,
                )
                assert answer.status_code == 200
                break
        process.send_signal(signal.SIGTERM)
        _, rest = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    lines.extend(rest.splitlines())
    assert process.returncode == 0, lines
    return [line for line in lines if line]
