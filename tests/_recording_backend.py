"""A backend that records what it received, for the tests of what HTTP pipes send: a
plain ASGI app under hypercorn, on a free port.

- ``/echo``: records the request (method, path, headers as the lines came, body bytes)
  and answers ``{"ok": true}``;
- ``/mirror``: records it and answers its body back byte for byte, with its
  ``Content-Type`` (none when it had none);
- ``/binary``: answers :data:`BINARY` as ``image/x-test; q=1``; ``/binary-gzip`` the same
  gzip-encoded; ``/untyped`` the same with no ``Content-Type``.
"""

from __future__ import annotations

import functools
import gzip
from collections.abc import AsyncIterator, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import trio

from pipework.container import serve

__all__ = ["BINARY", "BINARY_TYPE", "Received", "RecordingBackend", "recording_backend"]

#: Every byte value, CR and LF and NUL included, and more than one read's worth.
BINARY = bytes(range(256)) * 300
BINARY_TYPE = "image/x-test; q=1"


@dataclass
class Received:
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes

    def values(self, name: str) -> list[str]:
        """Every value of header ``name`` (any case), in the order the lines came."""
        return [v for n, v in self.headers if n == name.lower()]

    def names(self) -> set[str]:
        return {n for n, _ in self.headers}


@dataclass
class RecordingBackend:
    url: str = ""
    received: list[Received] = field(default_factory=list)

    async def app(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].replace("lifespan.", "")
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        path: str = scope["path"]
        if path == "/binary":
            await _answer(send, [(b"content-type", BINARY_TYPE.encode())], BINARY)
            return
        if path == "/binary-gzip":
            encoded = [(b"content-type", BINARY_TYPE.encode()), (b"content-encoding", b"gzip")]
            await _answer(send, encoded, gzip.compress(BINARY))
            return
        if path == "/untyped":
            await _answer(send, [], BINARY)
            return
        body = b"".join([chunk async for chunk in _body(receive)])
        headers = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in scope["headers"]]
        seen = Received(scope["method"], path, headers, body)
        self.received.append(seen)
        if path == "/mirror":
            typed = [(b"content-type", v.encode("latin-1")) for v in seen.values("content-type")]
            await _answer(send, typed, body)
        else:
            await _answer(send, [(b"content-type", b"application/json")], b'{"ok":true}')


async def _body(receive: Any) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        if message.get("body"):
            yield message["body"]
        if not message.get("more_body"):
            return


async def _answer(send: Any, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@asynccontextmanager
async def recording_backend() -> AsyncIterator[RecordingBackend]:
    backend = RecordingBackend()
    async with trio.open_nursery() as nursery:
        address = await nursery.start(
            functools.partial(serve, cast(Any, backend.app), host="127.0.0.1", port=0)
        )
        backend.url = address.url
        try:
            yield backend
        finally:
            nursery.cancel_scope.cancel()
