"""A backend whose answers never end, for the tests of ``max_response_bytes``: on a real
socket it answers every request ``200`` with a chunked body that goes on until the client
hangs up (plain, or one endless gzip stream of zeros) — or, told to cut its answers short,
declares a long body and closes the connection part of the way through. Also
:func:`retained`, which says how much memory what a test kept holds."""

from __future__ import annotations

import gc
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field

import trio

from ._loopback import serve_loopback

# The bytes of one chunk (of zeros, once decoded, with gzip).
_PIECE = 64 * 1024


@dataclass
class EndlessBackend:
    gzip: bool = False
    #: Close each connection after this many bytes of a body declared four times as long.
    cut_after: int | None = None
    accepted: int = 0
    #: Connections the client ended (the backend's next send failed).
    hung_up: int = 0
    #: Connections done with: closed, and their task holding nothing more.
    ended: int = 0
    changed: trio.Event = field(default_factory=trio.Event)

    async def handle(self, stream: trio.SocketStream) -> None:
        self.accepted += 1
        hung_up = False
        async with stream:
            try:
                await self._answer(stream)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                hung_up = True
        # Counted as the task ends (no checkpoint from here on), so a test that waits for
        # it measures only what the client kept.
        self.hung_up += hung_up
        self.ended += 1
        self.changed.set()
        self.changed = trio.Event()

    async def _answer(self, stream: trio.SocketStream) -> None:
        request = b""
        while b"\r\n\r\n" not in request:
            data = await stream.receive_some()
            if not data:
                return
            request += data
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
        if self.cut_after is not None:
            await stream.send_all(head + b"Content-Length: %d\r\n\r\n" % (4 * self.cut_after))
            for _ in range(0, self.cut_after, _PIECE):
                await stream.send_all(b"x" * _PIECE)
            return  # closed short of the length it declared
        coding = b"Content-Encoding: gzip\r\n" if self.gzip else b""
        await stream.send_all(head + coding + b"Transfer-Encoding: chunked\r\n\r\n")
        compressor = zlib.compressobj(wbits=zlib.MAX_WBITS | 16)
        while True:
            piece = b"x" * _PIECE
            if self.gzip:
                piece = compressor.compress(b"\0" * _PIECE) or compressor.flush(zlib.Z_SYNC_FLUSH)
            await stream.send_all(b"%x\r\n%s\r\n" % (len(piece), piece))

    async def wait_ended(self, count: int) -> None:
        while self.ended < count:
            await self.changed.wait()


@asynccontextmanager
async def endless_backend(
    *, gzip: bool = False, cut_after: int | None = None
) -> AsyncIterator[tuple[EndlessBackend, int]]:
    """An :class:`EndlessBackend` on 127.0.0.1, and its port."""
    backend = EndlessBackend(gzip, cut_after)
    async with serve_loopback(backend.handle) as port:
        yield backend, port


@contextmanager
def retained() -> Iterator[Callable[[], int]]:
    """Trace allocations for the body of the ``with``; the function given says how many
    bytes allocated since it began are still alive, once the garbage collector has run."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]

    def alive() -> int:
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before

    try:
        yield alive
    finally:
        if started:
            tracemalloc.stop()
