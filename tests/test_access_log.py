"""The access log, over real HTTP, for every kind of request: a route's (sync and async,
with a backend call), a proxy route's (a request and a websocket), the job and admin
endpoints'. Each line names the client (a trusted proxy's forwarding headers honoured, an
untrusted peer's ignored), the method, path and query (secrets redacted), the status, the
sizes, the duration, the user agent, the route, the service and host, the retries, the
request and trace ids and the pid; in JSON and as text."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from wsproto.events import TextMessage

from pipework import JsonFormatter
from pipework.container import BoundAddress

from ._proxy_backend import Backend, running_backend
from ._proxy_gateway import API, gateway, gateway_file
from .test_board_http import open_websocket
from .test_board_http import serving as serving_boards
from .test_proxy_websocket import Client

HANG_GUARD = 30.0
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE}-00f067aa0ba902b7-01"

ROUTES = (
    API
    + """
[pipes.call]
service = "echo"
path = "/echo/item"
into = "answer"

[routes.items]
path = "/items"
chain = ["call"]
result = "answer"

[routes.later]
path = "/later"
mode = "async"
chain = ["call"]
"""
)

TRUSTING = """
trusted_proxies = ["127.0.0.1"]
access_log_redact = ["token", "api_key"]
"""


@asynccontextmanager
async def served(
    tmp_path: Path, server: str = TRUSTING
) -> AsyncIterator[tuple[Backend, BoundAddress, httpx.AsyncClient]]:
    async with (
        running_backend() as backend,
        gateway(tmp_path, gateway_file(backend, ROUTES, server=server)) as (_, address),
        httpx.AsyncClient(base_url=address.url, timeout=HANG_GUARD) as http,
    ):
        yield backend, address, http


def access_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "pipework.access"]


def fields(record: logging.LogRecord) -> dict[str, Any]:
    """The line as the JSON formatter writes it: every field it carries."""
    data: dict[str, Any] = json.loads(JsonFormatter().format(record))
    return data


def the_line(caplog: pytest.LogCaptureFixture, request_id: str) -> dict[str, Any]:
    (line,) = [r for r in access_lines(caplog) if getattr(r, "correlation_id", "") == request_id]
    return fields(line)


def common(data: dict[str, Any]) -> None:
    """What every line carries whatever the request."""
    assert data["event"] == "request"
    assert data["pid"] == os.getpid()
    assert data["duration"] >= 0


async def test_a_sync_route_with_a_backend_call(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pipework.access")
    body = json.dumps({"n": 1}).encode()
    with trio.fail_after(HANG_GUARD):
        async with served(tmp_path) as (backend, _, http):
            answer = await http.post(
                "/items?token=s3cret&page=2&Api_Key=k",
                content=body,
                headers={
                    "Content-Type": "application/json",
                    "User-Agent": "probe/1.0 (tests)",
                    "X-Request-ID": "req-sync",
                    "X-Forwarded-For": "198.51.100.1, 203.0.113.7",
                    "traceparent": TRACEPARENT,
                },
            )
            assert answer.status_code == 200
    data = the_line(caplog, "req-sync")
    common(data)
    assert {k: data.get(k) for k in EXPECTED_SYNC} == {
        **EXPECTED_SYNC,
        "bytes_out": len(answer.content),
        "host": f"127.0.0.1:{backend.port}",
    }
    # The text form: CLIENT METHOD TARGET STATUS DURATION name=value... request_id=ID
    (record,) = [r for r in access_lines(caplog) if r.correlation_id == "req-sync"]  # type: ignore[attr-defined]  # set through `extra`
    text = record.getMessage()
    assert text.startswith("203.0.113.7 POST /items?token=REDACTED&page=2&Api_Key=REDACTED 200 ")
    assert (
        f" bytes_in={len(body)} bytes_out={len(answer.content)} route=items service=echo " in text
    )
    assert ' user_agent="probe/1.0 (tests)" ' in text
    assert f" trace_id={TRACE} pid={os.getpid()} request_id=req-sync" in text
    assert text.endswith("request_id=req-sync")
    assert "s3cret" not in text


EXPECTED_SYNC: dict[str, Any] = {
    # The peer (127.0.0.1) is a trusted proxy: the nearest untrusted hop it names.
    "client": "203.0.113.7",
    "method": "POST",
    "path": "/items",
    "query": "token=REDACTED&page=2&Api_Key=REDACTED",
    "status": 200,
    "bytes_in": len(b'{"n": 1}'),
    "bytes_out": None,  # set per run
    "user_agent": "probe/1.0 (tests)",
    "route": "items",
    "service": "echo",
    "host": None,  # set per run
    "retries": 0,
    "correlation_id": "req-sync",
    "trace_id": TRACE,
}


async def test_an_async_route_and_its_job_endpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pipework.access")
    with trio.fail_after(HANG_GUARD):
        async with served(tmp_path) as (_, _, http):
            accepted = await http.post("/later", json={}, headers={"X-Request-ID": "req-async"})
            assert accepted.status_code == 202
            token = accepted.headers["x-job-token"]
            status = await http.get(
                accepted.headers["location"],
                headers={"X-Job-Token": token, "X-Request-ID": "req-status"},
            )
            assert status.status_code == 200
    later = the_line(caplog, "req-async")
    common(later)
    assert (later["route"], later["status"], later["method"]) == ("later", 202, "POST")
    assert later["bytes_out"] == len(accepted.content)
    assert later["client"] == "127.0.0.1"  # no forwarding header: the peer itself
    job = the_line(caplog, "req-status")
    common(job)
    assert (job["endpoint"], job["status"], job["path"]) == ("jobs", 200, status.url.path)
    assert "route" not in job
    assert job["bytes_out"] == len(status.content)


async def test_an_admin_endpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pipework.access")
    with trio.fail_after(HANG_GUARD):
        async with served(tmp_path) as (_, _, http):
            pool = await http.get(
                "/admin/pool",
                headers={"Authorization": "Bearer proxy-admin", "X-Request-ID": "req-admin"},
            )
            assert pool.status_code == 200
    data = the_line(caplog, "req-admin")
    common(data)
    assert (data["endpoint"], data["status"], data["method"]) == ("admin", 200, "GET")


async def test_a_proxy_route(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pipework.access")
    body = b"x" * 1000
    with trio.fail_after(HANG_GUARD):
        async with served(tmp_path) as (backend, _, http):
            answer = await http.post(
                "/api/echo/up?api_key=k&q=1",
                content=body,
                headers={
                    "X-Request-ID": "req-proxy",
                    "User-Agent": "probe/2",
                    "Forwarded": 'for="[2001:db8::7]:4711";proto=https',
                    "traceparent": TRACEPARENT,
                },
            )
            assert answer.status_code == 200
    data = the_line(caplog, "req-proxy")
    common(data)
    assert {k: data.get(k) for k in EXPECTED_PROXY} == {
        **EXPECTED_PROXY,
        "bytes_out": len(answer.content),
        "host": f"127.0.0.1:{backend.port}",
    }


EXPECTED_PROXY: dict[str, Any] = {
    "client": "2001:db8::7",  # Forwarded's for=, from a trusted peer
    "method": "POST",
    "path": "/api/echo/up",
    "query": "api_key=REDACTED&q=1",
    "status": 200,
    "upstream_status": 200,
    "bytes_in": 1000,
    "bytes_out": None,
    "user_agent": "probe/2",
    "route": "api",
    "service": "echo",
    "host": None,
    "retries": 0,
    "correlation_id": "req-proxy",
    "trace_id": TRACE,
}


async def test_a_proxied_websocket(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pipework.access")
    with trio.fail_after(HANG_GUARD):
        async with (
            served(tmp_path) as (backend, address, _),
            Client.opening(address, "/api/chat") as ws,
        ):
            await ws.accepted()
            await ws.say(TextMessage("close 4002"))
            await ws.closed()
    (line,) = [fields(r) for r in access_lines(caplog) if r.__dict__.get("route") == "api"]
    common(line)
    assert {k: line.get(k) for k in ("method", "path", "status", "route", "service")} == {
        "method": "GET",
        "path": "/api/chat",
        "status": 101,
        "route": "api",
        "service": "echo",
    }
    assert line["host"] == f"127.0.0.1:{backend.port}"
    assert line["close_code"] == 4002
    assert line["client"] == "127.0.0.1"


async def test_forwarding_headers_from_an_untrusted_peer_are_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pipework.access")
    spoofed = {"X-Forwarded-For": "203.0.113.7", "Forwarded": "for=198.51.100.9"}
    with trio.fail_after(HANG_GUARD):
        async with served(tmp_path, server="") as (_, _, http):
            for path, request_id in (("/items?token=t", "req-pipe"), ("/api/echo/x", "req-api")):
                answer = await http.post(
                    path, json={}, headers={**spoofed, "X-Request-ID": request_id}
                )
                assert answer.status_code == 200
    for request_id in ("req-pipe", "req-api"):
        assert the_line(caplog, request_id)["client"] == "127.0.0.1"
    # The default redaction list holds `token`.
    assert the_line(caplog, "req-pipe")["query"] == "token=REDACTED"


async def test_a_board_websocket(caplog: pytest.LogCaptureFixture) -> None:
    """The container's own websockets (a board's follow) have their line too: a refused
    one with its refusal's status."""
    caplog.set_level(logging.INFO, logger="pipework.access")
    with trio.fail_after(HANG_GUARD):
        async with serving_boards() as board:
            stream, _, _ = await open_websocket(board, "/boards/news/nope?token=t")
            await stream.aclose()
    (line,) = [fields(r) for r in access_lines(caplog) if r.__dict__.get("endpoint") == "board_ws"]
    common(line)
    assert (line["method"], line["path"], line["status"]) == ("GET", "/boards/news/nope", 404)
    assert line["query"] == "token=REDACTED"
    assert line["client"] == "127.0.0.1"


async def test_a_method_a_proxy_prefix_does_not_take(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pipework.access")
    routes = '[routes.api]\nproxy = "echo"\nprefix = "/api"\nmethods = ["GET"]\n'
    with trio.fail_after(HANG_GUARD):
        async with (
            running_backend() as backend,
            gateway(tmp_path, gateway_file(backend, routes)) as (_, address),
            httpx.AsyncClient(base_url=address.url) as http,
        ):
            refused = await http.delete("/api/x?q=1", headers={"X-Request-ID": "req-405"})
            assert refused.status_code == 405
    data = the_line(caplog, "req-405")
    common(data)
    assert (data["method"], data["path"], data["query"], data["status"]) == (
        "DELETE",
        "/api/x",
        "q=1",
        405,
    )
