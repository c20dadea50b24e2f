"""The push board. **Fan-out**: N SSE followers of one resource, each on its own socket,
read by one epoll loop in the benchmark's process (plain non-blocking sockets, a few µs per
event, so the client is not what is measured; the server runs in its own process); the row
is the median, over three writes, of the time from the write (``PUT``) until the last
follower has the update, against a bare quart-trio SSE app broadcasting one
``trio.Event`` to the same number of streams (goal: ≤ 1 s for 5,000). Both servers run
with the garbage collector's young threshold a container serves with (50,000); the rows
marked *interpreter's GC* run both with the interpreter's default (700), which is what a
broadcast to thousands of streams costs most in either (docs/design.md, "Push boards").
The note gives each server's CPU time for one broadcast. **Idle followers**: the server's
RSS growth per connected, idle SSE follower in **KB**, against the bare app's per stream.
**Memory after cycles**: RSS after 5,000 follow/disconnect cycles against the RSS after the
first 500 (**KB**; goal: within 10%). **Coalescing**: the sans-IO core fed 1,000
updates/s to one resource for 10 s of virtual time with a 50 ms window; the row is changes
per published event (the coalescing ratio), against a ``keep_all`` board (1.0)."""

from __future__ import annotations

import os
import select
import socket
import statistics
import time
from typing import Any

import trio

from pipework.board import BoardCore, BoardSettings

from . import _load
from ._load import Server
from ._serve import raise_open_files_limit

MODULE = "benchmarks._board_serve"
#: Followers connecting at once (the rest wait for these to be on).
CONNECTING = 200
WRITES = 3


def _request(server: Server, method: str, path: str, body: bytes, token: str = "") -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    request = (
        f"{method} {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        f"{auth}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    with socket.create_connection((server.host, server.port)) as conn:
        conn.sendall(request)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    return answer


def _sse_path(server: Server) -> str:
    if server.kind == "bare":
        return "/sse"
    answer = _request(server, "POST", "/boards/bench", b"0", "bench")
    resource = answer.split(b'"id":"', 1)[1].split(b'"', 1)[0].decode()
    return f"/boards/bench/{resource}"


def _write(server: Server, path: str, value: int) -> None:
    if server.kind == "bare":
        _request(server, "POST", "/publish", str(value).encode())
    else:
        _request(server, "PUT", path, str(value).encode(), "bench")


def _cpu_seconds(pid: int) -> float:
    """The process's user + system CPU time."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Followers:
    """N SSE streams on non-blocking sockets, read with one epoll."""

    def __init__(self, server: Server, path: str, count: int) -> None:
        self.server = server
        self.poll = select.epoll()
        self.sockets: dict[int, socket.socket] = {}
        self.received: dict[int, bytes] = {}
        self.request = (
            f"GET {path} HTTP/1.1\r\nHost: bench\r\nAccept: text/event-stream\r\n\r\n"
        ).encode()
        self.retries = 0
        connecting: set[int] = set()
        for _ in range(count):
            connecting.add(self._connect())
            while len(connecting) >= CONNECTING:
                connecting = self._settle(connecting)
        while connecting:
            connecting = self._settle(connecting)

    def _connect(self) -> int:
        conn = socket.create_connection((self.server.host, self.server.port))
        conn.setblocking(False)
        conn.send(self.request)
        fd = conn.fileno()
        self.sockets[fd], self.received[fd] = conn, b""
        self.poll.register(fd, select.EPOLLIN)
        return fd

    def _settle(self, connecting: set[int]) -> set[int]:
        """Read; the streams still connecting. One the machine's network stack refused
        while thousands connect (a full accept queue resets it) is opened again."""
        done, lost = self._until(b"event: ", connecting)
        for fd in lost:
            self.retries += 1
            if self.retries > 100:
                raise RuntimeError(f"{self.server.kind}: followers keep being refused")
            self.poll.unregister(fd)
            self.sockets.pop(fd).close()
            del self.received[fd]
        return (connecting - done - lost) | {self._connect() for _ in lost}

    def _until(self, marker: bytes, waiting: set[int]) -> tuple[set[int], set[int]]:
        """Read what is ready: the streams among ``waiting`` that now hold ``marker``, and
        those that were closed or reset."""
        done, lost = set(), set()
        for fd, _ in self.poll.poll(30):
            try:
                chunk = self.sockets[fd].recv(65536)
            except ConnectionError:
                chunk = b""
            if not chunk:
                lost.add(fd)
                continue
            self.received[fd] += chunk
            if fd in waiting and marker in self.received[fd]:
                done.add(fd)
        return done, lost

    def broadcast(self, server: Server, path: str, value: int) -> tuple[float, float]:
        """Write, then wait until every stream has the update: (seconds, server CPU)."""
        for fd in self.received:
            self.received[fd] = b""
        waiting = set(self.sockets)
        cpu = _cpu_seconds(server.pid)
        start = time.perf_counter()
        _write(server, path, value)
        while waiting:
            done, lost = self._until(b"event: update", waiting)
            if lost:
                raise RuntimeError(f"{server.kind}: {len(lost)} followers were cut")
            waiting -= done
        return time.perf_counter() - start, _cpu_seconds(server.pid) - cpu

    def close(self) -> None:
        for conn in self.sockets.values():
            conn.close()
        self.poll.close()


def _fan_out(server: Server, count: int) -> dict[str, float]:
    path = _sse_path(server)
    time.sleep(0.05)  # outside any trio run: the server settles before its RSS is read
    before = server.rss_kb()
    followers = _Followers(server, path, count)
    try:
        time.sleep(0.5)  # the followers connect; outside any trio run
        idle_kb = (server.rss_kb() - before) / count
        seconds, cpu = [], []
        for value in range(1, WRITES + 1):
            took, used = followers.broadcast(server, path, value)
            seconds.append(took)
            cpu.append(used)
            time.sleep(0.3)  # between broadcasts; outside any trio run
    finally:
        followers.close()
    return {
        "last_s": statistics.median(seconds),
        "cpu_s": statistics.median(cpu),
        "idle_kb": idle_kb,
    }


def _fan_out_row(n: int, gc: str, ours: dict[str, float], bare: dict[str, float]) -> dict[str, Any]:
    which = "" if gc == "serving" else ", the interpreter's GC"
    return {
        "scenario": f"fan-out: last of {n:,} SSE followers has the update{which}",
        "subject_us": ours["last_s"] * 1e6,
        "baseline": f"bare quart-trio SSE broadcast{which}",
        "baseline_us": bare["last_s"] * 1e6,
        "ratio": ours["last_s"] / bare["last_s"],
        "goal": "≤ 1 s for 5,000" if n == 5000 and gc == "serving" else "",
        "note": f"server CPU {ours['cpu_s']:.2f} s vs {bare['cpu_s']:.2f} s",
    }


def fan_out(quick: bool) -> list[dict[str, Any]]:
    raise_open_files_limit()
    rows = []
    sizes = (1000,) if quick else (1000, 5000)
    for n in sizes:
        for gc in ("serving", "interpreter"):
            measured: dict[str, dict[str, float]] = {}
            for kind in ("pipework", "bare"):
                with _load.server(kind, "--gc", gc, module=MODULE) as served:
                    measured[kind] = _fan_out(served, n)
            ours, bare = measured["pipework"], measured["bare"]
            rows.append(_fan_out_row(n, gc, ours, bare))
            if gc == "serving":
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


async def _open(server: Server, path: str) -> trio.SocketStream:
    """An SSE follower on a trio socket, once its first event has arrived."""
    stream = await trio.open_tcp_stream(server.host, server.port)
    await stream.send_all(
        f"GET {path} HTTP/1.1\r\nHost: bench\r\nAccept: text/event-stream\r\n\r\n".encode()
    )
    data = b""
    while b"event: " not in data:
        chunk = await stream.receive_some()
        if not chunk:
            raise RuntimeError(f"{server.kind}: the stream closed before its first event")
        data += chunk
    return stream


async def _cycles(server: Server, first: int, total: int) -> tuple[int, int]:
    path = _sse_path(server)
    await trio.sleep(0.05)
    limiter = trio.CapacityLimiter(50)

    async def one() -> None:
        async with limiter:
            stream = await _open(server, path)
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
