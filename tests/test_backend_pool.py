"""The lean keep-alive pool (pipework/backends/_pool.py, _h1.py) against a raw trio HTTP/1.1
server on 127.0.0.1 that can be told, request by request, to answer, hold, cut an answer
short or close. Timeouts are checked at exact virtual time (``autojump_clock``)."""

from __future__ import annotations

import gc
import gzip
import json
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import cast

import httpx
import pytest
import trio
import trio.testing

import pipework as pw
from pipework import Backends, Context, HttpCall, Pipe, Service
from pipework.backends._client import ServiceClient
from pipework.backends._failures import BadAnswer, CallTimeout, ConnectFailed, ConnectionBroken
from pipework.backends._h1 import BadEncoding
from pipework.backends._pool import Pool, ResponseTooLarge

from ._endless_backend import endless_backend, retained
from ._loopback import serve_loopback

HANG_GUARD = 10.0


@dataclass
class Seen:
    conn: int  # which connection (0, 1, ...) carried it
    method: str
    target: str
    headers: dict[str, str]
    body: bytes


def ok(body: bytes = b"{}", *, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        + extra
        + b"Content-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


# What the server does with one request: answer bytes (and keep the connection), answer
# bytes then close (keep=False), or close without a word (None).
Plan = Callable[["RawBackend", Seen, int], Awaitable[tuple[bytes, bool] | None]]


async def echo(backend: RawBackend, seen: Seen, index: int) -> tuple[bytes, bool] | None:
    return ok(json.dumps({"conn": seen.conn, "index": index}).encode()), True


@dataclass
class RawBackend:
    plan: Plan = echo
    accepted: int = 0
    open: int = 0
    seen: list[Seen] = field(default_factory=list)
    release: trio.Event = field(default_factory=trio.Event)
    closed: list[int] = field(default_factory=list)  # connections the client closed

    async def handle(self, stream: trio.SocketStream) -> None:
        conn = self.accepted
        self.accepted += 1
        self.open += 1
        buffer = b""
        try:
            index = 0
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = await stream.receive_some()
                    if not data:
                        self.closed.append(conn)
                        return
                    buffer += data
                head, buffer = buffer.split(b"\r\n\r\n", 1)
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ")
                headers = {k.lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:])}
                length = int(headers.get("content-length", "0"))
                while len(buffer) < length:
                    buffer += await stream.receive_some()
                body, buffer = buffer[:length], buffer[length:]
                seen = Seen(conn, method, target, headers, body)
                self.seen.append(seen)
                action = await self.plan(self, seen, index)
                index += 1
                if action is None:
                    return
                raw, keep = action
                await stream.send_all(raw)
                if not keep:
                    return
        except trio.BrokenResourceError:
            self.closed.append(conn)
        finally:
            self.open -= 1
            await stream.aclose()


@asynccontextmanager
async def serving(plan: Plan = echo) -> AsyncIterator[tuple[RawBackend, int]]:
    backend = RawBackend(plan)
    async with serve_loopback(backend.handle) as port:
        yield backend, port


@pytest.fixture
async def pools() -> AsyncIterator[Callable[..., Pool]]:
    """Makes pools and closes them after the test (what Backends does for its own)."""
    made: list[Pool] = []

    def make(*args: object, **kwargs: object) -> Pool:
        made.append(Pool(*args, **kwargs))  # type: ignore[arg-type]  # passes the real arguments on
        return made[-1]

    yield make
    for pool in made:
        await pool.aclose()


def head(port: int) -> list[tuple[bytes, bytes]]:
    return [(b"Host", f"127.0.0.1:{port}".encode())]


async def get(pool: Pool, port: int, target: bytes = b"/", *, method: bytes = b"GET") -> object:
    answer = await pool.request(
        method, target, head(port), deadline=trio.current_time() + 5, max_bytes=1 << 20
    )
    return json.loads(answer.body) if answer.body else None


# -- reuse and the limit -------------------------------------------------------------------


async def test_sequential_calls_share_one_connection(pools: Callable[..., Pool]) -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving() as (backend, port):
            pool = pools("127.0.0.1", port)
            answers = [await get(pool, port) for _ in range(3)]
            assert answers == [{"conn": 0, "index": i} for i in range(3)]
            assert backend.accepted == 1
            assert pool.statistics().open == 1
            assert pool.statistics().idle == 1
            await pool.aclose()
            await trio.testing.wait_all_tasks_blocked()
            assert backend.open == 0


async def test_calls_beyond_the_limit_wait_in_order_and_reuse_the_connections(
    pools: Callable[..., Pool],
) -> None:
    async def hold(backend: RawBackend, seen: Seen, index: int) -> tuple[bytes, bool] | None:
        await backend.release.wait()
        return await echo(backend, seen, index)

    with trio.fail_after(HANG_GUARD):
        async with serving(hold) as (backend, port):
            pool = pools("127.0.0.1", port, max_connections=2)
            async with trio.open_nursery() as nursery:
                for name in "abcd":
                    nursery.start_soon(get, pool, port, f"/{name}".encode())
                    await trio.testing.wait_all_tasks_blocked()
                assert backend.accepted == 2
                assert [s.target for s in backend.seen] == ["/a", "/b"]
                stats = pool.statistics()
                assert (stats.open, stats.waiting) == (2, 2)
                backend.release.set()
            assert backend.accepted == 2  # the waiters took the two connections in turn
            assert sorted(s.target for s in backend.seen[2:]) == ["/c", "/d"]
            assert pool.statistics().open == 2
            await pool.aclose()


async def test_waiters_are_served_first_come_first_served(pools: Callable[..., Pool]) -> None:
    async def hold(backend: RawBackend, seen: Seen, index: int) -> tuple[bytes, bool] | None:
        await backend.release.wait()
        return await echo(backend, seen, index)

    with trio.fail_after(HANG_GUARD):
        async with serving(hold) as (backend, port):
            pool = pools("127.0.0.1", port, max_connections=1)
            async with trio.open_nursery() as nursery:
                for name in "abcde":
                    nursery.start_soon(get, pool, port, f"/{name}".encode())
                    await trio.testing.wait_all_tasks_blocked()
                assert pool.statistics().waiting == 4
                backend.release.set()
            assert [s.target for s in backend.seen] == ["/a", "/b", "/c", "/d", "/e"]
            assert backend.accepted == 1


async def test_a_waiter_that_gives_up_passes_its_turn_on(pools: Callable[..., Pool]) -> None:
    async def hold(backend: RawBackend, seen: Seen, index: int) -> tuple[bytes, bool] | None:
        if seen.target == "/hold":
            await backend.release.wait()
        return await echo(backend, seen, index)

    with trio.fail_after(HANG_GUARD):
        async with serving(hold) as (backend, port):
            pool = pools("127.0.0.1", port, max_connections=1)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(get, pool, port, b"/hold")
                await trio.testing.wait_all_tasks_blocked()
                quitter = trio.CancelScope()

                async def quit_waiting() -> None:
                    with quitter:
                        await get(pool, port, b"/quit")

                nursery.start_soon(quit_waiting)
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(get, pool, port, b"/after")
                await trio.testing.wait_all_tasks_blocked()
                assert pool.statistics().waiting == 2
                quitter.cancel()
                backend.release.set()
            assert [s.target for s in backend.seen] == ["/hold", "/after"]
            assert pool.statistics().open == 1
            await pool.aclose()


# -- timeouts, at exact virtual time -------------------------------------------------------


async def test_a_silent_backend_times_out_at_the_deadline(
    pools: Callable[..., Pool],
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def silent(backend: RawBackend, seen: Seen, index: int) -> tuple[bytes, bool] | None:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async with serving(silent) as (_backend, port):
        pool = pools("127.0.0.1", port)
        start = trio.current_time()
        with pytest.raises(CallTimeout) as info:
            await pool.request(b"GET", b"/", head(port), deadline=start + 3, max_bytes=100)
        assert info.value.phase == "answer"
        assert trio.current_time() == start + 3
        assert pool.statistics().open == 0  # the connection in use was closed


async def test_waiting_for_a_connection_times_out_at_the_deadline(
    pools: Callable[..., Pool],
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def hold(backend: RawBackend, seen: Seen, index: int) -> tuple[bytes, bool] | None:
        await backend.release.wait()
        return await echo(backend, seen, index)

    async with serving(hold) as (backend, port):
        pool = pools("127.0.0.1", port, max_connections=1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(get, pool, port)
            await trio.testing.wait_all_tasks_blocked()
            start = trio.current_time()
            with pytest.raises(CallTimeout) as info:
                await pool.request(b"GET", b"/", head(port), deadline=start + 2, max_bytes=100)
            assert info.value.phase == "pool"
            assert trio.current_time() == start + 2
            assert pool.statistics().waiting == 0
            backend.release.set()
        assert backend.accepted == 1


async def test_connecting_times_out_at_the_connect_timeout(
    pools: Callable[..., Pool],
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def never(host: str, port: int) -> trio.SocketStream:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    pool = pools("127.0.0.1", 9, connect_timeout=1.5, connect=never)
    start = trio.current_time()
    with pytest.raises(CallTimeout) as info:
        await pool.request(b"GET", b"/", head(9), deadline=start + 10, max_bytes=100)
    assert info.value.phase == "connect"
    assert trio.current_time() == start + 1.5
    assert pool.statistics().open == 0
    with pytest.raises(CallTimeout) as info:  # the call's deadline, when it comes first
        await pool.request(b"GET", b"/", head(9), deadline=start + 2, max_bytes=100)
    assert info.value.phase == "connect"
    assert trio.current_time() == start + 2
    assert pool.statistics().open == 0


async def test_a_refused_connection_is_a_connect_error(pools: Callable[..., Pool]) -> None:
    async def refuse(host: str, port: int) -> trio.SocketStream:
        raise OSError("all attempts to connect failed")

    pool = pools("127.0.0.1", 9, connect=refuse)
    with trio.fail_after(HANG_GUARD), pytest.raises(ConnectFailed) as info:
        await pool.request(b"GET", b"/", head(9), deadline=trio.current_time() + 1, max_bytes=1)
    assert isinstance(info.value.__cause__, OSError)
    assert pool.statistics().open == 0


# -- idle connections ----------------------------------------------------------------------


async def test_idle_connections_close_after_the_idle_timeout(
    pools: Callable[..., Pool],
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with serving() as (backend, port):
        pool = pools("127.0.0.1", port, idle_timeout=5)
        await get(pool, port)
        await trio.sleep(4.9)
        await get(pool, port)  # still fresh: reused
        assert backend.accepted == 1
        await trio.sleep(5)
        assert await get(pool, port) == {"conn": 1, "index": 0}  # the expired one was closed
        await trio.testing.wait_all_tasks_blocked()
        assert backend.closed == [0]
        assert backend.open == 1
        await pool.aclose()
        await trio.testing.wait_all_tasks_blocked()
        assert backend.open == 0


async def test_max_idle_caps_the_connections_kept(pools: Callable[..., Pool]) -> None:
    async def hold(backend: RawBackend, seen: Seen, index: int) -> tuple[bytes, bool] | None:
        await backend.release.wait()
        return await echo(backend, seen, index)

    with trio.fail_after(HANG_GUARD):
        async with serving(hold) as (backend, port):
            pool = pools("127.0.0.1", port, max_connections=3, max_idle=1)
            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(get, pool, port)
                await trio.testing.wait_all_tasks_blocked()
                backend.release.set()
            await trio.testing.wait_all_tasks_blocked()
            assert (pool.statistics().open, pool.statistics().idle) == (1, 1)
            assert backend.open == 1
            await pool.aclose()


# -- cancellation and broken connections ---------------------------------------------------


async def test_a_call_cancelled_mid_answer_closes_its_connection(
    pools: Callable[..., Pool],
) -> None:
    async def half(backend: RawBackend, seen: Seen, index: int) -> tuple[bytes, bool] | None:
        if seen.conn == 0:
            return b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n12345", True
        return await echo(backend, seen, index)

    with trio.fail_after(HANG_GUARD):
        async with serving(half) as (backend, port):
            pool = pools("127.0.0.1", port)
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(get, pool, port)
                    await trio.testing.wait_all_tasks_blocked()  # it waits for the rest
                    assert len(backend.seen) == 1
                    scope.cancel()
            assert scope.cancelled_caught
            assert pool.statistics().open == 0
            await trio.testing.wait_all_tasks_blocked()
            assert backend.closed == [0]
            assert await get(pool, port) == {"conn": 1, "index": 0}


async def test_a_call_cancelled_as_it_takes_a_connection_gives_it_back(
    pools: Callable[..., Pool],
) -> None:
    """Cancelled at the schedule point after it took an idle connection or a place to open
    one, a call keeps neither: the pool's count stays right and later calls are served."""
    with trio.fail_after(HANG_GUARD):
        async with serving() as (backend, port):
            pool = pools("127.0.0.1", port, max_connections=1)

            async def cancelled_call() -> None:
                with trio.CancelScope() as scope:
                    scope.cancel()
                    await get(pool, port)

            await cancelled_call()  # it had taken the place to open a connection
            assert (pool.statistics().open, pool.statistics().idle) == (0, 0)
            assert await get(pool, port) == {"conn": 0, "index": 0}
            await cancelled_call()  # it had taken the idle connection
            assert (pool.statistics().open, pool.statistics().idle) == (1, 1)
            assert await get(pool, port) == {"conn": 0, "index": 1}
            assert backend.accepted == 1


async def test_connection_close_is_honoured(pools: Callable[..., Pool]) -> None:
    async def closing(backend: RawBackend, seen: Seen, index: int) -> tuple[bytes, bool] | None:
        return ok(b'{"bye": true}', extra=b"Connection: close\r\n"), False

    with trio.fail_after(HANG_GUARD):
        async with serving(closing) as (backend, port):
            pool = pools("127.0.0.1", port)
            assert await get(pool, port) == {"bye": True}
            assert pool.statistics().open == 0
            assert await get(pool, port) == {"bye": True}
            assert backend.accepted == 2


async def test_a_connection_the_peer_closed_while_idle_is_replaced(
    pools: Callable[..., Pool],
) -> None:
    async def once(backend: RawBackend, seen: Seen, index: int) -> tuple[bytes, bool] | None:
        raw, _ = await echo(backend, seen, index) or (b"", False)
        return raw, False  # answers, then closes without saying so

    with trio.fail_after(HANG_GUARD):
        async with serving(once) as (backend, port):
            pool = pools("127.0.0.1", port)
            await get(pool, port)
            await trio.testing.wait_all_tasks_blocked()
            assert await get(pool, port) == {"conn": 1, "index": 0}
            assert len(backend.seen) == 2  # noticed on checkout: nothing was sent on it


@pytest.mark.parametrize("method", [b"GET", b"HEAD"])
async def test_bytes_past_an_answer_close_its_connection(
    pools: Callable[..., Pool], method: bytes
) -> None:
    """Bytes after the answer's end (past its length; a body with an answer to HEAD, which
    has none) would be read as the next request's answer: the connection is not reused."""
    poison = ok(b'{"poison": true}')

    async def overlong(backend: RawBackend, seen: Seen, index: int) -> tuple[bytes, bool] | None:
        if seen.conn == 0 and index == 0:
            # To a GET: two bytes of body, then more; to a HEAD: a body (the answer's
            # length says how long the body of a GET would be).
            return (ok(b"{}") + poison if method == b"GET" else ok(poison)), True
        return await echo(backend, seen, index)

    with trio.fail_after(HANG_GUARD):
        async with serving(overlong) as (backend, port):
            pool = pools("127.0.0.1", port)
            assert await get(pool, port, method=method) == ({} if method == b"GET" else None)
            assert await get(pool, port) == {"conn": 1, "index": 0}
            assert backend.accepted == 2


def stale_after_first(backend: RawBackend, seen: Seen, index: int) -> bool:
    """The connection's second request meets a server that just closed it."""
    return seen.conn == 0 and index == 1


@pytest.mark.parametrize("method", [b"GET", b"HEAD", b"PUT", b"DELETE", b"OPTIONS"])
async def test_an_idempotent_request_on_a_stale_connection_is_sent_once_more(
    pools: Callable[..., Pool],
    method: bytes,
) -> None:
    async def plan(backend: RawBackend, seen: Seen, index: int) -> tuple[bytes, bool] | None:
        if stale_after_first(backend, seen, index):
            return None
        if seen.method == "HEAD":
            return b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", True
        return await echo(backend, seen, index)

    with trio.fail_after(HANG_GUARD):
        async with serving(plan) as (backend, port):
            pool = pools("127.0.0.1", port)
            await get(pool, port)
            answer = await get(pool, port, method=method)
            assert answer == (None if method == b"HEAD" else {"conn": 1, "index": 0})
            assert [(s.conn, s.method) for s in backend.seen] == [
                (0, "GET"),
                (0, method.decode()),
                (1, method.decode()),
            ]
            assert pool.statistics().open == 1
            await pool.aclose()


async def test_a_post_on_a_stale_connection_is_not_sent_again(pools: Callable[..., Pool]) -> None:
    async def plan(backend: RawBackend, seen: Seen, index: int) -> tuple[bytes, bool] | None:
        if stale_after_first(backend, seen, index):
            return None
        return await echo(backend, seen, index)

    with trio.fail_after(HANG_GUARD):
        async with serving(plan) as (backend, port):
            pool = pools("127.0.0.1", port)
            await get(pool, port)
            with pytest.raises(ConnectionBroken, match="failed before an answer"):
                await get(pool, port, method=b"POST")
            assert [s.method for s in backend.seen] == ["GET", "POST"]
            assert pool.statistics().open == 0


async def test_a_failure_after_the_first_byte_is_never_retried(pools: Callable[..., Pool]) -> None:
    async def plan(backend: RawBackend, seen: Seen, index: int) -> tuple[bytes, bool] | None:
        if index == 1:
            return b"HTTP/1.1 200 OK\r\nContent-Le", False
        return await echo(backend, seen, index)

    with trio.fail_after(HANG_GUARD):
        async with serving(plan) as (backend, port):
            pool = pools("127.0.0.1", port)
            await get(pool, port)
            with pytest.raises(ConnectionBroken, match="closed the connection before the answer"):
                await get(pool, port)
            assert len(backend.seen) == 2
            assert pool.statistics().open == 0


async def test_a_fresh_connection_that_fails_is_not_retried(pools: Callable[..., Pool]) -> None:
    async def plan(backend: RawBackend, seen: Seen, index: int) -> tuple[bytes, bool] | None:
        return None

    with trio.fail_after(HANG_GUARD):
        async with serving(plan) as (backend, port):
            pool = pools("127.0.0.1", port)
            with pytest.raises(ConnectionBroken, match="failed before an answer"):
                await get(pool, port)
            assert len(backend.seen) == 1


async def test_a_switch_of_protocols_is_a_bad_answer(pools: Callable[..., Pool]) -> None:
    """A 101 to a request that offered an upgrade (its headers came from a call template):
    the pool never switches protocols, and says so instead of waiting for an answer that
    h11 will never give it."""

    async def switch(backend: RawBackend, seen: Seen, index: int) -> tuple[bytes, bool] | None:
        return b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n", True

    with trio.fail_after(HANG_GUARD):
        async with serving(switch) as (_backend, port):
            pool = pools("127.0.0.1", port)
            offer = [*head(port), (b"Upgrade", b"websocket"), (b"Connection", b"upgrade")]
            with pytest.raises(BadAnswer, match="switched protocols"):
                await pool.request(
                    b"GET", b"/", offer, deadline=trio.current_time() + 5, max_bytes=100
                )
            assert pool.statistics().open == 0


# -- bodies --------------------------------------------------------------------------------


def chunked(*parts: bytes, extra: bytes = b"") -> bytes:
    out = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n" + extra + b"\r\n"
    for part in parts:
        out += f"{len(part):x}\r\n".encode() + part + b"\r\n"
    return out + b"0\r\n\r\n"


@pytest.mark.parametrize(
    ("raw", "body"),
    [
        (chunked(b"hello ", b"world"), b"hello world"),
        (ok(gzip.compress(b"x" * 300), extra=b"Content-Encoding: gzip\r\n"), b"x" * 300),
        (ok(zlib.compress(b"y" * 300), extra=b"Content-Encoding: deflate\r\n"), b"y" * 300),
        (chunked(gzip.compress(b"z" * 300), extra=b"Content-Encoding: gzip\r\n"), b"z" * 300),
    ],
)
async def test_chunked_and_compressed_bodies_are_read_whole(
    pools: Callable[..., Pool], raw: bytes, body: bytes
) -> None:
    async def plan(backend: RawBackend, seen: Seen, index: int) -> tuple[bytes, bool] | None:
        return raw, True

    with trio.fail_after(HANG_GUARD):
        async with serving(plan) as (backend, port):
            pool = pools("127.0.0.1", port)
            for _ in range(2):
                answer = await pool.request(
                    b"GET", b"/", head(port), deadline=trio.current_time() + 5, max_bytes=1000
                )
                assert answer.body == body
            assert backend.accepted == 1  # and the connection stayed usable
            await pool.aclose()


@pytest.mark.parametrize(
    "raw",
    [
        ok(b"x" * 101),
        chunked(b"x" * 60, b"x" * 41),
        ok(gzip.compress(b"x" * 10_000_000), extra=b"Content-Encoding: gzip\r\n"),
    ],
)
async def test_a_body_past_max_bytes_is_refused_and_its_connection_closed(
    pools: Callable[..., Pool], raw: bytes
) -> None:
    async def plan(backend: RawBackend, seen: Seen, index: int) -> tuple[bytes, bool] | None:
        return raw, True

    with trio.fail_after(HANG_GUARD):
        async with serving(plan) as (_backend, port):
            pool = pools("127.0.0.1", port)
            with pytest.raises(ResponseTooLarge) as info:
                await pool.request(
                    b"GET", b"/", head(port), deadline=trio.current_time() + 5, max_bytes=100
                )
            assert info.value.status == 200
            assert pool.statistics().open == 0


async def test_a_request_body_is_sent_with_its_length(pools: Callable[..., Pool]) -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving() as (backend, port):
            pool = pools("127.0.0.1", port)
            headers = [*head(port), (b"Content-Length", b"7")]
            await pool.request(
                b"POST",
                b"/x",
                headers,
                b'{"a":1}',
                deadline=trio.current_time() + 5,
                max_bytes=100,
            )
            assert backend.seen[0].body == b'{"a":1}'
            await pool.aclose()


# -- through Backends ----------------------------------------------------------------------


class _Ctx:
    def __init__(self, state: dict[str, object]) -> None:
        self.state = state
        self.remaining = 5.0
        self.path = "test"
        self.correlation_id = "c0ffee"  # forwarded as X-Request-ID by both clients
        self.traceparent: str | None = None
        self.tracestate: str | None = None
        self.baggage: str | None = None
        # What a failed call's log line names.
        self.pipe = Pipe(_nothing, "call")
        self.job_id = "job-1"


async def _nothing(ctx: Context) -> None:
    return None


async def test_backends_call_http_services_through_the_pool_on_one_connection() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving() as (backend, port):
            service = Service("api", f"http://127.0.0.1:{port}/base", headers={"X-Key": "k"})
            call = HttpCall.of(
                "api", "/items/{id}", method="POST", query={"q": "{q}"}, body={"id": "{id}"}
            )
            ctx = cast(Context, _Ctx({"id": "a b", "q": ["x&y", "z"]}))
            async with Backends([service]) as backends:
                assert isinstance(backends._lean["api"], ServiceClient)
                answers = [await backends.call(call, ctx) for _ in range(2)]
            assert answers == [{"conn": 0, "index": 0}, {"conn": 0, "index": 1}]
            assert backend.accepted == 1
            seen = backend.seen[0]
            assert (seen.method, seen.target) == ("POST", "/base/items/a%20b?q=x%26y&q=z")
            assert seen.body == b'{"id":"a b"}'
            assert seen.headers["host"] == f"127.0.0.1:{port}"
            assert seen.headers["user-agent"] == "pipework"
            assert seen.headers["x-key"] == "k"
            assert seen.headers["content-type"] == "application/json"
            assert seen.headers["content-length"] == "12"
            assert seen.headers["accept-encoding"] == "gzip, deflate"
            assert seen.headers["x-request-id"] == "c0ffee"  # the request id, as on httpx
            mock = httpx.MockTransport(lambda request: httpx.Response(204))
            async with Backends([service], transport=mock) as via_httpx:
                assert via_httpx._lean == {}  # an injected transport: every call on httpx
                assert await via_httpx.call(call, ctx) is None


@pytest.mark.parametrize("gzip", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("client", ["lean", "httpx"])
async def test_an_endless_answer_stops_at_max_response_bytes_and_keeps_nothing(
    client: str, gzip: bool
) -> None:
    """A backend whose (decoded) body never ends: each call fails as too big once
    ``max_response_bytes`` is read — not at the service's timeout, far beyond this test's
    guard — its connection is closed (the backend's next send fails) and never reused, and
    the errors, kept as a failed job keeps its own, hold none of what was read. Once they
    are dropped too, nothing is left for the garbage collector to finalize (an async
    generator left half-way would be reported: warnings are errors)."""
    limit = 1 << 20
    calls = 4
    with trio.fail_after(HANG_GUARD):
        async with endless_backend(gzip=gzip) as (backend, port):
            service = Service(
                "api", f"http://127.0.0.1:{port}", timeout=1000, max_response_bytes=limit
            )
            transport = httpx.AsyncHTTPTransport() if client == "httpx" else None
            plain = _Ctx({})
            plain.remaining = 1000.0  # the service's timeout is the bound, not the job's
            ctx = cast(Context, plain)
            call = HttpCall.of("api", "/")
            async with Backends([service], transport=transport) as backends:
                assert ("api" in backends._lean) == (client == "lean")
                errors: list[pw.BackendError] = []
                with retained() as alive:
                    for done in range(1, calls + 1):
                        with pytest.raises(pw.BackendError) as info:
                            await backends.call(call, ctx)
                        errors.append(info.value)
                        await backend.wait_ended(done)
                    # A fresh connection for every call, each closed by the client.
                    assert backend.accepted == backend.hung_up == calls
                    kept = alive()
                if client == "lean":
                    assert backends._lean["api"].pool.statistics().open == 0
                assert all(e.status == 200 and e.http_status == 502 for e in errors)
                assert str(errors[0]).endswith(f"more than {limit} bytes (its max_response_bytes)")
                assert kept < limit, f"{calls} failed calls keep {kept} bytes alive"
                del info, errors
                gc.collect()


@pytest.mark.parametrize("client", ["lean", "httpx"])
async def test_an_answer_cut_short_keeps_nothing_it_read(client: str) -> None:
    """A backend that closes the connection part of the way through a long body: each call
    fails (a broken connection, a 502 without status) and its error, kept as a failed job
    keeps its own, holds none of the body read before the break."""
    cut = 2 << 20
    calls = 4
    with trio.fail_after(HANG_GUARD):
        async with endless_backend(cut_after=cut) as (backend, port):
            service = Service(
                "api", f"http://127.0.0.1:{port}", timeout=1000, max_response_bytes=8 * cut
            )
            transport = httpx.AsyncHTTPTransport() if client == "httpx" else None
            plain = _Ctx({})
            plain.remaining = 1000.0
            ctx = cast(Context, plain)
            async with Backends([service], transport=transport) as backends:
                errors: list[pw.BackendError] = []
                with retained() as alive:
                    for done in range(1, calls + 1):
                        with pytest.raises(pw.BackendError) as info:
                            await backends.call(HttpCall.of("api", "/"), ctx)
                        errors.append(info.value)
                        await backend.wait_ended(done)
                    kept = alive()
                assert all(e.status is None for e in errors)
                assert kept < cut, f"{calls} failed calls keep {kept} bytes alive"


@pytest.mark.parametrize("client", ["lean", "httpx"])
async def test_a_body_that_does_not_decode_is_the_same_error_on_both_clients(client: str) -> None:
    async def plan(backend: RawBackend, seen: Seen, index: int) -> tuple[bytes, bool] | None:
        return ok(b"not gzip at all", extra=b"Content-Encoding: gzip\r\n"), True

    with trio.fail_after(HANG_GUARD):
        async with serving(plan) as (_backend, port):
            service = Service("api", f"http://127.0.0.1:{port}")
            transport = httpx.AsyncHTTPTransport() if client == "httpx" else None
            async with Backends([service], transport=transport) as backends:
                with pytest.raises(pw.BackendError) as info:
                    await backends.call(HttpCall.of("api", "/"), cast(Context, _Ctx({})))
    assert str(info.value) == (
        "service 'api' answered with a body that does not decode in its Content-Encoding "
        "(for test); check how the service compresses its answers"
    )
    assert type(info.value) is pw.BackendError
    assert info.value.status is None
    # One decoder for both clients, and its verdict is the cause on both.
    assert isinstance(info.value.__cause__, BadEncoding)
