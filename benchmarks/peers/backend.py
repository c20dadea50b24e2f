"""A tiny backend on raw trio sockets, no framework: the peers' services A and B.

``python -m benchmarks.peers.backend NAME`` serves on a free port of 127.0.0.1 and prints
its base URL once it listens. Every ``GET`` is answered ``{"service": NAME, "ok": true}``
according to the mode in force, which ``POST /_mode`` sets (its body is the mode):

- ``fast``: at once (the start);
- ``hang``: never, until the caller closes the connection or the mode changes (a change
  answers every hanging request at once, so the next scenario starts clean);
- ``slow S``: after S seconds.

``GET /_stats`` answers how many requests are hanging or sleeping now.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Awaitable, Callable

import trio

from .._serve import raise_open_files_limit


class _Mode:
    def __init__(self) -> None:
        self.kind = "fast"
        self.delay = 0.0
        self.changed = trio.Event()
        self.waiting = 0

    def set(self, text: str) -> None:
        kind, _, delay = text.strip().partition(" ")
        if kind not in ("fast", "hang", "slow"):
            raise ValueError(f"unknown mode {text!r}")
        self.kind, self.delay = kind, float(delay or 0)
        changed, self.changed = self.changed, trio.Event()
        changed.set()


def _response(status: int, body: bytes) -> bytes:
    reason = {200: "OK", 400: "Bad Request"}[status]
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


def handler(name: str, mode: _Mode) -> Callable[[trio.SocketStream], Awaitable[None]]:
    answer = _response(200, json.dumps({"service": name, "ok": True}).encode())

    async def wait_out(stream: trio.SocketStream, buffer: bytearray) -> bool:
        """Hold this request as the mode says; False if the caller went away."""
        mode.waiting += 1
        gone = False
        try:
            changed = mode.changed
            with trio.move_on_after(mode.delay if mode.kind == "slow" else math.inf):
                async with trio.open_nursery() as nursery:

                    async def until_changed() -> None:
                        await changed.wait()
                        nursery.cancel_scope.cancel()

                    async def until_closed() -> None:
                        # Reading tells when the caller closes; a pipelined request is kept.
                        nonlocal gone
                        try:
                            chunk = await stream.receive_some(65536)
                        except trio.BrokenResourceError:  # reset: gone too (HAProxy's way)
                            chunk = b""
                        if chunk:
                            buffer.extend(chunk)
                            return
                        gone = True
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(until_changed)
                    nursery.start_soon(until_closed)
            return not gone
        finally:
            mode.waiting -= 1

    async def handle(stream: trio.SocketStream) -> None:
        buffer = bytearray()
        try:
            while True:
                end = buffer.find(b"\r\n\r\n")
                if end < 0:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        return
                    buffer += chunk
                    continue
                head = bytes(buffer[:end]).decode("latin-1").split("\r\n")
                method, target = head[0].split(" ")[:2]
                length = 0
                for line in head[1:]:
                    key, _, value = line.partition(":")
                    if key.strip().lower() == "content-length":
                        length = int(value)
                while len(buffer) < end + 4 + length:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        return
                    buffer += chunk
                body = bytes(buffer[end + 4 : end + 4 + length])
                del buffer[: end + 4 + length]
                if method == "POST" and target == "/_mode":
                    try:
                        mode.set(body.decode())
                    except ValueError as exc:
                        await stream.send_all(_response(400, json.dumps(str(exc)).encode()))
                        continue
                    await stream.send_all(_response(200, json.dumps(body.decode()).encode()))
                    continue
                if target == "/_stats":
                    stats = {"mode": mode.kind, "waiting": mode.waiting}
                    await stream.send_all(_response(200, json.dumps(stats).encode()))
                    continue
                if mode.kind != "fast" and not await wait_out(stream, buffer):
                    return
                await stream.send_all(answer)
        except* (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the caller went away

    return handle


async def serve(name: str) -> None:
    mode = _Mode()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1", backlog=4096)
    host, port = listeners[0].socket.getsockname()[:2]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, handler(name, mode), listeners)
        print(f"http://{host}:{port}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers.backend", description=__doc__)
    parser.add_argument("name", help="the service's name, echoed in every answer")
    args = parser.parse_args(argv)
    raise_open_files_limit()
    trio.run(serve, args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
