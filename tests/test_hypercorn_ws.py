"""The websocket close fix (``pipework.container._hypercorn_ws``): that hypercorn as installed
still needs it, and that it applies once and refuses internals it was not written for. That
the fix works is tested through the board's websocket (tests/test_board_http.py)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

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

# Taken when this module is imported, before any test serves (serve() applies the fix).
HYPERCORN_HANDLE_EVENTS: Callable[..., Any] = WSStream._handle_events
assert not _hypercorn_ws.is_applied(), "collect this module before anything serves"


def unpatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Put hypercorn's own method back for one test (the fix replaces it for good)."""
    monkeypatch.setattr(WSStream, "_handle_events", HYPERCORN_HANDLE_EVENTS)


def echo_app() -> QuartTrio:
    app = QuartTrio(__name__)

    @app.websocket("/ws")
    async def echo() -> None:
        await websocket.accept()
        while True:
            await websocket.send(await websocket.receive())

    return app


async def test_unpatched_hypercorn_still_drops_the_close_frame(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Canary: hypercorn as installed still ends a websocket whose peer broke the protocol
    without a close frame.

    If this starts failing, hypercorn sends the close frame itself; check whether
    ``pipework.container._hypercorn_ws`` is still needed before updating this test.
    """
    unpatch(monkeypatch)
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.errorlog = logging.getLogger("hypercorn.error")  # not hypercorn's own handlers
    stop = trio.Event()
    with trio.fail_after(HANG_GUARD):
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(
                functools.partial(hypercorn_serve, echo_app(), config, shutdown_trigger=stop.wait)
            )
            host, port = binds[0].removeprefix("http://").rsplit(":", 1)
            async with await trio.open_tcp_stream(host, int(port)) as stream:
                ws = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
                await stream.send_all(ws.send(wsproto.events.Request(host="test", target="/ws")))
                received: list[wsproto.events.Event] = []
                while not any(isinstance(e, wsproto.events.AcceptConnection) for e in received):
                    ws.receive_data(await stream.receive_some())
                    received.extend(ws.events())
                await stream.send_all(b"\x81\x02hi")  # unmasked: a protocol error
                rest = bytearray()
                while data := await stream.receive_some():
                    rest += data
                assert rest == b"", "hypercorn sent something: is the fix still needed?"
            stop.set()


def test_the_fix_is_idempotent() -> None:
    _hypercorn_ws.apply()
    patched = WSStream._handle_events
    assert patched is not HYPERCORN_HANDLE_EVENTS
    _hypercorn_ws.apply()
    assert WSStream._handle_events is patched
    assert _hypercorn_ws.is_applied()


async def changed_handle_events(self: WSStream) -> None:
    """``_handle_events`` as a future hypercorn might write it."""


def no_events(self: Connection) -> Iterator[wsproto.events.Event]:
    """wsproto's ``events`` as a future version might have it: a refused frame is
    reported some other way."""
    yield from ()


def test_the_fix_refuses_a_changed_hypercorn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(WSStream, "_handle_events", changed_handle_events)
    with pytest.raises(RuntimeError) as info:
        _hypercorn_ws.apply()
    assert WSStream._handle_events is changed_handle_events
    message = str(info.value)
    assert "WSStream._handle_events is not the method the fix copies" in message
    assert "written for hypercorn 0.18.0" in message


def test_the_fix_refuses_a_changed_wsproto(monkeypatch: pytest.MonkeyPatch) -> None:
    unpatch(monkeypatch)
    monkeypatch.setattr(Connection, "events", no_events)
    with pytest.raises(RuntimeError, match=r"wsproto .* no longer reports an unmasked"):
        _hypercorn_ws.apply()
    assert WSStream._handle_events is HYPERCORN_HANDLE_EVENTS
