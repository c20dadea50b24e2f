"""The two streams of a proxied HTTP request, at the ASGI boundary.

- :class:`Upload`: the request's body, pulled one ASGI message at a time by whoever sends it
  on. The server reads the client's socket no further ahead than its small queue of
  messages, so a slow backend slows the client's upload instead of filling memory.
- :func:`watch_disconnect`: once the body is read, the next ``receive`` returns only when
  the client goes away; that cancels the exchange (its backend connection is closed and its
  slot freed).
- :func:`send_problem`: an answer of the proxy's own (problem+json), before any byte of the
  backend's answer was sent.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any, Final

import trio

from .._http._problems import PROBLEM_JSON, Problem, encode_problem

__all__ = [
    "ASGIReceive",
    "ASGISend",
    "BodyTooLarge",
    "ClientGone",
    "Upload",
    "send_problem",
    "watch_disconnect",
]

ASGIReceive = Callable[[], Awaitable[MutableMapping[str, Any]]]
ASGISend = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_PROBLEM_TYPE: Final = PROBLEM_JSON.encode()


class ClientGone(Exception):
    """The client closed its connection before the exchange ended."""


class BodyTooLarge(Exception):
    """The request's body grew past the route's ``max_body``."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is larger than this route's max_body={limit} bytes")
        self.limit = limit


class Upload:
    """The request's body as an async iterator of chunks; ``done`` is set once its end was
    read. Raises :class:`ClientGone` if the client leaves mid-body and
    :class:`BodyTooLarge` past ``limit`` bytes (None: no limit)."""

    __slots__ = ("_ended", "_limit", "_receive", "done", "received")

    def __init__(self, receive: ASGIReceive, limit: int | None) -> None:
        self._receive = receive
        self._limit = limit
        self._ended = False
        self.received = 0
        self.done = trio.Event()

    def __aiter__(self) -> Upload:
        return self

    async def __anext__(self) -> bytes:
        while not self._ended:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                raise ClientGone("the client went away while sending the request body")
            if not message.get("more_body", False):
                self._ended = True
                self.done.set()
            chunk = message.get("body", b"")
            if chunk:
                self.received += len(chunk)
                if self._limit is not None and self.received > self._limit:
                    raise BodyTooLarge(self._limit)
                return bytes(chunk)
        raise StopAsyncIteration


async def watch_disconnect(
    receive: ASGIReceive, upload: Upload | None, gone: Callable[[], None]
) -> None:
    """Call ``gone`` when the client disconnects: after ``upload`` ended (or, for a request
    without a body, after its one empty message), the server's next message is that."""
    if upload is None:
        message = await receive()  # the empty body of a request that has none
        if message["type"] == "http.disconnect":
            gone()
            return
    else:
        await upload.done.wait()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            gone()
            return


async def send_problem(
    send: ASGISend,
    problem: Problem,
    *,
    correlation_id: str,
    instance: str,
) -> int:
    """Answer with ``problem``; returns its status."""
    body = encode_problem(problem, correlation_id=correlation_id, instance=instance)
    headers = [
        (b"content-type", _PROBLEM_TYPE),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
        (b"x-request-id", correlation_id.encode()),
    ]
    headers += _encoded(problem.headers)
    await send({"type": "http.response.start", "status": problem.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
    return problem.status


def _encoded(headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    return [
        (name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()
    ]
