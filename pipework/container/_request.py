"""The request being served, read once per request.

Quart's ``request`` and ``g`` are context-local proxies: every attribute read through one
looks the request up again. A hot path takes the objects once (:func:`current_request`,
:func:`current_g`). Request headers are read from the ASGI scope once, first value per
lowercase name (:func:`read_headers`): asking werkzeug's ``Headers`` for a header that
is absent raises and catches an exception inside it, and a request lacks most of the
optional headers the container looks for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, cast

from quart import Request, g, request

from .._http._cors import CorsPolicy

__all__ = ["Incoming", "current_g", "current_request", "incoming", "read_headers"]


class Incoming:
    """What the container reads off a request once (its ``g.pipework``): one slotted
    record, where attributes of ``g`` would each take a slot of its dict for as long as
    the request is parked."""

    __slots__ = (
        "baggage",
        "body_bytes",
        "cors",
        "header_bytes",
        "headers",
        "origin",
        "route",
        "started",
        "traceparent",
        "tracestate",
    )

    def __init__(self, started: float, headers: Mapping[str, str], header_bytes: int) -> None:
        self.started = started
        #: First value per lowercase name; emptied once the request has been read.
        self.headers: Mapping[str, str] = headers
        self.header_bytes = header_bytes
        self.traceparent: str | None = None
        self.tracestate: str | None = None
        self.baggage: str | None = None
        self.route = ""  # the route's name, once matched
        self.body_bytes: int | None = None  # the body's size once read (the access log)
        self.origin = headers.get("origin")  # read before the headers are let go
        #: The CORS policy of the matched route (its answer's Access-Control-* headers).
        self.cors: CorsPolicy | None = None


def incoming() -> Incoming | None:
    """This request's record (None before the container's first hook has run)."""
    found: Incoming | None = current_g().get("pipework")
    return found


def current_request() -> Request:
    """The request object itself, not the proxy (valid for this request only)."""
    return cast(Request, cast(Any, request)._get_current_object())


def current_g() -> Any:
    """This request's ``g`` namespace itself, not the proxy."""
    return cast(Any, g)._get_current_object()


def read_headers(raw: Iterable[tuple[bytes, bytes]]) -> tuple[dict[str, str], int]:
    """The first value of each header by lowercase name (decoded as Latin-1, as werkzeug
    does), and the headers' size in bytes (each ``name: value`` line with its CRLF)."""
    headers: dict[str, str] = {}
    size = 0
    for name, value in raw:
        size += len(name) + len(value) + 4
        key = name.decode("latin-1").lower()
        if key not in headers:
            headers[key] = value.decode("latin-1")
    return headers, size
