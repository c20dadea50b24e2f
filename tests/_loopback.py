"""A raw TCP server on 127.0.0.1 for the tests that play a backend byte by byte."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import trio

__all__ = ["serve_loopback"]


@asynccontextmanager
async def serve_loopback(
    handler: Callable[[trio.SocketStream], Awaitable[object]],
) -> AsyncIterator[int]:
    """Serve each connection to a free port of 127.0.0.1 with ``handler`` (in a task of
    its own) for the body of the ``async with``; the port is yielded."""
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1")
        )
        try:
            yield listeners[0].socket.getsockname()[1]
        finally:
            nursery.cancel_scope.cancel()
