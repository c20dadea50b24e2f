"""The Quart app the container serves: quart-trio's, with a leaner connection per request.

quart-trio serves each HTTP request in a nursery of two tasks it spawns: one reads the
request's messages (its body, then a hang-up), one runs the handler and sends the answer;
whichever ends first cancels the other. Here the handler runs in the task the server gave
the request (the nursery's own body) and only the reader is spawned: the same cancellation
both ways (the nursery's scope covers its body), one task fewer a request.

The handler then runs before the reader has taken anything, so the request's first
message, queued by the server with the request when its body came with its head (always,
for a request without one), is taken at once, before the handler runs: a handler reading
a small body finds it there, as it would have after the reader's turn, with no wait. That
needs the server's ``receive`` to be a trio memory channel's (hypercorn's is); with any
other, the reader takes every message.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable
from quart.wrappers import Request
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection

__all__ = ["App"]


class _Connection(TrioASGIHTTPConnection):
    async def __call__(self, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        request = self._create_request_from_scope(send)
        async with trio.open_nursery() as nursery:
            if _took_first(request, receive):
                nursery.cancel_scope.cancel()  # a hang-up: as the reader would, at once
            nursery.start_soon(self.handle_messages, nursery, request, receive)
            await self.handle_request(nursery, request, send)


def _took_first(request: Request, receive: Any) -> bool:
    """Take the request's first message if it is queued already, as quart's reader would;
    whether it was a hang-up."""
    # hypercorn's receive is its memory channel's bound method; any other server's is
    # read by the reader task alone.
    if not isinstance(receive, MethodType):
        return False
    channel = receive.__self__
    if not isinstance(channel, trio.MemoryReceiveChannel):
        return False
    try:
        message = channel.receive_nowait()
    except trio.WouldBlock:
        return False
    if message["type"] == "http.request":
        request.body.append(message.get("body", b""))
        if not message.get("more_body", False):
            request.body.set_complete()
        return False
    return bool(message["type"] == "http.disconnect")


class App(QuartTrio):
    asgi_http_class = _Connection
