"""The serving layer: a QuartTrio app on hypercorn's trio worker, over real sockets."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import h11
import httpx
import pytest
import trio
import trio.testing
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import TrioSingleTask
from quart import Response
from quart_trio import QuartTrio

from pipework.container import BoundAddress, _hypercorn_fix, serve

from .test_container_harness import receive_response

# Each test runs on each HTTP/1.1 server serve() has (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("http1_server")

# Every test that waits on the network is bounded by this: the failure mode of the bugs
# under test is a hang, and a hang must fail the test, not stall the run.
HANG_GUARD = 10.0


@dataclass
class Gate:
    """Lets a test see into, and hold, the ``/park`` handler."""

    started: trio.Event = field(default_factory=trio.Event)
    entered: trio.Event = field(default_factory=trio.Event)
    release: trio.Event = field(default_factory=trio.Event)
    cancelled: trio.Event = field(default_factory=trio.Event)


def make_app(gate: Gate) -> QuartTrio:
    app = QuartTrio(__name__)

    @app.before_serving
    async def startup() -> None:
        gate.started.set()

    @app.route("/")
    async def index() -> str:
        return "hello"

    @app.route("/close")
    async def close() -> Response:
        return Response("bye", headers={"Connection": "close"})

    @app.route("/park")
    async def park() -> str:
        gate.entered.set()
        try:
            await gate.release.wait()
        except trio.Cancelled:
            gate.cancelled.set()
            raise
        return "released"

    return app


@asynccontextmanager
async def serving(app: QuartTrio, **options: Any) -> AsyncIterator[BoundAddress]:
    """Serve ``app`` for the body of the ``async with``, then shut down gracefully and
    wait for ``serve`` to return."""
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        address: BoundAddress = await nursery.start(
            functools.partial(serve, app, shutdown_trigger=stop, **options)
        )
        try:
            yield address
        finally:
            stop.set()


class RawClient:
    """HTTP/1.1 over a bare trio socket, parsed with h11, so a test sees exactly when the
    server closes the connection."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.conn = h11.Connection(our_role=h11.CLIENT)

    async def get(
        self, target: str, headers: Sequence[tuple[str, str]] = ()
    ) -> tuple[h11.Response, bytes]:
        await self.send_request(target, headers)
        return await self.receive_response()

    async def send_request(self, target: str, headers: Sequence[tuple[str, str]] = ()) -> None:
        if self.conn.our_state is h11.DONE:
            self.conn.start_next_cycle()
        request = h11.Request(method="GET", target=target, headers=[("Host", "test"), *headers])
        await self.stream.send_all(self.conn.send(request) + self.conn.send(h11.EndOfMessage()))

    async def receive_response(self) -> tuple[h11.Response, bytes]:
        return await receive_response(self.conn, self.stream)

    async def receive_rest(self) -> bytes:
        """Everything the server sends until it closes the connection."""
        data = bytearray()
        while chunk := await self.stream.receive_some():
            data += chunk
        return bytes(data)


@asynccontextmanager
async def raw_client(address: BoundAddress) -> AsyncIterator[RawClient]:
    async with await trio.open_tcp_stream(address.host, address.port) as stream:
        yield RawClient(stream)


def header(response: h11.Response, name: bytes) -> bytes | None:
    return next((value for key, value in response.headers if key == name), None)


async def test_serves_a_request_on_the_reported_free_port() -> None:
    gate = Gate()
    with trio.fail_after(HANG_GUARD):
        async with serving(make_app(gate)) as address:
            # Reported only after the app's startup ran and the socket listens.
            assert gate.started.is_set()
            assert address.host == "127.0.0.1"
            assert address.port > 0
            assert address.url == f"http://127.0.0.1:{address.port}"
            async with httpx.AsyncClient(base_url=address.url) as client:
                response = await client.get("/")
            assert response.status_code == 200
            assert response.text == "hello"


@pytest.mark.parametrize(
    ("target", "headers", "body"),
    [
        pytest.param("/", [("Connection", "close")], b"hello", id="client-asks"),
        pytest.param("/close", [], b"bye", id="app-answers"),
    ],
)
async def test_connection_close_closes_the_socket(
    target: str, headers: list[tuple[str, str]], body: bytes
) -> None:
    # Regression: without pipework's hypercorn fix the socket stays open after the
    # response and the client waits for EOF until the guard fires.
    with trio.fail_after(HANG_GUARD):
        async with serving(make_app(Gate())) as address, raw_client(address) as client:
            response, received = await client.get(target, headers)
            assert response.status_code == 200
            assert received == body
            assert header(response, b"connection") == b"close"
            assert await client.receive_rest() == b""


async def test_connection_closes_after_keep_alive_max_requests() -> None:
    with trio.fail_after(HANG_GUARD):
        async with (
            serving(make_app(Gate()), keep_alive_max_requests=2) as address,
            raw_client(address) as client,
        ):
            first, _ = await client.get("/")
            assert header(first, b"connection") is None
            second, received = await client.get("/")
            assert second.status_code == 200
            assert received == b"hello"
            assert header(second, b"connection") == b"close"
            assert await client.receive_rest() == b""


async def test_keep_alive_timeout_closes_an_idle_connection() -> None:
    # Regression: without the fix the idle timer is never restarted after a response,
    # so an idle keep-alive connection stays open for as long as the client likes.
    with trio.fail_after(HANG_GUARD):
        async with (
            # A short real timeout: the test waits for this deadline to pass.
            serving(make_app(Gate()), keep_alive_timeout=0.3) as address,
            raw_client(address) as client,
        ):
            response, _ = await client.get("/")
            assert header(response, b"connection") is None
            assert await client.receive_rest() == b""


async def test_graceful_shutdown_returns_and_releases_the_port() -> None:
    stop = trio.Event()
    with trio.fail_after(HANG_GUARD):
        # The nursery waits for serve() to return before the client closes: its idle
        # keep-alive connection must not hold the shutdown up.
        async with httpx.AsyncClient() as client, trio.open_nursery() as nursery:
            address: BoundAddress = await nursery.start(
                functools.partial(
                    serve,
                    make_app(Gate()),
                    shutdown_trigger=stop,
                    # Longer than the guard: a connection holding the shutdown up fails.
                    graceful_timeout=2 * HANG_GUARD,
                )
            )
            assert (await client.get(address.url)).status_code == 200
            stop.set()
    with trio.socket.socket() as sock:
        # What a restarting server does: listen on the same port again.
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
        await sock.bind((address.host, address.port))
        sock.listen()


async def test_a_parked_request_finishes_within_the_grace_period() -> None:
    gate = Gate()
    stop = trio.Event()
    served = False

    async def run_server(*, task_status: trio.TaskStatus[BoundAddress]) -> None:
        nonlocal served
        await serve(
            make_app(gate),
            shutdown_trigger=stop,
            graceful_timeout=HANG_GUARD,
            task_status=task_status,
        )
        served = True

    with trio.fail_after(HANG_GUARD):
        async with trio.open_nursery() as nursery:
            address: BoundAddress = await nursery.start(run_server)
            async with raw_client(address) as client:
                await client.send_request("/park")
                await gate.entered.wait()
                stop.set()
                # Let the shutdown go as far as it can while the request is parked.
                await trio.testing.wait_all_tasks_blocked()
                assert not served
                # The listener is already closed: no new connections.
                with trio.socket.socket() as sock, pytest.raises(ConnectionRefusedError):
                    await sock.connect((address.host, address.port))
                gate.release.set()
                response, body = await client.receive_response()
                assert (response.status_code, body) == (200, b"released")
                # The server ends the connection after the last response; without the
                # hypercorn fix it stays open and holds serve() up for the whole grace period.
                assert await client.receive_rest() == b""
    assert served
    assert not gate.cancelled.is_set()


async def test_a_request_parked_past_the_grace_period_is_cancelled() -> None:
    gate = Gate()
    stop = trio.Event()
    with trio.fail_after(HANG_GUARD):
        async with trio.open_nursery() as nursery:
            address: BoundAddress = await nursery.start(
                # A short real grace period: the test waits for this deadline to pass.
                functools.partial(
                    serve, make_app(gate), shutdown_trigger=stop, graceful_timeout=0.1
                )
            )
            async with raw_client(address) as client:
                await client.stream.send_all(b"GET /park HTTP/1.1\r\nHost: test\r\n\r\n")
                await gate.entered.wait()
                stop.set()
                # At the deadline the handler is cancelled and the connection closed
                # without a response.
                assert await client.receive_rest() == b""
    assert gate.cancelled.is_set()


def unpatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Put hypercorn's own methods back for one test (the fix patches them for good)."""
    for patch in _hypercorn_fix._PATCHES:
        monkeypatch.setattr(patch.cls, patch.name, inspect.unwrap(getattr(patch.cls, patch.name)))


def patched_methods() -> list[Callable[..., Any]]:
    return [getattr(patch.cls, patch.name) for patch in _hypercorn_fix._PATCHES]


@pytest.mark.http1_servers("hypercorn")  # of hypercorn's own code
async def test_unpatched_hypercorn_still_cancels_its_bookkeeping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Canary: hypercorn as installed still has the bug the fix works around.

    If this starts failing, hypercorn no longer cancels its connection bookkeeping when a
    response ends; check whether ``pipework.container._hypercorn_fix`` is still needed
    before updating this test.
    """
    unpatch(monkeypatch)
    original_close = TCPServer._close
    original_restart = TrioSingleTask.restart
    restart_cancelled = trio.Event()
    close_cancelled_while_open = trio.Event()
    closed = trio.Event()

    async def recording_restart(self: TrioSingleTask, task_group: Any, action: Any) -> None:
        try:
            await original_restart(self, task_group, action)
        except trio.Cancelled:
            restart_cancelled.set()
            raise

    async def recording_close(self: TCPServer) -> None:
        try:
            await original_close(self)
        except trio.Cancelled:
            if self.stream.socket.fileno() != -1:
                close_cancelled_while_open.set()
            raise
        closed.set()

    monkeypatch.setattr(TrioSingleTask, "restart", recording_restart)
    monkeypatch.setattr(TCPServer, "_close", recording_close)
    # hypercorn's own serve(), as pipework's would apply the fix.
    config = Config()
    config.bind = ["127.0.0.1:0"]
    # Left at "-", hypercorn would swap its logger's handlers for one bound to this
    # test's captured stderr, and later tests would log through it.
    config.errorlog = logging.getLogger("hypercorn.error")
    stop = trio.Event()
    with trio.fail_after(HANG_GUARD):
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(
                functools.partial(
                    hypercorn_serve, make_app(Gate()), config, shutdown_trigger=stop.wait
                )
            )
            host, port = binds[0].removeprefix("http://").rsplit(":", 1)
            async with raw_client(BoundAddress(host, int(port))) as client:
                response, _ = await client.get("/")
                assert response.status_code == 200
                await restart_cancelled.wait()
                response, _ = await client.get("/", [("Connection", "close")])
                assert response.status_code == 200
                await close_cancelled_while_open.wait()
            # Our close lets the server read EOF and close its side; wait for that so
            # no socket is left to the garbage collector.
            await closed.wait()
            stop.set()


@pytest.mark.http1_servers("hypercorn")  # of hypercorn's own code
def test_fix_is_idempotent() -> None:
    _hypercorn_fix.apply()
    patched = patched_methods()
    _hypercorn_fix.apply()
    assert patched_methods() == patched
    assert _hypercorn_fix.is_applied()
    for method in patched:
        # One wrapper around hypercorn's method, not a wrapper around a wrapper.
        assert inspect.unwrap(method) is not method
        assert not hasattr(inspect.unwrap(method), "_pipework_patched")


async def changed_restart(self: TrioSingleTask, action: Any) -> None:
    """``restart`` with a parameter gone, as a future hypercorn might have it."""


async def changed_run(self: TCPServer) -> None:
    """A method that no longer goes through the names the fixes rely on."""


@pytest.mark.http1_servers("hypercorn")  # of hypercorn's own code
@pytest.mark.parametrize(
    ("cls", "attribute", "replacement", "problem"),
    [
        pytest.param(TCPServer, "_close", None, "_close is missing", id="close-gone"),
        pytest.param(
            TCPServer, "_close", lambda self: None, "is not an async method", id="close-sync"
        ),
        pytest.param(TCPServer, "run", changed_run, "run no longer uses", id="run-changed"),
        pytest.param(
            TCPServer, "protocol_send", changed_run, "protocol_send no longer uses", id="caller"
        ),
        pytest.param(
            TrioSingleTask, "restart", changed_restart, "does not take", id="restart-changed"
        ),
    ],
)
def test_fix_refuses_changed_hypercorn_internals(
    monkeypatch: pytest.MonkeyPatch, cls: type, attribute: str, replacement: object, problem: str
) -> None:
    unpatch(monkeypatch)
    monkeypatch.setattr(cls, attribute, replacement)
    with pytest.raises(RuntimeError, match=problem):
        _hypercorn_fix.apply()
    assert not _hypercorn_fix.is_applied()
    # Nothing was patched half-way.
    assert not any(hasattr(method, "_pipework_patched") for method in patched_methods())


@pytest.mark.http1_servers("hypercorn")  # of hypercorn's own code
@pytest.mark.parametrize(
    ("installed", "advice"),
    [
        ("0.19.0", "install the series pipework declares (pip install 'hypercorn>=0.18,<0.19')"),
        ("0.18.0", "reinstall it (pip install --force-reinstall 'hypercorn==0.18.0')"),
    ],
)
def test_a_refused_fix_says_what_to_do(
    monkeypatch: pytest.MonkeyPatch, installed: str, advice: str
) -> None:
    monkeypatch.setattr(_hypercorn_fix, "_installed_version", lambda: installed)
    unpatch(monkeypatch)
    monkeypatch.setattr(TCPServer, "_close", None)
    with pytest.raises(RuntimeError) as info:
        _hypercorn_fix.apply()
    message = str(info.value)
    assert message.startswith(f"pipework cannot apply its connection fix to hypercorn {installed}")
    assert "written for hypercorn 0.18.0" in message
    assert advice in message


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        pytest.param({"bind": ["0.0.0.0:80"]}, "pass host and port", id="reserved"),
        pytest.param({"workers": 2}, "cannot be set", id="process-level"),
        pytest.param({"keep_alive_timout": 1.0}, "unknown hypercorn option", id="typo"),
    ],
)
async def test_serve_rejects_options_it_cannot_honour(
    options: dict[str, object], problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        await serve(make_app(Gate()), hypercorn_options=options)
