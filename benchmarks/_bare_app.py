"""The baselines the container is measured against: a bare quart-trio app whose routes do
what pipework's benchmark routes do (read the JSON body, await, answer ``n * 2`` as JSON),
without the engine, and a raw trio-socket HTTP responder that measures the load
generator's own ceiling.

``/_bench/parked`` and ``/_bench/release`` belong to the benchmark, not to the baseline:
they count the parked handlers and wake them all.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import trio
from quart import Response, request
from quart_trio import QuartTrio

__all__ = ["create_bare_app", "raw_responder"]

JSON = "application/json"


def _json(value: object) -> Response:
    return Response(json.dumps(value), content_type=JSON)


class _Gate:
    """Where the parked handlers wait: one event, replaced by each release."""

    def __init__(self) -> None:
        self.event = trio.Event()
        self.parked = 0


def create_bare_app() -> QuartTrio:
    app = QuartTrio(__name__, static_folder=None)
    gate = _Gate()

    async def echo() -> Response:
        body = await request.get_json()
        await trio.lowlevel.checkpoint()  # the await pipework's one pipe does
        return _json(body["n"] * 2)

    async def park() -> Response:
        body = await request.get_json()
        event = gate.event
        gate.parked += 1
        try:
            await event.wait()
        finally:
            gate.parked -= 1
        return _json(body["n"] * 2)

    async def parked() -> Response:
        return _json({"parked": gate.parked, "suspended": gate.parked})

    async def release() -> Response:
        released, event = gate.parked, gate.event
        gate.event = trio.Event()
        event.set()
        return _json({"released": released})

    app.add_url_rule("/echo", "echo", echo, methods=["POST"])
    app.add_url_rule("/park", "park", park, methods=["POST"])
    app.add_url_rule("/_bench/parked", "bench_parked", parked, methods=["GET"])
    app.add_url_rule("/_bench/release", "bench_release", release, methods=["POST"])
    return app


_RAW_RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n42"


def raw_responder() -> Callable[[trio.SocketStream], Awaitable[None]]:
    """A keep-alive HTTP/1.1 responder on bare trio sockets: answers every request ``42``
    (it reads each request's head and Content-Length body, and nothing else)."""

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
                length = 0
                for line in bytes(buffer[:end]).split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(buffer) < end + 4 + length:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        return
                    buffer += chunk
                del buffer[: end + 4 + length]
                await stream.send_all(_RAW_RESPONSE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return

    return handle
