"""Load for the container benchmarks: server processes, wrk, a fallback client, parking.

- :func:`server` starts ``python -m benchmarks._serve KIND`` and yields its address and
  PID (the RSS comes from ``/proc/PID/status``);
- :func:`wrk` runs ``wrk -t2 -cC -dDs --latency`` with a small Lua script (POST with a JSON
  body; its ``done`` hook prints the summary as one JSON line, which is what is parsed);
- :func:`python_load` is the in-repo fallback when wrk is missing: C keep-alive
  connections on bare trio sockets, each sending its next request when the last is
  answered (its ceiling is measured against the raw responder and reported);
- :func:`park` opens N connections on bare trio sockets, each sending one request, waits
  until the server reports all N parked, calls back (to measure), releases them and
  checks every answer.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
#: How long a server process may take to print its address (several start at once, and a
#: server of several processes starts each of them: seconds each on a busy machine).
START_TIMEOUT = 120.0


# -- server processes --------------------------------------------------------------------


@dataclass(frozen=True)
class Server:
    """A benchmark server process: where it listens and its PID."""

    kind: str
    url: str
    host: str
    port: int
    pid: int

    def rss_kb(self) -> int:
        """The process's resident set size (VmRSS) in KB."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError(f"no VmRSS in /proc/{self.pid}/status")


@contextlib.contextmanager
def server(kind: str, *args: str, module: str = "benchmarks._serve") -> Iterator[Server]:
    """Run ``python -m MODULE KIND ARGS`` until the block ends (MODULE prints its URL)."""
    with tempfile.TemporaryFile() as errors:
        process = subprocess.Popen(
            [sys.executable, "-m", module, kind, *args],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=errors,
        )
        try:
            url = _read_url(process)
            if not url:
                errors.seek(0)
                tail = errors.read()[-2000:].decode(errors="replace")
                raise RuntimeError(f"the {kind} server did not start:\n{tail}")
            host, _, port = url.removeprefix("http://").rpartition(":")
            yield Server(kind, url, host, int(port), process.pid)
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()


def _read_url(process: subprocess.Popen[bytes]) -> str:
    assert process.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT
    os.set_blocking(process.stdout.fileno(), False)
    line = b""
    while not line.endswith(b"\n") and (remaining := deadline - time.monotonic()) > 0:
        if process.poll() is not None:
            break
        # Wait for output (or the deadline) instead of spinning.
        readable, _, _ = select.select([process.stdout], [], [], min(remaining, 1.0))
        if readable:
            line += process.stdout.readline()
    return line.decode().strip()


# -- load results --------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadResult:
    """One load run: throughput, latency percentiles and failed requests."""

    rps: float
    p50_us: float
    p99_us: float
    requests: int
    errors: int
    tool: str

    @property
    def us_per_request(self) -> float:
        return 1e6 / self.rps if self.rps else math.inf

    def describe(self) -> str:
        text = (
            f"{self.rps:,.0f} req/s, p50 {self.p50_us / 1e3:,.1f} ms, "
            f"p99 {self.p99_us / 1e3:,.1f} ms"
        )
        return text + (f", {self.errors} errors" if self.errors else "")


def best(results: list[LoadResult]) -> LoadResult:
    """The run with the highest throughput: the one other load on the machine hurt least."""
    return max(results, key=lambda r: r.rps)


# -- wrk -------------------------------------------------------------------------------------

_WRK_SCRIPT = """\
wrk.method = "POST"
wrk.body = '%(body)s'
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests": %%d, "duration_us": %%d, "connect": %%d, "read": %%d, ' ..
    '"write": %%d, "status": %%d, "timeout": %%d, "p50_us": %%.0f, "p99_us": %%.0f}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


def wrk_path() -> str | None:
    return shutil.which("wrk")


def wrk(
    url: str, *, body: str, seconds: float, connections: int = 64, threads: int = 2
) -> LoadResult:
    """``wrk -tT -cC -dDs --latency`` POSTing ``body`` as JSON to ``url``."""
    executable = wrk_path()
    if executable is None:
        raise RuntimeError("wrk is not installed (scripts/ensure-bench-tools installs it)")
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as script:
        script.write(_WRK_SCRIPT % {"body": body})
        script.flush()
        completed = subprocess.run(
            [
                executable,
                f"-t{threads}",
                f"-c{connections}",
                f"-d{seconds:g}s",
                "--timeout",
                "10s",
                "--latency",
                "-s",
                script.name,
                url,
            ],
            capture_output=True,
            text=True,
            timeout=seconds + 30,
            check=False,
        )
    return parse_wrk(completed.stdout, completed.stderr)


def parse_wrk(stdout: str, stderr: str = "") -> LoadResult:
    """Read the summary line our Lua ``done`` hook printed."""
    for line in stdout.splitlines():
        if line.startswith("WRK_JSON "):
            data = json.loads(line.removeprefix("WRK_JSON "))
            errors = sum(data[k] for k in ("connect", "read", "write", "status", "timeout"))
            seconds = data["duration_us"] / 1e6
            return LoadResult(
                rps=data["requests"] / seconds if seconds else 0.0,
                p50_us=float(data["p50_us"]),
                p99_us=float(data["p99_us"]),
                requests=data["requests"],
                errors=errors,
                tool="wrk",
            )
    raise RuntimeError(f"wrk printed no summary:\n{stdout}\n{stderr}")


# -- raw HTTP/1.1 on trio sockets ----------------------------------------------------------


def post_request(path: str, body: bytes, *, close: bool = False) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
    )
    return (head + ("Connection: close\r\n" if close else "") + "\r\n").encode() + body


def get_request(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode()


class ResponseReader:
    """Reads HTTP/1.1 responses with a Content-Length body off one stream."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.buffer = bytearray()

    async def _fill(self) -> None:
        chunk = await self.stream.receive_some(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection before a full response")
        self.buffer += chunk

    async def response(self) -> tuple[int, bool, bytes]:
        """``(status, keep_alive, body)`` of the next response."""
        while (end := self.buffer.find(b"\r\n\r\n")) < 0:
            await self._fill()
        lines = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        length, keep_alive = 0, True
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "connection" and value == "close":
                keep_alive = False
            elif name == "transfer-encoding":
                raise ConnectionError(f"unexpected Transfer-Encoding: {value}")
        while len(self.buffer) < end + 4 + length:
            await self._fill()
        body = bytes(self.buffer[end + 4 : end + 4 + length])
        del self.buffer[: end + 4 + length]
        return status, keep_alive, body


async def call(host: str, port: int, request: bytes) -> tuple[int, bytes]:
    """One request on its own connection: ``(status, body)``."""
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        await stream.send_all(request)
        status, _, body = await ResponseReader(stream).response()
        return status, body


# -- the fallback load generator -------------------------------------------------------------


def python_load(
    host: str, port: int, *, path: str, body: str, seconds: float, connections: int = 64
) -> LoadResult:
    """Like wrk: ``connections`` keep-alive connections, each sending its next request when
    the last is answered, for ``seconds``; a pure-Python client (report its ceiling)."""
    return trio.run(_python_load, host, port, path, body.encode(), seconds, connections)


async def _python_load(
    host: str, port: int, path: str, body: bytes, seconds: float, connections: int
) -> LoadResult:
    request = post_request(path, body)
    latencies: list[float] = []
    errors = 0
    clock = time.perf_counter

    async def connection(stop: float) -> None:
        nonlocal errors
        while clock() < stop:
            try:
                stream = await trio.open_tcp_stream(host, port)
            except OSError:
                errors += 1
                continue
            async with stream:
                reader = ResponseReader(stream)
                keep_alive = True
                while keep_alive and clock() < stop:
                    start = clock()
                    try:
                        await stream.send_all(request)
                        status, keep_alive, _ = await reader.response()
                    except (OSError, ConnectionError, trio.BrokenResourceError):
                        errors += 1
                        break
                    latencies.append(clock() - start)
                    if status >= 400:
                        errors += 1

    start = clock()
    with trio.move_on_after(seconds + 10):
        async with trio.open_nursery() as nursery:
            for _ in range(connections):
                nursery.start_soon(connection, start + seconds)
    elapsed = clock() - start
    latencies.sort()

    def percentile(q: float) -> float:
        if not latencies:
            return math.inf
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1e6

    return LoadResult(
        rps=len(latencies) / elapsed,
        p50_us=percentile(0.50),
        p99_us=percentile(0.99),
        requests=len(latencies),
        errors=errors,
        tool="python",
    )


# -- parking ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParkResult:
    """What :func:`park` saw: how many parked and how many were answered correctly."""

    parked: int
    answered: int
    wrong: int
    park_seconds: float
    release_seconds: float


async def park(
    host: str,
    port: int,
    count: int,
    measure: Callable[[], Awaitable[None]],
    *,
    time_limit: float,
    connecting: int = 256,
) -> ParkResult:
    """Park ``count`` requests (one connection each) on ``POST /park``, await ``measure()``
    once the server reports them all parked, release them, and check every answer."""
    answers: dict[int, tuple[int, bytes]] = {}
    failures: list[BaseException] = []
    all_answered = trio.Event()
    slots = trio.Semaphore(connecting)

    async def client(n: int) -> None:
        try:
            async with slots:
                stream = await trio.open_tcp_stream(host, port)
                await stream.send_all(post_request("/park", b'{"n": %d}' % n, close=True))
            async with stream:
                status, _, body = await ResponseReader(stream).response()
            answers[n] = (status, body)
        except (OSError, ConnectionError, trio.BrokenResourceError) as exc:
            failures.append(exc)
        if len(answers) + len(failures) == count:
            all_answered.set()

    async def parked_now() -> tuple[int, int]:
        status, body = await call(host, port, get_request("/_bench/parked"))
        if status != 200:
            raise RuntimeError(f"GET /_bench/parked answered {status}: {body!r}")
        counts = json.loads(body)
        return int(counts["parked"]), int(counts["suspended"])

    parked = 0
    with trio.fail_after(time_limit):
        async with trio.open_nursery() as nursery:
            start = trio.current_time()
            for n in range(count):
                nursery.start_soon(client, n)
            while True:
                await trio.sleep(0.25)
                parked, suspended = await parked_now()
                if min(parked, suspended) >= count or failures:
                    break
            park_seconds = trio.current_time() - start
            await trio.sleep(0.25)  # let the last handlers settle before measuring
            await measure()
            start = trio.current_time()
            status, body = await call(host, port, post_request("/_bench/release", b"{}"))
            if status != 200:
                raise RuntimeError(f"POST /_bench/release answered {status}: {body!r}")
            await all_answered.wait()
            release_seconds = trio.current_time() - start
    wrong = sum(1 for n, got in answers.items() if got != (200, str(2 * n).encode()))
    return ParkResult(parked, len(answers), wrong + len(failures), park_seconds, release_seconds)
