"""The server path under hostile bytes, over real sockets: no connection can end the
server, requests are framed per RFC 9112, and hypercorn's own answers are problems.

See ``pipework/container/_hypercorn_fix.py`` for the bugs each test pins.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import h11
import pytest
import trio
import trio.testing
from hypercorn.config import Config
from hypercorn.protocol.events import Response, StreamClosed
from hypercorn.trio import serve as hypercorn_serve
from hypercorn.trio.tcp_server import TCPServer

import pipework as pw
from pipework.container import BoundAddress, _h1_server, _hypercorn_fix
from pipework.container._hypercorn_h11 import _send_stream_problem

from ._raw_http import Answer, split_answers
from .test_container_harness import HANG_GUARD, serving
from .test_server import Gate, make_app, unpatch

# Each test runs on each HTTP/1.1 server serve() has (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("http1_server")


def make_engine() -> pw.Engine:
    registry = pw.Registry()
    engine = pw.Engine(registry=registry, pool=pw.WeightedPool(4))

    @engine.pipe
    async def echo(ctx: pw.Context) -> None:
        ctx.state["echoed"] = True

    engine.chain("echo", echo)
    registry.route("echo", path="/echo", chain="echo")
    return engine


@asynccontextmanager
async def gateway() -> AsyncIterator[BoundAddress]:
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine()) as served:
            yield served.address


async def converse(address: BoundAddress, data: bytes) -> tuple[list[Answer], bytes]:
    """Send ``data`` on a new connection; return the answers and whatever follows them,
    read until the server closes the connection."""
    async with await trio.open_tcp_stream(address.host, address.port) as stream:
        await stream.send_all(data)
        received = bytearray()
        while chunk := await stream.receive_some():
            received += chunk
    return split_answers(bytes(received))


def problem(answer: Answer, status: int, slug: str) -> dict[str, Any]:
    assert answer.status == status, answer
    assert answer.header(b"content-type") == b"application/problem+json", answer
    assert answer.header(b"connection") == b"close", answer
    document: dict[str, Any] = answer.json()
    assert document["status"] == status
    assert document["type"] == f"urn:pipework:problem:{slug}"
    assert document["correlation_id"] == (answer.header(b"x-request-id") or b"").decode()
    return document


REASONS = {
    400: b"Bad Request",
    431: b"Request Header Fields Too Large",
    501: b"Not Implemented",
    505: b"HTTP Version Not Supported",
}
GOOD = (
    b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    b"Content-Length: 2\r\n\r\n{}"
)


# -- one connection never ends the server ----------------------------------------------


async def test_bytes_after_a_closing_request_are_not_read_and_never_end_the_server() -> None:
    """hypercorn issue #203: an early answer, ``Connection: close`` and bytes after the
    body made hypercorn answer a 400 while the app's answer was being sent, and the two
    sends met in trio's ``BusyResourceError``, which ended the process."""
    shape = b"POST /nope HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
    async with gateway() as address:
        for trailing in [b"YYYY", b"GET /echo HTTP/1.1\r\nHost: t\r\n\r\n", b"\x00" * 100] * 40:
            answers, rest = await converse(address, shape + trailing)
            assert [a.status for a in answers] == [404]
            assert rest == b""
            assert answers[0].json()["detail"] == "no route for POST /nope"
        answers, _ = await converse(
            address, GOOD.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
        )
        assert answers[0].status == 200


@pytest.mark.http1_servers("hypercorn")  # of hypercorn's own code
async def test_a_close_waits_for_the_sends_before_it() -> None:
    """The root cause of #203: ``TCPServer._close`` sent its EOF without the send lock the
    connection's other sends take, so the two could run at once."""
    a, b = trio.socket.socketpair()
    stream = trio.SocketStream(a)
    # No app, no context, no state: only the close path runs, which uses none of them.
    server = TCPServer(None, Config(), None, {}, stream)  # type: ignore[arg-type]  # no app, context or state: see above
    closed = trio.Event()

    async def close() -> None:
        await server._close()
        closed.set()

    with trio.fail_after(HANG_GUARD), b:
        async with trio.open_nursery() as nursery:
            async with server.send_lock:  # a send under way
                nursery.start_soon(close)
                await trio.testing.wait_all_tasks_blocked()
                assert not closed.is_set()
                assert stream.socket.fileno() != -1
            await closed.wait()
        assert stream.socket.fileno() == -1


@pytest.mark.http1_servers("hypercorn")  # of hypercorn's own code
@pytest.mark.parametrize(
    "error",
    [
        pytest.param(RuntimeError("boom"), id="error"),
        pytest.param(ExceptionGroup("two", [RuntimeError("a"), ValueError("b")]), id="group"),
    ],
)
async def test_what_escapes_a_connection_closes_that_connection_only(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, error: Exception
) -> None:
    original = TCPServer._read_data
    failing = trio.Event()

    async def read_data(self: TCPServer) -> None:
        if not failing.is_set():
            failing.set()
            raise error
        await original(self)

    monkeypatch.setattr(TCPServer, "_read_data", read_data)
    async with gateway() as address:
        answers, rest = await converse(address, GOOD)
        assert (answers, rest) == ([], b"")  # closed without an answer
        answers, _ = await converse(
            address, GOOD.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
        )
        assert answers[0].status == 200
    records = [r for r in caplog.records if "failed in the server" in r.getMessage()]
    assert len(records) == 1
    assert records[0].levelno == logging.ERROR
    assert records[0].exc_info is not None
    assert records[0].exc_info[1] is error or isinstance(records[0].exc_info[1], ExceptionGroup)


@pytest.mark.http1_servers("lean")  # the twin of the test above, on pipework's server
@pytest.mark.parametrize(
    "error",
    [
        pytest.param(RuntimeError("boom"), id="error"),
        pytest.param(ExceptionGroup("two", [RuntimeError("a"), ValueError("b")]), id="group"),
    ],
)
async def test_what_escapes_a_lean_connection_closes_that_connection_only(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, error: Exception
) -> None:
    original = _h1_server._Connection.serve_request
    failing = trio.Event()

    async def serve_request(self: _h1_server._Connection, request: h11.Request) -> bool:
        if not failing.is_set():
            failing.set()
            raise error
        return await original(self, request)

    monkeypatch.setattr(_h1_server._Connection, "serve_request", serve_request)
    async with gateway() as address:
        answers, rest = await converse(address, GOOD)
        assert (answers, rest) == ([], b"")  # closed without an answer
        answers, _ = await converse(
            address, GOOD.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
        )
        assert answers[0].status == 200
    records = [r for r in caplog.records if "failed in the server" in r.getMessage()]
    assert len(records) == 1
    assert records[0].levelno == logging.ERROR
    assert records[0].exc_info is not None
    assert records[0].exc_info[1] is error or isinstance(records[0].exc_info[1], ExceptionGroup)


@pytest.mark.http1_servers("hypercorn")  # of hypercorn's own code
async def test_unpatched_hypercorn_still_ends_on_bytes_after_a_closing_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Canary: hypercorn as installed still has #203. If this fails, check whether the
    first fixes in ``pipework.container._hypercorn_fix`` are still needed."""
    unpatch(monkeypatch)
    # Only the close's shield stays (without it the close never happens, hypercorn #106).
    monkeypatch.setattr(TCPServer, "_close", _hypercorn_fix._shielded(TCPServer._close))
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.errorlog = logging.getLogger("hypercorn.error")
    shape = (
        b"POST /nope HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}YYYY"
    )

    async def serve_until_it_ends() -> None:
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(
                functools.partial(hypercorn_serve, make_app(Gate()), config)
            )
            host, port = binds[0].removeprefix("http://").rsplit(":", 1)
            while True:
                try:
                    await converse(BoundAddress(host, int(port)), shape)
                except OSError:
                    await trio.sleep_forever()  # the server is gone; its error is on its way

    with trio.fail_after(HANG_GUARD), pytest.raises(BaseExceptionGroup) as info:
        await serve_until_it_ends()
    assert info.group_contains(trio.BusyResourceError, depth=None)


# -- framing per RFC 9112 ----------------------------------------------------------------


async def test_both_framings_are_answered_and_the_connection_closed() -> None:
    smuggled = b"GET /echo HTTP/1.1\r\nHost: t\r\n\r\n"
    request = (
        b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    )
    async with gateway() as address:
        answers, rest = await converse(address, request + smuggled)
    assert len(answers) == 1  # the request after it on the connection is not served
    assert rest == b""
    document = problem(answers[0], 400, "malformed-request")
    assert "both Content-Length and Transfer-Encoding" in document["detail"]


@pytest.mark.parametrize(
    ("request_bytes", "status", "slug", "detail"),
    [
        pytest.param(
            b"POST /echo HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
            400,
            "malformed-request",
            "Transfer-Encoding is not defined for HTTP/1.0",
            id="chunked-on-1.0",
        ),
        pytest.param(
            b"post /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\n{}",
            501,
            "not-implemented",
            "method 'post' is not implemented; methods are case-sensitive",
            id="lower-case-method",
        ),
        pytest.param(
            b"GET /echo HTTP/9.9\r\nHost: t\r\n\r\n",
            505,
            "http-version-not-supported",
            "HTTP/9.9 is not supported",
            id="version",
        ),
        pytest.param(
            b"GET /echo HTTP/1.1\r\nHost: t\r\nHost: u\r\n\r\n",
            400,
            "malformed-request",
            "the request is not valid HTTP/1.1: Found multiple Host: headers",
            id="two-hosts",
        ),
        pytest.param(
            b"GET /echo HTTP/1.1\r\nHost: t\r\nbad header\r\n\r\n",
            400,
            "malformed-request",
            "the request is not valid HTTP/1.1: ",
            id="h11-error",
        ),
        pytest.param(
            b"GET /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip\r\n\r\n",
            501,
            "not-implemented",
            "Only Transfer-Encoding: chunked is supported",
            id="transfer-coding",
        ),
        pytest.param(
            b"GET /echo HTTP/1.1\r\nHost: t\r\nX-Long: " + b"a" * 20_000,
            431,
            "headers-too-large",
            "the request's line and headers are too large",
            id="head-too-large",
        ),
    ],
)
async def test_requests_rfc_9112_refuses_are_answered_with_a_problem_and_closed(
    request_bytes: bytes, status: int, slug: str, detail: str
) -> None:
    async with gateway() as address:
        # A good request after it on the connection is not served; a head too large
        # is refused before it ends.
        after = GOOD if status != 431 else b""
        answers, rest = await converse(address, request_bytes + after)
        assert len(answers) == 1
        assert rest == b""
        assert detail in problem(answers[0], status, slug)["detail"]
        assert answers[0].reason == REASONS[status]


async def test_every_status_line_has_its_reason_phrase() -> None:
    async with gateway() as address:
        answers, _ = await converse(
            address,
            GOOD
            + b"GET /nowhere HTTP/1.1\r\nHost: t\r\n\r\n"
            + b"GET /echo HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
        )
    assert [(a.status, a.reason) for a in answers] == [
        (200, b"OK"),
        (404, b"Not Found"),
        (405, b"Method Not Allowed"),
    ]


async def test_a_refused_websocket_handshake_is_a_problem() -> None:
    handshake = (
        b"GET /echo HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 12\r\n\r\n"
    )
    async with gateway() as address:
        answers, _ = await converse(address, handshake)
    problem(answers[0], 400, "malformed-request")


async def test_a_problem_answer_after_the_apps_own_head_only_ends_the_stream() -> None:
    """hypercorn notes an answer's head as sent only after writing it: an app cancelled
    during that write leaves the stream looking unanswered, and the 500 hypercorn then sends
    meets h11 in the middle of the app's body. The problem answer gives way to the answer
    under way (before, h11's error escaped and closed the connection with an ERROR log)."""
    sent: list[object] = []

    class Stream:
        def __init__(self) -> None:
            self.scope = {"http_version": "1.1"}
            self.stream_id = 1

        async def send(self, event: object) -> None:
            if isinstance(event, Response):
                raise h11.LocalProtocolError(
                    "can't handle event type Response when role=SERVER and state=SEND_BODY"
                )
            sent.append(event)

    await _send_stream_problem(Stream(), 500)  # type: ignore[arg-type]  # the stream's part
    assert [type(event) for event in sent] == [StreamClosed]
