"""Three fixes to hypercorn's websocket stream: the close frame for a protocol error, frames
that arrive before the handshake is answered, and the close code a client sent.

The bugs (hypercorn 0.18.0 with wsproto 1.3), all in ``hypercorn.protocol.ws_stream``:

1. **A protocol error ends with a bare TCP close.** A peer that breaks the websocket
   protocol (a text frame that is not UTF-8, an unmasked client frame, a reserved opcode, a
   fragmented control frame) must be answered with a Close frame carrying the status code
   (RFC 6455 §7.1.7 "Fail the WebSocket Connection"; §7.4.1: 1007 for invalid payload data,
   1002 for a protocol error) before the TCP connection closes. wsproto reports such a
   frame as a ``CloseConnection`` event with that code and leaves its connection ``OPEN``:
   sending the close frame is the server's part (a close the peer sent moves the connection
   to ``REMOTE_CLOSING`` instead). ``WSStream._handle_events`` answers a ``CloseConnection``
   only in ``REMOTE_CLOSING``, then ends the stream either way::

       elif isinstance(event, CloseConnection):
           if self.connection.state == ConnectionState.REMOTE_CLOSING:
               await self._send_wsproto_event(event.response())
           await self.send(StreamClosed(stream_id=self.stream_id))   <- OPEN: nothing sent

   so the client sees the connection drop (1006) and cannot tell its mistake from a
   network failure.

2. **A frame before the handshake's answer can take the whole server down.** A client
   that writes a frame right behind its handshake request (RFC 6455 §4.1 says it must wait
   for the answer; not every client does) has it handed to ``WSStream.handle`` while the
   app is still deciding. ``handle`` answers it with a 400 at once, from the connection's
   reading task, while the app's task answers the handshake (101, or a refusal)::

       reading task: handle(Data) ─ _send_error_response(400) ─ Response sent, awaits the socket
       app's task:   app_send(accept) ─ _accept ─ Response(101)  <- h11: LocalProtocolError
       reading task: ─ EndBody   <- h11 is in ERROR: LocalProtocolError, not caught

   The reading task's error leaves ``TCPServer.run``, which lets only ``OSError`` through
   quietly, and trio's ``serve_listeners`` ends the whole server with it (hypercorn issue
   #225, only partly fixed upstream). Which answer wins depends on the scheduler.

3. **The app never learns the client's close code.** ASGI's ``websocket.disconnect``
   carries "the WebSocket close code, as per the WebSocket spec" (1005 when the close frame
   had none), and a ``reason``. hypercorn answers the client's close frame, then reports
   the end from ``handle(StreamClosed)`` with a code of its own choosing::

       if self.state in {ASGIWebsocketState.HTTPCLOSED, ASGIWebsocketState.CLOSED}:
           code = CloseReason.NORMAL_CLOSURE.value
       else:
           code = CloseReason.ABNORMAL_CLOSURE.value      <- a client's 4001 "bye" too

   so an app that passes the close on (a proxy relaying it to its backend) cannot tell a
   client that said goodbye with a code from one whose connection dropped.

The fixes:

1. ``WSStream._handle_events`` is replaced by hypercorn's own code plus the missing branch:
   a ``CloseConnection`` that arrives while the connection is still ``OPEN`` is sent back
   as a close frame with wsproto's code and reason, then the stream ends as before.
2. ``WSStream.handle`` holds a frame that comes before the handshake is decided until the
   app has decided it (``WSStream.app_send`` says when): once accepted, the frame is read
   as if it had come after the 101; once refused, it is dropped with the connection. The
   reading task waits rather than buffering, so a client that keeps sending only fills its
   own socket buffers; an app that never answers the handshake holds that connection's
   reading (with HTTP/2, that connection's other streams too) as it would hold its own.
3. The replaced ``_handle_events`` keeps the code and reason of the close that ended the
   connection (the client's close frame, its answer to the app's, or the code wsproto
   refused a frame with), and ``handle(StreamClosed)`` reports them in
   ``websocket.disconnect`` (``code``, ``reason``) instead of hypercorn's guess. A
   connection that ends without a close frame is still reported as 1006.

``apply()`` checks the internals these rely on and raises ``RuntimeError`` if they changed,
patching nothing: ``_handle_events`` must be, to the character, the method the copy was
made from (its source's digest), wsproto must still report a refused frame as described
(it is fed one), and ``handle``, ``app_send`` and ``Handshake.accept`` must still use the
names the wrappers read.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import textwrap
from collections.abc import Callable, Coroutine
from typing import Any, Final

from hypercorn.protocol.events import Body, Data, StreamClosed
from hypercorn.protocol.ws_stream import (
    ASGIWebsocketState,
    FrameTooLargeError,
    Handshake,
    WSStream,
)
from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.events import CloseConnection, Message, Ping
from wsproto.frame_protocol import CloseReason

__all__ = ["TESTED_HYPERCORN_VERSION", "TESTED_WSPROTO_VERSION", "apply", "is_applied"]

#: The hypercorn release whose ``WSStream`` these fixes were written against (the
#: replaced ``_handle_events`` is its copy).
TESTED_HYPERCORN_VERSION: Final = "0.18.0"
_PIN: Final = "hypercorn>=0.18,<0.19"
#: The wsproto release whose way of reporting a refused frame the replacement relies on.
TESTED_WSPROTO_VERSION: Final = "1.3.2"

#: sha256 of the dedented source of ``WSStream._handle_events`` in hypercorn 0.18.0.
_HANDLE_EVENTS_SHA256: Final = "3a32ba6592e09f194fe018d61281dd6961e2558e590ad2628823cee05dc202e2"

_MARKER: Final = "_pipework_ws"
# Where a stream keeps the event that says its handshake is decided.
_DECIDED: Final = "_pipework_handshake_decided"
# Where a stream keeps the (code, reason) of the close that ended its connection.
_CLOSED_WITH: Final = "_pipework_closed_with"

# An unmasked text frame "hi", as a client may not send it (RFC 6455 §5.1).
_UNMASKED_CLIENT_FRAME: Final = b"\x81\x02hi"

_AsyncMethod = Callable[..., Coroutine[Any, Any, None]]


def _answering_refused_frames(original: _AsyncMethod) -> _AsyncMethod:
    @functools.wraps(original)  # for its name and ``__wrapped__``: it is not called
    async def _handle_events(self: Any) -> None:
        # hypercorn 0.18.0's WSStream._handle_events (``self`` is a WSStream, typed Any:
        # hypercorn's attributes are loosely typed), with one branch and one line added.
        for event in self.connection.events():
            if isinstance(event, Message):
                try:
                    self.buffer.extend(event)
                except FrameTooLargeError:
                    await self._send_wsproto_event(
                        CloseConnection(code=CloseReason.MESSAGE_TOO_BIG)
                    )
                    break

                if event.message_finished:
                    await self.app_put(self.buffer.to_message())
                    self.buffer.clear()
            elif isinstance(event, Ping):
                await self._send_wsproto_event(event.response())
            elif isinstance(event, CloseConnection):
                # For handle(StreamClosed), which tells the app (a 1005 is kept: the
                # client's close frame had no code).
                setattr(self, _CLOSED_WITH, (int(event.code), event.reason or ""))
                if self.connection.state == ConnectionState.REMOTE_CLOSING:
                    await self._send_wsproto_event(event.response())
                elif self.connection.state == ConnectionState.OPEN:
                    # Still OPEN: wsproto refused a frame (a close the peer sent would
                    # have moved it on); its code says why and the peer must get it.
                    await self._send_wsproto_event(
                        CloseConnection(code=event.code, reason=event.reason)
                    )
                await self.send(StreamClosed(stream_id=self.stream_id))

    return _handle_events


def _holding_early_frames_telling_ends(original: _AsyncMethod) -> _AsyncMethod:
    @functools.wraps(original)
    async def handle(self: Any, event: Any) -> None:
        if isinstance(event, Body | Data) and not self.closed and not self.handshake.accepted:
            await _decided(self).wait()
            if self.closed or not self.handshake.accepted:
                return  # refused, or the app failed: the connection ends with its answer
        elif isinstance(event, StreamClosed) and not self.closed and self.app_put is not None:
            closed_with = vars(self).get(_CLOSED_WITH)
            if closed_with is not None:
                # hypercorn's own branch for StreamClosed, with the close's code and reason
                # in place of its 1000-or-1006 guess.
                self.closed = True
                code, reason = closed_with
                await self.app_put({"type": "websocket.disconnect", "code": code, "reason": reason})
                return
        await original(self, event)

    return handle


def _telling_when_decided(original: _AsyncMethod) -> _AsyncMethod:
    @functools.wraps(original)
    async def app_send(self: Any, message: Any) -> None:
        try:
            await original(self, message)
        finally:
            # Accepted (the 101 is out), refused (an answer has begun or is sent), or
            # ended: a held frame may go on.
            if self.closed or self.handshake.accepted or self.state != ASGIWebsocketState.HANDSHAKE:
                await _decided(self).set()

    return app_send


def _decided(stream: Any) -> Any:
    """The stream's "handshake decided" event (the worker's own event class)."""
    event = vars(stream).get(_DECIDED)
    if event is None:
        event = stream.context.event_class()
        setattr(stream, _DECIDED, event)
    return event


# (method, how it is patched, its parameters, names its body must use)
_TARGETS: Final[
    tuple[tuple[str, Callable[[_AsyncMethod], _AsyncMethod], tuple[str, ...], frozenset[str]], ...]
] = (
    ("_handle_events", _answering_refused_frames, ("self",), frozenset()),
    (
        "handle",
        _holding_early_frames_telling_ends,
        ("self", "event"),
        frozenset({"accepted", "closed", "app_put", "_send_error_response"}),
    ),
    (
        "app_send",
        _telling_when_decided,
        ("self", "message"),
        frozenset({"closed", "state", "_accept"}),
    ),
)


def is_applied() -> bool:
    """Whether every ``WSStream`` method this module patches is the patched version."""
    return all(_is_patched(getattr(WSStream, name, None)) for name, _, _, _ in _TARGETS)


def apply() -> None:
    """Make hypercorn send the close frame for a websocket frame wsproto refused, read a
    frame that comes before the handshake's answer after it, and tell the app the code and
    reason of the close that ended a connection. Idempotent.

    Raises ``RuntimeError`` if hypercorn's ``WSStream`` or wsproto no longer look like the
    ones these fixes were written for; nothing is patched then.
    """
    originals = _check_internals()
    for (name, patch, _, _), original in zip(_TARGETS, originals, strict=True):
        if not _is_patched(original):
            patched = patch(original)
            setattr(patched, _MARKER, True)
            setattr(WSStream, name, patched)


def _is_patched(method: object) -> bool:
    return getattr(method, _MARKER, False) is True


def _check_internals() -> list[_AsyncMethod]:
    """Return the current target methods after checking what the fixes rely on."""
    methods: list[_AsyncMethod] = []
    for name, _, parameters, uses in _TARGETS:
        where = f"WSStream.{name}"
        method = getattr(WSStream, name, None)
        if method is None:
            raise _incompatible(f"{where} is missing")
        methods.append(method)
        if _is_patched(method):
            continue
        if not inspect.iscoroutinefunction(method):
            raise _incompatible(f"{where} is not an async method")
        signature = inspect.signature(method)
        if tuple(signature.parameters) != parameters:
            raise _incompatible(f"{where}{signature} does not take {parameters}")
        if not uses <= set(method.__code__.co_names):
            raise _incompatible(f"{where} no longer uses {', '.join(sorted(uses))}")
    if not _is_patched(WSStream._handle_events):
        try:
            source = textwrap.dedent(inspect.getsource(WSStream._handle_events))
        except (OSError, TypeError) as exc:
            raise _incompatible(
                f"the source of WSStream._handle_events cannot be read ({exc})"
            ) from None
        if hashlib.sha256(source.encode()).hexdigest() != _HANDLE_EVENTS_SHA256:
            raise _incompatible("WSStream._handle_events is not the method the fix copies")
    # The 101 goes out after ``accepted`` is set, so a held frame never meets a stream
    # that has sent its 101 but does not know it.
    if "accepted" not in Handshake.accept.__code__.co_names:
        raise _incompatible("Handshake.accept no longer sets accepted")
    if not hasattr(ASGIWebsocketState, "HANDSHAKE"):
        raise _incompatible("ASGIWebsocketState has no HANDSHAKE")
    _check_wsproto()
    return methods


def _check_wsproto() -> None:
    connection = Connection(ConnectionType.SERVER)
    connection.receive_data(_UNMASKED_CLIENT_FRAME)
    events = list(connection.events())
    if not (
        len(events) == 1
        and isinstance(events[0], CloseConnection)
        and events[0].code == CloseReason.PROTOCOL_ERROR
        and connection.state == ConnectionState.OPEN
    ):
        raise RuntimeError(
            "pipework cannot apply its websocket fixes: wsproto "
            f"{_installed_version('wsproto')} no longer reports an unmasked client frame "
            f"as a CloseConnection (1002) on an open connection (it gave {events!r} in "
            f"state {connection.state.name}). The fixes were written for wsproto "
            f"{TESTED_WSPROTO_VERSION}: install that (pip install "
            f"'wsproto=={TESTED_WSPROTO_VERSION}'), or re-check "
            "pipework/container/_hypercorn_ws.py against the installed one."
        )


def _installed_version(package: str = "hypercorn") -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:  # imported, yet not installed: vendored
        return "unknown"


def _incompatible(problem: str) -> RuntimeError:
    installed = _installed_version()
    if installed == TESTED_HYPERCORN_VERSION:
        todo = (
            "the installed hypercorn has the tested version but was changed: reinstall it "
            f"(pip install --force-reinstall 'hypercorn=={TESTED_HYPERCORN_VERSION}')"
        )
    else:
        todo = (
            f"install the series pipework declares (pip install '{_PIN}'), or, to move to "
            f"hypercorn {installed}, re-check the bugs described in "
            "pipework/container/_hypercorn_ws.py against it, update the copied method, "
            "its digest, TESTED_HYPERCORN_VERSION and the pin in pyproject.toml together"
        )
    return RuntimeError(
        f"pipework cannot apply its websocket fixes to hypercorn {installed}: {problem}. "
        f"The fixes were written for hypercorn {TESTED_HYPERCORN_VERSION}; {todo}."
    )
