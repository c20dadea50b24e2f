"""HTTP/1.1 framing rules hypercorn leaves open, and the answers it writes by itself.

hypercorn 0.18 on h11 0.16 serves requests that RFC 9112 and RFC 9110 say to refuse:

- a request with both ``Content-Length`` and ``Transfer-Encoding`` is served and its
  connection kept, so the next request on it is served too. Two parsers that disagree on
  where such a body ends are how requests are smuggled past a proxy; RFC 9112 §6.1: treat
  it as an error and close the connection after answering;
- ``Transfer-Encoding`` on HTTP/1.0 (RFC 9112 §6.1: the framing is faulty; close);
- any ``HTTP/x.y`` is served as HTTP/1.1, ``HTTP/9.9`` included (RFC 9110 §15.6.6: 505);
- the method is upper-cased before the application sees it, so ``post`` runs a ``POST``
  route; methods are case-sensitive (RFC 9110 §9.1) and no route can declare ``post``:
  501, as for any method the server does not implement.

And its own answers (h11's protocol errors, an application that ended without answering,
a refused websocket handshake) have an empty body and, like every hypercorn answer, no
reason phrase in the status line.

This module decides, without I/O: :func:`refusal` for a request head, :func:`problem_for`
for the status hypercorn chose, :func:`encode` for the answer's head and body.
``_hypercorn_fix`` patches hypercorn to call them.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Final

from .._http._problems import PROBLEM_JSON, Problem, encode_problem
from ..dispatcher._job import new_correlation_id

__all__ = ["encode", "problem_for", "reason", "refusal"]

_VERSIONS: Final = frozenset({b"1.0", b"1.1"})

# (status, title, slug) of the answers hypercorn writes by itself, by status.
_BY_STATUS: Final[dict[int, tuple[str, str]]] = {
    400: ("Bad Request", "malformed-request"),
    403: ("Forbidden", "forbidden"),
    404: ("Not Found", "not-found"),
    431: ("Request Header Fields Too Large", "headers-too-large"),
    500: ("Internal Server Error", "server-error"),
    501: ("Not Implemented", "not-implemented"),
    505: ("HTTP Version Not Supported", "http-version-not-supported"),
}

_DETAILS: Final[dict[int, str]] = {
    400: "the request is not valid HTTP/1.1",
    403: "the server refused the websocket handshake",
    404: "no such host is served here",
    431: "the request's line and headers are too large",
    500: "the server failed; its log has the details under this correlation id",
    501: "the request uses a feature the server does not implement",
}


def refusal(
    method: bytes, http_version: bytes, headers: list[tuple[bytes, bytes]]
) -> Problem | None:
    """The problem a request head must be answered with before any application sees it
    (the connection is closed after it), or None. ``headers`` as h11 gives them: names
    lower-cased, values stripped."""
    if http_version not in _VERSIONS:
        return Problem(
            505,
            "HTTP Version Not Supported",
            f"HTTP/{http_version.decode('ascii', 'replace')} is not supported; "
            "send HTTP/1.1 (or HTTP/2)",
            slug="http-version-not-supported",
        )
    if method != method.upper():
        shown = method.decode("ascii", "replace")
        return Problem(
            501,
            "Not Implemented",
            f"method {shown!r} is not implemented; methods are case-sensitive: "
            f"did you mean {shown.upper()!r}?",
            slug="not-implemented",
        )
    length = chunked = False
    for name, _ in headers:
        if name == b"content-length":
            length = True
        elif name == b"transfer-encoding":
            chunked = True
    why = None
    if chunked and http_version == b"1.0":
        why = "Transfer-Encoding is not defined for HTTP/1.0; send Content-Length, or HTTP/1.1"
    elif chunked and length:
        why = (
            "the request has both Content-Length and Transfer-Encoding, so where its body "
            "ends is ambiguous; send one of them"
        )
    if why is None:
        return None
    return Problem(400, "Bad Request", why, slug="malformed-request")


def problem_for(status: int, error: BaseException | None = None) -> Problem:
    """The problem for an answer hypercorn chose itself; ``error``: h11's complaint about
    the request, if that is why (its words describe the client's bytes, so they are shown)."""
    title, slug = _BY_STATUS.get(status, (reason(status).decode() or "Error", "server-error"))
    detail = _DETAILS.get(status, "")
    if error is not None and str(error):
        detail = f"{detail}: {error}" if detail else str(error)
    return Problem(status, title, detail, slug=slug)


def encode(problem: Problem, *, close: bool) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The head and body of an answer carrying ``problem``; ``close``: the connection ends
    after it (HTTP/1 only: HTTP/2 forbids the ``Connection`` header)."""
    correlation_id = new_correlation_id()
    body = encode_problem(problem, correlation_id=correlation_id, instance="/")
    headers = [
        (b"content-type", PROBLEM_JSON.encode()),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
        (b"x-request-id", correlation_id.encode()),
    ]
    if close:
        headers.append((b"connection", b"close"))
    return headers, body


def reason(status: int) -> bytes:
    """The standard reason phrase of ``status`` (empty for a code without one)."""
    return _REASONS.get(status, b"")


_REASONS: Final = {int(s): s.phrase.encode("ascii") for s in HTTPStatus}
