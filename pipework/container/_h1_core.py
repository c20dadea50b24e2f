"""The decisions of pipework's HTTP/1.1 server (:mod:`._h1_server`), without I/O.

What a request head asks for (:func:`handoff`: a connection hypercorn must serve), the ASGI
``http`` scope built from it as hypercorn builds it (:func:`http_scope`), and the head of
an answer (:func:`response_head`): the app's headers stripped as hypercorn strips them,
``Date`` and ``Server`` added only when the app set none, ``Connection: close`` when the
connection ends after it. The framing refusals and problem answers are :mod:`._framing`'s,
shared with the hypercorn path.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Iterable, Mapping
from enum import Enum
from typing import Any, Final
from urllib.parse import unquote

import h11

from . import _framing

__all__ = [
    "SERVER_NAME",
    "Handoff",
    "handoff",
    "http_scope",
    "informational",
    "response_head",
    "suppress_body",
]

#: The ``Server`` header's value on answers whose app set none.
SERVER_NAME: Final = b"pipework"


class Handoff(Enum):
    """Why a connection goes to hypercorn: what this server does not speak itself."""

    WEBSOCKET = "websocket"
    H2C = "h2c"
    PRIOR_KNOWLEDGE = "h2 prior knowledge"


def handoff(request: h11.Request) -> Handoff | None:
    """Whether ``request`` starts something only hypercorn serves here: a websocket
    handshake, an ``Upgrade: h2c``, or HTTP/2's connection preface read as a request
    (``PRI * HTTP/2.0``). hypercorn then answers it exactly as it does without this server
    (its refusals included), so any ``Upgrade`` naming one of them is enough."""
    if request.method == b"PRI" and request.target == b"*" and request.http_version == b"2.0":
        return Handoff.PRIOR_KNOWLEDGE
    for name, value in request.headers:
        if name == b"upgrade":
            asked = value.strip().lower()
            if asked == b"websocket":
                return Handoff.WEBSOCKET
            if asked == b"h2c":
                return Handoff.H2C
    return None


def http_scope(
    request: h11.Request,
    *,
    scheme: str,
    client: tuple[str, int] | None,
    server: tuple[str, int] | None,
    root_path: str,
    state: Mapping[str, Any],
    raw_headers: bool = False,
) -> dict[str, Any]:
    """The ASGI ``http`` scope of ``request``, key for key what hypercorn 0.18 builds for
    HTTP/1 (``HTTPStream.handle``): the path percent-decoded from ASCII, header names
    lower-cased (``raw_headers``: as sent, hypercorn's ``h11_pass_raw_headers``), a copy of
    the lifespan ``state`` per request, no extension (HTTP/1 has none of hypercorn's)."""
    path, _, query_string = request.target.partition(b"?")
    headers = request.headers.raw_items() if raw_headers else list(request.headers)
    return {
        "type": "http",
        "http_version": request.http_version.decode(),
        "asgi": {"spec_version": "2.1", "version": "3.0"},
        "method": request.method.decode("ascii"),
        "scheme": scheme,
        "path": unquote(path.decode("ascii")),
        "raw_path": path,
        "query_string": query_string,
        "root_path": root_path,
        "headers": headers,
        "client": client,
        "server": server,
        "state": dict(state),
        "extensions": {},
    }


def server_name_allowed(server_names: Iterable[str], request: h11.Request) -> bool:
    """hypercorn's ``server_names``: when some are configured, a request's ``Host`` must be
    one of them (404 otherwise)."""
    names = list(server_names)
    if not names:
        return True
    host = next((value for name, value in request.headers if name == b"host"), b"")
    return host.decode("latin-1") in names


def has_length(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether an app's answer headers declare its body's length."""
    return any(bytes(name).lower() == b"content-length" for name, _ in headers)


def suppress_body(method: str, status: int) -> bool:
    """Whether an answer carries no body whatever the app sends (RFC 9110 §6.4.1)."""
    return method == "HEAD" or 100 <= status < 200 or status in (204, 304)


def _strip(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The app's headers as bytes, stripped, pseudo-headers refused (hypercorn's
    ``build_and_validate_headers``)."""
    out: list[tuple[bytes, bytes]] = []
    for name, value in headers:
        if name[:1] == b":":
            raise ValueError("Pseudo headers are not valid")
        out.append((bytes(name).strip(), bytes(value).strip()))
    return out


class _Date:
    """The ``Date`` header's value, formatted once a second."""

    second = -1
    value = b""

    @classmethod
    def now(cls) -> bytes:
        second = int(time.time())
        if second != cls.second:
            cls.value = email.utils.formatdate(second, usegmt=True).encode("ascii")
            cls.second = second
        return cls.value


def response_head(
    status: int,
    headers: Iterable[tuple[bytes, bytes]],
    *,
    close: bool,
    date: bool = True,
    server: bool = True,
) -> h11.Response | h11.InformationalResponse:
    """The head of an answer: the app's ``headers`` (stripped), its own ``Date`` and
    ``Server`` kept or the server's added (``date``, ``server``: whether to add them,
    hypercorn's ``include_date_header`` and ``include_server_header``), the reason phrase,
    and ``Connection: close`` when ``close`` (the connection ends after this answer)."""
    out = _strip(headers)
    has_date = has_server = False
    for name, _ in out:
        lower = name.lower()
        if lower == b"date":
            has_date = True
        elif lower == b"server":
            has_server = True
    if date and not has_date:
        out.append((b"date", _Date.now()))
    if server and not has_server:
        out.append((b"server", SERVER_NAME))
    if status < 200:
        return h11.InformationalResponse(
            status_code=status, headers=out, reason=_framing.reason(status)
        )
    if close:
        out.append((b"connection", b"close"))
    return h11.Response(status_code=status, headers=out, reason=_framing.reason(status))


def server_headers(date: bool = True, server: bool = True) -> list[tuple[bytes, bytes]]:
    """The server's own ``Date`` and ``Server`` (for the answers it writes itself)."""
    headers = []
    if date:
        headers.append((b"date", _Date.now()))
    if server:
        headers.append((b"server", SERVER_NAME))
    return headers


def informational(status: int) -> h11.InformationalResponse:
    """A bare 1xx answer (``100 Continue``) with the server's ``Date`` and ``Server``."""
    headers = server_headers()
    return h11.InformationalResponse(
        status_code=status, headers=headers, reason=_framing.reason(status)
    )
