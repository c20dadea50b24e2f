"""bench_redis's HTTP rows: what an operator sees of the Redis store, through HTTP.

Two ``pipework serve`` processes run the same gateway file but for ``[store]``: one on the
memory store, one on a local Redis (as ``backend = "redis"`` builds it). 16 clients, each
on a keep-alive connection of its own, run jobs one after the other: on the sync route
``POST /echo`` (one answer per job), and on the async route ``POST /later`` (answered
202) followed by ``GET /jobs/{id}/result`` until the result is there, as an async client
does. The two servers take turns, so the machine's load falls on both alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import trio

import pipework as pw

from ._load import HOST, START_TIMEOUT, ResponseReader, post_request

ROOT = Path(__file__).resolve().parent.parent
CLIENTS = 16


async def echo(ctx: pw.Context) -> None:
    """The routes' one pipe: no work of its own, so the rows measure the store's cost."""
    ctx.state["answer"] = ctx.state["n"] * 2


def _gateway(store: str) -> str:
    return f"""
[pool]
max_workers = 64

{store}

[pipes.echo]
python = "benchmarks._redis_http:echo"

[routes.echo]
path = "/echo"
chain = ["echo"]
result = "answer"

[routes.later]
path = "/later"
mode = "async"
chain = ["echo"]
result = "answer"
"""


@contextlib.contextmanager
def serving(store: str) -> Iterator[tuple[str, int]]:
    """``pipework serve`` on a gateway file with this ``[store]`` section: (host, port)."""
    with tempfile.TemporaryDirectory(prefix="pipework-bench-http-") as directory:
        path = Path(directory) / "gateway.toml"
        path.write_text(_gateway(store))
        command = [sys.executable, "-m", "pipework", "serve", str(path), "--port", "0"]
        command += ["--log-level", "WARNING"]
        process = subprocess.Popen(
            command, cwd=ROOT, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        try:
            yield HOST, _port(process)
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stderr is not None:
                process.stderr.close()


def _port(process: subprocess.Popen[bytes]) -> int:
    """The port ``serve`` announces on stderr (``pipework serving on http://HOST:PORT``)."""
    assert process.stderr is not None
    os.set_blocking(process.stderr.fileno(), False)
    seen = b""
    deadline = time.monotonic() + START_TIMEOUT
    while (remaining := deadline - time.monotonic()) > 0 and process.poll() is None:
        # Wait for output (or the deadline) instead of spinning; outside any trio run.
        readable, _, _ = select.select([process.stderr], [], [], min(remaining, 1.0))
        if readable:
            seen += process.stderr.read() or b""
        if b"pipework serving on " in seen and b"\n" in seen.split(b"pipework serving on ")[1]:
            url = seen.split(b"pipework serving on ")[1].split()[0].decode()
            return int(url.rsplit(":", 1)[1].rstrip("/"))
    raise RuntimeError(f"pipework serve did not start:\n{seen.decode(errors='replace')}")


def _get(path: str, token: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\nX-Job-Token: {token}\r\n\r\n".encode()


def measure(port: int, route: str, jobs: int) -> float:
    """Seconds per job: ``jobs`` jobs through ``route`` (``sync`` or ``async``), 16 clients."""
    return trio.run(_measure, port, route, jobs)


async def _measure(port: int, route: str, jobs: int) -> float:
    per_client = jobs // CLIENTS
    body = json.dumps({"n": 21}).encode()

    async def client() -> None:
        stream = await trio.open_tcp_stream(HOST, port)
        async with stream:
            reader = ResponseReader(stream)
            for _ in range(per_client):
                await stream.send_all(post_request("/echo" if route == "sync" else "/later", body))
                status, _, answer = await reader.response()
                if route == "sync":
                    if status != 200 or json.loads(answer) != 42:
                        raise RuntimeError(f"POST /echo answered {status}: {answer!r}")
                    continue
                if status != 202:
                    raise RuntimeError(f"POST /later answered {status}: {answer!r}")
                accepted = json.loads(answer)
                result = _get(f"/jobs/{accepted['id']}/result", accepted["token"])
                while True:
                    await stream.send_all(result)
                    status, _, answer = await reader.response()
                    if status == 200:
                        break
                    if status != 409:  # not finished yet: asked again at once
                        raise RuntimeError(f"GET of the result answered {status}: {answer!r}")
                    await trio.sleep(0.001)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(CLIENTS):
            nursery.start_soon(client)
    return (time.perf_counter() - start) / (per_client * CLIENTS)
