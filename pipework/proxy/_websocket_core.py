"""The websocket relay's decisions, with no I/O: how each side is closed when the relay ends,
which headers go on in the handshake and come back from it, and how a target and a host are
written on the backend's request line. The trio driver is :mod:`._websocket`.

The close rules (RFC 6455 §7.4: 1005 and 1006 are never sent, they only report a close
frame without a code and a connection lost without one), each tested in
``tests/test_proxy_websocket.py``:

* **The client closes** with a code: the backend gets a close frame with the same code and
  reason; without a code (1005): a close frame without one; the client hung up (1006, or
  1015 for a failed TLS handshake): the backend's connection is closed without a close
  frame, so the backend too sees its peer vanish.
* **The backend closes** with a code: the client gets it, with its reason; without a code
  (1005): 1000, since an ASGI server always writes a code. The backend's close is echoed
  back to it (its code, or none), as RFC 6455 §5.5.1 asks.
* **The backend fails**: its connection ends without a close frame (1006), or it breaks the
  protocol (wsproto refuses its frame with 1002, 1007...): the client gets 1011 with a
  short reason; a protocol error is answered to the backend with wsproto's code.
* **Idle**: nothing passed either way for the idle timeout: both get 1001 "idle timeout".
* **Too big**: a backend message over the relay's limit: both get 1009.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

__all__ = [
    "BackendClosed",
    "BackendFailed",
    "ClientClosed",
    "CloseFrame",
    "Closing",
    "Ending",
    "IdleTimeout",
    "MessageTooBig",
    "WebsocketOutcome",
    "answer_headers",
    "closing",
    "handshake_headers",
    "wire_host",
    "wire_target",
]

NORMAL: Final = 1000
GOING_AWAY: Final = 1001
NO_CODE: Final = 1005
LOST: Final = 1006
TOO_BIG: Final = 1009
INTERNAL_ERROR: Final = 1011
TRY_AGAIN_LATER: Final = 1013
TLS_FAILED: Final = 1015

EndedBy: TypeAlias = Literal["client", "backend", "idle"]


@dataclass(frozen=True, slots=True)
class WebsocketOutcome:
    """How a relayed websocket went, for the access log and the metrics.

    ``status``: the handshake's answer to the client: 101 when accepted, else the refusal's
    status (the backend's own, 502 or 504 for a failed handshake, or 403 where the server
    lacks ASGI's ``websocket.http.response`` extension and answers every refusal so); None
    when the client left before an answer. ``close_code``: the code the client's side ended
    with (the client's own when it closed, 1006 when it hung up); None when refused.
    ``ended_by``: which end, or the idle timeout, ended an accepted websocket. ``detail``:
    why it was refused or failed, for the log ("" when it ended as its ends wished)."""

    status: int | None
    close_code: int | None = None
    ended_by: EndedBy | None = None
    detail: str = ""


# -- how the relay ended, and what each side is told ---------------------------------------


@dataclass(frozen=True, slots=True)
class ClientClosed:
    """The client ended: ``websocket.disconnect``'s code (1005: its close frame had no
    code; 1006: it hung up) and reason."""

    code: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class BackendClosed:
    """The backend sent a close frame: its code (1005: none) and reason."""

    code: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class BackendFailed:
    """The backend's connection ended without a close frame (``code`` 1006), or wsproto
    refused one of its frames (``code`` and ``reason`` are wsproto's: 1002, 1007...)."""

    code: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class IdleTimeout:
    """No message passed either way for ``seconds``."""

    seconds: float


@dataclass(frozen=True, slots=True)
class MessageTooBig:
    """A backend message grew past ``limit`` (characters of text, or bytes)."""

    limit: int


Ending: TypeAlias = ClientClosed | BackendClosed | BackendFailed | IdleTimeout | MessageTooBig


@dataclass(frozen=True, slots=True)
class CloseFrame:
    """A close to send: ``code`` None is a close frame without a code."""

    code: int | None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Closing:
    """What the relay sends as it ends. ``client``: the ``websocket.close`` for the client
    (None: it has closed). ``backend``: the close frame for the backend (None: its
    connection is closed without one). ``code``: the code the client's side ends with;
    ``detail``: what went wrong, if something did."""

    client: CloseFrame | None
    backend: CloseFrame | None
    code: int
    ended_by: EndedBy
    detail: str = ""


def closing(ending: Ending) -> Closing:
    """How each side is closed after ``ending`` (the rules in the module's docstring)."""
    if isinstance(ending, ClientClosed):
        code = ending.code
        if code in (LOST, TLS_FAILED):
            backend = None  # it vanished: so does the backend's peer
        elif code == NO_CODE:
            backend = CloseFrame(None)
        else:
            backend = CloseFrame(code, ending.reason)
        return Closing(None, backend, code, "client")
    if isinstance(ending, BackendClosed):
        code = NORMAL if ending.code == NO_CODE else ending.code
        echo = CloseFrame(None if ending.code == NO_CODE else ending.code)
        return Closing(CloseFrame(code, ending.reason), echo, code, "backend")
    if isinstance(ending, BackendFailed):
        if ending.code == LOST:
            return Closing(
                CloseFrame(INTERNAL_ERROR, "backend connection lost"),
                None,
                INTERNAL_ERROR,
                "backend",
                "the backend's connection ended without a close frame",
            )
        return Closing(
            CloseFrame(INTERNAL_ERROR, "backend broke the websocket protocol"),
            CloseFrame(ending.code, ending.reason),
            INTERNAL_ERROR,
            "backend",
            f"the backend broke the websocket protocol ({ending.code}: {ending.reason})",
        )
    if isinstance(ending, IdleTimeout):
        frame = CloseFrame(GOING_AWAY, "idle timeout")
        detail = f"no message passed either way for {ending.seconds:g}s"
        return Closing(frame, frame, GOING_AWAY, "idle", detail)
    frame = CloseFrame(TOO_BIG, "message too big")
    detail = f"a backend message grew past the relay's limit of {ending.limit} bytes"
    return Closing(frame, frame, TOO_BIG, "backend", detail)


# -- headers ---------------------------------------------------------------------------------

# Written by wsproto from the handshake itself (a second copy would make the request
# ambiguous), or framing the relay never forwards.
_HANDSHAKE_OWN: Final = frozenset(
    {
        b"host",
        b"upgrade",
        b"connection",
        b"sec-websocket-key",
        b"sec-websocket-version",
        b"sec-websocket-protocol",
        b"sec-websocket-extensions",
        b"sec-websocket-accept",
        b"content-length",
        b"transfer-encoding",
    }
)

# Hop-by-hop (RFC 9110 §7.6.1), the websocket handshake's own, framing, and the two the
# server adds to every answer itself (a second Date or Server would be wrong).
_ANSWER_DROPPED: Final = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"content-length",
        b"sec-websocket-accept",
        b"sec-websocket-protocol",
        b"sec-websocket-extensions",
        b"sec-websocket-version",
        b"date",
        b"server",
    }
)


def handshake_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """``headers`` for the backend's handshake request, less those wsproto writes itself
    (Host, Upgrade, Connection, the ``Sec-WebSocket-*`` ones) and framing. Names are
    lower-cased."""
    kept = []
    for name, value in headers:
        lowered = name.lower()
        if lowered not in _HANDSHAKE_OWN:
            kept.append((lowered, value))
    return kept


def answer_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """A backend answer's headers (its 101's, or its refusal's) as the client gets them:
    hop-by-hop ones and those ``Connection`` names removed, with framing, the handshake's
    own and ``Date`` and ``Server`` (the server writes its own). Names are lower-cased."""
    pairs = [(name.lower(), value) for name, value in headers]
    dropped = _ANSWER_DROPPED.union(
        token.strip().lower()
        for name, value in pairs
        if name == b"connection"
        for token in value.split(b",")
    )
    return [(name, value) for name, value in pairs if name not in dropped]


# -- the request line ------------------------------------------------------------------------

_VISIBLE: Final = frozenset(range(0x21, 0x7F))


def wire_target(target: bytes) -> str:
    """``target`` as wsproto writes it (ASCII): any byte that is not visible ASCII is
    percent-encoded (as a browser would), every other byte kept as the client sent it."""
    if all(byte in _VISIBLE for byte in target):
        return target.decode("ascii")
    return "".join(chr(byte) if byte in _VISIBLE else f"%{byte:02X}" for byte in target)


def wire_host(host: bytes) -> str | None:
    """``host`` as wsproto takes it (it writes ``host.encode("idna")``), or None if it would
    not write these bytes unchanged (not ASCII, an empty or overlong label)."""
    try:
        text = host.decode("ascii")
        written = text.encode("idna")
    except UnicodeError:
        return None
    return text if written == host else None
