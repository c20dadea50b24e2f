"""Upstream resilience on the lean client, against several real trio HTTP/1.1 servers on
127.0.0.1 (one per host): balancing, outlier ejection, the breaker, retries and their
budget, hedging, and the health checks. Time is trio's virtual clock (``autojump_clock``)
wherever a wait matters; every server is driven by its plan, request by request."""

from __future__ import annotations

import functools
import math
import random
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import trio
import trio.testing

import pipework as pw
from pipework import Backends, Context, Gateway, HttpCall, Service
from pipework._http._problems import problem_for_exception
from pipework._metrics import Metrics
from pipework.backends._balance_core import Host
from pipework.backends._client import ServiceClient
from pipework.backends._failures import ConnectFailed
from pipework.backends._hosts_core import ServiceCore
from pipework.backends._resilience_spec import (
    BreakerSpec,
    HedgeSpec,
    OutlierSpec,
    RetrySpec,
)
from pipework.backends._stream import StreamTimeouts
from pipework.container import BoundAddress

from .test_backend_pool import Plan, RawBackend, Seen, _Ctx, echo, serving
from .test_gateway import TOKEN, gateway_file

HANG_GUARD = 30.0


def status(code: int) -> Plan:
    async def plan(backend: RawBackend, seen: Seen, index: int) -> tuple[bytes, bool] | None:
        return f"HTTP/1.1 {code} X\r\nContent-Length: 0\r\n\r\n".encode(), True

    return plan


async def hold(backend: RawBackend, seen: Seen, index: int) -> tuple[bytes, bool] | None:
    await backend.release.wait()
    return await echo(backend, seen, index)


@asynccontextmanager
async def hosts(*plans: Plan) -> AsyncIterator[list[tuple[RawBackend, str]]]:
    """One server per plan: its backend and its base URL."""
    async with AsyncExitStack() as stack:
        found = []
        for plan in plans:
            backend, port = await stack.enter_async_context(serving(plan))
            found.append((backend, f"http://127.0.0.1:{port}"))
        yield found


def service(urls: Sequence[str], **settings: Any) -> Service:
    settings.setdefault("balance", "round_robin")
    return Service("api", hosts=tuple(pw.HostSpec(u) for u in urls), timeout=10.0, **settings)


@asynccontextmanager
async def client(svc: Service) -> AsyncIterator[ServiceClient]:
    made = ServiceClient(svc, "pipework", rng=random.Random(7))
    try:
        yield made
    finally:
        await made.aclose()


async def get(c: ServiceClient, method: str = "GET", path: str = "/") -> Any:
    return await c.call(HttpCall.of("api", path, method=method), {}, trio.current_time() + 10)


def counts(found: list[tuple[RawBackend, str]]) -> list[int]:
    return [len(b.seen) for b, _ in found]


def urls(found: list[tuple[RawBackend, str]]) -> list[str]:
    return [u for _, u in found]


#: A service with a ``[retry]`` table: statuses retried (without one, only a failed
#: connection is).
RETRY: dict[str, Any] = {"retry": RetrySpec()}


# -- balancing ---------------------------------------------------------------------------


async def test_calls_are_spread_over_the_hosts_each_on_its_own_pool() -> None:
    with trio.fail_after(HANG_GUARD):
        async with hosts(echo, echo, echo) as found, client(service([u for _, u in found])) as c:
            for _ in range(9):
                await get(c)
            assert counts(found) == [3, 3, 3]
            # One kept-alive connection per host, each carrying that host's Host header.
            assert [b.accepted for b, _ in found] == [1, 1, 1]
            for backend, url in found:
                assert {s.headers["host"] for s in backend.seen} == {url.removeprefix("http://")}
            assert sorted(c.links) == sorted(u for _, u in found)
            assert all(link.pool.statistics().idle == 1 for link in c.links.values())


# -- outlier ejection ----------------------------------------------------------------------


async def test_a_failing_host_is_ejected_and_traffic_moves_to_the_others(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with hosts(echo, status(500), echo) as found:
        outlier = OutlierSpec(consecutive_5xx=2, max_ejection_percent=50)
        svc = service([u for _, u in found], outlier=outlier)
        async with client(svc) as c:
            statuses = []
            for _ in range(12):
                try:
                    await get(c)
                except pw.BackendError as exc:
                    statuses.append(exc.status)
            assert statuses == [500, 500]  # then the host was out
            assert counts(found)[1] == 2
            assert counts(found)[0] + counts(found)[2] == 10
            stats = c.core.statistics(trio.current_time())
            assert [h.state for h in stats.hosts] == ["available", "ejected", "available"]
            # Its ejection ends at base_ejection_time: it takes calls again.
            autojump_clock.jump(outlier.base_ejection_time)
            for _ in range(3):
                with suppress(pw.BackendError):
                    await get(c)
            assert counts(found)[1] == 3


# -- the breaker ---------------------------------------------------------------------------


async def test_the_breaker_opens_when_every_host_is_out_and_refuses_at_once() -> None:
    with trio.fail_after(HANG_GUARD):
        async with hosts(status(503), status(503)) as found:
            svc = service(
                [u for _, u in found],
                outlier=OutlierSpec(consecutive_5xx=1, max_ejection_percent=100),
                breaker=BreakerSpec(wait=7.0),
                retry=RetrySpec(),
            )
            ctx = _Ctx({})
            backends = Backends([svc])
            backends.metrics = metrics = Metrics()
            async with backends:
                with pytest.raises(pw.BackendError) as failed:
                    await backends.call(HttpCall.of("api", "/"), cast(Context, ctx))
                assert failed.value.status == 503
                assert counts(found) == [1, 1]  # a try on each, the retry on the other
                seen = counts(found)
                with pytest.raises(pw.Overloaded) as refused:
                    await backends.call(HttpCall.of("api", "/"), cast(Context, ctx))
                text = metrics.exposition().decode()
            assert 'pipework_backend_breaker_state{service="api",state="open"} 1.0' in text
            assert 'pipework_backend_refused_total{reason="circuit_open",service="api"} 1.0' in text
            assert 'pipework_backend_retries_total{kind="retry",service="api"} 1.0' in text
            for _, url in found:
                assert (
                    f'pipework_backend_host_ejections_total{{host="{url}",service="api"}} 1.0'
                    in text
                )
                assert (
                    f'pipework_backend_host_state{{host="{url}",service="api",state="ejected"}} 1.0'
                    in text
                )
            # Closed, the backends are no longer read.
            assert (
                'pipework_backend_breaker_state{service="api"' not in metrics.exposition().decode()
            )
            assert counts(found) == seen  # nothing was sent
            assert refused.value.http_status == 503
            assert refused.value.reason == "circuit_open"
            assert 0 < refused.value.retry_after <= 7.0
            assert "circuit breaker is open" in str(refused.value)
            # As a request's answer: 503 problem+json with Retry-After, in whole seconds.
            problem = problem_for_exception(refused.value)
            assert problem.status == 503
            assert problem.headers == {"Retry-After": str(math.ceil(refused.value.retry_after))}
            assert problem.extensions["reason"] == "circuit_open"


# -- retries -------------------------------------------------------------------------------


async def test_an_idempotent_call_is_retried_on_another_host() -> None:
    with trio.fail_after(HANG_GUARD):
        async with hosts(status(503), echo) as found, client(service(urls(found), **RETRY)) as c:
            answer = await get(c)
            assert answer == {"conn": 0, "index": 0}
            assert counts(found) == [1, 1]
            assert c.core.statistics(trio.current_time()).budget.retries == 1


async def test_a_post_is_not_retried() -> None:
    with trio.fail_after(HANG_GUARD):
        async with hosts(status(503), echo) as found, client(service(urls(found), **RETRY)) as c:
            with pytest.raises(pw.BackendError) as info:
                await get(c, "POST")
            assert info.value.status == 503
            assert counts(found) == [1, 0]


async def test_a_retry_waits_for_room_in_the_budget() -> None:
    with trio.fail_after(HANG_GUARD):
        async with hosts(status(503), echo) as found:
            svc = service([u for _, u in found], retry=RetrySpec(min_concurrency=0))
            async with client(svc) as c:
                with pytest.raises(pw.BackendError) as info:
                    await get(c)
                assert info.value.status == 503
                assert counts(found) == [1, 0]
                stats = c.core.statistics(trio.current_time()).budget
                assert stats.retries == 0
                assert stats.exhausted == 1


# -- hedging -------------------------------------------------------------------------------


async def test_a_hedge_wins_against_a_slow_host_and_the_slow_try_is_closed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with hosts(hold, echo) as found:
        svc = service([u for _, u in found], hedge=HedgeSpec(delay=0.5))
        async with client(svc) as c:
            start = trio.current_time()
            answer = await get(c)
            assert answer == {"conn": 0, "index": 0}
            assert trio.current_time() == start + 0.5  # the hedge went out at its delay
            assert counts(found) == [1, 1]
            # The slow try's connection was closed, never to be reused.
            assert c.links[found[0][1]].pool.statistics().open == 0
            stats = c.core.statistics(trio.current_time())
            assert stats.budget.hedges == 1
            assert [h.outstanding for h in stats.hosts] == [0, 0]
            # The slow try lost after 0.5 s at least: its host's latency says so, and
            # it is no failure.
            slow = stats.hosts[0]
            assert slow.latency is not None
            assert slow.latency >= 0.5
            assert (slow.failures, slow.consecutive_local_origin_failure) == (0, 0)


async def test_without_a_hedge_the_slow_host_is_waited_for(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with hosts(hold, echo) as found, client(service([u for _, u in found])) as c:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(get, c)
            await trio.testing.wait_all_tasks_blocked()
            assert counts(found) == [1, 0]
            found[0][0].release.set()
        assert counts(found) == [1, 0]


# -- active health checks ------------------------------------------------------------------


class Health:
    """A host whose ``/health`` answers ``code`` (changeable), and echoes anything else."""

    def __init__(self) -> None:
        self.code = 200
        self.checks = 0

    async def __call__(
        self, backend: RawBackend, seen: Seen, index: int
    ) -> tuple[bytes, bool] | None:
        if seen.target == "/health":
            self.checks += 1
            return f"HTTP/1.1 {self.code} X\r\nContent-Length: 0\r\n\r\n".encode(), True
        return await echo(backend, seen, index)


def states(backends: Backends) -> list[str]:
    stats = backends._lean["api"].core.statistics(trio.current_time())
    return [h.state for h in stats.hosts]


async def until(condition: Callable[[], bool]) -> None:
    """Wait (in virtual time) for ``condition``; the test's guard bounds it."""
    while not condition():  # noqa: ASYNC110 - the core has no event to wait on
        await trio.sleep(0.01)


def host(backends: Backends, index: int) -> Host:
    return backends._lean["api"].core.hosts[index]


async def test_a_health_check_takes_a_host_out_and_brings_it_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    one, two = Health(), Health()
    spec = pw.HealthSpec(
        "/health", interval=1.0, timeout=0.5, healthy_threshold=2, unhealthy_threshold=3
    )
    async with hosts(one, two) as found:
        svc = service([u for _, u in found], health=spec)
        ctx = cast(Context, _Ctx({}))
        call = HttpCall.of("api", "/")
        # The nursery outlives the backends: closing them ends their checks.
        async with trio.open_nursery() as nursery, Backends([svc]) as backends:
            await nursery.start(backends.check_health)
            await until(lambda: not host(backends, 1).on_probation)  # a first check passed
            assert states(backends) == ["available", "available"]
            two.code = 503
            await until(lambda: not host(backends, 1).healthy)
            # Three failures take a healthy host out (unhealthy_threshold).
            assert two.checks - 1 == spec.unhealthy_threshold
            assert states(backends) == ["available", "unhealthy"]
            before = counts(found)
            for _ in range(4):
                await backends.call(call, ctx)
            assert counts(found)[1] == before[1]  # no call went to it
            two.code = 200
            await until(lambda: host(backends, 1).healthy)
            assert two.checks - 1 - spec.unhealthy_threshold == spec.healthy_threshold
            assert states(backends) == ["available", "available"]
            # Checks are not tries: nothing counted on the hosts but the calls.
            stats = backends._lean["api"].core.statistics(trio.current_time())
            assert sum(h.requests for h in stats.hosts) == 4


async def test_a_reload_keeps_the_health_of_the_hosts_that_stay(
    autojump_clock: trio.testing.MockClock,
) -> None:
    one, two, three = Health(), Health(), Health()
    spec = pw.HealthSpec("/health", interval=1.0, timeout=0.5)
    async with hosts(one, two, three) as found:
        urls = [u for _, u in found]
        first = Backends([service(urls[:2], health=spec)])
        async with trio.open_nursery() as nursery, first as old:
            await nursery.start(old.check_health)
            two.code = 503
            await until(lambda: not host(old, 1).healthy)
            assert states(old) == ["available", "unhealthy"]
            async with Backends([service(urls, health=spec)]) as new:
                new.adopt(old)
                assert states(new) == ["available", "unhealthy", "available"]
                await trio.testing.wait_all_tasks_blocked()
                assert not old._health  # its checks stopped: the new ones take over
                await nursery.start(new.check_health)
                two.code = 200
                await until(lambda: host(new, 1).healthy)
                assert states(new) == ["available", "available", "available"]
                await until(lambda: not host(new, 2).on_probation)  # the new host is checked


def closed_port() -> str:
    """A URL nothing listens on: a connection to it is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def test_a_refused_connection_is_retried_on_another_host_whatever_the_method() -> None:
    with trio.fail_after(HANG_GUARD):
        async with hosts(echo) as found, client(service([closed_port(), found[0][1]])) as c:
            answer = await get(c, "POST")  # nothing was sent: a POST may go again
            assert answer == {"conn": 0, "index": 0}
            assert counts(found) == [1]
            first = c.core.statistics(trio.current_time()).hosts[0]
            assert (first.requests, first.failures) == (1, 1)


async def test_a_try_past_its_per_try_timeout_is_retried_on_another_host(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with hosts(hold, echo) as found:
        retry = RetrySpec(per_try_timeout=1.0)
        svc = service([u for _, u in found], retry=retry)
        async with client(svc) as c:
            start = trio.current_time()
            answer = await get(c)
            assert answer == {"conn": 0, "index": 0}
            assert counts(found) == [1, 1]
            # The retry went out after the try's timeout and its backoff, well before the
            # call's own deadline (10 s).
            assert start + 1.0 <= trio.current_time() <= start + 1.0 + retry.backoff_base
            assert c.links[found[0][1]].pool.statistics().open == 0  # the slow one closed


async def test_a_hedged_call_cancelled_from_outside_ends_every_try(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with hosts(hold, hold) as found:
        svc = service([u for _, u in found], hedge=HedgeSpec(delay=0.5))
        async with client(svc) as c:
            with trio.move_on_after(2.0) as scope:
                await get(c)
            assert scope.cancelled_caught
            assert counts(found) == [1, 1]  # the first try and its hedge
            stats = c.core.statistics(trio.current_time())
            assert [h.outstanding for h in stats.hosts] == [0, 0]
            assert [h.failures for h in stats.hosts] == [0, 0]  # cancelled: nobody's fault
            assert [h.latency for h in stats.hosts] == [None, None]  # no try answered
            assert stats.budget.retries_in_flight == 0
            assert stats.budget.active_calls == 0
            assert all(link.pool.statistics().open == 0 for link in c.links.values())


# -- through the gateway -------------------------------------------------------------------


async def test_a_gateway_reload_keeps_the_health_of_its_hosts(tmp_path: Path) -> None:
    """Real time (the gateway reads its file in a thread): every wait is on a condition."""
    good, bad = Health(), Health()
    bad.code = 503
    async with hosts(good, bad) as found:
        (one, url1), (two, url2) = found
        text = gateway_file(url1).replace(f'base_url = "{url1}"', f'hosts = ["{url1}", "{url2}"]')
        text += '\n[services.users.health]\npath = "/health"\ninterval = 0.5\ntimeout = 0.5\n'
        path = tmp_path / "gateway.toml"
        path.write_text(text)
        gateway = Gateway(str(path))
        stop = trio.Event()
        with trio.fail_after(HANG_GUARD):
            async with trio.open_nursery() as nursery:
                address: BoundAddress = await nursery.start(
                    functools.partial(gateway.run, port=0, stop=stop)
                )

                def core() -> ServiceCore:
                    assert gateway._backends is not None
                    return gateway._backends._lean["users"].core

                first = core()
                await until(lambda: not first.hosts[1].healthy)
                # Off probation, the good host would need three slow checks in a row to go.
                await until(lambda: not first.hosts[0].on_probation)
                auth = {"Authorization": f"Bearer {TOKEN}"}
                async with httpx.AsyncClient(base_url=address.url) as http:
                    reloaded = await http.post("/admin/reload", headers=auth)
                    assert reloaded.status_code == 200, reloaded.text
                    assert core() is first  # carried over, with what it learnt
                    assert not first.hosts[1].healthy
                    checks = bad.checks
                    await until(lambda: bad.checks > checks)  # the new plan checks it
                    for n in range(4):
                        answer = await http.get(f"/users/{n}")
                        assert answer.status_code == 200, answer.text
                assert [s.target for s in two.seen if s.target != "/health"] == []
                assert len([s for s in one.seen if s.target != "/health"]) == 4
                stop.set()


# -- the defaults: a file written before resilience existed -----------------------------------


def from_file(url: str, tables: str = "") -> Service:
    """Service ``api`` as a gateway file declares it: one host at ``url``, then ``tables``."""
    text = f'[services.api]\nbase_url = "{url}"\ntimeout = 10\n{tables}'
    return pw.loads_config(text).services["api"]


async def test_an_old_style_file_retries_no_status_and_never_opens_its_breaker(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with hosts(status(503)) as found, client(from_file(found[0][1])) as c:
        for n in range(1, 41):  # twice the breaker's minimum_calls, every one failed
            with pytest.raises(pw.BackendError) as info:
                await get(c)
            assert info.value.status == 503
            assert counts(found) == [n]  # one try each: a 503 is not retried
        stats = c.core.statistics(trio.current_time())
        assert (stats.breaker.state, stats.breaker.opened, stats.refused["circuit_open"]) == (
            "closed",
            0,
            0,
        )
        assert stats.hosts[0].state == "available"  # a lone host is never ejected
        assert stats.budget.retries == 0


async def test_an_old_style_file_retries_a_failed_connection_once() -> None:
    with trio.fail_after(HANG_GUARD):
        async with client(from_file(closed_port())) as c:
            with pytest.raises(ConnectFailed):
                await get(c, "POST")  # nothing was sent: any method
            (host,) = c.core.statistics(trio.current_time()).hosts
            assert (host.requests, host.failures) == (2, 2)


async def test_with_empty_retry_and_breaker_tables_a_503_is_retried_and_the_breaker_opens(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with hosts(status(503)) as found:
        svc = from_file(found[0][1], "[services.api.retry]\n[services.api.breaker]\n")
        async with client(svc) as c:
            # Envoy's defaults: two tries a call; 20 tries in the window, all failed, open it.
            for n in range(1, 11):
                with pytest.raises(pw.BackendError) as info:
                    await get(c)
                assert info.value.status == 503
                assert counts(found) == [2 * n]
            with pytest.raises(pw.Overloaded) as refused:
                await get(c)
            assert refused.value.reason == "circuit_open"
            assert counts(found) == [20]  # refused: nothing sent


# -- streamed exchanges (proxy routes) ---------------------------------------------------------

TIMEOUTS = StreamTimeouts(connect=5.0, first_byte=5.0, idle=5.0)


async def pieces(body: bytes, size: int = 100) -> AsyncIterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start : start + size]


async def stream(
    c: ServiceClient,
    method: bytes = b"GET",
    body: bytes | None = None,
    headers: Sequence[tuple[bytes, bytes]] = (),
) -> tuple[int, bytes]:
    """A streamed exchange, read whole: its status and body."""
    sent = None if body is None else pieces(body)
    length = None if body is None else len(body)
    async with c.stream(
        method, b"/x", list(headers), sent, length=length, timeouts=TIMEOUTS
    ) as answer:
        return answer.status, b"".join([piece async for piece in answer.body()])


@pytest.mark.parametrize(("settings", "expected"), [({}, [1, 0]), (RETRY, [1, 1])])
async def test_a_stream_answered_503_is_retried_on_another_host_with_a_retry_table(
    settings: dict[str, Any], expected: list[int]
) -> None:
    with trio.fail_after(HANG_GUARD):
        async with hosts(status(503), echo) as found, client(service(urls(found), **settings)) as c:
            code, _ = await stream(c)
            assert code == (200 if settings else 503)  # the 503 relayed, without a table
            assert counts(found) == expected
            stats = c.core.statistics(trio.current_time())
            assert [h.requests for h in stats.hosts] == expected  # tries on each host


async def test_a_stream_whose_body_was_read_is_never_sent_again() -> None:
    body = bytes(range(256)) * 4
    with trio.fail_after(HANG_GUARD):
        async with hosts(status(503), echo) as found:
            svc = service(urls(found), retry=RetrySpec(idempotent_only=False))
            async with client(svc) as c:
                code, _ = await stream(c, b"PUT", body)
                assert code == 503
                assert counts(found) == [1, 0]
                assert found[0][0].seen[0].body == body


async def test_a_refused_connection_is_retried_before_the_body_is_read() -> None:
    body = b"order=7;" * 100
    with trio.fail_after(HANG_GUARD):
        async with hosts(echo) as found, client(service([closed_port(), found[0][1]])) as c:
            code, _ = await stream(c, b"POST", body)
            assert code == 200
            assert found[0][0].seen[0].body == body  # sent whole, once
            first = c.core.statistics(trio.current_time()).hosts[0]
            assert (first.requests, first.failures) == (1, 1)


async def test_a_streamed_answer_counts_on_its_host_until_its_exchange_ends() -> None:
    with trio.fail_after(HANG_GUARD):
        async with hosts(echo, echo) as found, client(service(urls(found))) as c:
            async with c.stream(b"GET", b"/", [], None, length=None, timeouts=TIMEOUTS) as a:
                assert a.status == 200
                stats = c.core.statistics(trio.current_time())
                assert [h.outstanding for h in stats.hosts] == [1, 0]  # being relayed
                assert [h.requests for h in stats.hosts] == [1, 0]
            stats = c.core.statistics(trio.current_time())
            assert [h.outstanding for h in stats.hosts] == [0, 0]
            assert stats.budget.active_calls == 0


async def test_a_stream_never_hedges(autojump_clock: trio.testing.MockClock) -> None:
    async with hosts(hold, echo) as found:
        svc = service(urls(found), hedge=HedgeSpec(delay=0.5))
        async with client(svc) as c, trio.open_nursery() as nursery:
            nursery.start_soon(stream, c)
            await trio.sleep(2.0)  # four times the hedge's delay, in virtual time
            assert counts(found) == [1, 0]
            found[0][0].release.set()
        assert counts(found) == [1, 0]
        assert c.core.statistics(trio.current_time()).budget.hedges == 0


async def test_a_streams_try_ends_at_its_per_try_timeout_and_goes_elsewhere(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with hosts(hold, echo) as found:
        svc = service(urls(found), retry=RetrySpec(per_try_timeout=1.0))
        async with client(svc) as c:
            start = trio.current_time()
            code, _ = await stream(c)
            assert code == 200
            assert counts(found) == [1, 1]
            assert start + 1.0 <= trio.current_time() <= start + 1.0 + RetrySpec().backoff_base


async def test_an_open_breaker_refuses_a_stream_before_anything_is_sent() -> None:
    with trio.fail_after(HANG_GUARD):
        async with hosts(status(503)) as found:
            svc = service(urls(found), breaker=BreakerSpec(minimum_calls=2, wait=7.0))
            async with client(svc) as c:
                assert (await stream(c))[0] == 503
                assert (await stream(c))[0] == 503
                with pytest.raises(pw.Overloaded) as refused:
                    await stream(c)
                assert refused.value.reason == "circuit_open"
                assert 0 < refused.value.retry_after <= 7.0
                assert counts(found) == [2]


async def test_each_host_gets_its_own_host_header_unless_one_was_kept() -> None:
    with trio.fail_after(HANG_GUARD):
        async with hosts(echo, echo) as found, client(service(urls(found))) as c:
            own = found[0][1].removeprefix("http://").encode()
            for _ in range(2):  # the service's Host, as a proxy route sends it
                await stream(c, headers=[(b"host", own)])
            for _ in range(2):  # the client's, kept
                await stream(c, headers=[(b"host", b"shop.example")])
            for backend, url in found:
                assert [s.headers["host"] for s in backend.seen] == [
                    url.removeprefix("http://"),
                    "shop.example",
                ]
