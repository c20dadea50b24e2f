"""Proxy routes through their service's resilience core, served by a gateway from its file
in front of several small real trio backends (one per host) and a real client: a host
picked per request on its own pool with its own ``Host``, a retry only while nothing of the
request's body was read, an open breaker's refusal as a 503 problem with ``Retry-After``,
health checks keeping requests off a host, the per-host metrics counting proxied tries,
and websockets to the hosts the service picks. Real time (the gateway reads its file in a
thread): every wait is on a condition."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio
from wsproto.events import TextMessage

from pipework import Gateway
from pipework.backends._hosts_core import ServiceCore
from pipework.container import BoundAddress

from ._proxy_backend import running_backend
from ._proxy_gateway import gateway
from .test_backend_pool import echo
from .test_proxy_websocket import Client
from .test_resilience_io import (
    HANG_GUARD,
    Health,
    closed_port,
    counts,
    hosts,
    status,
    until,
    urls,
)


def proxy_file(hosts: Sequence[str], tables: str = "") -> str:
    """Service ``api`` over ``hosts`` (round robin), every path under ``/api`` proxied to
    it, and ``tables`` (the service's resilience tables)."""
    listed = ", ".join(f'"{url}"' for url in hosts)
    return f"""
[server]
admin_token = "proxy-admin"

[services.api]
hosts = [{listed}]
balance = "round_robin"
timeout = 5
limit = 4

{tables}

[routes.api]
proxy = "api"
prefix = "/api"
strip_prefix = true
"""


@asynccontextmanager
async def proxying(
    tmp_path: Path, hosts: Sequence[str], tables: str = ""
) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient, BoundAddress]]:
    async with (
        gateway(tmp_path, proxy_file(hosts, tables)) as (gw, address),
        httpx.AsyncClient(base_url=address.url, timeout=HANG_GUARD) as client,
    ):
        yield gw, client, address


def core(gw: Gateway) -> ServiceCore:
    assert gw._backends is not None
    return gw._backends.lean("api").core


async def test_requests_are_spread_over_the_hosts_and_counted_per_host(tmp_path: Path) -> None:
    with trio.fail_after(HANG_GUARD):
        async with (
            hosts(echo, echo, echo) as found,
            proxying(tmp_path, urls(found)) as (_, http, _),
        ):
            for _ in range(6):
                answer = await http.get("/api/x")
                assert answer.status_code == 200, answer.text
            metrics = (await http.get("/metrics")).text
        assert counts(found) == [2, 2, 2]
        for backend, url in found:
            # Each host on its own kept-alive connection, named by its own Host.
            assert {s.headers["host"] for s in backend.seen} == {url.removeprefix("http://")}
            assert backend.accepted == 1
            line = f'pipework_backend_host_requests_total{{host="{url}",service="api"}} 2.0'
            assert line in metrics


@pytest.mark.parametrize(("tables", "expected"), [("", [1, 0]), ("[services.api.retry]", [1, 1])])
async def test_a_bodiless_get_answered_503_is_retried_elsewhere_with_a_retry_table(
    tmp_path: Path, tables: str, expected: list[int]
) -> None:
    with trio.fail_after(HANG_GUARD):
        async with (
            hosts(status(503), echo) as found,
            proxying(tmp_path, urls(found), tables) as (_, http, _),
        ):
            answer = await http.get("/api/x")
        assert answer.status_code == (200 if tables else 503)
        assert counts(found) == expected


async def test_a_request_whose_body_went_out_is_not_sent_again(tmp_path: Path) -> None:
    body = bytes(range(256)) * 8
    tables = "[services.api.retry]\nidempotent_only = false\n"
    with trio.fail_after(HANG_GUARD):
        async with (
            hosts(status(503), echo) as found,
            proxying(tmp_path, urls(found), tables) as (_, http, _),
        ):
            answer = await http.put("/api/x", content=body)
        assert answer.status_code == 503  # the backend's own, relayed
        assert counts(found) == [1, 0]
        assert found[0][0].seen[0].body == body


async def test_a_refused_connection_is_retried_elsewhere_with_the_whole_body(
    tmp_path: Path,
) -> None:
    body = b"order=7;" * 200
    with trio.fail_after(HANG_GUARD):
        async with (
            hosts(echo) as found,
            proxying(tmp_path, [closed_port(), found[0][1]]) as (gw, http, _),
        ):
            answer = await http.post("/api/orders", content=body)
            assert answer.status_code == 200, answer.text
            first = core(gw).statistics(trio.current_time()).hosts[0]
            assert (first.requests, first.failures) == (1, 1)
        (seen,) = found[0][0].seen
        assert (seen.method, seen.target, seen.body) == ("POST", "/orders", body)


async def test_an_open_breaker_refuses_proxied_requests_with_503_and_retry_after(
    tmp_path: Path,
) -> None:
    tables = "[services.api.breaker]\nminimum_calls = 2\nwait = 30\n"
    with trio.fail_after(HANG_GUARD):
        async with (
            hosts(status(503), status(503)) as found,
            proxying(tmp_path, urls(found), tables) as (_, http, _),
        ):
            for _ in range(2):
                assert (await http.get("/api/x")).status_code == 503  # the backends'
            refused = await http.get("/api/x")
            metrics = (await http.get("/metrics")).text
        assert counts(found) == [1, 1]  # nothing sent for the refusal
        assert refused.status_code == 503
        assert refused.headers["content-type"] == "application/problem+json"
        assert 1 <= int(refused.headers["retry-after"]) <= 30
        assert refused.json()["reason"] == "circuit_open"
        assert 'pipework_backend_refused_total{reason="circuit_open",service="api"} 1.0' in metrics
        assert 'pipework_backend_breaker_state{service="api",state="open"} 1.0' in metrics


async def test_health_checks_keep_proxied_requests_off_an_unhealthy_host(tmp_path: Path) -> None:
    bad, good = Health(), Health()
    bad.code = 503
    tables = '[services.api.health]\npath = "/health"\ninterval = 0.5\ntimeout = 0.5\n'
    with trio.fail_after(HANG_GUARD):
        async with (
            hosts(bad, good) as found,
            proxying(tmp_path, urls(found), tables) as (gw, http, _),
        ):
            api = core(gw)
            await until(lambda: not api.hosts[0].healthy)
            # Off probation, the good host would need three slow checks in a row to go.
            await until(lambda: not api.hosts[1].on_probation and api.hosts[1].healthy)
            for _ in range(4):
                answer = await http.get("/api/x")
                assert answer.status_code == 200, answer.text
        one, two = (backend for backend, _ in found)
        assert [s.target for s in one.seen if s.target != "/health"] == []
        assert len([s for s in two.seen if s.target != "/health"]) == 4


# -- websockets ------------------------------------------------------------------------------


async def test_websockets_go_to_the_hosts_the_service_picks(tmp_path: Path) -> None:
    with trio.fail_after(HANG_GUARD):
        async with (
            running_backend() as one,
            running_backend() as two,
            proxying(tmp_path, [one.url, two.url]) as (gw, _, address),
        ):
            api = core(gw)
            async with (
                Client.opening(address, "/api/a") as a,
                Client.opening(address, "/api/b") as b,
            ):
                await a.accepted()
                await b.accepted()
                for ws, text in ((a, "to one"), (b, "to two")):
                    await ws.say(TextMessage(text))
                    assert await ws.message() == text
                stats = api.statistics(trio.current_time())
                assert [h.requests for h in stats.hosts] == [1, 1]  # one each, round robin
                assert [h.outstanding for h in stats.hosts] == [1, 1]  # open: the hosts' load
                for ws in (a, b):
                    await ws.say(TextMessage("close 4002"))
                    assert (await ws.closed()).code == 4002
            await until(lambda: all(h.outstanding == 0 for h in api.hosts))


async def test_a_websocket_whose_host_refuses_the_connection_goes_to_another(
    tmp_path: Path,
) -> None:
    with trio.fail_after(HANG_GUARD):
        async with (
            running_backend() as backend,
            proxying(tmp_path, [closed_port(), backend.url]) as (gw, _, address),
            Client.opening(address, "/api/chat") as ws,
        ):
            await ws.accepted()
            await ws.say(TextMessage("hello"))
            assert await ws.message() == "hello"
            first, second = core(gw).statistics(trio.current_time()).hosts
            assert (first.requests, first.failures, second.requests) == (1, 1, 1)
            await ws.say(TextMessage("close 4002"))
            assert (await ws.closed()).code == 4002
