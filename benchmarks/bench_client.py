"""What one backend call costs through each HTTP client, next to a bare h11 exchange.

One kept-alive connection to a raw trio HTTP/1.1 responder in its own process on
127.0.0.1 (``python -m benchmarks._serve raw``: it answers ``42`` as JSON), sequential GETs,
every client in the same ``trio.run``, taking turns in each repetition. The baseline is a
bare h11 exchange over a trio socket stream (the request sent, the answer read to its end,
``start_next_cycle``), the least any HTTP/1.1 client over h11 can do. The subjects: httpx's
``AsyncClient.get``; httpcore's ``AsyncConnectionPool.request`` (httpx's transport, used
directly); pipework's lean pool (``pipework/backends/_pool.py``) and, end to end, the
pipe's ``Backends.call`` (the request rendered from a call template, the answer checked and
parsed) on the lean pool and on httpx (``transport=`` forces httpx). Rows are µs per call,
the median of the repetitions; the ratio is that over the bare exchange's median.

Over https (the same responder behind TLS, ``_serve raw-tls``, a certificate made here with
trustme): ``Backends.call`` on the lean pool (TLS under its connection) against the same
call through httpx with the same TLS context, in the same run; the ratio is lean over
httpx.

    .venv/bin/python -m benchmarks --quick --only bench_client
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import h11
import httpcore
import httpx
import trio

from pipework.backends._http import Backends
from pipework.backends._http_spec import HttpCall, Service
from pipework.backends._pool import Pool
from pipework.pipes._pipe import Context

from ._load import server

BASELINE = "bare h11 exchange over a trio stream"
Call = Callable[[], Awaitable[object]]


class _Ctx:
    """What ``Backends.call`` reads of a pipe's context."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {"id": 42}
        self.remaining = 30.0
        self.path = "bench"
        self.correlation_id = "bench-0123456789abcdef"  # sent as the service's request id
        self.traceparent: str | None = None
        self.tracestate: str | None = None
        self.baggage: str | None = None


class _BareH11:
    def __init__(self, stream: trio.SocketStream, host: bytes) -> None:
        self._stream = stream
        self._conn = h11.Connection(h11.CLIENT)
        self._headers = [(b"Host", host), (b"Accept", b"*/*")]

    async def call(self) -> object:
        conn = self._conn
        data = conn.send(h11.Request(method=b"GET", target=b"/users/42", headers=self._headers))
        data += conn.send(h11.EndOfMessage())
        await self._stream.send_all(data)
        body = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await self._stream.receive_some(65536))
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
        conn.start_next_cycle()
        return body


async def _per_call(call: Call, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        await call()
    return (time.perf_counter() - start) / n * 1e6


async def _measure(host: str, port: int, n: int, reps: int) -> dict[str, tuple[float, float]]:
    url = f"http://{host}:{port}"
    target = f"{url}/users/42"
    service = Service("users", url, max_connections=4)
    call = HttpCall.of("users", "/users/{id}")
    ctx = cast(Context, _Ctx())
    stream = await trio.open_tcp_stream(host, port)
    bare = _BareH11(stream, f"{host}:{port}".encode())
    pool = Pool(host, port, max_connections=4)
    lean_headers = [(b"Host", f"{host}:{port}".encode()), (b"Accept", b"*/*")]
    async with (
        httpx.AsyncClient() as client,
        httpcore.AsyncConnectionPool(max_connections=4) as core,
        Backends([service]) as lean_backends,
        Backends([service], transport=httpx.AsyncHTTPTransport()) as httpx_backends,
    ):

        async def via_httpx() -> object:
            return (await client.get(target)).content

        async def via_httpcore() -> object:
            return (await core.request("GET", target)).content

        async def via_pool() -> object:
            deadline = trio.current_time() + 30
            answer = await pool.request(
                b"GET", b"/users/42", lean_headers, deadline=deadline, max_bytes=1 << 20
            )
            return answer.body

        async def via_backends_lean() -> object:
            return await lean_backends.call(call, ctx)

        async def via_backends_httpx() -> object:
            return await httpx_backends.call(call, ctx)

        subjects: dict[str, Call] = {
            "httpx.AsyncClient.get": via_httpx,
            "httpcore.AsyncConnectionPool.request": via_httpcore,
            "pipework lean pool (h11)": via_pool,
            "Backends.call, lean pool": via_backends_lean,
            "Backends.call, httpx (transport= given)": via_backends_httpx,
        }
        samples: dict[str, list[float]] = {name: [] for name in subjects}
        baseline: list[float] = []
        for call_ in (bare.call, *subjects.values()):  # warm-up, connections opened
            await _per_call(call_, max(n // 10, 10))
        for _ in range(reps):
            baseline.append(await _per_call(bare.call, n))
            for name, subject in subjects.items():
                samples[name].append(await _per_call(subject, n))
    await pool.aclose()
    await stream.aclose()
    base = statistics.median(baseline)
    return {name: (statistics.median(values), base) for name, values in samples.items()}


async def _measure_https(host: str, port: int, ca: str, n: int, reps: int) -> tuple[float, float]:
    """``Backends.call`` over https: (lean pool µs, httpx µs), medians of the same run."""
    url = f"https://{host}:{port}"
    service = Service("users", url, max_connections=4, ca_bundle=ca)
    context = service.ssl_context()
    assert context is not None
    call = HttpCall.of("users", "/users/{id}")
    ctx = cast(Context, _Ctx())
    transport = httpx.AsyncHTTPTransport(verify=context)
    async with (
        Backends([service]) as lean,
        Backends([service], transport=transport) as through_httpx,
    ):

        async def via_lean() -> object:
            return await lean.call(call, ctx)

        async def via_httpx() -> object:
            return await through_httpx.call(call, ctx)

        for subject in (via_lean, via_httpx):  # warm-up: the handshakes are done here
            await _per_call(subject, max(n // 10, 10))
        lean_us: list[float] = []
        httpx_us: list[float] = []
        for _ in range(reps):
            lean_us.append(await _per_call(via_lean, n))
            httpx_us.append(await _per_call(via_httpx, n))
    return statistics.median(lean_us), statistics.median(httpx_us)


def _https(n: int, reps: int) -> tuple[float, float]:
    import trustme  # a test dependency: only this row needs it

    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    with tempfile.TemporaryDirectory() as directory:
        cert, key, ca_file = (os.path.join(directory, n) for n in ("c.pem", "k.pem", "ca.pem"))
        leaf.cert_chain_pems[0].write_to_path(cert)
        leaf.private_key_pem.write_to_path(key)
        ca.cert_pem.write_to_path(ca_file)
        with server("raw-tls", "--cert", cert, "--key", key) as backend:
            return trio.run(_measure_https, backend.host, backend.port, ca_file, n, reps)


def run(quick: bool) -> list[dict[str, object]]:
    n, reps = (500, 5) if quick else (2_000, 7)
    gc.disable()  # as timeit does: a collection landing in one side's loop is noise
    try:
        with server("raw") as backend:
            results = trio.run(_measure, backend.host, backend.port, n, reps)
        lean_https, httpx_https = _https(n, reps)
    finally:
        gc.enable()
    goals = {"pipework lean pool (h11)": "≤ 1.5×", "Backends.call, lean pool": "report only"}
    rows: list[dict[str, object]] = []
    for name, (subject_us, baseline_us) in results.items():
        rows.append(
            {
                "scenario": f"client: {name}, one kept-alive connection, GET",
                "subject_us": round(subject_us, 1),
                "baseline": BASELINE,
                "baseline_us": round(baseline_us, 1),
                "ratio": round(subject_us / baseline_us, 2),
                "goal": goals.get(name, "report only"),
                "note": f"{'quick run: ' if quick else ''}median of {reps} × {n:,} sequential "
                "calls; server in its own process",
            }
        )
    rows.append(
        {
            "scenario": "client: Backends.call over https, lean pool (TLS), one kept-alive "
            "connection, GET",
            "subject_us": round(lean_https, 1),
            "baseline": "Backends.call over https through httpx (transport=, same TLS context)",
            "baseline_us": round(httpx_https, 1),
            "ratio": round(lean_https / httpx_https, 2),
            "goal": "report only",
            "note": f"{'quick run: ' if quick else ''}median of {reps} × {n:,} sequential "
            "calls; TLS server in its own process",
        }
    )
    return rows


if __name__ == "__main__":
    for row in run(quick="--quick" in sys.argv):
        print(
            f"{row['scenario']:<72} {row['subject_us']:>8} µs vs {row['baseline_us']:>7} µs "
            f"ratio {row['ratio']}"
        )
