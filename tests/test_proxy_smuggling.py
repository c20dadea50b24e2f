"""Request smuggling through a proxy route, against a real backend that keeps its
connections alive: whatever framing a client sends, the gateway either refuses the request
(a problem, and the client's connection closed) or sends the backend exactly the one
request it understood, framed once (``Content-Length`` or chunked, never both), so the
backend's connection never falls out of step with the gateway's.

The backend (:class:`RawBackend`) is h11's server side on a socket, as lenient as h11 is
(it would take both framings, as many servers do): it records every request it parses on
each connection and answers each with the connection's number and the request's place on
it. The client writes raw bytes. Each shape is sent on a connection that has just carried
an honest request, after which another honest request goes on the same connection (if the
gateway kept it) and must get its own answer, from the same kept-alive backend connection.

The other way, a backend that frames its answers wrongly (a body with an answer to
``HEAD``, both framings at once) must not leave its connection out of step either, nor
the client's.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import h11
import pytest
import trio

from pipework.container import BoundAddress
from pipework.proxy import ProxyLayer

from ._loopback import serve_loopback
from ._proxy_gateway import API, gateway, gateway_file
from ._raw_http import Answer, split_answers

# -- the backend -----------------------------------------------------------------------


@dataclass
class Seen:
    """A request as the backend parsed it."""

    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""
    complete: bool = False  # its end was read (and it was answered)

    def header(self, name: bytes) -> list[bytes]:
        return [value for key, value in self.headers if key == name]

    @property
    def framing(self) -> Framing:
        """How the request framed its body, as sent (never both, or the gateway failed)."""
        length, chunked = self.header(b"content-length"), self.header(b"transfer-encoding")
        assert not (length and chunked), f"both framings reached the backend: {self.headers}"
        assert len(length) <= 1, self.headers
        assert len(chunked) <= 1, self.headers
        if chunked:
            assert chunked == [b"chunked"], self.headers
            return "chunked"
        return "length" if length else "none"


@dataclass
class BackendConnection:
    number: int
    requests: list[Seen] = field(default_factory=list)
    error: str | None = None  # what h11 refused in the bytes it got
    closed: bool = False


class RawBackend:
    """h11's server side on 127.0.0.1: keeps connections alive, answers each request with
    JSON naming its connection and its place there, and records what it parsed.

    ``misbehave`` maps a target to the bytes written as its answer instead, as they are:
    a backend that frames its answers wrongly (the connection is kept alive after them)."""

    def __init__(self, misbehave: dict[bytes, bytes] | None = None) -> None:
        self.url = ""
        self.misbehave = misbehave or {}
        self.connections: list[BackendConnection] = []
        self._changed = trio.lowlevel.ParkingLot()

    def _note(self) -> None:
        self._changed.unpark_all()

    async def wait_for(self, condition: Callable[[], bool]) -> None:
        while not condition():
            await self._changed.park()

    def all_requests(self) -> list[Seen]:
        return [seen for connection in self.connections for seen in connection.requests]

    async def handle(self, stream: trio.SocketStream) -> None:
        connection = BackendConnection(len(self.connections) + 1)
        self.connections.append(connection)
        h = h11.Connection(h11.SERVER)
        try:
            while await self._one(stream, h, connection):
                h.start_next_cycle()
        except h11.RemoteProtocolError as exc:
            if not _cut(h):  # an end of file mid-request is the sender's way to give up
                connection.error = str(exc)
        except trio.BrokenResourceError:
            pass
        finally:
            connection.closed = True
            self._note()
            await stream.aclose()

    async def _one(
        self, stream: trio.SocketStream, h: h11.Connection, connection: BackendConnection
    ) -> bool:
        """Read and answer one request; False when the connection ends."""
        event = await _next(stream, h)
        if isinstance(event, h11.ConnectionClosed):
            return False
        assert isinstance(event, h11.Request), event
        seen = Seen(event.method, event.target, list(event.headers))
        connection.requests.append(seen)
        self._note()
        while isinstance(event := await _next(stream, h), h11.Data):
            seen.body += event.data
            self._note()
        if not isinstance(event, h11.EndOfMessage):
            return False  # the connection ended mid-request
        seen.complete = True
        wrong = self.misbehave.get(seen.target)
        if wrong is not None:
            h.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
            h.send(h11.EndOfMessage())  # as far as h11 knows, the answer was sent whole
            await stream.send_all(wrong)
            self._note()
            return True
        body = json.dumps(
            {
                "connection": connection.number,
                "place": len(connection.requests),
                "method": seen.method.decode(),
                "target": seen.target.decode(),
                "body": seen.body.decode("latin-1"),
            }
        ).encode()
        headers = [("content-type", "application/json"), ("content-length", str(len(body)))]
        data = h.send(h11.Response(status_code=200, headers=headers))
        if seen.method != b"HEAD":
            data += h.send(h11.Data(data=body))
        data += h.send(h11.EndOfMessage())
        await stream.send_all(data)
        self._note()
        return h.our_state is h11.DONE and h.their_state is h11.DONE


def _cut(h: h11.Connection) -> bool:
    """Whether the peer closed the connection in the middle of a request."""
    data, closed = h.trailing_data
    return closed and not data


async def _next(stream: trio.SocketStream, h: h11.Connection) -> Any:
    while (event := h.next_event()) is h11.NEED_DATA:
        h.receive_data(await stream.receive_some(65536))
    return event


@asynccontextmanager
async def running_raw_backend(
    misbehave: dict[bytes, bytes] | None = None,
) -> AsyncIterator[RawBackend]:
    backend = RawBackend(misbehave)
    async with serve_loopback(backend.handle) as port:
        backend.url = f"http://127.0.0.1:{port}"
        yield backend


# -- the client ------------------------------------------------------------------------


class RawClient:
    """A client writing raw bytes on one connection and reading whole answers."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.received = bytearray()
        self.taken = 0  # answers (interim ones included) already returned
        self.ended = False

    @classmethod
    @asynccontextmanager
    async def connected(cls, address: BoundAddress) -> AsyncIterator[RawClient]:
        async with await trio.open_tcp_stream(address.host, address.port) as stream:
            yield cls(stream)

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def answer(self) -> Answer:
        """The next answer (an interim 100 included); fails if the connection ends first."""
        while True:
            answers, _ = split_answers(bytes(self.received))
            if len(answers) > self.taken:
                self.taken += 1
                return answers[self.taken - 1]
            assert not self.ended, f"the connection ended before an answer: {self.received!r}"
            await self._read()

    async def final_answer(self) -> Answer:
        while (answer := await self.answer()).status < 200:
            pass
        return answer

    async def until(self, marker: bytes, start: int) -> bytes:
        """What came from offset ``start`` on, once it holds ``marker``."""
        while marker not in self.received[start:]:
            assert not self.ended, f"the connection ended before {marker!r}"
            await self._read()
        return bytes(self.received[start:])

    async def end(self) -> bytes:
        """Read until the server closes the connection; what came after the answers taken."""
        while not self.ended:
            await self._read()
        answers, rest = split_answers(bytes(self.received))
        assert len(answers) == self.taken, f"answers nobody asked for: {answers[self.taken :]}"
        return rest

    async def _read(self) -> None:
        chunk = await self.stream.receive_some(65536)
        if not chunk:
            self.ended = True
        self.received += chunk


# -- the shapes ------------------------------------------------------------------------

Framing = Literal["length", "chunked", "none"]


@dataclass(frozen=True)
class Refused:
    """The gateway answers this problem and closes the connection; the backend gets nothing."""

    status: int
    detail: str
    # Refused while its body streams: the backend may have got the request's start, never
    # its end, and that connection is closed (never carries another request).
    mid_body: bool = False


@dataclass(frozen=True)
class Passed:
    """The backend gets this request, and nothing else, framed this way."""

    method: bytes
    target: bytes
    body: bytes
    framing: Framing
    header: tuple[bytes, bytes] | None = None  # a header it must carry, as it must
    then: Refused | None = None  # the bytes after it, taken as the next request: refused


@dataclass(frozen=True)
class Unfinished:
    """A body that does not end where the gateway reads it (its length or a chunk's size is
    huge): the backend gets the bytes after the head as this body, framed this way, and
    never a request in them; the client gives up and closes its connection."""

    body: bytes
    framing: Framing


Outcome = Passed | Refused | Unfinished


@dataclass(frozen=True)
class Shape:
    """The bytes a client sends; between two parts it waits for a ``100 Continue``."""

    parts: tuple[bytes, ...]
    outcome: Outcome


def head(*lines: bytes, method: bytes = b"POST", version: bytes = b"1.1") -> bytes:
    """A request head to ``/api/s`` with ``lines`` after its Host line."""
    start = method + b" /api/s HTTP/" + version
    return b"\r\n".join([start, b"Host: t", *lines]) + b"\r\n\r\n"


HELLO = b"5\r\nhello\r\n0\r\n\r\n"  # "hello", chunked
SMUGGLED = b"GET /api/smuggled HTTP/1.1\r\nHost: t\r\n\r\n"
BOTH = "both Content-Length and Transfer-Encoding"
ONLY_CHUNKED = "Only Transfer-Encoding: chunked is supported"
MULTIPLE_TE = "multiple Transfer-Encoding headers"
NOT_HTTP = "the request is not valid HTTP/1.1"


def passed(body: bytes, framing: Framing, **kwargs: Any) -> Passed:
    return Passed(b"POST", b"/s", body, framing, **kwargs)


SHAPES: dict[str, Shape] = {
    # CL.TE and TE.CL: the two framings at once, in either order.
    "cl-te": Shape(
        (head(b"Content-Length: 6", b"Transfer-Encoding: chunked") + b"0\r\n\r\nG",),
        Refused(400, BOTH),
    ),
    "te-cl": Shape(
        (
            head(b"Transfer-Encoding: chunked", b"Content-Length: 3")
            + b"8\r\nSMUGGLED\r\n0\r\n\r\n",
        ),
        Refused(400, BOTH),
    ),
    "cl-te-smuggled-request": Shape(
        (head(b"Content-Length: 4", b"Transfer-Encoding: chunked") + b"0\r\n\r\n" + SMUGGLED,),
        Refused(400, BOTH),
    ),
    # TE.TE: a Transfer-Encoding one parser may take and another not.
    "te-xchunked": Shape(
        (head(b"Transfer-Encoding: xchunked") + HELLO,), Refused(501, ONLY_CHUNKED)
    ),
    "te-xchunked-and-cl": Shape(
        (head(b"Content-Length: 5", b"Transfer-Encoding: xchunked") + HELLO,),
        Refused(501, ONLY_CHUNKED),
    ),
    "te-space-before-colon": Shape(
        (head(b"Transfer-Encoding : chunked") + HELLO,), Refused(400, NOT_HTTP)
    ),
    "te-space-before-colon-and-cl": Shape(
        (head(b"Content-Length: 5", b"Transfer-Encoding : chunked") + b"hello",),
        Refused(400, NOT_HTTP),
    ),
    "te-chunked-identity": Shape(
        (head(b"Transfer-Encoding: chunked, identity") + HELLO,), Refused(501, ONLY_CHUNKED)
    ),
    "te-identity-chunked": Shape(
        (head(b"Transfer-Encoding: identity, chunked") + HELLO,), Refused(501, ONLY_CHUNKED)
    ),
    "te-two-headers": Shape(
        (head(b"Transfer-Encoding: chunked", b"Transfer-Encoding: identity") + HELLO,),
        Refused(501, MULTIPLE_TE),
    ),
    "te-two-chunked-headers": Shape(
        (head(b"Transfer-Encoding: chunked", b"Transfer-Encoding: chunked") + HELLO,),
        Refused(501, MULTIPLE_TE),
    ),
    "te-quoted": Shape(
        (head(b'Transfer-Encoding: "chunked"') + HELLO,), Refused(501, ONLY_CHUNKED)
    ),
    "te-null-byte": Shape(
        (head(b"Transfer-Encoding: chunked\x00") + HELLO,), Refused(400, NOT_HTTP)
    ),
    "te-tab-before-value": Shape(
        (head(b"Transfer-Encoding:\tchunked") + HELLO,), passed(b"hello", "chunked")
    ),
    "te-space-after-value": Shape(
        (head(b"Transfer-Encoding: chunked \t") + HELLO,), passed(b"hello", "chunked")
    ),
    "te-upper-case": Shape(
        (head(b"TRANSFER-ENCODING: CHUNKED") + HELLO,), passed(b"hello", "chunked")
    ),
    "te-tab-and-cl": Shape(
        (head(b"Content-Length: 5", b"Transfer-Encoding:\tchunked") + HELLO,),
        Refused(400, BOTH),
    ),
    # Content-Length: twice, listed, signed, spaced.
    "cl-twice-same": Shape(
        (head(b"Content-Length: 5", b"Content-Length: 5") + b"hello",), passed(b"hello", "length")
    ),
    "cl-list-same": Shape((head(b"Content-Length: 5, 5") + b"hello",), passed(b"hello", "length")),
    "cl-twice-different": Shape(
        (head(b"Content-Length: 5", b"Content-Length: 6") + b"hello!",), Refused(400, NOT_HTTP)
    ),
    "cl-list-different": Shape(
        (head(b"Content-Length: 5, 6") + b"hello!",), Refused(400, NOT_HTTP)
    ),
    "cl-plus-sign": Shape((head(b"Content-Length: +5") + b"hello",), Refused(400, NOT_HTTP)),
    "cl-minus-sign": Shape((head(b"Content-Length: -5") + b"hello",), Refused(400, NOT_HTTP)),
    "cl-hex": Shape((head(b"Content-Length: 0x5") + b"hello",), Refused(400, NOT_HTTP)),
    "cl-inner-space": Shape((head(b"Content-Length: 1 2") + b"hello",), Refused(400, NOT_HTTP)),
    "cl-space-before-colon": Shape(
        (head(b"Content-Length : 5") + b"hello",), Refused(400, NOT_HTTP)
    ),
    "cl-spaces-around": Shape(
        (head(b"Content-Length: \t 5 \t") + b"hello",), passed(b"hello", "length")
    ),
    "cl-leading-zeros": Shape(
        (head(b"Content-Length: 005") + b"hello",), passed(b"hello", "length")
    ),
    "cl-and-its-zero-padded-twin": Shape(
        (head(b"Content-Length: 5", b"Content-Length: 05") + b"hello",), Refused(400, NOT_HTTP)
    ),
    # obs-fold: a header line continued on the next.
    "obs-fold-space": Shape(
        (head(b"X-Note: a", b" b", b"Content-Length: 5") + b"hello",),
        passed(b"hello", "length", header=(b"x-note", b"a b")),
    ),
    "obs-fold-tab": Shape(
        (head(b"X-Note: a", b"\tb", b"Content-Length: 5") + b"hello",),
        passed(b"hello", "length", header=(b"x-note", b"a b")),
    ),
    "obs-fold-te-value": Shape(
        (head(b"Transfer-Encoding:", b" chunked") + HELLO,), passed(b"hello", "chunked")
    ),
    "obs-fold-te-and-cl": Shape(
        (head(b"Content-Length: 5", b"Transfer-Encoding:", b" chunked") + HELLO,),
        Refused(400, BOTH),
    ),
    "obs-fold-cl-value": Shape(
        (head(b"Content-Length: 5", b" 0") + b"hello",), Refused(400, NOT_HTTP)
    ),
    "obs-fold-hides-te": Shape(
        # The Transfer-Encoding line continues X-Note: no framing, so no body. What
        # follows is the next request, which is not HTTP: refused.
        (head(b"X-Note: a", b" Transfer-Encoding: chunked") + HELLO,),
        passed(b"", "length", then=Refused(400, NOT_HTTP)),
    ),
    # Names a CGI or WSGI backend reads as the framing (or forwarding) fields: dropped.
    "underscore-lookalikes": Shape(
        (
            head(b"Transfer_Encoding: chunked", b"Content_Length: 5", b"X_Forwarded_For: 1.2.3.4")
            + HELLO,
        ),
        passed(b"", "length", then=Refused(400, NOT_HTTP)),
    ),
    "obs-fold-first-line": Shape(
        (b"POST /api/s HTTP/1.1\r\n Transfer-Encoding: chunked\r\nHost: t\r\n\r\n" + HELLO,),
        Refused(400, NOT_HTTP),
    ),
    # Bare LF line endings: the head is read (as h11 reads it) and sent on with CRLF.
    "bare-lf-head": Shape(
        (b"POST /api/s HTTP/1.1\nHost: t\nContent-Length: 5\n\nhello",),
        passed(b"hello", "length"),
    ),
    "bare-lf-mixed": Shape(
        (b"POST /api/s HTTP/1.1\r\nHost: t\nTransfer-Encoding: chunked\r\n\n" + HELLO,),
        passed(b"hello", "chunked"),
    ),
    "bare-cr-in-head": Shape(
        (b"POST /api/s HTTP/1.1\r\nHost: t\rContent-Length: 5\r\n\r\nhello",),
        Refused(400, NOT_HTTP),
    ),
    # Chunks: extensions are read and dropped; a size past 20 hex digits is refused.
    "chunk-extensions": Shape(
        (head(b"Transfer-Encoding: chunked") + b'5;a=b;c="d;e"\r\nhello\r\n0;z\r\n\r\n',),
        passed(b"hello", "chunked"),
    ),
    "chunk-trailers": Shape(
        # Trailers are dropped (none reach the backend), framing ones too.
        (
            head(b"Transfer-Encoding: chunked")
            + b"5\r\nhello\r\n0\r\nContent-Length: 100\r\nX-Trailer: 1\r\n\r\n",
        ),
        passed(b"hello", "chunked"),
    ),
    "chunk-trailer-te": Shape(
        (head(b"Transfer-Encoding: chunked") + b"5\r\nhello\r\n0\r\nTransfer-Encoding: x\r\n\r\n",),
        Refused(501, ONLY_CHUNKED, mid_body=True),
    ),
    "chunk-size-overflow": Shape(
        (head(b"Transfer-Encoding: chunked") + b"1" + b"0" * 20 + b"\r\nhello\r\n0\r\n\r\n",),
        Refused(400, NOT_HTTP, mid_body=True),
    ),
    "chunk-size-huge": Shape(
        # 20 hex digits are read (2**80 - 1 bytes): the rest is that chunk's data.
        (head(b"Transfer-Encoding: chunked") + b"f" * 20 + b"\r\n" + HELLO + SMUGGLED,),
        Unfinished(HELLO + SMUGGLED, "chunked"),
    ),
    "chunk-size-negative": Shape(
        (head(b"Transfer-Encoding: chunked") + b"-5\r\nhello\r\n0\r\n\r\n",),
        Refused(400, NOT_HTTP, mid_body=True),
    ),
    "chunk-size-hex-prefix": Shape(
        (head(b"Transfer-Encoding: chunked") + b"0x5\r\nhello\r\n0\r\n\r\n",),
        Refused(400, NOT_HTTP, mid_body=True),
    ),
    "chunk-longer-than-its-size": Shape(
        (head(b"Transfer-Encoding: chunked") + b"3\r\nhello\r\n0\r\n\r\n",),
        Refused(400, NOT_HTTP, mid_body=True),
    ),
    "bare-lf-chunks": Shape(
        # A chunk's size line ends at CRLF only: the first one here holds it all.
        (head(b"Transfer-Encoding: chunked") + b"5\nhello\n0\n\n" + SMUGGLED,),
        Refused(400, NOT_HTTP, mid_body=True),
    ),
    "cl-huge": Shape(
        (head(b"Content-Length: 99999999999999999999") + b"hello" + SMUGGLED,),
        Unfinished(b"hello" + SMUGGLED, "length"),
    ),
    "chunk-size-space": Shape(
        (head(b"Transfer-Encoding: chunked") + b"5 \r\nhello\r\n0\r\n\r\n",),
        passed(b"hello", "chunked"),
    ),
    # Expect: 100-continue: the gateway's server answers it; the backend gets the body.
    "expect-100-continue": Shape(
        (head(b"Expect: 100-continue", b"Content-Length: 5"), b"hello"),
        passed(b"hello", "length"),
    ),
    "expect-100-continue-chunked": Shape(
        (head(b"Expect: 100-continue", b"Transfer-Encoding: chunked"), HELLO),
        passed(b"hello", "chunked"),
    ),
    # HTTP/1.0 has no Transfer-Encoding.
    "http-1.0-te": Shape(
        (head(b"Transfer-Encoding: chunked", version=b"1.0") + HELLO,),
        Refused(400, "Transfer-Encoding is not defined for HTTP/1.0"),
    ),
    "http-1.0-te-and-cl": Shape(
        (head(b"Transfer-Encoding: chunked", b"Content-Length: 5", version=b"1.0") + HELLO,),
        Refused(400, "Transfer-Encoding is not defined for HTTP/1.0"),
    ),
    # A request inside another's body is that body, never a request of its own.
    "request-in-a-body": Shape(
        (head(b"Content-Length: %d" % len(SMUGGLED)) + SMUGGLED,),
        passed(SMUGGLED, "length"),
    ),
    "request-in-a-chunked-body": Shape(
        (
            head(b"Transfer-Encoding: chunked")
            + b"%x\r\n%s\r\n0\r\n\r\n" % (len(SMUGGLED), SMUGGLED),
        ),
        passed(SMUGGLED, "chunked"),
    ),
    "request-in-a-get-body": Shape(
        (head(b"Content-Length: %d" % len(SMUGGLED), method=b"GET") + SMUGGLED,),
        Passed(b"GET", b"/s", SMUGGLED, "length"),
    ),
    # A body without framing is no body: what follows is the next request.
    "post-without-framing": Shape((head(),), passed(b"", "length")),
    "get-without-framing": Shape((head(method=b"GET"),), Passed(b"GET", b"/s", b"", "none")),
}


# -- the test --------------------------------------------------------------------------


def honest(n: int) -> bytes:
    return b"GET /api/honest/%d HTTP/1.1\r\nHost: t\r\n\r\n" % n


def served_by(answer: Answer, target: bytes) -> tuple[int, int]:
    """The backend connection and the place on it of the request ``answer`` answers,
    which must be ``target``."""
    assert answer.status == 200, answer
    document = answer.json()
    assert document["target"] == target.decode(), document
    return document["connection"], document["place"]


def refused(answer: Answer, outcome: Refused) -> None:
    assert answer.status == outcome.status, answer
    assert answer.header(b"content-type") == b"application/problem+json", answer
    assert answer.header(b"connection") == b"close", answer
    assert outcome.detail in answer.json()["detail"], answer.json()


def check_passed(answer: Answer, backend: RawBackend, outcome: Passed) -> None:
    """The backend got the request whole, on its kept-alive connection, framed once."""
    assert served_by(answer, outcome.target) == (1, 2)
    seen = backend.connections[0].requests[1]
    got = (seen.method, seen.body, seen.framing)
    assert got == (outcome.method, outcome.body, outcome.framing), seen
    if outcome.header is not None:
        name, value = outcome.header
        assert seen.header(name) == [value], seen.headers
    for dropped in (b"expect", b"te", b"trailer", b"connection"):
        assert not seen.header(dropped), seen.headers
    assert not [name for name, _ in seen.headers if b"_" in name], seen.headers


async def check_unfinished(backend: RawBackend, outcome: Unfinished) -> None:
    """The backend gets the rest of the client's bytes as the request's body."""
    first = backend.connections[0]
    await backend.wait_for(
        lambda: len(first.requests) == 2 and len(first.requests[1].body) >= len(outcome.body)
    )
    seen = first.requests[1]
    assert (seen.body, seen.framing) == (outcome.body, outcome.framing), seen


async def check_in_step(backend: RawBackend, outcome: Outcome, where: tuple[int, int]) -> None:
    """What the backend got, once the honest request after the shape was answered from
    backend connection and place ``where``: each request the gateway understood, whole, one
    after the other; and nothing of a refused one, unless it was cut short."""
    first = backend.connections[0]
    expected = [b"/honest/1", *([outcome.target] if isinstance(outcome, Passed) else [])]
    expected.append(b"/honest/2")
    if where == (1, len(expected)):
        assert [seen.target for seen in first.requests] == expected
        assert all(seen.complete for seen in first.requests)
        assert len(backend.connections) == 1
    else:
        # The request began on the backend's connection: the backend never got its end,
        # and the gateway closed that connection.
        assert where == (2, 1), where
        cut_short = isinstance(outcome, Unfinished) or (
            isinstance(outcome, Refused) and outcome.mid_body
        )
        assert cut_short, f"a refused request reached the backend: {first}"
        await backend.wait_for(lambda: first.closed)
        assert first.requests[0].target == b"/honest/1"
        assert first.requests[0].complete
        rest = [(seen.target, seen.complete) for seen in first.requests[1:]]
        assert rest in ([], [(b"/s", False)]), first.requests
        assert len(backend.connections) == 2
    assert not any(c.error for c in backend.connections), backend.connections


@dataclass
class Proxied:
    """A gateway whose route ``/api`` proxies to ``backend``, at ``address``."""

    backend: RawBackend
    address: BoundAddress
    layer: ProxyLayer

    async def settled(self) -> None:
        """Return once every proxied exchange has ended: its backend connection is back
        in the pool, or closed."""
        await self.layer.wait_released(self.layer.proxies)


@asynccontextmanager
async def proxied(
    tmp_path: Path, misbehave: dict[bytes, bytes] | None = None
) -> AsyncIterator[Proxied]:
    """A gateway in front of a :class:`RawBackend` (``misbehave``: its wrong answers), the
    service's connections kept alive for as long as the test runs."""
    service = "limit = 4\nkeepalive_expiry = 3600"
    async with (
        running_raw_backend(misbehave) as backend,
        gateway(tmp_path, gateway_file(backend, API, service=service)) as (gw, address),
    ):
        assert gw.container is not None
        yield Proxied(backend, address, gw.container.proxy_layer)


@pytest.mark.parametrize("name", sorted(SHAPES))
async def test_a_smuggling_shape_never_desynchronises_the_backend(
    tmp_path: Path, name: str
) -> None:
    shape, outcome = SHAPES[name], SHAPES[name].outcome
    async with proxied(tmp_path) as setup, RawClient.connected(setup.address) as client:
        backend, settled = setup.backend, setup.settled
        with trio.fail_after(30):
            await client.send(honest(1))
            assert served_by(await client.final_answer(), b"/honest/1") == (1, 1)
            await settled()
            for n, part in enumerate(shape.parts):
                if n:  # the body waits for the go-ahead
                    interim = await client.answer()
                    assert interim.status == 100, interim
                await client.send(part)
            if isinstance(outcome, Unfinished):
                await check_unfinished(backend, outcome)
                await client.stream.aclose()  # the client gives up
            else:
                answer = await client.final_answer()
                refusal: Refused | None = None
                if isinstance(outcome, Passed):
                    check_passed(answer, backend, outcome)
                    refusal = outcome.then
                    if refusal is not None:
                        answer = await client.final_answer()
                else:
                    refusal = outcome
                if refusal is not None:
                    refused(answer, refusal)
                    assert await client.end() == b""  # closed: nothing after it is read
            await settled()
            # The next request, on the same client connection if it is still open, is
            # served on the same backend connection (unless the shape's request had
            # started there and was cut short) and gets its own answer.
            if isinstance(outcome, Passed) and outcome.then is None:
                await client.send(honest(2))
                where = served_by(await client.final_answer(), b"/honest/2")
            else:
                async with RawClient.connected(setup.address) as again:
                    await again.send(honest(2))
                    where = served_by(await again.final_answer(), b"/honest/2")
            await check_in_step(backend, outcome, where)


async def test_pipelined_requests_reach_the_backend_one_by_one(tmp_path: Path) -> None:
    """Requests sent at once, one with another request's bytes in its body: the gateway
    and the backend cut them at the same places."""
    body_with_request = head(b"Content-Length: %d" % len(SMUGGLED)) + SMUGGLED
    chunked_with_request = head(b"Transfer-Encoding: chunked") + b"%x\r\n%s\r\n0\r\n\r\n" % (
        len(SMUGGLED),
        SMUGGLED,
    )
    async with proxied(tmp_path) as setup, RawClient.connected(setup.address) as client:
        backend = setup.backend
        with trio.fail_after(30):
            await client.send(
                honest(1) + body_with_request + honest(2) + chunked_with_request + honest(3)
            )
            targets = [b"/honest/1", b"/s", b"/honest/2", b"/s", b"/honest/3"]
            for target in targets:  # each answer is its own request's
                served_by(await client.final_answer(), target)
    # (Each request may take the backend connection the one before it is still giving back.)
    assert sorted((seen.target, seen.body) for seen in backend.all_requests()) == sorted(
        zip(targets, [b"", SMUGGLED, b"", SMUGGLED, b""], strict=True)
    )
    assert all(seen.complete for seen in backend.all_requests())
    assert not any(c.error for c in backend.connections), backend.connections


# -- a backend that frames its answers wrongly --------------------------------------------

POISON = b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\nX-Poison: yes\r\n\r\npoison!"


async def test_a_body_sent_with_an_answer_to_head_never_answers_the_next_request(
    tmp_path: Path,
) -> None:
    """A backend that sends a body with its answer to ``HEAD`` (many hand-written ones do):
    the gateway reads no body there (RFC 9110 §9.3.2), so the body's bytes are left on the
    connection. Were it reused, the next request's answer -- any client's -- would be read
    from them: here a whole answer of the body's author."""
    answers = {b"/page": b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(POISON), POISON)}
    async with proxied(tmp_path, answers) as setup:
        backend, settled, address = setup.backend, setup.settled, setup.address
        with trio.fail_after(30):
            async with RawClient.connected(address) as client:
                await client.send(honest(1))
                assert served_by(await client.final_answer(), b"/honest/1") == (1, 1)
                await settled()
                start = len(client.received)
                await client.send(b"HEAD /api/page HTTP/1.1\r\nHost: t\r\n\r\n")
                # (split_answers would read it as a GET's, cut short: its head is read here.)
                head_ = await client.until(b"\r\n\r\n", start)
                assert head_.startswith(b"HTTP/1.1 200 OK\r\n"), head_
                assert b"\r\ncontent-length: %d\r\n" % len(POISON) in head_, head_
                assert head_.endswith(b"\r\n\r\n"), head_  # and no body
            await settled()
            async with RawClient.connected(address) as other:
                await other.send(honest(2))
                answer = await other.final_answer()
                assert answer.header(b"x-poison") is None, answer
                assert served_by(answer, b"/honest/2") == (2, 1)
        assert [[s.target for s in c.requests] for c in backend.connections] == [
            [b"/honest/1", b"/page"],
            [b"/honest/2"],
        ]


async def test_an_answer_with_both_framings_is_relayed_framed_once(tmp_path: Path) -> None:
    """RFC 9112 §6.3: an answer with both ``Transfer-Encoding`` and ``Content-Length`` is
    read by its chunks, and an intermediary removes the ``Content-Length`` before it passes
    the answer on."""
    both = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n" + HELLO
    async with proxied(tmp_path, {b"/both": both}) as setup:
        settled, address = setup.settled, setup.address
        with trio.fail_after(30):
            async with RawClient.connected(address) as client:
                await client.send(b"GET /api/both HTTP/1.1\r\nHost: t\r\n\r\n")
                answer = await client.final_answer()
                assert (answer.status, answer.body) == (200, b"hello"), answer
                assert answer.header(b"content-length") in (None, b"5"), answer
                await settled()
                await client.send(honest(1))
                served_by(await client.final_answer(), b"/honest/1")
