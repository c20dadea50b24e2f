"""Fixes 4 and 5 of :mod:`._hypercorn_fix`, in hypercorn's HTTP/1.1 protocol (applied,
and their use of hypercorn's internals checked, there).

**4.** :mod:`._framing` says what RFC 9112 requires that hypercorn does not check, and a
request it refuses is answered with a problem and a closed connection before any
application sees it. hypercorn's own error answers (h11's protocol errors, an application
that ended without answering, a refused websocket handshake) get a problem+json body, and
every HTTP/1.1 status line its reason phrase.

**5.** Nothing is read after a request that closes its connection (RFC 9112 §9.6: a server
must not process further requests on it); h11 raised "Got data when expecting EOF" on such
bytes and hypercorn answered a 400 in the middle of the application's answer. Nor is
anything read after a protocol error while the answer is being sent: the answer ends first,
then the connection (hypercorn cut it short). Bytes that are not read are dropped as they
arrive, so they cost no memory; the reading goes on, so a client that leaves is still seen.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any, Final

import h11
from hypercorn.events import Closed, RawData
from hypercorn.protocol.events import Body, EndBody, Response, StreamClosed
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
from hypercorn.protocol.ws_stream import WSStream

from .._http._problems import Problem
from . import _framing

__all__ = [
    "h11_problem_answer",
    "http_stream_problem_answer",
    "reading_connection",
    "refuse_bad_framing",
    "with_reason",
    "ws_stream_problem_answer",
]

_AsyncMethod = Callable[..., Coroutine[Any, Any, None]]


class _ServerConnection(h11.Connection):
    """h11's server side, reading nothing after a request that closes its connection, nor
    after a protocol error while the answer is being sent (fix 5 above)."""

    def receive_data(self, data: bytes) -> None:
        if data and self.their_state in _NOT_READ:
            return  # dropped unread; an end of file still goes through
        super().receive_data(data)

    def next_event(self) -> Any:
        if self.their_state is h11.MUST_CLOSE:
            return h11.NEED_DATA  # what follows a closing request is never parsed
        if self.their_state is h11.ERROR and self.our_state is h11.SEND_BODY:
            return h11.NEED_DATA
        try:
            return super().next_event()
        except h11.RemoteProtocolError:
            if self.our_state is not h11.SEND_BODY:
                raise  # hypercorn answers with a problem and closes the connection
            # The answer is under way: it ends first, then closes the connection (the
            # peer's state is ERROR now, so hypercorn does not keep it alive).
            return h11.NEED_DATA


_NOT_READ: Final = frozenset({h11.MUST_CLOSE, h11.ERROR})


def reading_connection(init: Callable[..., None]) -> Callable[..., None]:
    def reading_connection(self: H11Protocol, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.connection = _ServerConnection(
            h11.SERVER, max_incomplete_event_size=self.config.h11_max_incomplete_size
        )

    return reading_connection


def refuse_bad_framing(create_stream: _AsyncMethod) -> _AsyncMethod:
    async def refuse_bad_framing(self: H11Protocol, request: h11.Request) -> None:
        problem = _framing.refusal(request.method, request.http_version, list(request.headers))
        if problem is None:
            await create_stream(self, request)
            return
        # No stream is made: the request's body is never read, so the connection ends.
        await _send_problem(self, problem)
        await self.send(Closed())

    return refuse_bad_framing


def h11_problem_answer(_original: _AsyncMethod) -> _AsyncMethod:
    async def h11_problem_answer(self: H11Protocol, status_code: int) -> None:
        # Called from hypercorn's ``except h11.RemoteProtocolError`` only: its words say
        # what was wrong with the client's bytes.
        error = sys.exception()
        shown = error if isinstance(error, h11.RemoteProtocolError) else None
        await _send_problem(self, _framing.problem_for(status_code, shown))

    return h11_problem_answer


async def _send_problem(protocol: H11Protocol, problem: Problem) -> None:
    """The whole answer framed at once, then sent: the application's task may try to answer
    while this one waits on the socket, and h11 turns our side to ERROR when it refuses
    that answer, so a body framed after such a wait would never be sent."""
    headers, body = _framing.encode(problem, close=True)
    headers += protocol.config.response_headers("h11")
    status = problem.status
    connection = protocol.connection
    try:
        data = connection.send(
            h11.Response(status_code=status, headers=headers, reason=_framing.reason(status))
        )
        data += connection.send(h11.Data(data=body))
        data += connection.send(h11.EndOfMessage())
    except h11.LocalProtocolError:
        return  # an answer is under way already: it is the one the client gets
    await protocol.send(RawData(data=data))


def with_reason(send_h11_event: _AsyncMethod) -> _AsyncMethod:
    """An answer's head with its reason phrase, and with hypercorn's own ``Date`` and
    ``Server`` only when the app set none: a relayed answer (a proxy route) keeps the
    service's, instead of carrying two of each."""

    async def with_reason(self: H11Protocol, event: Any) -> None:
        if isinstance(event, h11.Response | h11.InformationalResponse):
            headers = _own_headers_once(event.headers)
            if not event.reason or headers is not None:
                event = type(event)(
                    status_code=event.status_code,
                    headers=event.headers if headers is None else headers,
                    http_version=event.http_version,
                    reason=event.reason or _framing.reason(event.status_code),
                )
        await send_h11_event(self, event)

    return with_reason


#: Headers hypercorn adds to every answer after the app's (``Config.response_headers``).
_SERVER_ADDED: Final = frozenset({b"date", b"server"})


def _own_headers_once(headers: Any) -> list[tuple[bytes, bytes]] | None:
    """``headers`` without the later copies of ``Date`` and ``Server`` (hypercorn's), or
    None when there are none."""
    seen: set[bytes] = set()
    kept: list[tuple[bytes, bytes]] = []
    dropped = False
    for name, value in headers:
        if name in _SERVER_ADDED:
            if name in seen:
                dropped = True
                continue
            seen.add(name)
        kept.append((name, value))
    return kept if dropped else None


async def _send_stream_problem(stream: HTTPStream | WSStream, status_code: int) -> None:
    close = stream.scope.get("http_version") in ("1.0", "1.1")
    headers, body = _framing.encode(_framing.problem_for(status_code), close=close)
    stream_id = stream.stream_id
    try:
        await stream.send(Response(stream_id=stream_id, headers=headers, status_code=status_code))
    except h11.LocalProtocolError:
        # The app's own answer went out, but its task was cancelled while the head was
        # being written, before the stream noted it (hypercorn sets its state after the
        # write): that answer is the one under way. Only the stream's end is left to send.
        pass
    else:
        await stream.send(Body(stream_id=stream_id, data=body))
        await stream.send(EndBody(stream_id=stream_id))
    # The connection's end follows the answer's (hypercorn sends none after the answers it
    # writes while handling a request, and the connection stayed open); a second one, as
    # after an application that ended without answering, finds nothing left to do.
    await stream.send(StreamClosed(stream_id=stream_id))


async def _log_access(stream: HTTPStream | WSStream, status_code: int) -> None:
    took = time.time() - stream.start_time
    await stream.config.log.access(stream.scope, {"status": status_code, "headers": []}, took)


def http_stream_problem_answer(_original: _AsyncMethod) -> _AsyncMethod:
    async def http_stream_problem_answer(self: HTTPStream, status_code: int) -> None:
        await _send_stream_problem(self, status_code)
        self.state = ASGIHTTPState.CLOSED
        await _log_access(self, status_code)

    return http_stream_problem_answer


def ws_stream_problem_answer(_original: _AsyncMethod) -> _AsyncMethod:
    async def ws_stream_problem_answer(self: WSStream, status_code: int) -> None:
        await _send_stream_problem(self, status_code)
        await _log_access(self, status_code)

    return ws_stream_problem_answer
