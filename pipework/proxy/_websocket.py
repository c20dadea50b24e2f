"""The websocket relay: a client's websocket (an ASGI ``websocket`` scope) passed through to
a backend's, over a trio stream, with wsproto as the backend's client.

:func:`relay_websocket` first handshakes with the backend, offering it the client's
subprotocols, then answers the client's handshake the way the backend answered its own:

* **Accepted** (101): the client is accepted with the subprotocol the backend chose and the
  101's end-to-end headers; messages are relayed both ways until either side ends.
* **Refused**: with ASGI's ``websocket.http.response`` extension (hypercorn has it) the
  client gets the backend's status, headers and body (streamed); a handshake that failed
  (no connection, a broken or invalid answer) is a ``502 backend-failed`` problem, one that
  timed out a ``504 deadline-exceeded``. Without the extension the refusal is a
  ``websocket.close`` before accepting, which the server answers with 403: code 1013 for a
  timeout, 1011 otherwise.

What passes and what does not:

* **Whole messages, both ways.** ASGI carries whole messages only: the server assembles a
  client's fragments (hypercorn up to its ``websocket_max_message_size``, 16 MiB by
  default), and the relay assembles the backend's up to ``max_message`` (the same 16 MiB by
  default; past it both sides are closed with 1009). A message is relayed as soon as its
  last fragment arrives, as one frame.
* **Pings stay on their side.** The server answers the client's pings; the relay answers
  the backend's. Neither is passed on.
* **Close codes and reasons pass both ways**, mapped where RFC 6455 forbids sending them
  (1005, 1006): the rules are in :mod:`._websocket_core`. The client's code reaches the
  relay only from a server that reports it (hypercorn does with pipework's fix in
  ``container/_hypercorn_ws.py``; without it every client close looks like a hang-up).
* **No extensions with the backend.** The backend is not offered permessage-deflate: the
  relay would inflate and deflate every message again for a hop that is usually local.
  The client's side negotiates compression with the server as it likes.

Ending: either side's end ends the other at once (waits are cancelled; a message being
written is given ``close_timeout`` to finish, so no frame is cut in half when it can be
helped). The relay then closes both sides together, within ``close_timeout``: the close
frame for the backend, waiting for its answer and its end of the connection (RFC 6455 has
the server close TCP first, so the gateway keeps no TIME_WAIT per websocket), and the
``websocket.close`` for the client, waiting for its answer. ``idle_timeout`` ends a
websocket through which no message (nor backend ping) passed either way for that long:
both sides get 1001. The backend's connection is always closed on the way out, when
cancelled too (then without a close frame: a cancellation leaves no time to say goodbye).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

import trio
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Message,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.frame_protocol import CloseReason
from wsproto.utilities import RemoteProtocolError

from .._http._problems import PROBLEM_JSON, Problem, encode_problem
from ..backends._failures import CallTimeout, TransportFailure
from ..backends._stream import Handshake
from ._websocket_core import (
    INTERNAL_ERROR,
    TRY_AGAIN_LATER,
    BackendClosed,
    BackendFailed,
    ClientClosed,
    Closing,
    Ending,
    IdleTimeout,
    MessageTooBig,
    WebsocketOutcome,
    answer_headers,
    closing,
    handshake_headers,
    wire_host,
    wire_target,
)

__all__ = ["DEFAULT_MAX_MESSAGE", "WebsocketOutcome", "relay_websocket"]

_Receive: TypeAlias = Callable[[], Awaitable[MutableMapping[str, Any]]]
_Send: TypeAlias = Callable[[MutableMapping[str, Any]], Awaitable[None]]
_Headers: TypeAlias = list[tuple[bytes, bytes]]

#: hypercorn's default ``websocket_max_message_size``: the same bound both ways.
DEFAULT_MAX_MESSAGE: Final = 16 * 1024 * 1024
_READ: Final = 64 * 1024
_EXTENSION: Final = "websocket.http.response"


async def relay_websocket(
    scope: Mapping[str, Any],
    receive: _Receive,
    send: _Send,
    *,
    connect: Callable[[], Awaitable[trio.abc.Stream]],
    target: bytes,
    host: bytes | Callable[[], bytes],
    headers: _Headers,
    idle_timeout: float | None,
    handshake_timeout: float | None = None,
    close_timeout: float = 5.0,
    max_message: int = DEFAULT_MAX_MESSAGE,
    service: str | None = None,
    correlation_id: str = "",
    answer_filter: Callable[[_Headers], _Headers] | None = None,
    handshake_done: Callable[[Handshake], None] | None = None,
) -> WebsocketOutcome:
    """Relay the websocket of ``scope`` to a backend's, until either side ends it.

    Call it on a websocket scope before anything was sent on it (whether
    ``websocket.connect`` was received already or not). ``connect`` opens the backend's
    connection (it may raise ``OSError``, ``trio.TooSlowError`` or the lean client's
    :class:`~pipework.backends._failures.TransportFailure`\\ s); ``target`` and ``host`` go
    on the handshake's request line and ``Host``; ``headers`` are sent as they are (the
    caller's forwarding policy already applied), less those the handshake writes itself.
    ``handshake_timeout`` bounds connecting and the backend's answer to the handshake;
    ``idle_timeout`` (None: none) ends the websocket when no message passes either way for
    that long; ``close_timeout`` bounds the closing handshakes at the end. ``service`` and
    ``correlation_id`` go into refusal problems; ``answer_filter`` is applied to the
    backend's answer headers (its 101's, or its refusal's) after the relay's own filter.
    ``host`` may be a function, asked once connected (the host ``connect`` chose may name
    it). ``handshake_done`` hears how the backend's handshake ended,
    before the client is answered (:class:`~pipework.backends._stream.Handshake`); not when
    the client left first.

    Returns how it went; raises only what it cannot handle (a cancellation, a bug).
    """
    relay = _Relay(
        scope,
        receive,
        send,
        connect=connect,
        target=target,
        host=host,
        headers=headers,
        idle_timeout=idle_timeout,
        handshake_timeout=handshake_timeout,
        close_timeout=close_timeout,
        max_message=max_message,
        service=service,
        correlation_id=correlation_id,
        answer_filter=answer_filter,
        handshake_done=handshake_done,
    )
    try:
        return await relay.run()
    except* Exception as errors:
        # Every failure of either side ends the relay inside it; what escapes its tasks is
        # a bug (the relay's, the server's or a library's).
        alone = _alone(errors)
        raise alone from alone.__cause__


@dataclass(frozen=True, slots=True)
class _Accepted:
    subprotocol: str | None
    headers: _Headers


@dataclass(frozen=True, slots=True)
class _Refused:
    problem: Problem
    timed_out: bool = False
    #: Where the backend failed (``connect`` or ``handshake``); None: not the backend.
    phase: str | None = None


class _Relay:
    def __init__(
        self,
        scope: Mapping[str, Any],
        receive: _Receive,
        send: _Send,
        *,
        connect: Callable[[], Awaitable[trio.abc.Stream]],
        target: bytes,
        host: bytes | Callable[[], bytes],
        headers: _Headers,
        idle_timeout: float | None,
        handshake_timeout: float | None,
        close_timeout: float,
        max_message: int,
        service: str | None,
        correlation_id: str,
        answer_filter: Callable[[_Headers], _Headers] | None,
        handshake_done: Callable[[Handshake], None] | None = None,
    ) -> None:
        self.scope = scope
        self.receive = receive
        self.send = send
        self.connect = connect
        self.target = target
        self.host = host
        self.headers = headers
        self.idle_timeout = idle_timeout
        self.handshake_timeout = handshake_timeout
        self.close_timeout = close_timeout
        self.max_message = max_message
        self.service = service
        self.correlation_id = correlation_id
        self.answer_filter = answer_filter
        self.handshake_done = handshake_done
        self.where = f"service {service!r}" if service else "the backend"

        self.stream: trio.abc.Stream | None = None
        self.ws = WSConnection(ConnectionType.CLIENT)
        # The status the client's handshake was answered with, once it was.
        self.status: int | None = None
        # Set by the first end seen, from either side or the idle watch.
        self.ending: Ending | None = None
        self.waits: set[trio.CancelScope] = set()
        self.relaying: trio.CancelScope | None = None
        self.last_passed = 0.0
        # Serialises the two directions' writes to the backend (a pong between a message's
        # frames would be fine, but two send_all at once are not).
        self.backend_lock = trio.Lock()
        # Whether a write was cut mid-way on that side: its next frame would be garbage.
        self.backend_cut = False
        self.client_cut = False
        # The backend's connection is gone (end of file, reset): nothing more to say to it.
        self.backend_gone = False

    async def run(self) -> WebsocketOutcome:
        try:
            answer = await self._before_accepting()
            if isinstance(answer, WebsocketOutcome):
                return answer
            await self.send(
                {
                    "type": "websocket.accept",
                    "subprotocol": answer.subprotocol,
                    "headers": answer.headers,
                }
            )
            self.status = 101
            ending = await self._relay()
            plan = closing(ending)
            with trio.move_on_after(self.close_timeout):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._close_client, plan)
                    nursery.start_soon(self._close_backend, plan)
            return WebsocketOutcome(101, plan.code, plan.ended_by, plan.detail)
        finally:
            if self.stream is not None:
                await trio.aclose_forcefully(self.stream)

    # -- before the client is answered --------------------------------------------------------

    async def _before_accepting(self) -> _Accepted | WebsocketOutcome:
        """Handshake with the backend, while watching the client: one that leaves ends it.
        A refusal is relayed to the client here."""
        left: MutableMapping[str, Any] | None = None
        result: _Accepted | WebsocketOutcome | None = None
        async with trio.open_nursery() as nursery:

            async def watch_client() -> None:
                nonlocal left
                message = await self.receive()
                while message["type"] == "websocket.connect":
                    message = await self.receive()
                if message["type"] != "websocket.disconnect":
                    raise RuntimeError(
                        f"the server sent {message['type']!r} on a websocket not yet accepted"
                    )
                left = message
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch_client)
            answer = await self._handshake()
            self._report(answer)
            if isinstance(answer, _Accepted):
                result = answer
            elif isinstance(answer, _Refused):
                result = await self._refuse(answer)
            else:
                result = await self._relay_refusal(answer)
            nursery.cancel_scope.cancel()
        if isinstance(result, WebsocketOutcome):
            return result  # refused: the client may well have left since
        if left is not None:  # before the handshake was answered: the backend's is dropped
            return WebsocketOutcome(self.status, left.get("code", 1006), "client")
        assert result is not None
        return result

    def _report(self, answer: _Accepted | _Refused | RejectConnection) -> None:
        if self.handshake_done is None:
            return
        if isinstance(answer, _Accepted):
            self.handshake_done(Handshake(101))
        elif isinstance(answer, RejectConnection):
            self.handshake_done(Handshake(answer.status_code))
        else:
            self.handshake_done(Handshake(None, answer.phase, answer.timed_out))

    def _bad_host(self, host: bytes) -> _Refused:
        return _Refused(
            Problem(
                400,
                "Bad Request",
                f"the Host {host!r} cannot be sent on to {self.where}: "
                "send a host name of ASCII labels",
                slug="malformed-request",
            )
        )

    async def _handshake(self) -> _Accepted | _Refused | RejectConnection:
        if not callable(self.host) and wire_host(self.host) is None:
            return self._bad_host(self.host)
        timeout = math.inf if self.handshake_timeout is None else self.handshake_timeout
        phase = "connect"
        with trio.move_on_after(timeout):
            try:
                self.stream = await self.connect()
                host = self.host() if callable(self.host) else self.host
                wire = wire_host(host)
                if wire is None:
                    return self._bad_host(host)
                phase = "handshake"
                request = Request(
                    host=wire,
                    target=wire_target(self.target),
                    subprotocols=list(self.scope.get("subprotocols") or ()),
                    extra_headers=handshake_headers(self.headers),
                )
                await self.stream.send_all(self.ws.send(request))
                return await self._read_answer()
            except (CallTimeout, trio.TooSlowError) as exc:
                return self._timed_out(phase, exc)
            except (OSError, TransportFailure, trio.BrokenResourceError) as exc:
                what = "could not connect" if phase == "connect" else "failed the handshake"
                return self._failed(f"{self.where} {what} for a websocket: {exc}", phase)
            except RemoteProtocolError as exc:
                return self._failed(f"{self.where} answered the websocket handshake wrongly: {exc}")
        return self._timed_out(phase, None)

    async def _read_answer(self) -> _Accepted | _Refused | RejectConnection:
        assert self.stream is not None
        while True:
            for event in self.ws.events():
                if isinstance(event, AcceptConnection):
                    headers = answer_headers(event.extra_headers)
                    if self.answer_filter is not None:
                        headers = self.answer_filter(headers)
                    return _Accepted(event.subprotocol, headers)
                if isinstance(event, RejectConnection):
                    if event.status_code < 200:  # a 1xx other than 101: not an answer
                        return self._failed(
                            f"{self.where} answered the websocket handshake with "
                            f"{event.status_code}"
                        )
                    return event
            data = await self.stream.receive_some(_READ)
            if not data:
                return self._failed(
                    f"{self.where} closed the connection before answering the handshake"
                )
            self.ws.receive_data(bytes(data))

    def _failed(self, detail: str, phase: str = "handshake") -> _Refused:
        return _Refused(
            Problem(502, "Bad Gateway", detail, slug="backend-failed", service=self.service),
            phase=phase,
        )

    def _timed_out(self, phase: str, exc: BaseException | None) -> _Refused:
        if self.handshake_timeout is not None and exc is None:
            detail = (
                f"{self.where} did not answer the websocket handshake within "
                f"{self.handshake_timeout:g}s ({phase})"
            )
        else:  # the caller's connect ran out of its own time
            said = f": {exc}" if str(exc) else ""
            detail = f"{self.where} timed out in the websocket handshake ({phase}){said}"
        problem = Problem(
            504,
            "Gateway Timeout",
            detail,
            slug="deadline-exceeded",
            service=self.service,
            phase=phase,
        )
        return _Refused(problem, timed_out=True, phase=phase)

    def _extension(self) -> bool:
        extensions = self.scope.get("extensions") or {}
        return _EXTENSION in extensions

    async def _refuse(self, refused: _Refused) -> WebsocketOutcome:
        if not self._extension():
            return await self._refuse_by_closing(
                refused.problem.detail, timed_out=refused.timed_out
            )
        problem = refused.problem
        instance = self.scope.get("path", "")
        body = encode_problem(problem, correlation_id=self.correlation_id, instance=instance)
        headers = [
            (b"content-type", PROBLEM_JSON.encode()),
            (b"content-length", str(len(body)).encode()),
            (b"cache-control", b"no-store"),
        ]
        if self.correlation_id:
            headers.append((b"x-request-id", self.correlation_id.encode("latin-1")))
        await self._start_refusal(problem.status, headers)
        await self.send({"type": "websocket.http.response.body", "body": body})
        return WebsocketOutcome(problem.status, detail=problem.detail)

    async def _refuse_by_closing(self, detail: str, *, timed_out: bool) -> WebsocketOutcome:
        # Before accepting, a close is a refusal: ASGI servers answer it with 403.
        code = TRY_AGAIN_LATER if timed_out else INTERNAL_ERROR
        await self.send({"type": "websocket.close", "code": code})
        self.status = 403
        return WebsocketOutcome(403, detail=detail)

    async def _start_refusal(self, status: int, headers: _Headers) -> None:
        await self.send(
            {"type": "websocket.http.response.start", "status": status, "headers": headers}
        )
        self.status = status

    async def _relay_refusal(self, refusal: RejectConnection) -> WebsocketOutcome:
        """The backend's refusal, as it came: status, headers, its body as it arrives."""
        status = refusal.status_code
        detail = f"{self.where} refused the websocket handshake with {status}"
        if not self._extension():
            return await self._refuse_by_closing(detail, timed_out=False)
        headers = answer_headers(refusal.headers)
        if self.answer_filter is not None:
            headers = self.answer_filter(headers)
        await self._start_refusal(status, headers)
        if not refusal.has_body:
            await self.send({"type": "websocket.http.response.body", "body": b""})
            return WebsocketOutcome(status, detail=detail)
        assert self.stream is not None
        idle = math.inf if self.idle_timeout is None else self.idle_timeout
        while True:
            for event in self.ws.events():
                if isinstance(event, RejectData):
                    await self.send(
                        {
                            "type": "websocket.http.response.body",
                            "body": event.data,
                            "more_body": not event.body_finished,
                        }
                    )
                    if event.body_finished:
                        return WebsocketOutcome(status, detail=detail)
            # A body cut short (closed, broken, stalled, invalid) is not finished: the
            # server then closes the client's connection mid-answer, as HTTP says it.
            with trio.move_on_after(idle):
                try:
                    data = await self.stream.receive_some(_READ)
                    if data:
                        self.ws.receive_data(bytes(data))
                        continue
                except (trio.BrokenResourceError, RemoteProtocolError):
                    pass
            return WebsocketOutcome(status, detail=f"{detail}; its body was cut short")

    # -- relaying ----------------------------------------------------------------------------

    async def _relay(self) -> Ending:
        """Relay messages both ways until something ends the websocket; return what."""
        self.last_passed = trio.current_time()
        async with trio.open_nursery() as nursery:
            self.relaying = nursery.cancel_scope
            nursery.start_soon(self._client_to_backend)
            nursery.start_soon(self._backend_to_client)
            if self.idle_timeout is not None:
                nursery.start_soon(self._watch_idle, self.idle_timeout)
        assert self.ending is not None
        return self.ending

    def _end(self, ending: Ending) -> None:
        """The first end seen ends the relay: every wait stops now, a write in progress
        gets ``close_timeout`` to finish."""
        if self.ending is not None:
            return
        self.ending = ending
        for wait in self.waits:
            wait.cancel()
        assert self.relaying is not None
        self.relaying.deadline = trio.current_time() + self.close_timeout

    async def _wait(self, wait: Callable[[], Awaitable[Any]]) -> Any:
        """``wait()``'s result, or None if the relay ended first (then or meanwhile)."""
        if self.ending is not None:
            return None
        with trio.CancelScope() as scope:
            self.waits.add(scope)
            try:
                return await wait()
            finally:
                self.waits.discard(scope)
        return None

    def _passed(self) -> None:
        self.last_passed = trio.current_time()

    async def _watch_idle(self, seconds: float) -> None:
        while self.ending is None:
            due = self.last_passed + seconds
            if trio.current_time() >= due:
                self._end(IdleTimeout(seconds))
                return
            await self._wait(functools.partial(trio.sleep_until, due))

    async def _client_to_backend(self) -> None:
        while True:
            message = await self._wait(self.receive)
            if message is None:
                return
            kind = message["type"]
            if kind == "websocket.receive":
                self._passed()
                text = message.get("text")
                event: Message[Any] = (
                    TextMessage(text) if text is not None else BytesMessage(message["bytes"])
                )
                if not await self._to_backend(event):
                    return
                self._passed()
            elif kind == "websocket.disconnect":
                self._end(ClientClosed(message.get("code", 1005), message.get("reason") or ""))
                return

    async def _backend_to_client(self) -> None:
        assert self.stream is not None
        stream = self.stream
        parts: list[Any] = []
        size = 0
        while True:
            # Frames that came with the 101 are waiting in wsproto already.
            for event in self.ws.events():
                if isinstance(event, Message):
                    parts.append(event.data)
                    size += len(event.data)
                    if size > self.max_message:
                        self._end(MessageTooBig(self.max_message))
                        return
                    if event.message_finished:
                        if not await self._to_client(event, parts):
                            return
                        parts, size = [], 0
                        self._passed()
                elif isinstance(event, Ping):
                    self._passed()
                    if not await self._to_backend(event.response()):
                        return
                elif isinstance(event, CloseConnection):
                    if self.ws.state is ConnectionState.REMOTE_CLOSING:
                        self._end(BackendClosed(int(event.code), event.reason or ""))
                    else:  # lost (wsproto reports 1006), or wsproto refused a frame
                        self.backend_gone = event.code == CloseReason.ABNORMAL_CLOSURE
                        self._end(BackendFailed(int(event.code), event.reason or ""))
                    return
                else:  # a pong: the backend is there
                    self._passed()
            try:
                data = await self._wait(functools.partial(stream.receive_some, _READ))
            except trio.BrokenResourceError:
                data = b""
            if data is None:
                return
            self._passed()
            self.ws.receive_data(bytes(data) if data else None)  # None: the connection ended

    async def _to_backend(self, event: Event) -> bool:
        """Write ``event`` to the backend; False if its connection is broken (the relay
        ends). Nothing is written once the backend is closing."""
        assert self.stream is not None
        async with self.backend_lock:
            if self.ws.state is not ConnectionState.OPEN:
                return True
            data = self.ws.send(event)
            self.backend_cut = True
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.backend_gone = True
                self._end(BackendFailed(int(CloseReason.ABNORMAL_CLOSURE)))
                return False
            self.backend_cut = False
        return True

    async def _to_client(self, last: Message[Any], parts: list[Any]) -> bool:
        """Send the message ``parts`` make (``last`` its last fragment) to the client;
        False if the client is gone (the relay ends)."""
        message: dict[str, Any]
        if isinstance(last, TextMessage):
            message = {"type": "websocket.send", "text": "".join(parts)}
        else:
            message = {"type": "websocket.send", "bytes": b"".join(parts)}
        self.client_cut = True
        try:
            await self.send(message)
        except OSError:  # ASGI: a server's own IOError for a connection that has closed
            self._end(ClientClosed(1006))
            return False
        self.client_cut = False
        return True

    # -- closing -------------------------------------------------------------------------------

    async def _close_client(self, plan: Closing) -> None:
        if plan.client is None or self.client_cut:
            return  # it closed; or a cut message: the server ends the connection its way
        await self.send(
            {"type": "websocket.close", "code": plan.client.code, "reason": plan.client.reason}
        )
        # Wait for the client's answering close (messages it sent meanwhile are dropped):
        # a server closes the connection when the app returns, and one closed with the
        # client's close unread may reset it before the client has read ours.
        while (await self.receive())["type"] != "websocket.disconnect":
            pass

    async def _close_backend(self, plan: Closing) -> None:
        if plan.backend is None or self.backend_cut or self.backend_gone:
            return  # closed without a close frame, on the way out
        frame = plan.backend
        code: int = CloseReason.NO_STATUS_RCVD if frame.code is None else frame.code
        if not await self._to_backend_closing(CloseConnection(code, frame.reason or None)):
            return
        # Wait for the backend's close frame, then for it to close the connection.
        assert self.stream is not None
        while True:
            try:
                data = await self.stream.receive_some(_READ)
            except trio.BrokenResourceError:
                return
            if not data:
                return
            if self.ws.state is ConnectionState.LOCAL_CLOSING:
                self.ws.receive_data(bytes(data))
                for _ in self.ws.events():
                    pass  # a message the backend sent meanwhile, its close: none goes on

    async def _to_backend_closing(self, close: CloseConnection) -> bool:
        assert self.stream is not None
        state = self.ws.state
        if state not in (ConnectionState.OPEN, ConnectionState.REMOTE_CLOSING):
            return False
        try:
            await self.stream.send_all(self.ws.send(close))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        return True


def _alone(errors: BaseExceptionGroup[Exception]) -> BaseException:
    """One error surfaces as itself (a bug's own traceback, not trio's group around it);
    several stay a group."""
    leaves: list[BaseException] = []
    pending: list[BaseException] = [errors]
    while pending and len(leaves) < 2:
        error = pending.pop()
        if isinstance(error, BaseExceptionGroup):
            pending.extend(error.exceptions)
        else:
            leaves.append(error)
    if len(leaves) == 1 and not pending:
        return leaves[0]
    return errors
