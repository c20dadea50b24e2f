"""The backends layer owns its errors: every way a call can fail on the wire surfaces from an
HTTP pipe as pipework's error, the same for both clients (the lean pool, and httpx for an
injected transport, here over plain TCP), with the client's own exception as
``__cause__`` — and counts as the backend's trouble, which lowers an adaptive limit.
Also the dispatcher's classification of backend trouble, which knows pipework's errors and
the standard library's only.

Each failure is real: a raw trio server on 127.0.0.1 that refuses, resets, answers garbage
or never answers. Time is virtual (``autojump_clock``)."""

from __future__ import annotations

import contextlib
import functools
import socket
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
import pytest
import trio
import trio.testing

import pipework as pw
from pipework import Backends, HttpCall, Service, http_pipe
from pipework.backends._failures import BadAnswer, CallTimeout, ConnectFailed, ConnectionBroken
from pipework.backends._h1 import BadEncoding

TIMEOUT = 30.0
WHERE = "chain 'go' > pipe 'call'"


@dataclass
class Server:
    """Answers each request by its path (see :meth:`answer`)."""

    held: int = 0  # requests to /hold received
    changed: trio.Event = field(default_factory=trio.Event)

    async def handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            request = b""
            while b"\r\n\r\n" not in request:
                data = await stream.receive_some()
                if not data:
                    return
                request += data
            path = request.split(b" ", 2)[1].decode()
            with contextlib.suppress(trio.BrokenResourceError):  # the client hung up first
                await self.answer(path, stream)

    async def answer(self, path: str, stream: trio.SocketStream) -> None:
        if path in ("/reset", "/cut"):  # a long body begun, then a TCP reset or a close
            await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 10)
            if path == "/reset":
                linger = struct.pack("ii", 1, 0)
                stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
            return
        if path == "/malformed":
            await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: many\r\n\r\n")
        elif path == "/undecodable":
            body = b"not gzip at all"
            await stream.send_all(
                b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body)
            )
        elif path == "/hold":
            self.held += 1
            self.changed.set()
            self.changed = trio.Event()
        else:
            raise AssertionError(f"no such path {path}")
        while await stream.receive_some():  # until the client closes the connection
            pass

    async def wait_held(self, count: int) -> None:
        while self.held < count:
            await self.changed.wait()


@asynccontextmanager
async def serving() -> AsyncIterator[tuple[Server, int]]:
    server = Server()
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, server.handle, 0, host="127.0.0.1")
        )
        try:
            yield server, listeners[0].socket.getsockname()[1]
        finally:
            nursery.cancel_scope.cancel()


def closed_port() -> int:
    with socket.socket() as sock:  # a port nothing listens on once it is closed
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def engine_calling(
    port: int, path: str, client: str
) -> tuple[pw.Engine, Backends, pw.WeightedPool]:
    """An engine whose chain ``go`` is one HTTP pipe ``call`` to ``path``, through the
    ``client`` named, on a key with an adaptive limit; the service has one connection."""
    service = Service("api", f"http://127.0.0.1:{port}", timeout=TIMEOUT, max_connections=1)
    # An injected transport sends every call through httpx (with the service's one
    # connection, as Backends gives an httpx client of its own).
    transport = (
        httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=1))
        if client == "httpx"
        else None
    )
    backends = Backends([service], transport=transport)
    pool = pw.WeightedPool(8, keys={"api": pw.Weights(limit=4, adaptive=pw.Adaptive())})
    registry = pw.Registry()
    engine = pw.Engine(registry=registry, pool=pool)
    registry.add_pipe(http_pipe("call", HttpCall.of("api", path), backends))
    engine.chain("go", "call")
    return engine, backends, pool


def adaptive_limit(pool: pw.WeightedPool) -> float:
    limit = pool.statistics().keys["api"].adaptive_limit
    assert limit is not None
    return limit


async def fail(engine: pw.Engine) -> pw.PipeworkError:
    """The error the chain ``go`` fails with."""
    with pytest.raises(pw.PipeworkError) as info:
        await engine.run("go")
    return info.value


@dataclass(frozen=True)
class Failure:
    path: str
    error: type[pw.PipeworkError]
    message: str
    causes: dict[str, type[BaseException]]  # by client
    httpx_message: str | None = None  # where httpx cannot tell what the lean client can


FAILURES = {
    "connect-refused": Failure(
        "/",
        pw.BackendUnreachable,
        f"could not connect to service 'api' (for {WHERE}); nothing was sent: check that the "
        "service is up and reachable at its base_url",
        {"lean": ConnectFailed, "httpx": httpx.ConnectError},
    ),
    "reset-mid-answer": Failure(
        "/reset",
        pw.BackendError,
        f"the connection to service 'api' broke before its answer was complete (for {WHERE}); "
        "the service may have acted on the request: check its health and logs",
        {"lean": ConnectionBroken, "httpx": httpx.ReadError},
    ),
    "closed-mid-answer": Failure(
        "/cut",
        pw.BackendError,
        f"the connection to service 'api' broke before its answer was complete (for {WHERE}); "
        "the service may have acted on the request: check its health and logs",
        {"lean": ConnectionBroken, "httpx": httpx.RemoteProtocolError},
        # h11 under httpx calls a body cut short a protocol error, as a malformed one.
        httpx_message=f"service 'api' sent an invalid or incomplete HTTP answer (for {WHERE}); "
        "check the service (and any proxy in front of it)",
    ),
    "malformed-answer": Failure(
        "/malformed",
        pw.BackendError,
        f"service 'api' sent an invalid or incomplete HTTP answer (for {WHERE}); check the "
        "service (and any proxy in front of it)",
        {"lean": BadAnswer, "httpx": httpx.RemoteProtocolError},
    ),
    "undecodable-body": Failure(
        "/undecodable",
        pw.BackendError,
        "service 'api' answered with a body that does not decode in its Content-Encoding "
        f"(for {WHERE}); check how the service compresses its answers",
        {"lean": BadEncoding, "httpx": BadEncoding},  # one decoder, shared by both
    ),
}


@pytest.mark.parametrize("client", ["lean", "httpx"])
@pytest.mark.parametrize("kind", list(FAILURES))
async def test_a_failed_exchange_is_a_backend_error_caused_by_the_clients_own(
    autojump_clock: trio.testing.MockClock, kind: str, client: str
) -> None:
    failure = FAILURES[kind]
    async with serving() as (_server, port):
        if kind == "connect-refused":
            port = closed_port()
        engine, backends, pool = engine_calling(port, failure.path, client)
        async with backends, engine:
            before = adaptive_limit(pool)
            error = await fail(engine)
            after = adaptive_limit(pool)
    assert type(error) is failure.error
    assert isinstance(error, pw.BackendError)
    assert (error.service, error.status, error.http_status) == ("api", None, 502)
    if client == "httpx" and failure.httpx_message is not None:
        assert str(error) == failure.httpx_message
    else:
        assert str(error) == failure.message
    assert isinstance(error.__cause__, failure.causes[client]), repr(error.__cause__)
    assert after < before  # the backend's trouble, on either client


@pytest.mark.parametrize("client", ["lean", "httpx"])
async def test_no_free_connection_is_a_deadline_naming_the_services_connections(
    autojump_clock: trio.testing.MockClock, client: str
) -> None:
    async with serving() as (server, port):
        engine, backends, pool = engine_calling(port, "/hold", client)
        async with backends, engine:
            before = adaptive_limit(pool)
            first = await engine.submit("go")
            await server.wait_held(1)  # the service's only connection is taken
            start = trio.current_time()
            error = await fail(engine)
            assert trio.current_time() == start + TIMEOUT
            with pytest.raises(pw.DeadlineExceeded):  # the first, at the same time
                await engine.wait(first)
            after = adaptive_limit(pool)
    assert isinstance(error, pw.DeadlineExceeded)
    assert (error.scope, error.where, error.http_status) == ("pipe", WHERE, 504)
    assert str(error) == (
        f"no connection to service 'api' came free within 30s (for {WHERE}): all 1 of "
        "its max_connections were busy; raise them, or lower the limit of the service's key"
    )
    if client == "lean":
        assert isinstance(error.__cause__, CallTimeout)
        assert error.__cause__.phase == "pool"
    else:
        assert isinstance(error.__cause__, httpx.PoolTimeout)
    assert server.held == 1  # the second call never got a connection
    assert after < before


@pytest.mark.parametrize("client", ["lean", "httpx"])
async def test_a_backend_that_never_answers_is_a_deadline_caused_by_the_clients_timeout(
    autojump_clock: trio.testing.MockClock, client: str
) -> None:
    async with serving() as (server, port):
        engine, backends, pool = engine_calling(port, "/hold", client)
        async with backends, engine:
            before = adaptive_limit(pool)
            start = trio.current_time()
            error = await fail(engine)
            assert trio.current_time() == start + TIMEOUT
            after = adaptive_limit(pool)
    assert isinstance(error, pw.DeadlineExceeded)
    assert (error.scope, error.where, error.http_status) == ("pipe", WHERE, 504)
    assert str(error) == (
        f"service 'api' did not answer within 30s (for {WHERE}); check why it is slow, or "
        "raise its timeout if it may take that long"
    )
    if client == "lean":
        assert isinstance(error.__cause__, CallTimeout)
        assert error.__cause__.phase == "answer"
    else:
        assert isinstance(error.__cause__, httpx.ReadTimeout)
    assert server.held == 1
    assert after < before


# -- what counts as the backend's trouble ------------------------------------------------


def _describe(error: BaseException) -> str:
    name = type(error).__name__
    if isinstance(error, pw.DeadlineExceeded):
        return f"{name}({error.scope})"
    if isinstance(error, pw.BackendError):
        return f"{name}({error.status})"
    if isinstance(error, BaseExceptionGroup):
        return f"{name}({','.join(_describe(e) for e in error.exceptions)})"
    return name


@pytest.mark.parametrize(
    ("make_error", "trouble"),
    [
        (lambda: pw.BackendUnreachable("down", service="api"), True),
        (lambda: pw.BackendError("broken", service="api"), True),
        (lambda: pw.BackendError("busy", service="api", status=503), True),
        (lambda: pw.BackendError("teapot", service="api", status=418), False),
        (lambda: pw.DeadlineExceeded("slow", scope="pipe"), True),
        (lambda: TimeoutError("slow"), True),
        (lambda: ConnectionResetError("reset"), True),
        (lambda: OSError("all attempts to connect failed"), True),
        (lambda: FileNotFoundError("a pipe's own file"), False),
        (lambda: KeyError("missing"), False),
        (lambda: ExceptionGroup("two", [KeyError("k"), pw.BackendError("b", service="a")]), True),
        (lambda: ExceptionGroup("two", [KeyError("k"), ValueError("v")]), False),
        # An HTTP client's own exception is the pipe's bug unless the pipe says otherwise.
        (lambda: httpx.ConnectError("refused"), False),
        (lambda: httpx.ReadTimeout("slow"), False),
        (lambda: httpx.RemoteProtocolError("garbage"), False),
    ],
    ids=lambda value: str(value) if isinstance(value, bool) else _describe(value()),
)
async def test_only_pipeworks_errors_and_the_standard_librarys_are_the_backends_trouble(
    autojump_clock: trio.testing.MockClock,
    make_error: Callable[[], Exception],
    trouble: bool,
) -> None:
    """What a pipe raises lowers its key's adaptive limit exactly when it points at the
    backend; the dispatcher knows no HTTP client's exception types."""
    pool = pw.WeightedPool(8, keys={"api": pw.Weights(limit=4, adaptive=pw.Adaptive())})
    engine = pw.Engine(pool=pool)

    @engine.pipe(key="api")
    async def call(ctx: pw.Context) -> None:
        raise make_error()

    engine.chain("go", call)
    async with engine:
        before = adaptive_limit(pool)
        with pytest.raises(BaseException) as info:  # noqa: PT011 - each parametrized error
            await engine.run("go")
        assert type(info.value) is type(make_error())
        assert (adaptive_limit(pool) < before) is trouble


async def test_a_pipe_with_a_client_of_its_own_counts_when_it_raises_a_backend_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """As docs/design.md says: the same httpx failure raised as a BackendError from the
    client's exception lowers the limit (left as it is, it does not: above)."""
    pool = pw.WeightedPool(8, keys={"api": pw.Weights(limit=4, adaptive=pw.Adaptive())})
    engine = pw.Engine(pool=pool)

    @engine.pipe(key="api")
    async def call(ctx: pw.Context) -> None:
        try:
            raise httpx.ConnectError("refused")
        except httpx.TransportError as exc:
            raise pw.BackendError("service 'api' failed", service="api") from exc

    engine.chain("go", call)
    async with engine:
        before = adaptive_limit(pool)
        with pytest.raises(pw.BackendError) as info:
            await engine.run("go")
        assert isinstance(info.value.__cause__, httpx.ConnectError)
        assert adaptive_limit(pool) < before
