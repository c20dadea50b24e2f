"""A lean HTTP/1.1 server for one ASGI app, on trio and h11: a prototype that measures what
a leaner serving path than hypercorn's would give pipework's proxy routes (bench_proxy runs
pipework's own proxy layer on it; pipework never imports this).

One task per connection, no other task of its own: it reads a request's head, calls the
app, and writes what the app sends, the answer's head and its first body message in one
write (a small answer is one write, where hypercorn makes one for the head and one for the
body). ``receive`` reads the request's body from the socket as the app asks for it, and
once it is read, waits on the socket for the client's hang-up (``http.disconnect``), as
the ASGI spec has a server do; bytes a client sends early (a pipelined request) are kept
for the next request. An idle kept-alive connection is closed after 5 s, as hypercorn's.

What it leaves out, which a server pipework serves with must have: HTTP/2, websockets,
TLS, a graceful shutdown, limits on header size and body time, the framing fixes and
problem answers of ``pipework/container/_hypercorn_*``, and a request's ``Expect:
100-continue`` (never answered here). So it bounds what a leaner server could gain; it is
not one.
"""

from __future__ import annotations

import email.utils
import http
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final
from urllib.parse import unquote_to_bytes

import h11
import trio

__all__ = ["serve"]

ASGIApp = Callable[..., Awaitable[None]]

_READ: Final = 64 * 1024
_KEEP_ALIVE: Final = 5.0
_MAX_HEAD: Final = 16 * 1024
_REASONS: Final = {status.value: status.phrase.encode() for status in http.HTTPStatus}


class _Date:
    """The ``Date`` header's value, formatted once a second."""

    second = -1
    value = b""

    @classmethod
    def now(cls) -> bytes:
        second = int(time.time())
        if second != cls.second:
            cls.second, cls.value = second, email.utils.formatdate(second, usegmt=True).encode()
        return cls.value


class _Exchange:
    """One request on a connection: the ASGI ``receive`` and ``send`` the app gets."""

    __slots__ = ("_conn", "_head", "body_done", "closed", "ended", "started")

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self._head: tuple[int, list[tuple[bytes, bytes]]] | None = None
        self.body_done = False
        self.started = False  # the answer's head went out
        self.ended = False  # the whole answer went out
        self.closed = False  # the client hung up

    async def receive(self) -> MutableMapping[str, Any]:
        conn = self._conn
        if not self.body_done:
            event = await conn.next_event()
            if isinstance(event, h11.Data):
                return {"type": "http.request", "body": bytes(event.data), "more_body": True}
            if isinstance(event, h11.EndOfMessage):
                self.body_done = True
                return {"type": "http.request", "body": b"", "more_body": False}
            self.closed = True
            return {"type": "http.disconnect"}
        # The body was read: the next message is the client's hang-up. Early bytes (a
        # pipelined request) are h11's to keep for the next cycle.
        while not self.ended and not self.closed:
            try:
                data = await conn.stream.receive_some(_READ)
            except trio.BrokenResourceError:
                data = b""
            if not data:
                self.closed = True
                break
            conn.h11.receive_data(data)
        if not self.closed:  # answered whole: wait as a server would, for nothing
            await trio.sleep_forever()
        return {"type": "http.disconnect"}

    async def send(self, message: MutableMapping[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            headers = [(bytes(n), bytes(v)) for n, v in message.get("headers", ())]
            self._head = (int(message["status"]), headers)
            return
        if kind != "http.response.body" or self._head is None or self.ended:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        h = self._conn.h11
        data = b""
        if not self.started:
            status, headers = self._head
            headers += [(b"date", _Date.now()), (b"server", b"lean")]
            data = (
                h.send(
                    h11.Response(
                        status_code=status, headers=headers, reason=_REASONS.get(status, b"")
                    )
                )
                or b""
            )
            self.started = True
        body = message.get("body", b"")
        if body:
            data += h.send(h11.Data(data=body)) or b""
        if not message.get("more_body", False):
            data += h.send(h11.EndOfMessage()) or b""
            self.ended = True
        if data:
            await self._conn.stream.send_all(data)


class _Connection:
    __slots__ = ("app", "client", "h11", "server", "stream")

    def __init__(self, stream: trio.SocketStream, app: ASGIApp) -> None:
        self.stream = stream
        self.app = app
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
        self.client = stream.socket.getpeername()[:2]
        self.server = stream.socket.getsockname()[:2]

    async def next_event(self) -> Any:
        h = self.h11
        while True:
            event = h.next_event()
            if event is not h11.NEED_DATA:
                return event
            h.receive_data(await self.stream.receive_some(_READ))

    async def run(self) -> None:
        h = self.h11
        while True:
            with trio.move_on_after(_KEEP_ALIVE):
                event = await self.next_event()
            if not isinstance(event, h11.Request):
                return  # idle too long, closed, or not a request head
            exchange = await self._serve(event)
            if exchange.closed or not exchange.ended or h.our_state is not h11.DONE:
                return
            if h.their_state is not h11.DONE:
                return  # the app left the body unread: the connection cannot go on
            h.start_next_cycle()

    async def _serve(self, request: h11.Request) -> _Exchange:
        target = bytes(request.target)
        path, _, query = target.partition(b"?")
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.http_version.decode(),
            "method": request.method.decode(),
            "scheme": "http",
            "path": unquote_to_bytes(path).decode("utf-8", "surrogateescape"),
            "raw_path": path,
            "query_string": query,
            "root_path": "",
            "headers": list(request.headers),
            "client": self.client,
            "server": self.server,
        }
        exchange = _Exchange(self)
        await self.app(scope, exchange.receive, exchange.send)
        if not exchange.started:  # the app answered nothing
            await exchange.send({"type": "http.response.start", "status": 500, "headers": []})
            await exchange.send({"type": "http.response.body", "body": b""})
        return exchange


async def serve(
    app: ASGIApp,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` (its ``http`` scopes only) on ``host:port`` until cancelled;
    ``task_status.started()`` reports ``(host, port)``."""

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            try:
                await _Connection(stream, app).run()
            except* (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
                pass  # the client went away or broke the protocol

    listeners = await trio.open_tcp_listeners(port, host=host, backlog=4096)
    bound = listeners[0].socket.getsockname()[:2]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, handle, listeners)
        task_status.started((str(bound[0]), int(bound[1])))
