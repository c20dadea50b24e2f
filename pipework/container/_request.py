"""The request being served, read once per request.

Quart's ``request`` and ``g`` are context-local proxies: every attribute read through one
looks the request up again. A hot path takes the objects once (:func:`current_request`,
:func:`current_g`). Request headers are read from the ASGI scope once, first value per
lowercase name (:func:`read_headers`): asking werkzeug's ``Headers`` for a header that
is absent raises and catches an exception inside it, and a request lacks most of the
optional headers the container looks for.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

from quart import Request, g, request

__all__ = ["current_g", "current_request", "read_headers"]


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
