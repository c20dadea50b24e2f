"""The websocket fixes (``pipework.container._hypercorn_ws``): that hypercorn as installed
still needs them, and that they apply once and refuse internals they were not written for.
That the first two work is tested through the board's websocket (tests/test_board_http.py);
the third (the client's close code reaches the app) here, and through the proxy's relay
(tests/test_proxy_websocket.py)."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import h11
import pytest
import trio
import wsproto
import wsproto.events
from hypercorn.config import Config
from hypercorn.protocol.ws_stream import WSStream
from hypercorn.trio import serve as hypercorn_serve
from quart import websocket
from quart_trio import QuartTrio
from wsproto.connection import Connection
from wsproto.frame_protocol import CloseReason

from pipework.container import _hypercorn_ws, serve

from .test_container_harness import HANG_GUARD
from .test_server import unpatch as unpatch_server

# Each test runs on each HTTP/1.1 server serve() has (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("http1_server")

PATCHED = ("_handle_events", "handle", "app_send")


def unpatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Put hypercorn's own methods back for one test (the fixes patch them for good)."""
    for name in PATCHED:
        monkeypatch.setattr(WSStream, name, inspect.unwrap(getattr(WSStream, name)))


def echo_app() -> QuartTrio:
    app = QuartTrio(__name__)

    @app.websocket("/ws")
    async def echo() -> None:
        await websocket.accept()
        while True:
            await websocket.send(await websocket.receive())

    return app


class DisconnectRecorder:
    """An ASGI app that accepts every websocket and keeps the ``websocket.disconnect``
    messages it is given."""

    def __init__(self) -> None:
        self.accepted = trio.Event()
        self.disconnects: list[dict[str, Any]] = []
        self.disconnected = trio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            assert (await receive())["type"] == "lifespan.startup"
            await send({"type": "lifespan.startup.complete"})
            assert (await receive())["type"] == "lifespan.shutdown"
            await send({"type": "lifespan.shutdown.complete"})
            return
        assert (await receive())["type"] == "websocket.connect"
        await send({"type": "websocket.accept"})
        self.accepted.set()
        while (message := await receive())["type"] != "websocket.disconnect":
            pass
        self.disconnects.append(message)
        self.disconnected.set()


@asynccontextmanager
async def hypercorn_alone(app: Any = None) -> AsyncIterator[tuple[str, int]]:
    """hypercorn's own serve() (pipework's would apply the fixes) on a free port."""
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.errorlog = logging.getLogger("hypercorn.error")  # not hypercorn's own handlers
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            functools.partial(
                hypercorn_serve, app or echo_app(), config, shutdown_trigger=stop.wait
            )
        )
        host, port = binds[0].removeprefix("http://").rsplit(":", 1)
        try:
            yield host, int(port)
        finally:
            stop.set()


def handshake() -> tuple[wsproto.WSConnection, bytes]:
    ws = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
    return ws, ws.send(wsproto.events.Request(host="test", target="/ws"))


@pytest.mark.http1_servers("hypercorn")  # of hypercorn's own code
async def test_unpatched_hypercorn_still_drops_the_close_frame(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Canary: hypercorn as installed still ends a websocket whose peer broke the protocol
    without a close frame.

    If this starts failing, hypercorn sends the close frame itself; check whether the
    first fix in ``pipework.container._hypercorn_ws`` is still needed before updating this
    test.
    """
    unpatch(monkeypatch)
    with trio.fail_after(HANG_GUARD):
        async with (
            hypercorn_alone() as (host, port),
            await trio.open_tcp_stream(host, port) as stream,
        ):
            ws, request = handshake()
            await stream.send_all(request)
            received: list[wsproto.events.Event] = []
            while not any(isinstance(e, wsproto.events.AcceptConnection) for e in received):
                ws.receive_data(await stream.receive_some())
                received.extend(ws.events())
            await stream.send_all(b"\x81\x02hi")  # unmasked: a protocol error
            rest = bytearray()
            while data := await stream.receive_some():
                rest += data
            assert rest == b"", "hypercorn sent something: is the fix still needed?"


@pytest.mark.http1_servers("hypercorn")  # of hypercorn's own code
async def test_unpatched_hypercorn_still_dies_of_a_frame_before_the_101(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Canary: a frame written right behind the handshake request still ends hypercorn's
    whole server (its 400 races the app's 101 in h11).

    If this starts failing, hypercorn survives it; check whether the second fix in
    ``pipework.container._hypercorn_ws`` is still needed before updating this test.
    """
    unpatch(monkeypatch)
    unpatch_server(monkeypatch)  # its connection boundary would keep the server up
    with (
        trio.fail_after(HANG_GUARD),
        pytest.RaisesGroup(h11.LocalProtocolError, flatten_subgroups=True),
    ):
        async with (
            hypercorn_alone() as (host, port),
            await trio.open_tcp_stream(host, port) as stream,
        ):
            _, request = handshake()
            await stream.send_all(request + b"\x89\x80\x00\x00\x00\x00")  # a ping
            await trio.sleep_forever()  # until the server's death cancels this


async def close_with(
    stream: trio.SocketStream, close: wsproto.events.CloseConnection | None
) -> None:
    """Open a websocket on ``stream``, then end it with ``close`` (None: hang up)."""
    ws, request = handshake()
    await stream.send_all(request)
    received: list[wsproto.events.Event] = []
    while not any(isinstance(e, wsproto.events.AcceptConnection) for e in received):
        ws.receive_data(await stream.receive_some())
        received.extend(ws.events())
    if close is None:
        await stream.aclose()
    else:
        await stream.send_all(ws.send(close))


@pytest.mark.http1_servers("hypercorn")  # of hypercorn's own code
async def test_unpatched_hypercorn_still_hides_the_clients_close_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Canary: hypercorn as installed still tells the app 1006 when the client closed with
    a code of its own.

    If this starts failing, hypercorn passes the client's close code on; check whether the
    third fix in ``pipework.container._hypercorn_ws`` is still needed before updating this
    test.
    """
    unpatch(monkeypatch)
    app = DisconnectRecorder()
    with trio.fail_after(HANG_GUARD):
        async with (
            hypercorn_alone(app) as (host, port),
            await trio.open_tcp_stream(host, port) as stream,
        ):
            await close_with(stream, wsproto.events.CloseConnection(4001, "bye"))
            await app.disconnected.wait()
    assert [m["code"] for m in app.disconnects] == [1006]


@pytest.mark.parametrize(
    ("close", "code", "reason"),
    [
        pytest.param(wsproto.events.CloseConnection(4001, "bye"), 4001, "bye", id="4001"),
        pytest.param(wsproto.events.CloseConnection(1000), 1000, "", id="1000"),
        # A close frame without a code (wsproto sends none for 1005).
        pytest.param(
            wsproto.events.CloseConnection(CloseReason.NO_STATUS_RCVD),
            1005,
            "",
            id="no-code",
        ),
        pytest.param(None, 1006, None, id="hung-up"),
    ],
)
async def test_the_app_learns_how_the_client_closed(
    close: wsproto.events.CloseConnection | None, code: int, reason: str | None
) -> None:
    app = DisconnectRecorder()
    stop = trio.Event()
    with trio.fail_after(HANG_GUARD):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(functools.partial(serve, app, shutdown_trigger=stop))
            async with await trio.open_tcp_stream(address.host, address.port) as stream:
                await close_with(stream, close)
                await app.disconnected.wait()
            stop.set()
    [message] = app.disconnects
    assert message["code"] == code
    assert message.get("reason") == reason


@pytest.mark.http1_servers("hypercorn")  # of hypercorn's own code
def test_the_fixes_are_idempotent() -> None:
    _hypercorn_ws.apply()
    patched = [getattr(WSStream, name) for name in PATCHED]
    _hypercorn_ws.apply()
    assert [getattr(WSStream, name) for name in PATCHED] == patched
    assert _hypercorn_ws.is_applied()
    for method in patched:
        # One layer over hypercorn's method, not a layer over a layer.
        assert inspect.unwrap(method) is not method
        assert not hasattr(inspect.unwrap(method), "_pipework_ws")


async def changed_handle_events(self: WSStream) -> None:
    """``_handle_events`` as a future hypercorn might write it."""


async def changed_app_send(self: WSStream, message: Any, more: bool) -> None:
    """``app_send`` with a parameter more."""


def no_events(self: Connection) -> Iterator[wsproto.events.Event]:
    """wsproto's ``events`` as a future version might have it: a refused frame is
    reported some other way."""
    yield from ()


@pytest.mark.http1_servers("hypercorn")  # of hypercorn's own code
@pytest.mark.parametrize(
    ("cls", "attribute", "replacement", "problem"),
    [
        pytest.param(
            WSStream,
            "_handle_events",
            changed_handle_events,
            "WSStream._handle_events is not the method the fix copies",
            id="handle-events-changed",
        ),
        pytest.param(WSStream, "handle", None, "WSStream.handle is missing", id="handle-gone"),
        pytest.param(
            WSStream, "app_send", changed_app_send, "does not take", id="app-send-changed"
        ),
        pytest.param(
            Connection,
            "events",
            no_events,
            "wsproto .* no longer reports an unmasked",
            id="wsproto-changed",
        ),
    ],
)
def test_the_fixes_refuse_changed_internals(
    monkeypatch: pytest.MonkeyPatch, cls: type, attribute: str, replacement: object, problem: str
) -> None:
    unpatch(monkeypatch)
    monkeypatch.setattr(cls, attribute, replacement)
    with pytest.raises(RuntimeError, match=problem):
        _hypercorn_ws.apply()
    assert not _hypercorn_ws.is_applied()
    # Nothing was patched half-way.
    assert not any(hasattr(getattr(WSStream, name), "_pipework_ws") for name in PATCHED)


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
    monkeypatch.setattr(_hypercorn_ws, "_installed_version", lambda package="": installed)
    unpatch(monkeypatch)
    monkeypatch.setattr(WSStream, "handle", None)
    with pytest.raises(RuntimeError) as info:
        _hypercorn_ws.apply()
    message = str(info.value)
    assert message.startswith(f"pipework cannot apply its websocket fixes to hypercorn {installed}")
    assert "written for hypercorn 0.18.0" in message
    assert advice in message
