"""The websocket close fix (``pipework.container._hypercorn_ws``): that hypercorn as
installed still needs it, and that it applies once and refuses internals it was not written
for. That it works is tested through the board's websocket (tests/test_board_http.py)."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

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

from pipework.container import _hypercorn_ws

from .test_container_harness import HANG_GUARD


def unpatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Put hypercorn's own method back for one test (the fix patches it for good)."""
    monkeypatch.setattr(WSStream, "_handle_events", inspect.unwrap(WSStream._handle_events))


def echo_app() -> QuartTrio:
    app = QuartTrio(__name__)

    @app.websocket("/ws")
    async def echo() -> None:
        await websocket.accept()
        while True:
            await websocket.send(await websocket.receive())

    return app


@asynccontextmanager
async def hypercorn_alone() -> AsyncIterator[tuple[str, int]]:
    """hypercorn's own serve() (pipework's would apply the fix) on a free port."""
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.errorlog = logging.getLogger("hypercorn.error")  # not hypercorn's own handlers
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            functools.partial(hypercorn_serve, echo_app(), config, shutdown_trigger=stop.wait)
        )
        host, port = binds[0].removeprefix("http://").rsplit(":", 1)
        try:
            yield host, int(port)
        finally:
            stop.set()


def handshake() -> tuple[wsproto.WSConnection, bytes]:
    ws = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
    return ws, ws.send(wsproto.events.Request(host="test", target="/ws"))


async def test_unpatched_hypercorn_still_drops_the_close_frame(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Canary: hypercorn as installed still ends a websocket whose peer broke the protocol
    without a close frame.

    If this starts failing, hypercorn sends the close frame itself; check whether
    ``pipework.container._hypercorn_ws`` is still needed before updating this test.
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


def test_the_fix_is_idempotent() -> None:
    _hypercorn_ws.apply()
    patched = WSStream._handle_events
    _hypercorn_ws.apply()
    assert WSStream._handle_events is patched
    assert _hypercorn_ws.is_applied()
    # One layer over hypercorn's method, not a layer over a layer.
    assert inspect.unwrap(patched) is not patched
    assert not hasattr(inspect.unwrap(patched), "_pipework_ws")


async def changed_handle_events(self: WSStream) -> None:
    """``_handle_events`` as a future hypercorn might write it."""


def no_events(self: Connection) -> Iterator[wsproto.events.Event]:
    """wsproto's ``events`` as a future version might have it: a refused frame is
    reported some other way."""
    yield from ()


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
        pytest.param(
            WSStream,
            "_handle_events",
            None,
            "WSStream._handle_events is missing",
            id="handle-events-gone",
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
def test_the_fix_refuses_changed_internals(
    monkeypatch: pytest.MonkeyPatch, cls: type, attribute: str, replacement: object, problem: str
) -> None:
    unpatch(monkeypatch)
    monkeypatch.setattr(cls, attribute, replacement)
    with pytest.raises(RuntimeError, match=problem):
        _hypercorn_ws.apply()
    assert not _hypercorn_ws.is_applied()


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
    monkeypatch.setattr(WSStream, "_handle_events", None)
    with pytest.raises(RuntimeError) as info:
        _hypercorn_ws.apply()
    message = str(info.value)
    assert message.startswith(
        f"pipework cannot apply its websocket close fix to hypercorn {installed}"
    )
    assert "written for hypercorn 0.18.0" in message
    assert advice in message
