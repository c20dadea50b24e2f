"""One replica of the resilience benchmark's service: a raw trio HTTP/1.1 server (no
framework) whose behaviour can be switched while it serves.

``python -m benchmarks.resilience.replica NAME`` serves on a free port of 127.0.0.1 and
prints its base URL once it listens. ``GET /health`` is the gateways' health check; every
other ``GET`` is a call, answered ``{"replica": NAME, "ok": true}`` (200) or
``{"replica": NAME, "ok": false}`` (503) as the behaviour in force says. ``POST /_mode``
sets the behaviour (its body):

- ``fast``: every call and check answered 200 at once (the start);
- ``hang``: calls and checks answered never -- until the caller closes the connection or
  the behaviour changes (a change answers every held request at once, 200);
- ``fail P``: a share P of the calls (drawn at random, a seeded generator) answered 503 at
  once, the others 200; checks pass (the failures are in the traffic only, the case passive
  outlier detection exists for);
- ``down``: every call and check answered 503 at once;
- ``tail P S``: a share P of the calls (drawn at random) answered after S seconds (or
  never, if the caller closes first), the others at once; checks pass at once.

Every call is logged when it arrives: the time (``time.monotonic()``, the clock the load
generator's script reads too: ``CLOCK_MONOTONIC``), its ``X-Request-ID`` and what it was
given (``ok``, ``503``, ``hang``, ``slow``). ``GET /_log`` answers
``{"calls": [[t, id, outcome], ...], "health": checks}``; ``POST /_reset`` empties the log.
Paths starting with ``/_`` are never calls.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from .._serve import raise_open_files_limit

MODES = ("fast", "hang", "fail", "down", "tail")
_REASONS = {200: "OK", 400: "Bad Request", 503: "Service Unavailable"}


@dataclass
class Behaviour:
    """The behaviour in force, its log, and an event set (and replaced) at each change."""

    name: str
    kind: str = "fast"
    share: float = 0.0
    delay: float = 0.0
    changed: trio.Event = field(default_factory=trio.Event)
    calls: list[tuple[float, str, str]] = field(default_factory=list)
    health: int = 0
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self.rng.seed(f"replica {self.name}")  # the same draws in every run

    def set(self, text: str) -> None:
        """Switch to the behaviour ``text`` says (ValueError: it says none)."""
        words = text.split()
        kind = words[0] if words else ""
        numbers = {"fast": 0, "hang": 0, "fail": 1, "down": 0, "tail": 2}.get(kind)
        if numbers is None or len(words) != 1 + numbers:
            raise ValueError(f"unknown behaviour {text!r}: one of {', '.join(MODES)}")
        values = [float(word) for word in words[1:]]
        if kind in ("fail", "tail") and not 0 <= values[0] <= 1:
            raise ValueError(f"{text!r}: the share must be from 0 to 1")
        self.kind = kind
        self.share = values[0] if values else 0.0
        self.delay = values[1] if len(values) > 1 else 0.0
        changed, self.changed = self.changed, trio.Event()
        changed.set()

    def outcome(self, health: bool) -> str:
        """What this call (or check) gets: ``ok``, ``503``, ``hang`` or ``slow``."""
        kind = self.kind
        if kind == "hang":
            return "hang"
        if kind == "down":
            return "503"
        if health or kind == "fast":
            return "ok"
        if self.rng.random() >= self.share:
            return "ok"
        return "503" if kind == "fail" else "slow"


def response(status: int, body: bytes) -> bytes:
    return (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _hold(
    stream: trio.SocketStream, buffer: bytearray, changed: trio.Event, s: float
) -> bool:
    """Hold a request for ``s`` seconds (inf: until the behaviour changes); False when the
    caller went away first (a pipelined request read meanwhile is kept in ``buffer``)."""
    gone = False
    with trio.move_on_after(s):
        async with trio.open_nursery() as nursery:

            async def until_changed() -> None:
                await changed.wait()
                nursery.cancel_scope.cancel()

            async def until_closed() -> None:
                nonlocal gone
                try:
                    chunk = await stream.receive_some(65536)
                except trio.BrokenResourceError:  # a reset: gone too (HAProxy's way)
                    chunk = b""
                if chunk:
                    buffer.extend(chunk)
                    return
                gone = True
                nursery.cancel_scope.cancel()

            nursery.start_soon(until_changed)
            nursery.start_soon(until_closed)
    return not gone


def handler(behaviour: Behaviour) -> Callable[[trio.SocketStream], Awaitable[None]]:
    name = behaviour.name
    ok = response(200, json.dumps({"replica": name, "ok": True}).encode())
    failed = response(503, json.dumps({"replica": name, "ok": False}).encode())

    async def control(stream: trio.SocketStream, method: str, target: str, body: bytes) -> None:
        if method == "POST" and target == "/_mode":
            try:
                behaviour.set(body.decode())
            except ValueError as exc:
                await stream.send_all(response(400, json.dumps(str(exc)).encode()))
                return
            await stream.send_all(response(200, json.dumps(body.decode()).encode()))
        elif method == "POST" and target == "/_reset":
            behaviour.calls, behaviour.health = [], 0
            await stream.send_all(response(200, b"{}"))
        elif target == "/_log":
            log = {"calls": behaviour.calls, "health": behaviour.health}
            await stream.send_all(response(200, json.dumps(log).encode()))
        else:
            await stream.send_all(response(400, json.dumps(f"no {target}").encode()))

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
                length, request_id = 0, ""
                for line in head[1:]:
                    key, _, value = line.partition(":")
                    key = key.strip().lower()
                    if key == "content-length":
                        length = int(value)
                    elif key == "x-request-id":
                        request_id = value.strip()
                while len(buffer) < end + 4 + length:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        return
                    buffer += chunk
                body = bytes(buffer[end + 4 : end + 4 + length])
                del buffer[: end + 4 + length]
                if target.startswith("/_"):
                    await control(stream, method, target, body)
                    continue
                health = target == "/health"
                outcome = behaviour.outcome(health)
                if health:
                    behaviour.health += 1
                else:
                    behaviour.calls.append((time.monotonic(), request_id, outcome))
                if outcome in ("hang", "slow"):
                    held = math.inf if outcome == "hang" else behaviour.delay
                    if not await _hold(stream, buffer, behaviour.changed, held):
                        return
                await stream.send_all(failed if outcome == "503" else ok)
        except* (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the caller went away

    return handle


async def serve(name: str) -> None:
    behaviour = Behaviour(name)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1", backlog=4096)
    host, port = listeners[0].socket.getsockname()[:2]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, handler(behaviour), listeners)
        print(f"http://{host}:{port}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.resilience.replica", description=__doc__
    )
    parser.add_argument("name", help="the replica's name, echoed in every answer")
    args = parser.parse_args(argv)
    raise_open_files_limit()
    trio.run(serve, args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
