"""What a refused request costs: cProfile call counts and CPU time per request, once a
service's circuit breaker is open.

``python -m benchmarks.profile_refusal [--requests N] [--rounds R] [--against TREE]
[--log-level LEVEL] [--http1 SERVER ...]``

A gateway served in this process (``pipework.Gateway`` from a file, on a free port) has
one service of two hosts nobody listens on, with a breaker (``minimum_calls = 2``,
``wait = 600``), a route whose chain is one HTTP pipe to it (``GET /a``, sync mode) and a proxy
route to it (``/p``). One request opens the breaker (its two tries fail to connect); then
each route gets ``N`` refused requests from a bare keep-alive HTTP/1.1 client on a real
socket; for comparison, a third route's one HTTP pipe (``GET /h``) calls a healthy
backend (another process, so that its CPU is not counted: a bare threaded server
answering every request at once) and gets ``N`` answered requests the same way. Each
route's requests are measured under cProfile (calls per request, and which of them are
the logging's and the tracebacks'), then ``N`` more without it (CPU time per request: the
process's, gateway and client together). The log is configured as ``pipework serve
--log-level LEVEL`` does (WARNING by default, as the resilience benchmark's gateway), its
lines formatted and dropped; the lines per request are counted by level.

With ``--against TREE`` (a checkout of another version, e.g. ``git worktree add
/tmp/main main``) each round measures that tree and this one in turn, each in a process
of its own (``PYTHONPATH``), every other round in the other order, so both see the same
machine load; the table gives each tree's median over the rounds. Call counts do not
depend on the load; CPU times do.

``--http1``: which of the gateway's HTTP/1.1 servers to measure (``[server]
http1_server``: ``lean``, pipework's own, and ``hypercorn``; both by default), each in a
process of its own, in turn within each round; a tree given with ``--against`` is
measured on its default server.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import io
import json
import logging
import os
import pstats
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import trio

GATEWAY = """
[server]
default_timeout = 5

[pool]
max_workers = 64

[services.replicas]
hosts = ["{a}", "{b}"]
timeout = 5

[services.replicas.breaker]
minimum_calls = 2
wait = 600

[pipes.call_replicas]
service = "replicas"
path = "/a"
into = "a"

[routes.a]
method = "GET"
path = "/a"
chain = ["call_replicas"]
result = "a"

[routes.p]
proxy = "replicas"
prefix = "/p"

[services.fast]
base_url = "{fast}"
timeout = 5

[pipes.call_fast]
service = "fast"
path = "/h"
into = "h"

[routes.h]
method = "GET"
path = "/h"
chain = ["call_fast"]
result = "h"
"""

#: The routes measured, and the status each answers: the chain of one HTTP pipe and the
#: proxy route, refused; the chain of one HTTP pipe to a healthy backend.
TARGETS = {
    "HTTP pipe (sync)": ("/a", b"503"),
    "proxy": ("/p/x", b"503"),
    "HTTP pipe (sync), healthy": ("/h", b"200"),
}
#: The healthy backend's one answer.
_ANSWER = (
    b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}'
)
#: Where a profiled call's function lives, for the share of logging and tracebacks.
_LOGGING = ("/logging/__init__.py", "pipework/_logging.py")
_TRACEBACK = ("/traceback.py", "/linecache.py", "/ast.py")


def _closed_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


class _Counting(logging.Handler):
    """Formats every record (as a stream handler would) and counts them by level."""

    def __init__(self) -> None:
        super().__init__()
        self.levels: collections.Counter[str] = collections.Counter()
        self.tracebacks = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.format(record)
        self.levels[record.levelname] += 1
        self.tracebacks += record.exc_info is not None


async def _requests(port: int, raw: bytes, n: int) -> bytes:
    """Send ``raw`` ``n`` times on one kept-alive connection (hypercorn serves 1000
    requests per connection); the last answer's head."""
    head = b""
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        for _ in range(n):
            head = await _request(stream, raw)
    return head


async def _request(stream: trio.SocketStream, raw: bytes) -> bytes:
    """Send ``raw``; the answer's head (its body read by its Content-Length)."""
    await stream.send_all(raw)
    buffer = b""
    while b"\r\n\r\n" not in buffer:
        buffer += await _receive(stream)
    head, _, body = buffer.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        body += await _receive(stream)
    return head


async def _receive(stream: trio.SocketStream) -> bytes:
    data = await stream.receive_some(65536)
    if not data:
        raise RuntimeError("the gateway closed the connection")
    return data


def _share(stats: pstats.Stats, parts: tuple[str, ...]) -> int:
    return sum(
        calls
        for (filename, _, _), (_, calls, _, _, _) in stats.stats.items()  # type: ignore[attr-defined]  # pstats keeps its table untyped
        if any(part in filename for part in parts)
    )


async def _measure(requests: int, path: Path) -> dict[str, dict[str, Any]]:
    """Each route's figures, the gateway served from the file at ``path``."""
    from pipework import Gateway

    counting = _Counting()
    out: dict[str, dict[str, Any]] = {}
    gateway = Gateway(str(path))
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        address = await nursery.start(functools.partial(gateway.run, port=0, stop=stop))
        port = address.port
        # The breaker opens on the first call: both its tries fail to connect.
        await _requests(port, b"GET /a HTTP/1.1\r\nHost: gw\r\n\r\n", 1)
        logging.getLogger().addHandler(counting)
        for name, (target, status) in TARGETS.items():
            raw = f"GET {target} HTTP/1.1\r\nHost: gw\r\n\r\n".encode()
            head = await _requests(port, raw, 20)  # warm: caches, the route's series
            if not head.startswith(b"HTTP/1.1 " + status):
                raise RuntimeError(f"{target} was not answered {status.decode()}: {head!r}")
            counting.levels.clear()
            counting.tracebacks = 0
            profile = cProfile.Profile()
            profile.enable()
            await _requests(port, raw, requests)
            profile.disable()
            stats = pstats.Stats(profile, stream=io.StringIO())
            calls = sum(
                c
                for _, c, _, _, _ in stats.stats.values()  # type: ignore[attr-defined]  # pstats keeps its table untyped
            )
            lines = dict(counting.levels)
            tracebacks = counting.tracebacks
            start = time.process_time()
            await _requests(port, raw, requests)
            cpu = time.process_time() - start
            out[name] = {
                "calls": calls / requests,
                "logging": _share(stats, _LOGGING) / requests,
                "traceback": _share(stats, _TRACEBACK) / requests,
                "cpu_ms": cpu / requests * 1000,
                "lines": {level: n / requests for level, n in sorted(lines.items())},
                "tracebacks": tracebacks / requests,
            }
        logging.getLogger().removeHandler(counting)
        stop.set()
    return out


def _child(requests: int, level: str, http1: str | None) -> None:
    logging.getLogger().setLevel(level)  # the counting handler is added once measuring
    command = [sys.executable, str(Path(__file__).resolve()), "--backend"]
    backend = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert backend.stdout is not None
        fast = f"http://127.0.0.1:{int(backend.stdout.readline())}"
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder, "gateway.toml")
            text = GATEWAY.format(a=_closed_port(), b=_closed_port(), fast=fast)
            if http1 is not None:
                text = text.replace("[server]\n", f'[server]\nhttp1_server = "{http1}"\n', 1)
            path.write_text(text)
            print(json.dumps(trio.run(_measure, requests, path)))
    finally:
        backend.kill()
        backend.wait()


def _backend() -> None:
    """The healthy backend: a thread per connection, every request answered at once
    (a request is its head: the gateway's GET sends no body). Prints its port."""
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_answer, args=(conn,), daemon=True).start()


def _answer(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffer = b""
    with conn:
        while True:
            while b"\r\n\r\n" not in buffer:
                data = conn.recv(65536)
                if not data:
                    return
                buffer += data
            buffer = buffer.partition(b"\r\n\r\n")[2]
            conn.sendall(_ANSWER)


def _run(tree: Path, http1: str | None, requests: int, level: str) -> dict[str, dict[str, Any]]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    command = [sys.executable, str(Path(__file__).resolve()), "--child"]
    command += ["--requests", str(requests), "--log-level", level]
    if http1 is not None:
        command += ["--http1", http1]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"measuring {tree} failed:\n{done.stderr}")
    result: dict[str, dict[str, Any]] = json.loads(done.stdout.splitlines()[-1])
    return result


def _lines(row: dict[str, Any]) -> str:
    lines = ", ".join(f"{n:g} {level}" for level, n in row["lines"].items()) or "none"
    return lines + (f" ({row['tracebacks']:g} with a traceback)" if row["tracebacks"] else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.profile_refusal", description=__doc__
    )
    parser.add_argument("--requests", type=int, default=300, help="requests per route (< 1000)")
    parser.add_argument("--rounds", type=int, default=3, help="measurements of each tree")
    parser.add_argument("--against", type=Path, default=None, help="another tree to compare")
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING"])
    parser.add_argument(
        "--http1",
        nargs="+",
        choices=["lean", "hypercorn"],
        default=["lean", "hypercorn"],
        help="this tree's HTTP/1.1 servers to measure",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.backend:
        _backend()
        return 0
    if not 0 < args.requests < 1000:
        parser.error("--requests must be from 1 to 999 (one connection's worth)")
    if args.child:
        # One server in a child: the option's default (both) means the tree's default.
        chosen = args.http1[0] if len(args.http1) == 1 else None
        _child(args.requests, args.log_level, chosen)
        return 0
    here = Path(__file__).resolve().parent.parent
    subjects: list[tuple[Path, str | None]] = []
    if args.against:
        subjects.append((args.against.resolve(), None))
    subjects += [(here, server) for server in args.http1]
    runs: dict[tuple[Path, str | None], list[dict[str, dict[str, Any]]]] = {
        subject: [] for subject in subjects
    }
    for done in range(args.rounds):
        # Every other round in the other order: the second of two runs back to back is
        # not measured on the same machine as the first (caches, other processes).
        for tree, server in subjects if done % 2 == 0 else subjects[::-1]:
            runs[tree, server].append(_run(tree, server, args.requests, args.log_level))
    print(
        f"\nrefused requests (and healthy ones), log level {args.log_level}: per request, "
        f"median of {args.rounds}"
    )
    print(
        "\n| route | tree | HTTP/1.1 server | calls | of which logging | tracebacks | CPU ms "
        "| log lines |"
    )
    print("|---|---|---|---:|---:|---:|---:|---|")
    for name in TARGETS:
        for tree, server in subjects:
            rows = [run[name] for run in runs[tree, server]]
            calls = statistics.median(r["calls"] for r in rows)
            logs = statistics.median(r["logging"] for r in rows)
            frames = statistics.median(r["traceback"] for r in rows)
            cpu = statistics.median(r["cpu_ms"] for r in rows)
            print(
                f"| {name} | {tree} | {server or 'default'} | {calls:,.0f} | {logs:,.0f} "
                f"| {frames:,.0f} | {cpu:.2f} "
                f"| {_lines(rows[-1])} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
