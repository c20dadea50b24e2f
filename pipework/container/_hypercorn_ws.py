"""Make hypercorn fail a websocket with a close frame, not a bare TCP close.

The bug (hypercorn 0.18.0 with wsproto 1.3, in ``hypercorn.protocol.ws_stream``):

A peer that breaks the websocket protocol (a text frame that is not UTF-8, an unmasked
client frame, a reserved opcode, a fragmented control frame) must be answered with a Close
frame carrying the status code (RFC 6455 §7.1.7 "Fail the WebSocket Connection"; §7.4.1:
1007 for invalid payload data, 1002 for a protocol error) before the TCP connection closes.
wsproto reports such a frame as a ``CloseConnection`` event with that code and leaves its
connection ``OPEN``: sending the close frame is the server's part (a close the peer sent
moves the connection to ``REMOTE_CLOSING`` instead). ``WSStream._handle_events`` answers a
``CloseConnection`` only in ``REMOTE_CLOSING``, then ends the stream either way::

    elif isinstance(event, CloseConnection):
        if self.connection.state == ConnectionState.REMOTE_CLOSING:
            await self._send_wsproto_event(event.response())
        await self.send(StreamClosed(stream_id=self.stream_id))   <- OPEN: nothing sent

so the client sees the connection drop (1006) and cannot tell its mistake from a network
failure.

The fix replaces ``WSStream._handle_events`` with hypercorn's own code plus the missing
branch: a ``CloseConnection`` that arrives while the connection is still ``OPEN`` is sent
back as a close frame with wsproto's code and reason, then the stream ends as before.

Because the whole method is replaced, ``apply()`` refuses (``RuntimeError``, nothing
patched) unless hypercorn's method is, to the character, the one the copy was made from
(its source's digest), and unless wsproto still reports a refused frame as described (it
is fed one).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import textwrap
from collections.abc import Callable, Coroutine
from typing import Any, Final

from hypercorn.protocol.events import StreamClosed
from hypercorn.protocol.ws_stream import FrameTooLargeError, WSStream
from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.events import CloseConnection, Message, Ping
from wsproto.frame_protocol import CloseReason

__all__ = ["TESTED_HYPERCORN_VERSION", "TESTED_WSPROTO_VERSION", "apply", "is_applied"]

#: The hypercorn release whose ``WSStream._handle_events`` the replacement copies.
TESTED_HYPERCORN_VERSION: Final = "0.18.0"
_PIN: Final = "hypercorn>=0.18,<0.19"
#: The wsproto release whose way of reporting a refused frame the replacement relies on.
TESTED_WSPROTO_VERSION: Final = "1.3.2"

#: sha256 of the dedented source of ``WSStream._handle_events`` in hypercorn 0.18.0.
_HANDLE_EVENTS_SHA256: Final = "3a32ba6592e09f194fe018d61281dd6961e2558e590ad2628823cee05dc202e2"

_MARKER: Final = "_pipework_ws"

# An unmasked text frame "hi", as a client may not send it (RFC 6455 §5.1).
_UNMASKED_CLIENT_FRAME: Final = b"\x81\x02hi"

_AsyncMethod = Callable[..., Coroutine[Any, Any, None]]


def _answering_refused_frames(original: _AsyncMethod) -> _AsyncMethod:
    @functools.wraps(original)  # for its name and ``__wrapped__``: it is not called
    async def _handle_events(self: Any) -> None:
        # hypercorn 0.18.0's WSStream._handle_events (``self`` is a WSStream, typed Any:
        # hypercorn's attributes are loosely typed), with one branch added.
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


def is_applied() -> bool:
    """Whether ``WSStream._handle_events`` is this module's version."""
    return _is_patched(getattr(WSStream, "_handle_events", None))


def apply() -> None:
    """Make hypercorn send the close frame for a websocket frame wsproto refused.
    Idempotent.

    Raises ``RuntimeError`` if hypercorn's ``WSStream._handle_events`` is not the one the
    fix copies, or wsproto no longer reports a refused frame the way the fix expects;
    nothing is patched then.
    """
    original = getattr(WSStream, "_handle_events", None)
    if original is None:
        raise _incompatible("WSStream._handle_events is missing")
    if _is_patched(original):
        return
    _check_internals(original)
    patched = _answering_refused_frames(original)
    setattr(patched, _MARKER, True)
    WSStream._handle_events = patched  # type: ignore[method-assign]


def _is_patched(method: object) -> bool:
    return getattr(method, _MARKER, False) is True


def _check_internals(original: _AsyncMethod) -> None:
    """Check what the fix relies on: hypercorn's method is the one copied (its digest
    covers its signature too), and wsproto reports a refused frame as described."""
    try:
        source = textwrap.dedent(inspect.getsource(original))
    except (OSError, TypeError) as exc:
        raise _incompatible(
            f"the source of WSStream._handle_events cannot be read ({exc})"
        ) from None
    if hashlib.sha256(source.encode()).hexdigest() != _HANDLE_EVENTS_SHA256:
        raise _incompatible("WSStream._handle_events is not the method the fix copies")
    _check_wsproto()


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
            "pipework cannot apply its websocket close fix: wsproto "
            f"{_installed_version('wsproto')} no longer reports an unmasked client frame "
            f"as a CloseConnection (1002) on an open connection (it gave {events!r} in "
            f"state {connection.state.name}). The fix was written for wsproto "
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
            f"hypercorn {installed}, re-check the bug described in "
            "pipework/container/_hypercorn_ws.py against it, update the copied method, "
            "its digest, TESTED_HYPERCORN_VERSION and the pin in pyproject.toml together"
        )
    return RuntimeError(
        f"pipework cannot apply its websocket close fix to hypercorn {installed}: {problem}. "
        f"The fix was written for hypercorn {TESTED_HYPERCORN_VERSION}; {todo}."
    )
