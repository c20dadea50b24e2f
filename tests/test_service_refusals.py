"""A service's refusal (its circuit breaker open) is cheap and quiet, and answered as before:
a gateway from its file in front of two small real trio backends that answer 503, so two
calls open the breaker; then a route whose chain is one HTTP pipe, a proxy route and a
proxied websocket to the same service, each refused. The refused job's log is one INFO
line of its own with no traceback (its ``pipe ended`` line at DEBUG), while a failure that
is no refusal is logged as ever; a proxied request or websocket is refused before it waits
for a slot of its key or anything of its body is read. Real time (the gateway reads its
file in a thread): every wait is on a condition."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio

from pipework import Gateway
from pipework.backends._hosts_core import ServiceCore
from pipework.container import BoundAddress

from ._proxy_gateway import gateway
from .test_proxy_websocket import Client
from .test_resilience_io import HANG_GUARD, counts, hosts, status, urls


def gateway_file(hosts: Sequence[str]) -> str:
    """Service ``api`` over ``hosts``, whose breaker opens after two failed tries, with one
    slot and no room to wait for it; a chain of one HTTP pipe to it (``GET /pipe``), and
    every path under ``/api`` proxied to it."""
    listed = ", ".join(f'"{url}"' for url in hosts)
    return f"""
[server]
admin_token = "proxy-admin"

[services.api]
hosts = [{listed}]
balance = "round_robin"
timeout = 5
limit = 1
max_waiting = 0

[services.api.breaker]
minimum_calls = 2
wait = 30

[pipes.call_api]
service = "api"
path = "/x"
into = "x"

[routes.pipe]
method = "GET"
path = "/pipe"
chain = ["call_api"]
result = "x"

[routes.api]
proxy = "api"
prefix = "/api"
strip_prefix = true
"""


@asynccontextmanager
async def opened(
    tmp_path: Path,
) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient, BoundAddress]]:
    """The gateway, its service's breaker opened by two calls of the pipe (each a 503 from
    one host: ``req-failed-0`` and ``req-failed-1``)."""
    async with (
        hosts(status(503), status(503)) as found,
        gateway(tmp_path, gateway_file(urls(found))) as (gw, address),
        httpx.AsyncClient(base_url=address.url, timeout=HANG_GUARD) as http,
    ):
        for n in range(2):
            failed = await http.get("/pipe", headers={"X-Request-ID": f"req-failed-{n}"})
            assert failed.status_code == 502, failed.text  # the backend's 503
        assert core(gw).breaker.state.value == "open"
        assert counts(found) == [1, 1]
        yield gw, http, address
        assert counts(found) == [1, 1]  # nothing sent for any refusal


def core(gw: Gateway) -> ServiceCore:
    assert gw._backends is not None
    return gw._backends.lean("api").core


def trail(
    caplog: pytest.LogCaptureFixture, correlation_id: str, logger: str = "pipework.job"
) -> list[tuple[int, str, bool]]:
    """The ``logger`` lines of one request: level, event, whether a traceback is attached."""
    return [
        (r.levelno, getattr(r, "event", ""), r.exc_info is not None)
        for r in caplog.records
        if r.name == logger and getattr(r, "correlation_id", None) == correlation_id
    ]


# -- an HTTP pipe's refusal ------------------------------------------------------------------


@pytest.mark.parametrize("level", [logging.INFO, logging.DEBUG])
async def test_a_refused_call_ends_its_job_in_one_info_line_without_a_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, level: int
) -> None:
    caplog.set_level(level, logger="pipework")
    with trio.fail_after(HANG_GUARD):
        async with opened(tmp_path) as (_, http, _):
            refused = await http.get("/pipe", headers={"X-Request-ID": "req-refused"})
    assert refused.status_code == 503
    job = trail(caplog, "req-refused")
    # The job's life is DEBUG: at INFO the refusal is its access line (503) alone.
    expected = []
    if level == logging.DEBUG:
        expected = [
            (logging.DEBUG, "job accepted", False),
            (logging.DEBUG, "pipe ended", False),
            (logging.DEBUG, "job finished", False),
        ]
    assert job == expected
    (access,) = trail(caplog, "req-refused", "pipework.access")
    assert access == (logging.INFO, "request", False)
    if level == logging.DEBUG:
        (end,) = [r for r in caplog.records if getattr(r, "event", "") == "job finished"][-1:]
        assert (end.outcome, end.correlation_id) == ("failed", "req-refused")  # type: ignore[attr-defined]  # set through `extra`
        assert end.error.startswith("Overloaded: service 'api' is failing")  # type: ignore[attr-defined]  # set through `extra`
    # Nothing about the refusal at WARNING, anywhere: the breaker's opening was.
    mine = [r for r in caplog.records if getattr(r, "correlation_id", None) == "req-refused"]
    assert [r for r in mine if r.levelno >= logging.WARNING or r.exc_info] == []
    opened_lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "pipework.backends" and r.levelno == logging.WARNING
    ]
    assert opened_lines == ["service 'api': circuit breaker open (failure_rate)"]


async def test_a_failure_that_is_no_refusal_is_one_warning_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="pipework")
    with trio.fail_after(HANG_GUARD):
        async with opened(tmp_path):
            pass
    # The backend's 503: one WARNING where it failed; the pipe's end and the job's DEBUG.
    assert trail(caplog, "req-failed-0") == [
        (logging.DEBUG, "job accepted", False),
        (logging.WARNING, "backend call failed", True),  # its traceback at DEBUG
        (logging.DEBUG, "pipe ended", False),
        (logging.DEBUG, "job finished", False),
    ]


async def test_a_refused_call_is_answered_as_before(tmp_path: Path) -> None:
    with trio.fail_after(HANG_GUARD):
        async with opened(tmp_path) as (gw, http, _):
            refused = await http.get("/pipe", headers={"X-Request-ID": "req-refused"})
            metrics = (await http.get("/metrics")).text
            stats = core(gw).statistics(trio.current_time())
    assert refused.status_code == 503
    assert refused.headers["content-type"] == "application/problem+json"
    assert 29 <= int(refused.headers["retry-after"]) <= 30
    problem = refused.json()
    assert problem["type"] == "urn:pipework:problem:overloaded"
    assert (problem["reason"], problem["error_type"]) == ("circuit_open", "Overloaded")
    assert problem["where"] == "chain 'pipe' > pipe 'call_api'"
    assert problem["job_id"] == refused.headers["x-job-id"]
    assert problem["correlation_id"] == "req-refused"
    assert "service" not in problem
    assert dict(stats.refused) == {"circuit_open": 1, "circuit_probing": 0, "no_host": 0}
    assert 'pipework_backend_refused_total{reason="circuit_open",service="api"} 1.0' in metrics
    # The job ended failed, its pipe's end an error, as for any refused call.
    assert 'pipework_job_duration_seconds_count{outcome="failed",route="pipe"} 3.0' in metrics
    assert 'pipework_pipe_duration_seconds_count{outcome="error",pipe="call_api"} 3.0' in metrics


# -- proxy routes ----------------------------------------------------------------------------


async def test_a_proxied_request_is_refused_without_waiting_for_a_slot_or_its_body(
    tmp_path: Path,
) -> None:
    with trio.fail_after(HANG_GUARD):
        async with opened(tmp_path) as (gw, http, address):
            assert gw._pool is not None
            # The key's one slot is taken and nothing may wait for it: a request that
            # asked the pool first would be refused by it (queue_full), not the breaker.
            # The head of a POST whose body never comes: answered all the same.
            async with (
                gw._pool.slot("api"),
                await trio.open_tcp_stream(address.host, address.port) as raw,
            ):
                await raw.send_all(
                    b"POST /api/orders HTTP/1.1\r\nHost: gw\r\nContent-Length: 5000\r\n"
                    b"X-Request-ID: req-proxied\r\n\r\n"
                )
                answer = b""
                while b"}" not in answer:
                    answer += await raw.receive_some()
            metrics = (await http.get("/metrics")).text
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ")
    assert b"retry-after: " in head.lower()
    assert b'"reason":"circuit_open"' in body
    assert 'pipework_backend_refused_total{reason="circuit_open",service="api"} 1.0' in metrics


async def test_a_proxied_websocket_is_refused_without_waiting_for_a_slot(tmp_path: Path) -> None:
    with trio.fail_after(HANG_GUARD):
        async with opened(tmp_path) as (gw, _, address):
            assert gw._pool is not None
            async with gw._pool.slot("api"), Client.opening(address, "/api/chat") as ws:
                code, _, _ = await ws.refusal()
            refused = dict(core(gw).statistics(trio.current_time()).refused)
    assert code == 403  # the handshake closed (1013) before it was accepted
    assert refused == {"circuit_open": 1, "circuit_probing": 0, "no_host": 0}
