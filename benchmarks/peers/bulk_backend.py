"""A backend on raw trio sockets for streamed bodies: the proxy comparison's bulk service.

``python -m benchmarks.peers.bulk_backend`` serves on a free port of 127.0.0.1 and prints its
base URL once it listens:

- ``GET .../down/N``: an answer of N bytes (zeros) with ``Content-Length``, sent in 64 KiB
  pieces as fast as the caller reads them;
- ``PUT`` or ``POST`` anything: the body read and counted, never kept (``Content-Length``
  or chunked), answered ``{"received": N}``;
- any other ``GET``: ``{"service": "bulk", "ok": true}``.

Connections are kept alive. The backend holds one 64 KiB piece each way, whatever the
bodies' sizes, so the memory a benchmark sees growing is the gateway's.
"""

from __future__ import annotations

import json
import sys

import trio

from .._serve import raise_open_files_limit

PIECE = 64 * 1024
_ZEROS = memoryview(bytes(PIECE))


class _Reader:
    """The bytes of one connection, read as the parser asks for them."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = bytearray()

    async def fill(self) -> bool:
        chunk = await self.stream.receive_some(PIECE)
        self.buffer += chunk
        return bool(chunk)

    async def line(self) -> bytes | None:
        while (end := self.buffer.find(b"\r\n")) < 0:
            if not await self.fill():
                return None
        line = bytes(self.buffer[:end])
        del self.buffer[: end + 2]
        return line

    async def head(self) -> tuple[str, str, dict[str, str]] | None:
        while (end := self.buffer.find(b"\r\n\r\n")) < 0:
            if not await self.fill():
                return None
        lines = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
        del self.buffer[: end + 4]
        method, target = lines[0].split(" ")[:2]
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        return method, target, headers

    async def skip(self, count: int) -> int:
        """Read past ``count`` bytes without keeping them; how many there were."""
        left = count
        while left:
            if self.buffer:
                taken = min(left, len(self.buffer))
                del self.buffer[:taken]
            else:  # straight from the socket, never more than the body: nothing copied
                taken = len(await self.stream.receive_some(min(left, PIECE)))
                if not taken:
                    break
            left -= taken
        return count - left

    async def chunked(self) -> int | None:
        """Read past a chunked body (trailers too); its size, None if cut short."""
        size = 0
        while True:
            line = await self.line()
            if line is None:
                return None
            length = int(line.split(b";", 1)[0], 16)
            if length == 0:
                while (trailer := await self.line()) is not None and trailer:
                    pass
                return size
            if await self.skip(length) < length or await self.line() != b"":
                return None
            size += length


def _answer(body: bytes, status: bytes = b"200 OK") -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    ) + body


async def _download(stream: trio.SocketStream, size: int) -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
    await stream.send_all(head + b"content-length: %d\r\n\r\n" % size)
    left = size
    while left:
        piece = min(left, PIECE)
        await stream.send_all(_ZEROS[:piece])
        left -= piece


async def handle(stream: trio.SocketStream) -> None:
    reader = _Reader(stream)
    ok = _answer(json.dumps({"service": "bulk", "ok": True}).encode())
    try:
        while (head := await reader.head()) is not None:
            method, target, headers = head
            if method in ("PUT", "POST"):
                if "content-length" in headers:
                    length = int(headers["content-length"])
                    received: int | None = await reader.skip(length)
                    if received != length:
                        return
                elif "chunked" in headers.get("transfer-encoding", "").lower():
                    received = await reader.chunked()
                    if received is None:
                        return
                else:
                    received = 0
                await stream.send_all(_answer(json.dumps({"received": received}).encode()))
            elif method == "GET" and "/down/" in target:
                await _download(stream, int(target.rsplit("/", 1)[1]))
            else:
                await stream.send_all(ok)
            if headers.get("connection", "").lower() == "close":
                return
    except (trio.BrokenResourceError, trio.ClosedResourceError, ValueError):
        return


async def serve() -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1", backlog=4096)
    host, port = listeners[0].socket.getsockname()[:2]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, handle, listeners)
        print(f"http://{host}:{port}", flush=True)


def main() -> int:
    raise_open_files_limit()
    trio.run(serve)
    return 0


if __name__ == "__main__":
    sys.exit(main())
