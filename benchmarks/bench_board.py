"""The push board. **Fan-out**: N SSE followers of one resource on raw trio sockets (the
server in its own process); the row is the time from the write (``PUT``) until the last
follower has the update, against a bare quart-trio SSE app broadcasting one ``trio.Event``
to the same number of streams (goal: ≤ 1 s for 5,000). **Idle followers**: the server's
RSS growth per connected, idle SSE follower in **KB**, against the bare app's per stream.
**Memory after cycles**: RSS after 5,000 follow/disconnect cycles against the RSS after the
first 500 (**KB**; goal: within 10%). **Coalescing**: the sans-IO core fed 1,000
updates/s to one resource for 10 s of virtual time with a 50 ms window; the row is changes
per published event (the coalescing ratio), against a ``keep_all`` board (1.0)."""

from __future__ import annotations

import time
from typing import Any

import trio

from pipework.container._board_core import BoardCore, BoardSettings

from . import _load
from ._load import Server
from ._serve import raise_open_files_limit

MODULE = "benchmarks._board_serve"


async def _open(server: Server, path: str) -> tuple[trio.SocketStream, bytes]:
    stream = await trio.open_tcp_stream(server.host, server.port)
    await stream.send_all(
        f"GET {path} HTTP/1.1\r\nHost: bench\r\nAccept: text/event-stream\r\n\r\n".encode()
    )
    data = b""
    while b"event: " not in data:  # the first event: the follower is on
        chunk = await stream.receive_some()
        if not chunk:
            raise RuntimeError(f"{server.kind}: the stream closed before its first event")
        data += chunk
    return stream, data


async def _call(server: Server, method: str, path: str, body: bytes, token: str = "") -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    request = (
        f"{method} {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        f"{auth}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    async with await trio.open_tcp_stream(server.host, server.port) as stream:
        await stream.send_all(request)
        answer = b""
        while chunk := await stream.receive_some():
            answer += chunk
    return answer


async def _resource(server: Server) -> str:
    if server.kind == "bare":
        return "/sse"
    answer = await _call(server, "POST", "/boards/bench", b"0", "bench")
    resource = answer.split(b'"id":"', 1)[1].split(b'"', 1)[0].decode()
    return f"/boards/bench/{resource}"


async def _publish(server: Server, path: str, value: int) -> None:
    if server.kind == "bare":
        await _call(server, "POST", "/publish", str(value).encode())
    else:
        await _call(server, "PUT", path, str(value).encode(), "bench")


async def _fan_out(server: Server, followers: int) -> dict[str, float]:
    path = await _resource(server)
    await trio.sleep(0.05)
    streams: list[trio.SocketStream] = []
    before = server.rss_kb()
    async with trio.open_nursery() as nursery:
        limiter = trio.CapacityLimiter(200)

        async def connect() -> None:
            async with limiter:
                stream, _ = await _open(server, path)
                streams.append(stream)

        for _ in range(followers):
            nursery.start_soon(connect)
    await trio.sleep(0.5)
    idle_kb = (server.rss_kb() - before) / followers
    arrived: list[float] = []

    async def wait_update(stream: trio.SocketStream) -> None:
        data = b""
        while b"update" not in data:
            data += await stream.receive_some()
        arrived.append(time.perf_counter())

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for stream in streams:
                nursery.start_soon(wait_update, stream)
            await trio.sleep(0.2)
            start = time.perf_counter()
            await _publish(server, path, 1)
    for stream in streams:
        await stream.aclose()
    return {"last_s": max(arrived) - start, "idle_kb": idle_kb}


def fan_out(quick: bool) -> list[dict[str, Any]]:
    raise_open_files_limit()
    rows = []
    sizes = (1000,) if quick else (1000, 5000)
    for n in sizes:
        measured: dict[str, dict[str, float]] = {}
        for kind in ("pipework", "bare"):
            with _load.server(kind, module=MODULE) as served:
                measured[kind] = trio.run(_fan_out, served, n)
        ours, bare = measured["pipework"], measured["bare"]
        rows.append(
            {
                "scenario": f"fan-out: last of {n:,} SSE followers has the update",
                "subject_us": ours["last_s"] * 1e6,
                "baseline": "bare quart-trio SSE broadcast",
                "baseline_us": bare["last_s"] * 1e6,
                "ratio": ours["last_s"] / bare["last_s"],
                "goal": "≤ 1 s for 5,000" if n == 5000 else "",
            }
        )
        rows.append(
            {
                "scenario": f"RSS per idle SSE follower ({n:,} connected)",
                "subject_us": ours["idle_kb"],
                "unit": "KB",
                "baseline": "bare quart-trio SSE stream",
                "baseline_us": bare["idle_kb"],
                "ratio": ours["idle_kb"] / bare["idle_kb"],
            }
        )
    return rows


async def _cycles(server: Server, first: int, total: int) -> tuple[int, int]:
    path = await _resource(server)
    await trio.sleep(0.05)
    limiter = trio.CapacityLimiter(50)

    async def one() -> None:
        async with limiter:
            stream, _ = await _open(server, path)
            await stream.aclose()

    async def run(count: int) -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(count):
                nursery.start_soon(one)
        await trio.sleep(1.0)  # the handlers see their disconnects

    await run(first)
    baseline = server.rss_kb()
    await run(total - first)
    return baseline, server.rss_kb()


def cycles(quick: bool) -> list[dict[str, Any]]:
    first, total = (500, 2000) if quick else (500, 5000)
    with _load.server("pipework", module=MODULE) as served:
        baseline, after = trio.run(_cycles, served, first, total)
    return [
        {
            "scenario": f"RSS after {total:,} follow/disconnect cycles",
            "subject_us": float(after),
            "unit": "KB",
            "baseline": f"RSS after the first {first}",
            "baseline_us": float(baseline),
            "ratio": after / baseline,
            "goal": "≤ 1.10×",
        }
    ]


def coalescing(quick: bool) -> list[dict[str, Any]]:
    seconds = 2 if quick else 10
    ratios = {}
    for keep_all in (False, True):
        core = BoardCore(BoardSettings(window=0.05, keep_all=keep_all, max_batch=10_000))
        core.create("r", 0, now=0.0)
        core.join(["r"])
        for i in range(1, seconds * 1000 + 1):
            now = i / 1000
            due = core.deadline()
            if due is not None and due <= now:
                core.flush()
            core.update("r", i, now=now)
        core.flush()
        stats = core.statistics()
        ratios[keep_all] = stats.changes / stats.published
    return [
        {
            "scenario": "coalescing ratio, 1,000 updates/s to one resource (changes per event)",
            "subject_us": ratios[False],
            "unit": "×",
            "baseline": "keep_all board",
            "baseline_us": ratios[True],
            "ratio": ratios[True] / ratios[False],
            "note": "virtual time, 50 ms window",
        }
    ]


def run(quick: bool) -> list[dict[str, Any]]:
    return [*fan_out(quick), *cycles(quick), *coalescing(quick)]
