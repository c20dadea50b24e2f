"""pipework's HTTP/1.1 server (``container/_h1_server.py``) beside hypercorn's, over real
sockets: the same ASGI scope, body streaming, ``Expect: 100-continue``, the client's
hang-up, pipelining, the hand-off of h2c and HTTP/2 prior knowledge to hypercorn; and
its decisions without I/O (``container/_h1_core.py``)."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import h11
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from pipework import ConfigError, Gateway, load_config
from pipework.container import BoundAddress, ContainerConfig, serve
from pipework.container import _h1_core as core
from pipework.registry._gateway import _container_config

from ._raw_http import split_answers
from .test_container_harness import HANG_GUARD

# Each test runs on each HTTP/1.1 server serve() has (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("http1_server")


@dataclass
class Recorder:
    """A bare ASGI app: it keeps what it saw, and its lifespan puts ``{"ready": True}``
    in the state every request's scope copies."""

    scopes: list[dict[str, Any]] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    disconnected: trio.Event = field(default_factory=trio.Event)
    entered: trio.Event = field(default_factory=trio.Event)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    scope["state"]["ready"] = True
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        self.scopes.append(scope)
        path = scope["path"]
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.bodies.append(bytes(body))
                self.disconnected.set()
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        self.bodies.append(bytes(body))
        if path == "/hang":
            # Wait for the client's hang-up, as an app watching ``receive`` does.
            self.entered.set()
            message = await receive()
            assert message["type"] == "http.disconnect"
            self.disconnected.set()
            return
        if path == "/fail":
            raise RuntimeError("the app failed")
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"x-path", path.encode())],
            }
        )
        await send({"type": "http.response.body", "body": b"got %d" % len(body)})


@asynccontextmanager
async def serving(app: Any, **options: Any) -> AsyncIterator[BoundAddress]:
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        address: BoundAddress = await nursery.start(
            functools.partial(serve, app, shutdown_trigger=stop, **options)
        )
        try:
            yield address
        finally:
            stop.set()


async def converse(address: BoundAddress, data: bytes) -> bytes:
    """Send ``data``, then read until the server closes the connection."""
    async with await trio.open_tcp_stream(address.host, address.port) as stream:
        await stream.send_all(data)
        received = bytearray()
        while chunk := await stream.receive_some():
            received += chunk
    return bytes(received)


@pytest.mark.http1_servers("lean")  # it serves on both itself
async def test_the_scope_is_hypercorns() -> None:
    """The scope's every key, whichever server serves (only the client's port differs)."""
    scopes: dict[str, dict[str, Any]] = {}
    request = (
        b"POST /a%20b/c?x=1&y=%20 HTTP/1.1\r\nHost: t\r\nX-Mixed-Case: V\r\n"
        b"Content-Length: 2\r\nConnection: close\r\n\r\n{}"
    )
    with trio.fail_after(HANG_GUARD):
        for name in ("lean", "hypercorn"):
            app = Recorder()
            async with serving(app, http1=name) as address:
                answers, _ = split_answers(await converse(address, request))
            assert [a.status for a in answers] == [200]
            scope = dict(app.scopes[0])
            scope["client"] = scope["client"][0]
            scope["server"] = scope["server"][0]
            scopes[name] = scope
    assert scopes["lean"] == scopes["hypercorn"]
    assert scopes["lean"]["path"] == "/a b/c"
    assert scopes["lean"]["state"] == {"ready": True}
    assert (b"x-mixed-case", b"V") in scopes["lean"]["headers"]


async def test_a_chunked_body_is_streamed_to_the_app() -> None:
    app = Recorder()
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (b"a" * 5000, b"b" * 70000))
    request = (
        b"POST /up HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n"
        b"Connection: close\r\n\r\n" + chunks + b"0\r\n\r\n"
    )
    with trio.fail_after(HANG_GUARD):
        async with serving(app) as address:
            answers, rest = split_answers(await converse(address, request))
    assert [(a.status, a.body) for a in answers] == [(200, b"got 75000")]
    assert rest == b""
    assert app.bodies == [b"a" * 5000 + b"b" * 70000]


async def test_expect_100_continue_is_answered_before_the_body_is_sent() -> None:
    app = Recorder()
    with trio.fail_after(HANG_GUARD):
        async with (
            serving(app) as address,
            await trio.open_tcp_stream(address.host, address.port) as stream,
        ):
            await stream.send_all(
                b"PUT /x HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"
            )
            client = h11.Connection(h11.CLIENT)
            client.send(
                h11.Request(
                    method="PUT",
                    target="/x",
                    headers=[("Host", "t"), ("Content-Length", "5"), ("Expect", "100-continue")],
                )
            )
            events: list[Any] = []
            while not events or not isinstance(events[-1], h11.EndOfMessage):
                event = client.next_event()
                if event is h11.NEED_DATA:
                    client.receive_data(await stream.receive_some())
                    continue
                events.append(event)
                if isinstance(event, h11.InformationalResponse):
                    assert event.status_code == 100
                    assert event.reason == b"Continue"
                    await stream.send_all(b"hello")  # the body, only now
            assert isinstance(events[0], h11.InformationalResponse)
            assert isinstance(events[1], h11.Response)
            assert events[1].status_code == 200
    assert app.bodies == [b"hello"]


async def test_the_app_hears_the_client_hang_up() -> None:
    app = Recorder()
    with trio.fail_after(HANG_GUARD):
        async with serving(app) as address:
            async with await trio.open_tcp_stream(address.host, address.port) as stream:
                await stream.send_all(b"GET /hang HTTP/1.1\r\nHost: t\r\n\r\n")
                await app.entered.wait()
            await app.disconnected.wait()


async def test_pipelined_requests_are_answered_in_order() -> None:
    app = Recorder()
    requests = b"".join(
        b"POST /%d HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (n, n, b"x" * n)
        for n in range(1, 6)
    )
    requests += b"GET /last HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    with trio.fail_after(HANG_GUARD):
        async with serving(app) as address:
            answers, rest = split_answers(await converse(address, requests))
    assert [a.header(b"x-path") for a in answers] == [
        b"/1",
        b"/2",
        b"/3",
        b"/4",
        b"/5",
        b"/last",
    ]
    assert [a.body for a in answers][:5] == [b"got %d" % n for n in range(1, 6)]
    assert rest == b""


async def test_an_app_that_fails_before_answering_is_a_500_problem() -> None:
    app = Recorder()
    with trio.fail_after(HANG_GUARD):
        async with serving(app) as address:
            answers, rest = split_answers(
                await converse(address, b"GET /fail HTTP/1.1\r\nHost: t\r\n\r\n")
            )
            # The server goes on serving.
            again, _ = split_answers(
                await converse(address, b"GET /ok HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            )
    assert [(a.status, a.reason) for a in answers] == [(500, b"Internal Server Error")]
    assert answers[0].header(b"content-type") == b"application/problem+json"
    assert answers[0].header(b"connection") == b"close"
    assert rest == b""
    assert [a.status for a in again] == [200]


async def test_a_head_request_gets_no_body() -> None:
    app = Recorder()
    with trio.fail_after(HANG_GUARD):
        async with serving(app) as address:
            data = await converse(
                address, b"HEAD /h HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
            )
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert body == b""


async def _h2_get(stream: trio.abc.Stream, h2conn: h2.connection.H2Connection) -> int:
    """Read HTTP/2 frames until stream 1 ends; its status."""
    status = 0
    while True:
        data = await stream.receive_some()
        assert data, "the server closed the connection before answering"
        for event in h2conn.receive_data(data):
            if isinstance(event, h2.events.ResponseReceived):
                status = int(dict(event.headers)[b":status"])
            if isinstance(event, h2.events.StreamEnded) and event.stream_id == 1:
                return status
        if outgoing := h2conn.data_to_send():
            await stream.send_all(outgoing)


async def test_http2_with_prior_knowledge_is_served() -> None:
    """hypercorn serves it (the lean server hands the connection over, preface and all)."""
    app = Recorder()
    with trio.fail_after(HANG_GUARD):
        async with (
            serving(app) as address,
            await trio.open_tcp_stream(address.host, address.port) as stream,
        ):
            h2conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
            h2conn.initiate_connection()
            h2conn.send_headers(
                1,
                [(":method", "GET"), (":path", "/h2"), (":scheme", "http"), (":authority", "t")],
                end_stream=True,
            )
            await stream.send_all(h2conn.data_to_send())
            assert await _h2_get(stream, h2conn) == 200
    assert app.scopes[0]["http_version"] == "2"


async def test_an_h2c_upgrade_is_served() -> None:
    app = Recorder()
    with trio.fail_after(HANG_GUARD):
        async with (
            serving(app) as address,
            await trio.open_tcp_stream(address.host, address.port) as stream,
        ):
            h2conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
            settings = h2conn.initiate_upgrade_connection()
            assert settings is not None  # a client's upgrade carries its settings
            await stream.send_all(
                b"GET /up HTTP/1.1\r\nHost: t\r\nConnection: Upgrade, HTTP2-Settings\r\n"
                b"Upgrade: h2c\r\nHTTP2-Settings: " + settings + b"\r\n\r\n"
            )
            received = b""
            while b"\r\n\r\n" not in received:
                received += await stream.receive_some()
            head, _, rest = received.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 101 ")
            await stream.send_all(h2conn.data_to_send())
            # The answer to the upgraded request comes on stream 1.
            status = 0
            for event in h2conn.receive_data(rest) if rest else []:
                if isinstance(event, h2.events.ResponseReceived):
                    status = int(dict(event.headers)[b":status"])
            if not status:
                status = await _h2_get(stream, h2conn)
            assert status == 200
    assert app.scopes[0]["path"] == "/up"


async def test_idle_connections_close_at_once_on_shutdown() -> None:
    app = Recorder()
    stop = trio.Event()
    with trio.fail_after(HANG_GUARD):
        async with trio.open_nursery() as nursery:
            address: BoundAddress = await nursery.start(
                functools.partial(serve, app, shutdown_trigger=stop, graceful_timeout=60)
            )
            async with await trio.open_tcp_stream(address.host, address.port) as stream:
                await stream.send_all(b"GET /a HTTP/1.1\r\nHost: t\r\n\r\n")
                received = b""
                while b"got 0" not in received:
                    received += await stream.receive_some()
                stop.set()
                # Closed well before the 60 s grace: the connection was idle.
                while await stream.receive_some():
                    pass


# -- decisions without I/O -----------------------------------------------------------


def _request(headers: list[tuple[bytes, bytes]], method: bytes = b"GET") -> h11.Request:
    return h11.Request(method=method, target=b"/", headers=[(b"host", b"t"), *headers])


@pytest.mark.http1_servers("lean")  # no server involved
@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ([(b"upgrade", b"websocket"), (b"connection", b"upgrade")], core.Handoff.WEBSOCKET),
        ([(b"Upgrade", b"WebSocket")], core.Handoff.WEBSOCKET),
        ([(b"upgrade", b"h2c"), (b"connection", b"upgrade, http2-settings")], core.Handoff.H2C),
        ([(b"upgrade", b"tls/1.2")], None),
        ([(b"connection", b"upgrade")], None),
        ([], None),
    ],
)
def test_which_requests_are_handed_to_hypercorn(
    headers: list[tuple[bytes, bytes]], expected: core.Handoff | None
) -> None:
    assert core.handoff(_request(headers)) is expected


@pytest.mark.http1_servers("lean")  # no server involved
def test_the_http2_preface_is_handed_to_hypercorn() -> None:
    server = h11.Connection(h11.SERVER)
    server.receive_data(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    request = server.next_event()
    assert isinstance(request, h11.Request)
    assert core.handoff(request) is core.Handoff.PRIOR_KNOWLEDGE


_TOKEN = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12)


@pytest.mark.http1_servers("lean")  # no server involved
@given(
    names=st.lists(st.sampled_from(["Date", "date", "Server", "SERVER", "x-a", "content-type"])),
    status=st.sampled_from([200, 201, 204, 404, 503]),
    close=st.booleans(),
)
def test_an_answers_head_has_one_date_and_one_server(
    names: list[str], status: int, close: bool
) -> None:
    """The app's own ``Date`` and ``Server`` are kept (a relayed answer keeps the
    service's); the server's are added only when the app set none; the reason phrase is
    the status's; ``Connection: close`` when the connection ends after it."""
    headers = [(name.encode(), b" v%d " % i) for i, name in enumerate(names)]
    head = core.response_head(status, headers, close=close)
    assert isinstance(head, h11.Response)
    sent = [name for name, _ in head.headers]
    app_dates = sum(1 for n in names if n.lower() == "date")
    assert sent.count(b"date") == max(app_dates, 1)
    assert sent.count(b"server") == max(sum(1 for n in names if n.lower() == "server"), 1)
    assert (b"connection", b"close") in list(head.headers) if close else b"connection" not in sent
    assert head.reason
    # The app's values are stripped, as hypercorn strips them.
    assert all(not value.startswith(b" ") for _, value in head.headers)


@pytest.mark.http1_servers("lean")  # no server involved
def test_a_pseudo_header_from_the_app_is_refused() -> None:
    with pytest.raises(ValueError, match="Pseudo headers"):
        core.response_head(200, [(b":status", b"200")], close=False)


@pytest.mark.http1_servers("lean")  # no server involved
@pytest.mark.parametrize(
    ("method", "status", "suppressed"),
    [("HEAD", 200, True), ("GET", 204, True), ("GET", 304, True), ("GET", 200, False)],
)
def test_which_answers_carry_no_body(method: str, status: int, suppressed: bool) -> None:
    assert core.suppress_body(method, status) is suppressed


# -- choosing the server -------------------------------------------------------------


@pytest.mark.http1_servers("lean")  # the choice itself is under test
@pytest.mark.parametrize("chosen", ["lean", "hypercorn"])
async def test_the_file_chooses_the_http1_server(tmp_path: Path, chosen: str) -> None:
    """``[server] http1_server`` reaches ``serve``: hypercorn names itself in ``Server``,
    pipework's server as pipework."""
    path = tmp_path / "gateway.toml"
    path.write_text(f'[server]\nhttp1_server = "{chosen}"\n')
    gateway = Gateway(str(path))
    assert _container_config(gateway.config).http1_server == chosen
    stop = trio.Event()
    with trio.fail_after(HANG_GUARD):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(functools.partial(gateway.run, port=0, stop=stop))
            data = await converse(
                address, b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
            )
            stop.set()
    answers, _ = split_answers(data)
    expected = b"pipework" if chosen == "lean" else b"hypercorn-h11"
    assert [(a.status, a.header(b"server")) for a in answers] == [(200, expected)]


@pytest.mark.http1_servers("lean")  # no server involved
def test_an_unknown_http1_server_is_refused_where_it_was_written(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text('[server]\nhttp1_server = "hypercron"\n')
    with pytest.raises(ConfigError, match=r"server\.http1_server.*did you mean 'hypercorn'"):
        load_config(path)
    with pytest.raises(ValueError, match="http1_server must be one of lean, hypercorn"):
        ContainerConfig(http1_server="nginx")  # type: ignore[arg-type]  # what is refused


@pytest.mark.http1_servers("lean")  # no server involved
async def test_serve_refuses_an_unknown_http1_server() -> None:
    with pytest.raises(ValueError, match="http1 must be one of lean, hypercorn"):
        await serve(Recorder(), http1="nginx")  # type: ignore[arg-type]  # what is refused


async def test_read_timeout_ends_a_stalled_body_as_a_hang_up() -> None:
    """hypercorn's ``read_timeout``: a client that stops sending its body is cut off, and
    the app hears it as a hang-up (no error)."""
    app = Recorder()
    with trio.fail_after(HANG_GUARD):
        async with serving(app, hypercorn_options={"read_timeout": 1}) as address:
            data = await converse(
                address, b"POST /slow HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nab"
            )
    assert data == b""
    assert app.bodies == [b"ab"]  # what came before the stall, then the hang-up
    assert app.disconnected.is_set()
