"""The websocket relay (``pipework.proxy._websocket``) on real sockets: a raw wsproto
websocket backend on a free port, the relay served by hypercorn (pipework's ``serve``, with
its fixes) in a tiny ASGI app that relays every websocket, and a raw wsproto client.

The close rules of ``pipework.proxy._websocket_core`` are also checked as a table, without
I/O."""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio
import trio.testing
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Message,
    Ping,
    Pong,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.frame_protocol import CloseReason
from wsproto.utilities import RemoteProtocolError

from pipework.backends._stream import Handshake
from pipework.container import BoundAddress, serve
from pipework.proxy._websocket import WebsocketOutcome, relay_websocket
from pipework.proxy._websocket_core import (
    BackendClosed,
    BackendFailed,
    ClientClosed,
    CloseFrame,
    Closing,
    Ending,
    IdleTimeout,
    MessageTooBig,
    answer_headers,
    closing,
    handshake_headers,
    wire_host,
    wire_target,
)

# Each test runs on each HTTP/1.1 server serve() has (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("http1_server")

MB = 1024 * 1024
SUPPORTED = ("chat.v1", "chat.v0")  # the backend's subprotocols, in its preference


# -- the backend: wsproto over trio, one behaviour per path --------------------------------


@dataclass
class Seen:
    """What one backend connection saw."""

    request: Request | None = None
    messages: list[str | bytes] = field(default_factory=list)
    pings: list[bytes] = field(default_factory=list)
    pongs: list[bytes] = field(default_factory=list)
    close: tuple[int, str] | None = None  # the close frame it received (1006: none came)
    ponged: trio.Event = field(default_factory=trio.Event)
    ended: trio.Event = field(default_factory=trio.Event)  # its connection is closed


class Backend:
    """A websocket server whose path says what it does:

    ``/refuse`` answers the handshake 404 with a body (``/refuse-cut``: a tenth of it, then
    it closes the connection); ``/silent`` never answers it; ``/ping``
    pings the relay once accepted, ``/pinging`` every 20 s; ``/fragments`` sends one message
    in three frames; ``/bad`` sends a frame a client must refuse (masked). Once accepted it
    echoes every message (frame by frame), except ``"close"`` (it closes with 4002 "backend
    says"), ``"vanish"`` (it drops the connection without a close frame) and ``"big N"``
    (it answers N bytes). It answers pings, and answers a close, then closes the
    connection itself.
    """

    def __init__(self) -> None:
        self.seen: list[Seen] = []
        self._arrivals, self._arrived = trio.open_memory_channel[Seen](100)
        self.port = 0

    async def next(self) -> Seen:
        """The next connection the backend took."""
        return await self._arrived.receive()

    async def handle(self, stream: trio.SocketStream) -> None:
        seen = Seen()
        self.seen.append(seen)
        self._arrivals.send_nowait(seen)
        try:
            async with stream, trio.open_nursery() as nursery:
                await self._converse(stream, WSConnection(ConnectionType.SERVER), seen, nursery)
                nursery.cancel_scope.cancel()
        finally:
            seen.ended.set()

    async def _converse(
        self, stream: trio.SocketStream, ws: WSConnection, seen: Seen, nursery: trio.Nursery
    ) -> None:
        sending = trio.Lock()

        async def say(*events: Event, if_open: bool = False) -> None:
            async with sending:
                if not if_open or ws.state is ConnectionState.OPEN:
                    await stream.send_all(b"".join(ws.send(event) for event in events))

        async def keep_pinging() -> None:
            while True:
                await trio.sleep(20)
                await say(Ping(b"are you there"), if_open=True)

        while seen.request is None:
            data = await stream.receive_some()
            if not data:
                return
            ws.receive_data(data)
            for event in ws.events():
                assert isinstance(event, Request)
                seen.request = event
        path = seen.request.target
        if path.startswith("/silent"):
            while await stream.receive_some():
                pass  # never answers; ends when the relay closes the connection
            return
        if path.startswith("/refuse-cut"):
            head = [(b"content-type", b"text/plain"), (b"content-length", b"100")]
            await say(
                RejectConnection(status_code=404, headers=head, has_body=True),
                RejectData(b"only ten b", body_finished=False),
            )
            return
        if path.startswith("/refuse"):
            body = b"no such room"
            head = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(body))]
            await say(
                RejectConnection(status_code=404, headers=head, has_body=True),
                RejectData(body, body_finished=True),
            )
            return
        chosen = next((p for p in SUPPORTED if p in seen.request.subprotocols), None)
        await say(AcceptConnection(subprotocol=chosen, extra_headers=[(b"set-cookie", b"r=1")]))
        if path.startswith("/pinging"):
            nursery.start_soon(keep_pinging)
        elif path.startswith("/ping"):
            await say(Ping(b"are you there"))
        elif path.startswith("/fragments"):
            await say(
                TextMessage("one ", message_finished=False),
                TextMessage("two ", message_finished=False),
                TextMessage("three"),
            )
        elif path.startswith("/bad"):
            await stream.send_all(b"\x81\x82abcd" + bytes([ord("h") ^ 97, ord("i") ^ 98]))
        parts: list[Any] = []
        while True:
            data = await stream.receive_some()
            if ws.state is ConnectionState.CLOSED:
                return  # the close was answered: the server closes the connection first
            ws.receive_data(data or None)
            for event in ws.events():
                if isinstance(event, Message):
                    await say(type(event)(event.data, message_finished=event.message_finished))
                    parts.append(event.data)
                    if not event.message_finished:
                        continue
                    whole = "".join(parts) if isinstance(event, TextMessage) else b"".join(parts)
                    parts = []
                    seen.messages.append(whole)
                    if whole == "close":
                        await say(CloseConnection(4002, "backend says"))
                    elif whole == "vanish":
                        return
                    elif isinstance(whole, str) and whole.startswith("big "):
                        await say(BytesMessage(b"x" * int(whole.removeprefix("big "))))
                elif isinstance(event, Ping):
                    seen.pings.append(bytes(event.payload))
                    await say(event.response())
                elif isinstance(event, Pong):
                    seen.pongs.append(bytes(event.payload))
                    seen.ponged.set()
                elif isinstance(event, CloseConnection):
                    seen.close = (int(event.code), event.reason or "")
                    if ws.state is ConnectionState.REMOTE_CLOSING:
                        await say(event.response())
                    return


# -- the relay, served by hypercorn --------------------------------------------------------


@dataclass
class RelayApp:
    """An ASGI app that relays every websocket to ``connect``, and keeps the outcomes."""

    connect: Callable[[], Any]
    idle_timeout: float | None = None
    handshake_timeout: float | None = None
    max_message: int = 16 * MB
    host: bytes | Callable[[], bytes] = b"backend.test"
    extension: bool = True  # offer the relay ASGI's websocket.http.response extension
    outcomes: list[WebsocketOutcome] = field(default_factory=list)
    handshakes: list[Handshake] = field(default_factory=list)  # what handshake_done heard
    ended: trio.Event = field(default_factory=trio.Event)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            assert (await receive())["type"] == "lifespan.startup"
            await send({"type": "lifespan.startup.complete"})
            assert (await receive())["type"] == "lifespan.shutdown"
            await send({"type": "lifespan.shutdown.complete"})
            return
        assert scope["type"] == "websocket"
        if not self.extension:
            scope = {name: value for name, value in scope.items() if name != "extensions"}
        query = scope["query_string"]
        try:
            outcome = await relay_websocket(
                scope,
                receive,
                send,
                connect=self.connect,
                target=scope["raw_path"] + (b"?" + query if query else b""),
                host=self.host,
                headers=[(n, v) for n, v in scope["headers"] if n in {b"x-test", b"host"}],
                idle_timeout=self.idle_timeout,
                handshake_timeout=self.handshake_timeout,
                max_message=self.max_message,
                service="chat",
                correlation_id="corr-1",
                answer_filter=lambda headers: [*headers, (b"via", b"1.1 pipework")],
                handshake_done=self.handshakes.append,
            )
        finally:
            self.ended.set()
        self.outcomes.append(outcome)

    async def outcome(self) -> WebsocketOutcome:
        await self.ended.wait()
        [outcome] = self.outcomes
        return outcome


@dataclass
class Running:
    backend: Backend
    app: RelayApp
    address: BoundAddress


@asynccontextmanager
async def running(
    connect: Callable[[int], Callable[[], Any]] | None = None, **options: Any
) -> AsyncIterator[Running]:
    """A backend and the relay in front of it, on free ports, for the ``async with``."""
    backend = Backend()
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        [listener] = await nursery.start(
            functools.partial(trio.serve_tcp, backend.handle, 0, host="127.0.0.1")
        )
        backend.port = listener.socket.getsockname()[1]
        opener: Callable[[], Any]
        if connect is None:
            opener = functools.partial(trio.open_tcp_stream, "127.0.0.1", backend.port)
        else:
            opener = connect(backend.port)
        app = RelayApp(opener, **options)
        address = await nursery.start(
            functools.partial(serve, app, shutdown_trigger=stop, graceful_timeout=0.5)
        )
        try:
            yield Running(backend, app, address)
        finally:
            stop.set()
            nursery.cancel_scope.cancel()


# -- the client: wsproto over trio ---------------------------------------------------------


class Client:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.pending: list[Event] = []

    @classmethod
    @asynccontextmanager
    async def opening(
        cls,
        address: BoundAddress,
        target: str = "/echo",
        *,
        subprotocols: Sequence[str] = (),
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> AsyncIterator[Client]:
        async with await trio.open_tcp_stream(address.host, address.port) as stream:
            client = cls(stream)
            request = Request(
                host="relay.test",
                target=target,
                subprotocols=list(subprotocols),
                extra_headers=list(headers),
            )
            await stream.send_all(client.ws.send(request))
            yield client

    async def event(self) -> Event:
        while not self.pending:
            data = await self.stream.receive_some()
            self.ws.receive_data(data or None)
            self.pending.extend(self.ws.events())
        return self.pending.pop(0)

    async def answer(self) -> AcceptConnection | RejectConnection:
        event = await self.event()
        assert isinstance(event, AcceptConnection | RejectConnection), event
        return event

    async def accepted(self) -> AcceptConnection:
        answer = await self.answer()
        assert isinstance(answer, AcceptConnection), answer
        return answer

    async def refusal(self) -> tuple[int, dict[bytes, bytes], bytes]:
        answer = await self.answer()
        assert isinstance(answer, RejectConnection), answer
        body: list[bytes] = []
        if answer.has_body:
            await self.body(body)
        return answer.status_code, dict(answer.headers), b"".join(body)

    async def body(self, into: list[bytes]) -> None:
        """Read a refusal's body into ``into`` until its end."""
        while True:
            event = await self.event()
            assert isinstance(event, RejectData)
            if event.data:
                into.append(event.data)
            if event.body_finished:
                return

    async def say(self, *events: Event) -> None:
        await self.stream.send_all(b"".join(self.ws.send(event) for event in events))

    async def message(self) -> str | bytes:
        parts: list[Any] = []
        while True:
            event = await self.event()
            assert isinstance(event, Message), event
            parts.append(event.data)
            if event.message_finished:
                return "".join(parts) if isinstance(event, TextMessage) else b"".join(parts)

    async def closed(self) -> CloseConnection:
        """The close the relay sent (answered), skipping nothing else."""
        event = await self.event()
        assert isinstance(event, CloseConnection), event
        if self.ws.state is ConnectionState.REMOTE_CLOSING:
            await self.say(event.response())
        return event


# -- relaying ------------------------------------------------------------------------------


async def test_text_and_binary_messages_pass_both_ways() -> None:
    async with running() as run, Client.opening(run.address, "/echo?room=1") as client:
        await client.accepted()
        await client.say(TextMessage("héllo"), BytesMessage(b"\x00\xff"))
        assert await client.message() == "héllo"
        assert await client.message() == b"\x00\xff"
        await client.say(CloseConnection(1000))
        await client.closed()
        outcome = await run.app.outcome()
    seen = run.backend.seen[0]
    assert seen.messages == ["héllo", b"\x00\xff"]
    assert seen.request is not None
    assert seen.request.target == "/echo?room=1"
    assert seen.request.host == "backend.test"
    assert outcome == WebsocketOutcome(101, 1000, "client")
    assert run.app.handshakes == [Handshake(101)]


async def test_a_host_given_as_a_function_is_asked_once_connected() -> None:
    asked: list[bool] = []

    def host() -> bytes:
        asked.append(True)
        return b"picked.test"

    async with running(host=host) as run, Client.opening(run.address) as client:
        await client.accepted()
        assert asked == [True]
        await client.say(CloseConnection(1000))
        await client.closed()
    seen = run.backend.seen[0]
    assert seen.request is not None
    assert seen.request.host == "picked.test"


async def test_a_ten_megabyte_message_passes_whole_both_ways() -> None:
    big = bytes(range(256)) * (10 * MB // 256)
    text = "é" * (5 * MB)  # 10 MB of UTF-8
    async with running() as run, Client.opening(run.address) as client:
        await client.accepted()
        await client.say(BytesMessage(big))
        assert await client.message() == big
        await client.say(TextMessage(text))
        assert await client.message() == text
        await client.say(CloseConnection(1000))
        await client.closed()
    assert run.backend.seen[0].messages == [big, text]


async def test_a_fragmented_backend_message_reaches_the_client_whole() -> None:
    async with running() as run, Client.opening(run.address, "/fragments") as client:
        await client.accepted()
        assert await client.message() == "one two three"
        await client.say(CloseConnection(1000))
        await client.closed()


@pytest.mark.parametrize(
    ("offered", "chosen"),
    [
        pytest.param(["chat.v2", "chat.v0", "chat.v1"], "chat.v1", id="backend-chooses"),
        pytest.param(["chat.v2"], None, id="none-it-knows"),
        pytest.param([], None, id="none-offered"),
    ],
)
async def test_the_backend_chooses_among_the_clients_subprotocols(
    offered: list[str], chosen: str | None
) -> None:
    async with (
        running() as run,
        Client.opening(
            run.address, subprotocols=offered, headers=[(b"x-test", b"passed")]
        ) as client,
    ):
        accepted = await client.accepted()
        await client.say(CloseConnection(1000))
        await client.closed()
    assert accepted.subprotocol == chosen
    assert (b"set-cookie", b"r=1") in accepted.extra_headers  # the 101's own headers
    assert (b"via", b"1.1 pipework") in accepted.extra_headers  # the caller's filter's
    request = run.backend.seen[0].request
    assert request is not None
    assert request.subprotocols == offered
    assert (b"x-test", b"passed") in request.extra_headers


# -- closing -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("close", "backend_sees"),
    [
        pytest.param(CloseConnection(4001, "bye"), (4001, "bye"), id="4001"),
        pytest.param(CloseConnection(1001), (1001, ""), id="1001"),
        pytest.param(CloseConnection(CloseReason.NO_STATUS_RCVD), (1005, ""), id="no-code"),
    ],
)
async def test_the_clients_close_reaches_the_backend(
    close: CloseConnection, backend_sees: tuple[int, str]
) -> None:
    async with running() as run, Client.opening(run.address) as client:
        await client.accepted()
        await client.say(close)
        answer = await client.closed()
        seen = await run.backend.next()
        await seen.ended.wait()
        outcome = await run.app.outcome()
    assert int(answer.code) == int(close.code)  # hypercorn answered it
    assert seen.close == backend_sees
    assert outcome == WebsocketOutcome(101, backend_sees[0], "client")


async def test_the_backends_close_reaches_the_client() -> None:
    async with running() as run, Client.opening(run.address) as client:
        await client.accepted()
        await client.say(TextMessage("close"))
        assert await client.message() == "close"  # the echo, before the close
        close = await client.closed()
        seen = await run.backend.next()
        await seen.ended.wait()
        outcome = await run.app.outcome()
    assert (close.code, close.reason) == (4002, "backend says")
    assert seen.close == (4002, "")  # the relay echoed its code (RFC 6455 §5.5.1)
    assert outcome == WebsocketOutcome(101, 4002, "backend")


async def test_a_backend_that_vanishes_is_a_1011_for_the_client() -> None:
    async with running() as run, Client.opening(run.address) as client:
        await client.accepted()
        await client.say(TextMessage("vanish"))
        assert await client.message() == "vanish"
        close = await client.closed()
        outcome = await run.app.outcome()
    assert (close.code, close.reason) == (1011, "backend connection lost")
    assert outcome.close_code == 1011
    assert outcome.ended_by == "backend"
    assert "without a close frame" in outcome.detail


async def test_a_backend_that_breaks_the_protocol_is_told_and_the_client_gets_1011() -> None:
    async with running() as run, Client.opening(run.address, "/bad") as client:
        await client.accepted()
        close = await client.closed()
        seen = await run.backend.next()
        await seen.ended.wait()
        outcome = await run.app.outcome()
    assert (close.code, close.reason) == (1011, "backend broke the websocket protocol")
    assert seen.close is not None
    assert seen.close[0] == CloseReason.PROTOCOL_ERROR  # a client must refuse masked frames
    assert outcome.close_code == 1011
    assert "1002" in outcome.detail


async def test_a_client_that_vanishes_closes_the_backends_connection() -> None:
    async with running() as run:
        async with Client.opening(run.address) as client:
            await client.accepted()
            await client.say(TextMessage("hi"))
            assert await client.message() == "hi"
        # The client's socket is closed, without a close frame.
        seen = await run.backend.next()
        await seen.ended.wait()
        outcome = await run.app.outcome()
    assert seen.close == (1006, "")  # no close frame: the backend too sees its peer vanish
    assert outcome == WebsocketOutcome(101, 1006, "client")


async def test_pings_are_answered_on_their_own_side() -> None:
    async with running() as run, Client.opening(run.address, "/ping") as client:
        await client.accepted()
        seen = await run.backend.next()
        await seen.ponged.wait()
        await client.say(Ping(b"client here"))
        pong = await client.event()
        assert isinstance(pong, Pong)
        assert pong.payload == b"client here"
        await client.say(TextMessage("after"))
        assert await client.message() == "after"  # the backend's ping did not reach it
        await client.say(CloseConnection(1000))
        await client.closed()
        await seen.ended.wait()
    assert seen.pongs == [b"are you there"]
    assert seen.pings == []  # the client's ping stayed on its side


async def test_a_backend_message_over_the_limit_closes_both_with_1009() -> None:
    async with running(max_message=1000) as run, Client.opening(run.address) as client:
        await client.accepted()
        await client.say(TextMessage("big 999"))
        assert await client.message() == "big 999"
        assert await client.message() == b"x" * 999
        await client.say(TextMessage("big 2000"))
        assert await client.message() == "big 2000"
        close = await client.closed()
        seen = await run.backend.next()
        await seen.ended.wait()
        outcome = await run.app.outcome()
    assert close.code == 1009
    assert seen.close == (1009, "message too big")
    assert outcome.close_code == 1009


async def test_an_idle_websocket_is_closed_on_both_sides(
    mock_clock: trio.testing.MockClock,
) -> None:
    # The clock stands still but for the test's jumps, so the idle watch fires only then;
    # before each jump the relay has finished with the message the client just got.
    async with running(idle_timeout=30.0) as run, Client.opening(run.address) as client:
        await client.accepted()
        await client.say(TextMessage("hi"))
        assert await client.message() == "hi"
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(29.9)
        await client.say(TextMessage("still open"))
        assert await client.message() == "still open"
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(30.0)
        close = await client.closed()
        seen = await run.backend.next()
        await seen.ended.wait()
        outcome = await run.app.outcome()
    assert (close.code, close.reason) == (1001, "idle timeout")
    assert seen.close == (1001, "idle timeout")
    assert seen.messages == ["hi", "still open"]
    assert outcome == WebsocketOutcome(101, 1001, "idle", "no message passed either way for 30s")


async def test_the_backends_pings_keep_an_idle_timeout_away(
    mock_clock: trio.testing.MockClock,
) -> None:
    async with (
        running(idle_timeout=30.0) as run,
        Client.opening(run.address, "/pinging") as client,
    ):
        await client.accepted()
        seen = await run.backend.next()
        for pings in range(1, 5):  # 80 s without a message; a ping every 20 s
            await trio.testing.wait_all_tasks_blocked()  # the backend waits for its next
            mock_clock.jump(20.0)
            while len(seen.pongs) < pings:
                await seen.ponged.wait()
                seen.ponged = trio.Event()
        await client.say(TextMessage("still open"))
        assert await client.message() == "still open"
        await client.say(CloseConnection(1000))
        await client.closed()
        outcome = await run.app.outcome()
    assert seen.pongs == [b"are you there"] * 4
    assert outcome.ended_by == "client"


# -- refusals ------------------------------------------------------------------------------


async def test_a_backends_refusal_reaches_the_client_as_it_came() -> None:
    async with running() as run, Client.opening(run.address, "/refuse") as client:
        status, headers, body = await client.refusal()
        outcome = await run.app.outcome()
    assert (status, body) == (404, b"no such room")
    assert headers[b"content-type"] == b"text/plain"
    assert headers[b"via"] == b"1.1 pipework"
    assert outcome.status == 404
    assert run.app.handshakes == [Handshake(404)]


async def test_a_refusal_cut_short_is_not_completed_for_the_client() -> None:
    async with running() as run, Client.opening(run.address, "/refuse-cut") as client:
        answer = await client.answer()
        assert isinstance(answer, RejectConnection)
        assert answer.status_code == 404
        body: list[bytes] = []
        with pytest.raises(RemoteProtocolError):  # the client sees the answer end early
            await client.body(body)
        outcome = await run.app.outcome()
    assert body == [b"only ten b"]
    assert outcome.detail.endswith("its body was cut short")


async def test_a_host_wsproto_cannot_write_is_refused() -> None:
    async with running(host=b"a..b") as run, Client.opening(run.address) as client:
        status, _, body = await client.refusal()
        outcome = await run.app.outcome()
    assert status == 400
    assert json.loads(body)["type"] == "urn:pipework:problem:malformed-request"
    assert run.backend.seen == []  # nothing was sent
    assert outcome.status == 400
    assert run.app.handshakes == [Handshake(None)]  # the backend was not asked


async def test_without_the_extension_a_refusal_is_a_403() -> None:
    async with (
        running(extension=False) as run,
        Client.opening(run.address, "/refuse") as client,
    ):
        status, _, _ = await client.refusal()
        outcome = await run.app.outcome()
    assert status == 403
    assert outcome.status == 403
    assert outcome.detail == "service 'chat' refused the websocket handshake with 404"


@asynccontextmanager
async def unreachable_port() -> AsyncIterator[int]:
    """A port bound by nobody listening: connecting there is refused."""
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.mark.parametrize("extension", [True, False], ids=["extension", "no-extension"])
async def test_an_unreachable_backend_refuses_the_client(extension: bool) -> None:
    async with unreachable_port() as port:

        def nowhere(_: int) -> Callable[[], Any]:
            return functools.partial(trio.open_tcp_stream, "127.0.0.1", port)

        async with (
            running(nowhere, extension=extension) as run,
            Client.opening(run.address) as client,
        ):
            status, headers, body = await client.refusal()
            outcome = await run.app.outcome()
    assert run.app.handshakes == [Handshake(None, "connect")]
    if not extension:
        assert status == 403
        assert "could not connect" in outcome.detail
        return
    assert status == 502
    assert headers[b"content-type"] == b"application/problem+json"
    assert headers[b"x-request-id"] == b"corr-1"
    problem = json.loads(body)
    assert problem["type"] == "urn:pipework:problem:backend-failed"
    assert problem["service"] == "chat"
    assert problem["instance"] == "/echo"
    assert problem["detail"].startswith("service 'chat' could not connect for a websocket")
    assert outcome == WebsocketOutcome(502, detail=problem["detail"])


async def test_a_handshake_that_times_out_is_a_504(mock_clock: trio.testing.MockClock) -> None:
    async with (
        running(handshake_timeout=10.0) as run,
        Client.opening(run.address, "/silent") as client,
    ):
        seen = await run.backend.next()  # the relay's bound started before it connected
        mock_clock.jump(10.0)
        status, _, body = await client.refusal()
        await seen.ended.wait()  # the relay closed the backend's connection
        outcome = await run.app.outcome()
    assert status == 504
    problem = json.loads(body)
    assert problem["type"] == "urn:pipework:problem:deadline-exceeded"
    assert problem["phase"] == "handshake"
    assert "within 10s" in problem["detail"]
    assert outcome.status == 504
    assert run.app.handshakes == [Handshake(None, "handshake", timed_out=True)]


async def test_a_client_that_leaves_during_the_handshake_ends_it() -> None:
    async with running(handshake_timeout=None) as run:
        async with Client.opening(run.address, "/silent"):
            seen = await run.backend.next()
        # The client hung up while the backend had not answered.
        await seen.ended.wait()
        outcome = await run.app.outcome()
    assert outcome == WebsocketOutcome(None, 1006, "client")
    assert run.app.handshakes == []  # no answer to report


# -- the relay alone ------------------------------------------------------------------------


async def test_a_cancelled_relay_closes_the_backends_connection() -> None:
    """Cancelled from outside (the server shutting down, the caller's own bound), the relay
    closes its backend connection on the way out."""
    backend = Backend()
    to_relay, from_client = trio.open_memory_channel[Any](10)
    sent: list[dict[str, Any]] = []
    accepted = trio.Event()
    relay_scope = trio.CancelScope()

    async def send(message: Any) -> None:
        sent.append(message)
        if message["type"] == "websocket.accept":
            accepted.set()

    async def relay(port: int) -> None:
        with relay_scope:
            await relay_websocket(
                {"type": "websocket", "path": "/echo", "subprotocols": []},
                from_client.receive,
                send,
                connect=functools.partial(trio.open_tcp_stream, "127.0.0.1", port),
                target=b"/echo",
                host=b"backend.test",
                headers=[],
                idle_timeout=None,
            )

    async with trio.open_nursery() as nursery:
        [listener] = await nursery.start(
            functools.partial(trio.serve_tcp, backend.handle, 0, host="127.0.0.1")
        )
        await to_relay.send({"type": "websocket.connect"})
        nursery.start_soon(relay, listener.socket.getsockname()[1])
        await accepted.wait()
        seen = await backend.next()
        relay_scope.cancel()
        await seen.ended.wait()
        nursery.cancel_scope.cancel()
    assert relay_scope.cancelled_caught
    assert seen.close == (1006, "")  # closed at once, without a close frame
    assert [m["type"] for m in sent] == ["websocket.accept"]


# -- the rules, without I/O ----------------------------------------------------------------

CLOSE_RULES: list[tuple[Ending, Closing]] = [
    (
        ClientClosed(4001, "bye"),
        Closing(None, CloseFrame(4001, "bye"), 4001, "client"),
    ),
    (ClientClosed(1005), Closing(None, CloseFrame(None), 1005, "client")),
    (ClientClosed(1006), Closing(None, None, 1006, "client")),
    (ClientClosed(1015), Closing(None, None, 1015, "client")),
    (
        BackendClosed(4002, "why"),
        Closing(CloseFrame(4002, "why"), CloseFrame(4002), 4002, "backend"),
    ),
    (BackendClosed(1005), Closing(CloseFrame(1000), CloseFrame(None), 1000, "backend")),
    (
        BackendFailed(1006),
        Closing(
            CloseFrame(1011, "backend connection lost"),
            None,
            1011,
            "backend",
            "the backend's connection ended without a close frame",
        ),
    ),
    (
        BackendFailed(1007, "bad utf-8"),
        Closing(
            CloseFrame(1011, "backend broke the websocket protocol"),
            CloseFrame(1007, "bad utf-8"),
            1011,
            "backend",
            "the backend broke the websocket protocol (1007: bad utf-8)",
        ),
    ),
    (
        IdleTimeout(60),
        Closing(
            CloseFrame(1001, "idle timeout"),
            CloseFrame(1001, "idle timeout"),
            1001,
            "idle",
            "no message passed either way for 60s",
        ),
    ),
    (
        MessageTooBig(100),
        Closing(
            CloseFrame(1009, "message too big"),
            CloseFrame(1009, "message too big"),
            1009,
            "backend",
            "a backend message grew past the relay's limit of 100 bytes",
        ),
    ),
]


@pytest.mark.parametrize(("ending", "expected"), CLOSE_RULES, ids=lambda v: repr(v)[:40])
def test_the_close_rules(ending: Ending, expected: Closing) -> None:
    assert closing(ending) == expected


def test_the_handshake_sends_the_callers_headers_less_its_own() -> None:
    headers = [
        (b"Authorization", b"Bearer t"),
        (b"Host", b"client.test"),
        (b"Sec-WebSocket-Key", b"k"),
        (b"sec-websocket-extensions", b"permessage-deflate"),
        (b"Upgrade", b"websocket"),
        (b"content-length", b"0"),
        (b"cookie", b"a=1"),
    ]
    assert handshake_headers(headers) == [(b"authorization", b"Bearer t"), (b"cookie", b"a=1")]


def test_an_answers_headers_lose_hop_by_hop_and_server_owned_ones() -> None:
    headers = [
        (b"Set-Cookie", b"a=1"),
        (b"Connection", b"close, X-Private"),
        (b"X-Private", b"secret"),
        (b"Keep-Alive", b"timeout=5"),
        (b"Content-Length", b"12"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Date", b"Mon, 01 Jan 2024 00:00:00 GMT"),
        (b"Server", b"backend"),
        (b"Sec-WebSocket-Protocol", b"chat.v1"),
        (b"content-type", b"text/plain"),
    ]
    assert answer_headers(headers) == [(b"set-cookie", b"a=1"), (b"content-type", b"text/plain")]


@pytest.mark.parametrize(
    ("target", "wire"),
    [
        (b"/a/b%20c?x=1&y=%2F", "/a/b%20c?x=1&y=%2F"),
        (b"/caf\xc3\xa9", "/caf%C3%A9"),
        (b"/a b", "/a%20b"),
    ],
)
def test_the_target_is_kept_byte_for_byte_where_ascii_allows(target: bytes, wire: str) -> None:
    assert wire_target(target) == wire


@pytest.mark.parametrize(
    ("host", "wire"),
    [
        (b"backend.test:8080", "backend.test:8080"),
        (b"Backend.TEST", "Backend.TEST"),
        (b"[::1]:8080", "[::1]:8080"),
        (b"127.0.0.1", "127.0.0.1"),
        (b"a..b", None),
        (b"caf\xc3\xa9.test", None),
        (b"x" * 64 + b".test", None),
    ],
)
def test_a_host_goes_on_only_as_it_came(host: bytes, wire: str | None) -> None:
    assert wire_host(host) == wire
