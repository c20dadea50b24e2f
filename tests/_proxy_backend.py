"""A backend for proxy tests: a plain ASGI app under hypercorn, on a free port.

Every path answers something a test can check byte for byte:

- ``/echo...``: the request as the backend saw it (method, raw path, query, headers, the
  body's length and SHA-256), as JSON, with two ``Set-Cookie`` headers and one of its own;
- ``/download?n=N``: N bytes (a repeating pattern), streamed in 64 KiB chunks; ``sent``
  counts what left, ``gone`` is set when the client went away;
- ``/upload``: reads the body as it comes and answers its length and SHA-256;
- ``/sse``: server-sent events, one per ``gate`` opening (an event each time a test calls
  ``release``);
- ``/hang``: never answers; ``/status/N``: an empty answer with status N;
- websockets on any path: echoes text and binary frames, closes with the client's code.
"""

from __future__ import annotations

import functools
import hashlib
import json
import ssl
from collections.abc import AsyncIterator, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import trio

from pipework.container import serve

CHUNK = 64 * 1024
PATTERN = bytes(range(256)) * (CHUNK // 256)


@dataclass
class Backend:
    url: str = ""
    port: int = 0
    sent: int = 0  # /download bytes handed to the server
    received: int = 0  # /upload bytes read so far
    gone: trio.Event = field(default_factory=trio.Event)  # a /download client left
    hanging: int = 0  # /hang requests waiting now
    hung: trio.Event = field(default_factory=trio.Event)  # a /hang request arrived
    sse_gate: trio.Semaphore = field(default_factory=lambda: trio.Semaphore(0))
    requests: list[dict[str, Any]] = field(default_factory=list)

    def release(self) -> None:
        """Let ``/sse`` send its next event."""
        self.sse_gate.release()

    async def app(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].replace("lifespan.", "")
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        if scope["type"] == "websocket":
            await _echo_websocket(receive, send)
            return
        path: str = scope["path"]
        if path.startswith("/echo"):
            await self._echo(scope, receive, send)
        elif path == "/download":
            await self._download(scope, receive, send)
        elif path == "/upload":
            await self._upload(receive, send)
        elif path == "/sse":
            await self._sse(receive, send)
        elif path == "/hang":
            self.hanging += 1
            self.hung.set()
            try:
                await trio.sleep_forever()
            finally:
                self.hanging -= 1
        elif path.startswith("/status/"):
            await _answer(send, int(path.rsplit("/", 1)[1]), [], b"")
        else:
            await _answer(send, 404, [], b"no such path")

    async def _echo(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        digest, size = hashlib.sha256(), 0
        async for chunk in _body(receive):
            digest.update(chunk)
            size += len(chunk)
        seen = {
            "method": scope["method"],
            "raw_path": scope["raw_path"].decode("latin-1"),
            "query": scope["query_string"].decode("latin-1"),
            "headers": [[n.decode("latin-1"), v.decode("latin-1")] for n, v in scope["headers"]],
            "length": size,
            "sha256": digest.hexdigest(),
        }
        self.requests.append(seen)
        body = json.dumps(seen).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"set-cookie", b"a=1; Path=/"),
            (b"set-cookie", b"b=2; Path=/"),
            (b"x-backend", b"echo"),
            (b"connection", b"x-backend-hop"),
            (b"x-backend-hop", b"dropped by the proxy"),
        ]
        await _answer(send, 200, headers, body)

    async def _download(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        query = dict(p.split("=") for p in scope["query_string"].decode().split("&") if p)
        total = int(query.get("n", "0"))
        length = [] if query.get("chunked") else [(b"content-length", str(total).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": length})
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                self.gone.set()
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            left = total
            while left > 0:
                piece = PATTERN[: min(CHUNK, left)]
                await send({"type": "http.response.body", "body": piece, "more_body": True})
                self.sent += len(piece)
                left -= len(piece)
            await send({"type": "http.response.body", "body": b""})
            nursery.cancel_scope.cancel()

    async def _upload(self, receive: Any, send: Any) -> None:
        digest, size = hashlib.sha256(), 0
        async for chunk in _body(receive):
            digest.update(chunk)
            size += len(chunk)
            self.received = size
        body = json.dumps({"length": size, "sha256": digest.hexdigest()}).encode()
        await _answer(send, 200, [(b"content-type", b"application/json")], body)

    async def _sse(self, receive: Any, send: Any) -> None:
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for n in range(3):
            await self.sse_gate.acquire()
            event = f"id: {n}\ndata: event {n}\n\n".encode()
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


async def _body(receive: Any) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        if message.get("body"):
            yield message["body"]
        if not message.get("more_body"):
            return


async def _answer(send: Any, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    if status not in (204, 304):
        headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _echo_websocket(receive: Any, send: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "websocket.connect":
            await send({"type": "websocket.accept"})
        elif message["type"] == "websocket.receive":
            if message.get("text") == "close 4002":
                await send({"type": "websocket.close", "code": 4002, "reason": "backend says"})
                return
            await send(
                {"type": "websocket.send", **{k: v for k, v in message.items() if k != "type"}}
            )
        else:
            return


@asynccontextmanager
async def running_backend(ssl_context: ssl.SSLContext | None = None) -> AsyncIterator[Backend]:
    """The backend on a free port; over TLS with ``ssl_context`` (its URL then https://)."""
    backend = Backend()
    async with trio.open_nursery() as nursery:
        address = await nursery.start(
            functools.partial(
                serve, cast(Any, backend.app), host="127.0.0.1", port=0, ssl_context=ssl_context
            )
        )
        backend.url, backend.port = address.url, address.port
        try:
            yield backend
        finally:
            nursery.cancel_scope.cancel()
