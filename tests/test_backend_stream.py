"""The streamed exchange (pipework/backends/_stream.py) against real sockets: a raw h11
server written here, that each test tells what to do with a request (answer early, stream
without end, hold, stall, cut), and hypercorn with a plain ASGI app. Back-pressure is
checked on conditions (who is blocked, how many bytes moved), memory with tracemalloc,
and timeouts at exact virtual time (``autojump_clock``)."""

from __future__ import annotations

import functools
import logging
import math
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import h11
import pytest
import trio
import trio.testing
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from pipework import RetrySpec, Service
from pipework.backends._client import ServiceClient
from pipework.backends._failures import BadAnswer, CallTimeout, ConnectionBroken
from pipework.backends._pool import Pool
from pipework.backends._stream import StreamTimeouts, UpstreamAnswer

from ._loopback import serve_loopback

HANG_GUARD = 30.0
PIECE = 64 * 1024
MB = 1 << 20
# What two loopback sockets can hold in flight one way (send and receive buffers, at their
# largest on this kernel's defaults: 4 MiB + 32 MiB), with room to spare: bytes beyond it
# were moved because someone read them.
IN_FLIGHT = 40 * MB
#: Generous limits for the tests that wait on conditions (real clock): never reached.
PATIENT = StreamTimeouts(connect=60, first_byte=60, idle=60)


# -- a raw h11 backend ---------------------------------------------------------------------


class Peer:
    """One connection, as the backend sees it."""

    def __init__(self, stream: trio.SocketStream, backend: Backend) -> None:
        self.stream = stream
        self.conn = h11.Connection(h11.SERVER)
        self.backend = backend
        self.method = b""  # of the request being answered
        self.saw_eof = False

    async def next_event(self) -> Any:
        while (event := self.conn.next_event()) is h11.NEED_DATA:
            data = await self.stream.receive_some(PIECE)
            self.backend.received += len(data)
            self.conn.receive_data(data)
        return event

    async def body(self, *, limit: int | None = None) -> bytes:
        """The request's body (or its first ``limit`` bytes or so, the rest left unread)."""
        parts = bytearray()
        while limit is None or len(parts) < limit:
            event = await self.next_event()
            if isinstance(event, h11.EndOfMessage):
                break
            parts += event.data
        return bytes(parts)

    async def send(self, *events: Any) -> None:
        for event in events:
            data = self.conn.send(event)
            if data:
                await self.stream.send_all(data)

    async def answer(self, status: int, body: bytes = b"", *headers: tuple[bytes, bytes]) -> None:
        length = (b"content-length", b"%d" % len(body))
        await self.send(h11.Response(status_code=status, headers=[length, *headers]))
        if self.method != b"HEAD":
            await self.send(h11.Data(data=body))
        await self.send(h11.EndOfMessage())

    async def linger(self) -> None:
        """Read (and drop) whatever the client still sends, until it closes."""
        while data := await self.stream.receive_some(PIECE):
            self.backend.received += len(data)
        self.saw_eof = True


# What the backend does with one request; True keeps the connection for another.
Handler = Callable[[Peer, h11.Request], Awaitable[bool]]


async def ok(peer: Peer, request: h11.Request) -> bool:
    await peer.body()
    await peer.answer(200, b"ok")
    return True


@dataclass
class Backend:
    handler: Handler = ok
    accepted: int = 0
    requests: list[h11.Request] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)  # what handlers chose to keep
    #: How each connection ended: "closed" (by the backend), "eof" (the client closed
    #: it, or cut its request short), "reset" (a send or receive failed).
    ended: list[str] = field(default_factory=list)
    received: int = 0  # bytes read from every connection
    sent: int = 0  # body bytes sent by an endless answer
    sending: bool = False  # an endless answer is in a send
    release: trio.Event = field(default_factory=trio.Event)
    changed: trio.Event = field(default_factory=trio.Event)

    async def handle(self, stream: trio.SocketStream) -> None:
        self.accepted += 1
        peer = Peer(stream, self)
        how = "closed"
        try:
            while True:
                event = await peer.next_event()
                if isinstance(event, h11.ConnectionClosed):
                    how = "eof"
                    break
                self.requests.append(event)
                peer.method = event.method
                if not await self.handler(peer, event):
                    how = "eof" if peer.saw_eof else how
                    break
                if peer.conn.states != {h11.CLIENT: h11.DONE, h11.SERVER: h11.DONE}:
                    break
                peer.conn.start_next_cycle()
        except h11.RemoteProtocolError:  # the client closed mid-request
            how = "eof"
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            how = "reset"
        finally:
            self.ended.append(how)
            self.changed.set()
            self.changed = trio.Event()
            stream.socket.close()

    async def wait_ended(self, count: int) -> None:
        while len(self.ended) < count:
            await self.changed.wait()


@asynccontextmanager
async def serving(handler: Handler = ok) -> AsyncIterator[tuple[Backend, int]]:
    backend = Backend(handler)
    async with serve_loopback(backend.handle) as port:
        yield backend, port


@pytest.fixture
async def clients() -> AsyncIterator[Callable[..., ServiceClient]]:
    """Makes clients of 127.0.0.1:port and closes them after the test."""
    made: list[ServiceClient] = []

    def make(port: int, *, base: str = "", pool: Pool | None = None, **kw: Any) -> ServiceClient:
        service = Service("api", f"http://127.0.0.1:{port}{base}", **kw)
        made.append(ServiceClient(service, "pipework", pool))
        return made[-1]

    yield make
    for client in made:
        await client.aclose()


class Source:
    """A request body: ``total`` bytes (None: without end) in pieces of ``piece`` bytes,
    counting what was pulled; it may pause (on trio's clock) before each piece."""

    def __init__(
        self,
        total: int | None,
        *,
        piece: bytes = b"x" * PIECE,
        pause: float = 0,
        error: Exception | None = None,
    ) -> None:
        self.total = total
        self.piece = piece
        self.pause = pause
        self.error = error  # raised instead of the second piece
        self.pulled = 0
        self.pulls = 0
        self.crc = 0

    def __aiter__(self) -> Source:
        return self

    async def __anext__(self) -> bytes:
        self.pulls += 1
        if self.pause:
            await trio.sleep(self.pause)
        if self.error is not None and self.pulls == 2:
            raise self.error
        if self.total is not None and self.pulled >= self.total:
            raise StopAsyncIteration
        piece = self.piece
        if self.total is not None:
            piece = piece[: self.total - self.pulled]
        self.pulled += len(piece)
        self.crc = zlib.crc32(piece, self.crc)
        return piece


async def read_all(answer: UpstreamAnswer) -> bytes:
    return b"".join([piece async for piece in answer.body()])


def header(request: h11.Request, name: bytes) -> list[bytes]:
    return [value for key, value in request.headers if key == name]


@contextmanager
def peak_memory() -> Iterator[Callable[[], int]]:
    """The most memory allocated at once during the ``with``, over what was held before."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        yield lambda: tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


# -- streaming both ways, bounded ----------------------------------------------------------


async def echo(peer: Peer, request: h11.Request) -> bool:
    """Answers at once and sends each piece of the body back as it arrives."""
    await peer.send(h11.Response(status_code=200, headers=[(b"transfer-encoding", b"chunked")]))
    while isinstance(event := await peer.next_event(), h11.Data):
        await peer.send(h11.Data(data=event.data))
    await peer.send(h11.EndOfMessage())
    return True


@pytest.mark.hang_guard(real_seconds=180)  # 200 MB each way through four h11s, traced
async def test_a_large_body_streams_both_ways_at_once_in_bounded_memory(
    clients: Callable[..., ServiceClient],
) -> None:
    """200 MB up and the same 200 MB down at once (the backend echoes as it reads, and
    the client reads while it sends): nothing near a body's size is ever held, and the
    connection is reused after."""
    total = 200 * MB
    with trio.fail_after(170):
        async with serving(echo) as (backend, port):
            client = clients(port)
            source = Source(total, piece=bytes(range(256)) * (PIECE // 256))
            received, crc = 0, 0
            with peak_memory() as peak:
                async with client.stream(
                    b"POST", b"/echo", [], source, length=None, timeouts=PATIENT
                ) as answer:
                    assert answer.status == 200
                    async for piece in answer.body():
                        received += len(piece)
                        crc = zlib.crc32(piece, crc)
                held = peak()
            assert (received, crc) == (total, source.crc)
            assert held < 2 * MB, f"streaming 200 MB both ways held {held} bytes at once"
            async with client.stream(b"GET", b"/", [], None, length=None, timeouts=PATIENT) as a:
                assert await read_all(a) == b""
            assert backend.accepted == 1


def asgi_app() -> Callable[..., Awaitable[None]]:
    """``POST /upload`` answers the body's size and CRC; ``GET /download?N`` streams N
    bytes (no length: chunked); ``/length`` answers with a Content-Length."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        path = scope["path"]
        if path == "/upload":
            size, crc, more = 0, 0, True
            while more:
                message = await receive()
                size += len(message.get("body", b""))
                crc = zlib.crc32(message.get("body", b""), crc)
                more = message.get("more_body", False)
            body = b"%d %d %s" % (size, crc, dict(scope["headers"]).get(b"host", b""))
            headers = [(b"content-length", b"%d" % len(body))]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        if path == "/download":
            left = int(scope["query_string"])
            await send({"type": "http.response.start", "status": 200, "headers": []})
            piece = b"y" * PIECE
            while left > 0:
                chunk = piece[:left]
                left -= len(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        headers = [(b"content-length", b"5")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send(
            {"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else b"fixed"}
        )

    return app


@asynccontextmanager
async def hypercorn_backend() -> AsyncIterator[int]:
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.errorlog = logging.getLogger("hypercorn.error")
    config.accesslog = None
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            functools.partial(hypercorn_serve, asgi_app(), config, shutdown_trigger=stop.wait)
        )
        try:
            yield int(binds[0].rsplit(":", 1)[1])
        finally:
            stop.set()


@pytest.mark.parametrize("known_length", [True, False], ids=["content-length", "chunked"])
async def test_uploads_and_downloads_through_hypercorn(
    clients: Callable[..., ServiceClient], known_length: bool
) -> None:
    size = 32 * MB
    with trio.fail_after(HANG_GUARD * 2):
        async with hypercorn_backend() as port:
            client = clients(port)
            source = Source(size)
            length = size if known_length else None
            async with client.stream(
                b"PUT", b"/upload", [], source, length=length, timeouts=PATIENT
            ) as answer:
                assert answer.status == 200
                seen = await read_all(answer)
            assert seen == b"%d %d 127.0.0.1:%d" % (size, source.crc, port)
            async with client.stream(
                b"GET", b"/download?%d" % size, [], None, length=None, timeouts=PATIENT
            ) as answer:
                assert answer.header(b"transfer-encoding") == b"chunked"
                count = 0
                async for piece in answer.body():
                    assert len(piece) <= PIECE
                    count += len(piece)
            assert count == size
            for method, body in [(b"GET", b"fixed"), (b"HEAD", b"")]:
                async with client.stream(
                    method, b"/length", [], None, length=None, timeouts=PATIENT
                ) as answer:
                    assert answer.header(b"content-length") == b"5"
                    assert await read_all(answer) == body
            stats = client.pool.statistics()
            assert (stats.open, stats.idle) == (1, 1)  # one connection carried all four


# -- back-pressure -------------------------------------------------------------------------


async def endless(peer: Peer, request: h11.Request) -> bool:
    """Answers with a chunked body that never ends, counting what it sent."""
    backend = peer.backend
    await peer.send(h11.Response(status_code=200, headers=[(b"transfer-encoding", b"chunked")]))
    piece = h11.Data(data=b"z" * PIECE)
    while True:
        backend.sending = True
        await peer.send(piece)
        backend.sending = False
        backend.sent += PIECE


async def test_a_slow_reader_holds_the_backend_back(clients: Callable[..., ServiceClient]) -> None:
    """The answer is read from the socket only as the caller asks for it: a caller that
    stops reading leaves the backend blocked in its send, with no more sent than the
    sockets hold; each piece read lets it send more."""
    with trio.fail_after(HANG_GUARD):
        async with serving(endless) as (backend, port):
            client = clients(port)
            async with client.stream(
                b"GET", b"/", [], None, length=None, timeouts=PATIENT
            ) as answer:
                await trio.testing.wait_all_tasks_blocked()
                assert backend.sending
                before = backend.sent
                assert before < IN_FLIGHT
                body = answer.body()
                read = 0
                while read < before + 4 * MB:  # more than it had sent: it must have sent on
                    read += len(await body.__anext__())
                await trio.testing.wait_all_tasks_blocked()
                assert backend.sending
                assert read <= backend.sent < read + IN_FLIGHT
            await backend.wait_ended(1)
            assert backend.ended == ["reset"]  # closed under its send: not read to its end
            assert client.pool.statistics().open == 0


async def test_the_body_is_pulled_only_as_the_socket_takes_it(
    clients: Callable[..., ServiceClient],
) -> None:
    """A backend that does not read the body: the caller's body is pulled no further than
    what the sockets hold; as the backend reads, more is pulled. Its early refusal then
    stops the body where it is."""

    async def slow(peer: Peer, request: h11.Request) -> bool:
        await peer.backend.release.wait()
        peer.backend.bodies.append(await peer.body(limit=2 * IN_FLIGHT))
        await peer.answer(413, b"enough")
        await peer.linger()
        return False

    with trio.fail_after(HANG_GUARD):
        async with serving(slow) as (backend, port):
            client = clients(port)
            source = Source(None)

            async def upload() -> None:
                async with client.stream(
                    b"POST", b"/", [], source, length=None, timeouts=PATIENT
                ) as answer:
                    assert (answer.status, await read_all(answer)) == (413, b"enough")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(upload)
                await trio.testing.wait_all_tasks_blocked()
                held_back = source.pulled
                assert held_back < IN_FLIGHT
                backend.release.set()
            assert len(backend.bodies[0]) >= 2 * IN_FLIGHT
            assert source.pulled < len(backend.bodies[0]) + IN_FLIGHT
            assert source.pulled > held_back
            await backend.wait_ended(1)
            assert backend.ended == ["eof"]
            assert client.pool.statistics().open == 0


# -- early answers -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "extra"),
    [(413, [(b"connection", b"close")]), (401, []), (200, [(b"connection", b"close")])],
    ids=["413-close", "401", "200-close"],
)
async def test_an_early_answer_that_refuses_or_closes_stops_the_body(
    clients: Callable[..., ServiceClient], status: int, extra: list[tuple[bytes, bytes]]
) -> None:
    """The backend answers as soon as it has the head, reading none of the body: the
    answer is relayed whole, the rest of the body is never pulled, and the connection is
    closed after the exchange (the backend sees the client go)."""

    async def early(peer: Peer, request: h11.Request) -> bool:
        await peer.answer(status, b"go away", *extra)
        await peer.linger()
        return False

    with trio.fail_after(HANG_GUARD):
        async with serving(early) as (backend, port):
            client = clients(port)
            source = Source(None)
            async with client.stream(
                b"POST", b"/", [], source, length=None, timeouts=PATIENT
            ) as answer:
                assert answer.status == status
                assert await read_all(answer) == b"go away"
                await trio.testing.wait_all_tasks_blocked()
                pulled = source.pulled
                assert pulled < IN_FLIGHT
            await backend.wait_ended(1)
            assert backend.ended == ["eof"]
            assert source.pulled == pulled  # nothing more after the answer
            assert client.pool.statistics().open == 0


# -- reuse, and what closes a connection ---------------------------------------------------


async def test_a_connection_is_reused_only_after_a_clean_exchange(
    clients: Callable[..., ServiceClient],
) -> None:
    async def big(peer: Peer, request: h11.Request) -> bool:
        peer.backend.bodies.append(await peer.body())
        await peer.answer(200, b"b" * MB)
        return True

    with trio.fail_after(HANG_GUARD):
        async with serving(big) as (backend, port):
            client = clients(port)
            for _ in range(2):  # read to its end, a request body sent whole: kept
                async with client.stream(
                    b"PUT", b"/", [], Source(3 * PIECE), length=3 * PIECE, timeouts=PATIENT
                ) as answer:
                    assert len(await read_all(answer)) == MB
            assert backend.accepted == 1
            assert client.pool.statistics().idle == 1
            # Left after its head: the rest of the answer is on the wire, so it closes.
            async with client.stream(b"GET", b"/", [], None, length=None, timeouts=PATIENT):
                pass
            assert client.pool.statistics().open == 0
            await backend.wait_ended(1)
            # An error in the caller's code closes it too, even with the answer read.
            with pytest.raises(KeyError, match="the caller's own"):
                await read_then(client, KeyError("the caller's own"))
            assert client.pool.statistics().open == 0
            await backend.wait_ended(2)
            assert backend.accepted == 2
            assert backend.bodies[:2] == [b"x" * 3 * PIECE] * 2


async def read_then(client: ServiceClient, error: Exception) -> None:
    async with client.stream(b"GET", b"/", [], None, length=None, timeouts=PATIENT) as answer:
        await read_all(answer)
        raise error


@pytest.mark.parametrize("direction", ["download", "upload"])
async def test_a_cancelled_exchange_closes_its_connection_and_frees_its_place(
    clients: Callable[..., ServiceClient], direction: str
) -> None:
    """Cancelled mid-body either way, the exchange closes its connection at once (the
    backend sees it go) and the pool's one place is free for the next call."""

    async def plan(peer: Peer, request: h11.Request) -> bool:
        if request.target == b"/next":
            return await ok(peer, request)
        if direction == "download":
            return await endless(peer, request)
        await peer.send(h11.Response(status_code=200, headers=[(b"content-length", b"0")]))
        await peer.send(h11.EndOfMessage())
        await peer.body(limit=PIECE)  # a little, then no more
        await peer.backend.release.wait()
        await peer.linger()
        return False

    with trio.fail_after(HANG_GUARD):
        async with serving(plan) as (backend, port):
            client = clients(port, max_connections=1)
            source = Source(None) if direction == "upload" else None
            with trio.CancelScope() as scope:
                async with client.stream(
                    b"POST", b"/", [], source, length=None, timeouts=PATIENT
                ) as answer:
                    async for _ in answer.body():
                        if direction == "download":
                            break
                    await trio.testing.wait_all_tasks_blocked()  # the sender is blocked
                    scope.cancel()
                    await trio.sleep_forever()
            assert scope.cancelled_caught
            assert client.pool.statistics().open == 0
            backend.release.set()
            await backend.wait_ended(1)
            assert backend.ended == ["reset" if direction == "download" else "eof"]
            async with client.stream(b"GET", b"/next", [], None, length=None, timeouts=PATIENT):
                pass
            assert backend.accepted == 2


async def test_streams_beyond_the_limit_wait_their_turn_in_order(
    clients: Callable[..., ServiceClient],
) -> None:
    """The pool's limit holds for streamed exchanges: one connection, callers served one
    after the other, first come first served, each on the connection the last one left."""
    order: list[bytes] = []

    async def call(target: bytes) -> None:
        async with client.stream(b"GET", target, [], None, length=None, timeouts=PATIENT) as a:
            order.append(target)
            await read_all(a)

    async def held(peer: Peer, request: h11.Request) -> bool:
        if request.target == b"/first":
            await peer.backend.release.wait()
        return await ok(peer, request)

    with trio.fail_after(HANG_GUARD):
        async with serving(held) as (backend, port):
            client = clients(port, max_connections=1)
            async with trio.open_nursery() as nursery:
                for target in (b"/first", b"/a", b"/b", b"/c"):
                    nursery.start_soon(call, target)
                    await trio.testing.wait_all_tasks_blocked()
                assert client.pool.statistics().waiting == 3
                backend.release.set()
            assert order == [b"/first", b"/a", b"/b", b"/c"]
            assert backend.accepted == 1


@pytest.mark.parametrize(
    ("raw", "error", "message"),
    [
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n12345",
            ConnectionBroken,
            "before the answer's end",
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            BadAnswer,
            "invalid answer",
        ),
    ],
    ids=["cut-short", "malformed"],
)
async def test_an_answer_cut_short_or_malformed_mid_body_fails_the_read(
    clients: Callable[..., ServiceClient], raw: bytes, error: type[Exception], message: str
) -> None:
    async def broken(peer: Peer, request: h11.Request) -> bool:
        await peer.stream.send_all(raw)
        return False

    with trio.fail_after(HANG_GUARD):
        async with serving(broken) as (_backend, port):
            client = clients(port)
            with pytest.raises(error, match=message):
                await read_into(client, [], PATIENT)
            assert client.pool.statistics().open == 0


# -- timeouts, at exact virtual time -------------------------------------------------------


async def never_answers(peer: Peer, request: h11.Request) -> bool:
    await peer.body()
    await peer.linger()  # until the client gives up
    return False


TIMED = StreamTimeouts(connect=2, first_byte=3, idle=4)


async def test_connecting_times_out(
    clients: Callable[..., ServiceClient], autojump_clock: trio.testing.MockClock
) -> None:
    tries = 0

    async def never(host: str, port: int) -> trio.SocketStream:
        nonlocal tries
        tries += 1
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    client = clients(9, pool=Pool("127.0.0.1", 9, connect=never, connect_timeout=100))
    start = trio.current_time()
    with pytest.raises(CallTimeout, match=r"could not connect to 127\.0\.0\.1:9 within 2s") as info:
        async with client.stream(b"GET", b"/", [], None, length=None, timeouts=TIMED):
            raise AssertionError("unreachable")
    assert info.value.phase == "connect"
    # A connection not made is tried once more (the service's default retry: nothing was
    # sent), each try within the connect timeout, after a pause of at most backoff_base.
    assert tries == 2
    assert start + 4 <= trio.current_time() <= start + 4 + RetrySpec().backoff_base
    assert client.pool.statistics().open == 0


async def test_waiting_for_a_free_connection_counts_in_the_connect_timeout(
    clients: Callable[..., ServiceClient], autojump_clock: trio.testing.MockClock
) -> None:
    async with serving(endless) as (_backend, port):
        client = clients(port, max_connections=1)
        async with client.stream(b"GET", b"/", [], None, length=None, timeouts=TIMED):
            start = trio.current_time()
            with pytest.raises(
                CallTimeout, match=r"no connection to \S+ came free within 2s"
            ) as info:
                async with client.stream(b"GET", b"/", [], None, length=None, timeouts=TIMED):
                    raise AssertionError("unreachable")
            assert info.value.phase == "pool"
            assert trio.current_time() == start + 2
            assert client.pool.statistics().waiting == 0


async def test_the_first_byte_timeout_runs_from_the_end_of_the_request(
    clients: Callable[..., ServiceClient], autojump_clock: trio.testing.MockClock
) -> None:
    """Without a body it starts as the request goes out; with one, once the body was sent
    whole (the caller's pauses between pieces, 5 s each here, are not the backend's
    idleness: the idle timeout of 4 s does not bound them)."""
    async with serving(never_answers) as (backend, port):
        client = clients(port)
        start = trio.current_time()
        with pytest.raises(CallTimeout, match="sent no answer within 3s") as info:
            async with client.stream(b"GET", b"/", [], None, length=None, timeouts=TIMED):
                raise AssertionError("unreachable")
        assert info.value.phase == "answer"
        assert trio.current_time() == start + 3
        start = trio.current_time()
        source = Source(3 * PIECE, pause=5)
        with pytest.raises(CallTimeout, match="sent no answer within 3s") as info:
            async with client.stream(b"PUT", b"/", [], source, length=None, timeouts=TIMED):
                raise AssertionError("unreachable")
        assert info.value.phase == "answer"
        assert trio.current_time() == pytest.approx(start + 4 * 5 + 3)  # 3 pieces, then the end
        assert client.pool.statistics().open == 0
        await backend.wait_ended(2)


async def test_a_backend_silent_mid_body_times_out_idle(
    clients: Callable[..., ServiceClient], autojump_clock: trio.testing.MockClock
) -> None:
    async def stall(peer: Peer, request: h11.Request) -> bool:
        await peer.send(h11.Response(status_code=200, headers=[(b"content-length", b"10")]))
        await peer.send(h11.Data(data=b"12345"))
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async with serving(stall) as (_backend, port):
        client = clients(port)
        pieces: list[tuple[float, bytes]] = []
        with pytest.raises(CallTimeout, match="sent nothing more of its answer's body") as info:
            await read_into(client, pieces, TIMED)
        assert info.value.phase == "idle"
        [(start, piece)] = pieces
        assert piece == b"12345"
        assert trio.current_time() == start + 4
        assert client.pool.statistics().open == 0


async def read_into(
    client: ServiceClient,
    pieces: list[tuple[float, bytes]],
    timeouts: StreamTimeouts,
    deadline: float = math.inf,
) -> None:
    """Read an answer, noting each piece and when it came."""
    async with client.stream(
        b"GET", b"/", [], None, length=None, timeouts=timeouts, deadline=deadline
    ) as answer:
        async for piece in answer.body():
            pieces.append((trio.current_time(), piece))


async def test_a_backend_that_takes_none_of_the_body_times_out_idle(
    clients: Callable[..., ServiceClient], autojump_clock: trio.testing.MockClock
) -> None:
    async def deaf(peer: Peer, request: h11.Request) -> bool:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async with serving(deaf) as (_backend, port):
        client = clients(port)
        start = trio.current_time()
        with pytest.raises(CallTimeout, match="took nothing more of the request's body") as info:
            async with client.stream(b"POST", b"/", [], Source(None), length=None, timeouts=TIMED):
                raise AssertionError("unreachable")
        assert info.value.phase == "idle"
        assert trio.current_time() == start + 4
        assert client.pool.statistics().open == 0


async def test_the_deadline_bounds_the_whole_exchange(
    clients: Callable[..., ServiceClient], autojump_clock: trio.testing.MockClock
) -> None:
    """A backend that sends a piece every second, for ever: never idle, never done. The
    deadline ends it, wherever the caller is."""

    async def trickle(peer: Peer, request: h11.Request) -> bool:
        await peer.send(h11.Response(status_code=200, headers=[(b"transfer-encoding", b"chunked")]))
        while True:
            await peer.send(h11.Data(data=b"."))
            await trio.sleep(1)

    async with serving(trickle) as (_backend, port):
        client = clients(port)
        start = trio.current_time()
        pieces: list[tuple[float, bytes]] = []
        with pytest.raises(
            CallTimeout, match="no whole answer came by the exchange's deadline"
        ) as info:
            await read_into(client, pieces, TIMED, deadline=start + 10.5)
        assert info.value.phase == "answer"
        assert trio.current_time() == start + 10.5
        assert [when - start for when, _ in pieces] == list(range(11))
        assert client.pool.statistics().open == 0


# -- answers as HTTP/1.1 has them ----------------------------------------------------------


async def test_trailers_come_after_the_body(clients: Callable[..., ServiceClient]) -> None:
    async def with_trailers(peer: Peer, request: h11.Request) -> bool:
        await peer.body()
        chunked = (b"transfer-encoding", b"chunked")
        await peer.send(h11.Response(status_code=200, headers=[chunked, (b"trailer", b"x-sum")]))
        await peer.send(h11.Data(data=b"abc"), h11.EndOfMessage(headers=[(b"x-sum", b"294")]))
        return True

    with trio.fail_after(HANG_GUARD):
        async with serving(with_trailers) as (_backend, port):
            client = clients(port)
            async with client.stream(
                b"GET", b"/", [], None, length=None, timeouts=PATIENT
            ) as answer:
                assert answer.trailers == []
                assert await read_all(answer) == b"abc"
                assert answer.trailers == [(b"x-sum", b"294")]
            assert client.pool.statistics().idle == 1


async def test_head_204_and_304_have_no_body_and_keep_the_connection(
    clients: Callable[..., ServiceClient],
) -> None:
    async def bodiless(peer: Peer, request: h11.Request) -> bool:
        await peer.body()
        status = {b"/204": 204, b"/304": 304}.get(request.target, 200)
        headers = [] if status == 204 else [(b"content-length", b"1000")]
        await peer.send(h11.Response(status_code=status, headers=headers), h11.EndOfMessage())
        return True

    with trio.fail_after(HANG_GUARD):
        async with serving(bodiless) as (backend, port):
            client = clients(port)
            for method, target in [(b"HEAD", b"/"), (b"GET", b"/204"), (b"GET", b"/304")]:
                async with client.stream(
                    method, target, [], None, length=None, timeouts=PATIENT
                ) as answer:
                    assert await read_all(answer) == b""
            # Nobody asked for the (empty) body: its end was already there, so it is kept.
            async with client.stream(b"HEAD", b"/", [], None, length=None, timeouts=PATIENT) as a:
                assert a.header(b"content-length") == b"1000"
            assert backend.accepted == 1
            assert client.pool.statistics().idle == 1


async def test_an_answer_ending_with_its_connection(clients: Callable[..., ServiceClient]) -> None:
    async def old(peer: Peer, request: h11.Request) -> bool:
        await peer.stream.send_all(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n")
        for _ in range(3):
            await peer.stream.send_all(b"p" * PIECE)
        return False

    with trio.fail_after(HANG_GUARD):
        async with serving(old) as (_backend, port):
            client = clients(port)
            async with client.stream(
                b"GET", b"/", [], None, length=None, timeouts=PATIENT
            ) as answer:
                assert answer.http_version == b"1.0"
                assert await read_all(answer) == b"p" * 3 * PIECE
            assert client.pool.statistics().open == 0  # it ended with the connection


async def test_interim_answers_are_skipped_and_a_switch_is_refused(
    clients: Callable[..., ServiceClient],
) -> None:
    async def interim(peer: Peer, request: h11.Request) -> bool:
        if request.target == b"/switch":
            await peer.stream.send_all(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n")
            await peer.linger()
            return False
        await peer.stream.send_all(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\n\r\n")
        await peer.body()
        await peer.answer(201, b"made")
        return True

    with trio.fail_after(HANG_GUARD):
        async with serving(interim) as (_backend, port):
            client = clients(port)
            async with client.stream(
                b"POST", b"/", [], Source(10), length=10, timeouts=PATIENT
            ) as answer:
                assert (answer.status, await read_all(answer)) == (201, b"made")
            with pytest.raises(BadAnswer, match="sent an invalid answer"):
                async with client.stream(
                    b"GET",
                    b"/switch",
                    [(b"upgrade", b"x"), (b"connection", b"upgrade")],
                    None,
                    length=None,
                    timeouts=PATIENT,
                ):
                    raise AssertionError("unreachable")
            assert client.pool.statistics().open == 0


# -- the request: framed by the exchange ---------------------------------------------------


async def test_the_request_is_framed_by_the_exchange(clients: Callable[..., ServiceClient]) -> None:
    """Framing headers the caller passes are never sent (CL.TE, TE.CL, duplicate lengths):
    the exchange frames the body itself. Host is the service's unless the caller gives one;
    the target goes under the service's base path."""

    async def keep(peer: Peer, request: h11.Request) -> bool:
        peer.backend.bodies.append(await peer.body())
        await peer.answer(200)
        return True

    smuggling = [
        (b"Content-Length", b"4"),
        (b"Transfer-Encoding", b"chunked"),
        (b"content-length", b"99"),
        (b"x-kept", b"yes"),
    ]
    with trio.fail_after(HANG_GUARD):
        async with serving(keep) as (backend, port):
            client = clients(port, base="/base/")
            cases: list[tuple[Source | None, int | None, list[tuple[bytes, bytes]]]] = [
                (Source(10), 10, smuggling),
                (Source(3 * PIECE + 1), None, smuggling),
                (None, None, smuggling),
                (None, 0, [(b"Host", b"client.example")]),
            ]
            for source, length, headers in cases:
                async with client.stream(
                    b"POST", b"/x?q=%2F", headers, source, length=length, timeouts=PATIENT
                ) as answer:
                    await read_all(answer)
            first, chunked, empty, host = backend.requests
            assert backend.bodies == [b"x" * 10, b"x" * (3 * PIECE + 1), b"", b""]
            assert first.target == b"/base/x?q=%2F"
            assert header(first, b"host") == [b"127.0.0.1:%d" % port]
            assert header(first, b"x-kept") == [b"yes"]
            assert (header(first, b"content-length"), header(first, b"transfer-encoding")) == (
                [b"10"],
                [],
            )
            assert header(chunked, b"transfer-encoding") == [b"chunked"]
            assert header(chunked, b"content-length") == []
            assert header(empty, b"content-length") == header(empty, b"transfer-encoding") == []
            assert header(host, b"host") == [b"client.example"]
            assert header(host, b"content-length") == [b"0"]
            assert backend.accepted == 1  # every one of them left the connection in step


@pytest.mark.parametrize(
    ("total", "which"), [(5, "ended after 5 of the 10 bytes"), (20, "gave more than the 10 bytes")]
)
async def test_a_body_that_does_not_match_its_length_is_never_sent_whole(
    clients: Callable[..., ServiceClient], total: int, which: str
) -> None:
    async def keep(peer: Peer, request: h11.Request) -> bool:
        peer.backend.bodies.append(await peer.body())
        await peer.answer(200)
        return True

    with trio.fail_after(HANG_GUARD):
        async with serving(keep) as (backend, port):
            client = clients(port)
            with pytest.raises(ValueError, match=f"body {which} its length said"):
                async with client.stream(
                    b"POST", b"/", [], Source(total, piece=b"x" * 5), length=10, timeouts=PATIENT
                ):
                    raise AssertionError("unreachable")
            await backend.wait_ended(1)
            assert backend.ended == ["eof"]  # cut short: the backend saw no whole request
            assert backend.bodies == []
            assert client.pool.statistics().open == 0


async def test_an_error_of_the_callers_body_is_raised_as_it_was(
    clients: Callable[..., ServiceClient],
) -> None:
    class ClientGone(Exception):
        pass

    with trio.fail_after(HANG_GUARD):
        async with serving(never_answers) as (backend, port):
            client = clients(port)
            gone = ClientGone("the client went away")
            with pytest.raises(ClientGone) as info:
                async with client.stream(
                    b"POST", b"/", [], Source(None, error=gone), length=None, timeouts=PATIENT
                ):
                    raise AssertionError("unreachable")
            assert info.value is gone
            await backend.wait_ended(1)
            assert backend.ended == ["eof"]
            assert client.pool.statistics().open == 0


# -- the stale-connection retry ------------------------------------------------------------


def stale_second(handler: Handler) -> Handler:
    """The connection's second request meets a backend that just closed it (after
    reading its head, and some of its body if it has one)."""

    async def plan(peer: Peer, request: h11.Request) -> bool:
        if peer.backend.accepted == 1 and len(peer.backend.requests) == 2:
            if header(request, b"transfer-encoding") or header(request, b"content-length"):
                await peer.body(limit=1)
            return False
        return await handler(peer, request)

    return plan


@pytest.mark.parametrize("method", [b"GET", b"HEAD", b"PUT", b"DELETE", b"OPTIONS"])
async def test_an_idempotent_request_without_a_body_is_sent_again_on_a_stale_connection(
    clients: Callable[..., ServiceClient], method: bytes
) -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(stale_second(ok)) as (backend, port):
            client = clients(port)
            for _ in range(2):
                async with client.stream(
                    method, b"/", [], None, length=None, timeouts=PATIENT
                ) as answer:
                    assert answer.status == 200
                    await read_all(answer)
            assert [r.method for r in backend.requests] == [method] * 3
            assert backend.accepted == 2


@pytest.mark.parametrize(
    ("method", "source"),
    [(b"POST", None), (b"PUT", Source(3 * PIECE))],
    ids=["post", "put-with-a-body"],
)
async def test_a_stale_connection_is_not_retried_for_a_post_or_a_body_already_taken(
    clients: Callable[..., ServiceClient], method: bytes, source: Source | None
) -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(stale_second(ok)) as (backend, port):
            client = clients(port)
            async with client.stream(method, b"/", [], None, length=None, timeouts=PATIENT) as a:
                await read_all(a)
            with pytest.raises(ConnectionBroken, match="failed before an answer"):
                async with client.stream(method, b"/", [], source, length=None, timeouts=PATIENT):
                    raise AssertionError("unreachable")
            if source is not None:
                assert source.pulled > 0  # taken, so it cannot be sent again
            assert len(backend.requests) == 2
            assert backend.accepted == 1
            assert client.pool.statistics().open == 0


async def test_a_fresh_connection_that_fails_is_not_retried(
    clients: Callable[..., ServiceClient],
) -> None:
    async def hang_up(peer: Peer, request: h11.Request) -> bool:
        return False

    with trio.fail_after(HANG_GUARD):
        async with serving(hang_up) as (backend, port):
            client = clients(port)
            with pytest.raises(ConnectionBroken, match="failed before an answer"):
                async with client.stream(b"GET", b"/", [], None, length=None, timeouts=PATIENT):
                    raise AssertionError("unreachable")
            assert backend.accepted == 1


def test_timeouts_must_be_positive() -> None:
    with pytest.raises(ValueError, match="idle must be a positive number"):
        StreamTimeouts(connect=1, first_byte=1, idle=0)
    assert StreamTimeouts(connect=math.inf, first_byte=math.inf, idle=math.inf).idle == math.inf
