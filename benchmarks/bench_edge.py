"""Edge policy's cost: the same proxy route, bare, behind a rate limit, and behind a JWT
check and the rate limit, in one gateway process, in one run. The limit is keyed by the
client's address and so large that it is never reached (every request is decided, none
refused): what is measured is what deciding costs a request that passes. The route goes
to the raw trio backend of bench_peers (`benchmarks/peers/backend.py`, a small JSON body
at once); the gateway is `pipework.Gateway` serving the file `benchmarks/_edge_serve.py`
writes (the memory store, no access log).

Measures: `wrk -t2 -c32 --timeout 10s` GETting each route in turn, rounds alternating;
each route's req/s (2xx answers) is the best of its rounds, and the gateway process's CPU
time per 2xx answer (`/proc/PID/schedstat`) the least. The ratio is the bare route's
req/s over the route's (its cost per request over the bare route's): the goal, at least
0.9 times the bare route's throughput, is a ratio of at most 1.11. The JWT is ES256 (a
P-256 key made for the run, its JWKS in a file), sent by wrk with every request
(`-H Authorization`) and verified on every request.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt
import trio
from cryptography.hazmat.primitives.asymmetric import ec
from jwt.algorithms import ECAlgorithm

from . import _load
from ._edge_serve import AUDIENCE, ISSUER, ROUTES
from ._load import Server
from .bench_peers import _WRK_SCRIPT, ARun, enter_all, parse_wrk
from .bench_proxy import cpu_seconds

BACKEND = "benchmarks.peers.backend"
SERVE = "benchmarks._edge_serve"
CONNECTIONS = 32
GOAL = 0.9


@dataclass
class Results:
    seconds: float
    rounds: int
    runs: dict[str, list[ARun]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)
    load: list[tuple[float, float, float]] = field(default_factory=list)

    def best(self, route: str) -> ARun:
        return max(self.runs[route], key=lambda run: run.rps)

    def cpu_us(self, route: str) -> float:
        return min(self.cpu[route])


@contextlib.contextmanager
def started(jwks: Path) -> Iterator[Server]:
    with contextlib.ExitStack() as stack:
        (backend,) = enter_all(stack, [_load.server("A", module=BACKEND)])
        serve = _load.server(
            "pipework", "--backend", backend.url, "--jwks", str(jwks), module=SERVE
        )
        (gateway,) = enter_all(stack, [serve])
        yield gateway


def signed_token(folder: Path) -> tuple[Path, str]:
    """A JWKS file with one ES256 key made now, and a token it verifies (an hour long)."""
    private = ec.generate_private_key(ec.SECP256R1())
    jwk = {**ECAlgorithm.to_jwk(private.public_key(), as_dict=True), "kid": "bench-1"}
    path = folder / "jwks.json"
    path.write_text(json.dumps({"keys": [jwk]}))
    now = int(time.time())
    claims = {"sub": "bench", "iss": ISSUER, "aud": AUDIENCE, "iat": now, "exp": now + 3600}
    token = jwt.encode(claims, private, algorithm="ES256", headers={"kid": "bench-1"})
    return path, token


async def wrk_get(url: str, seconds: float, headers: dict[str, str]) -> ARun:
    """bench_peers' ``wrk_a`` (GET ``url``, two threads, CONNECTIONS) with ``headers``."""
    executable = _load.wrk_path()
    if executable is None:
        raise RuntimeError("wrk is not installed (scripts/ensure-bench-tools installs it)")
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as script:
        script.write(_WRK_SCRIPT)
        script.flush()
        command = [executable, "-t2", f"-c{CONNECTIONS}", f"-d{seconds:g}s", "--timeout", "10s"]
        for name, value in headers.items():
            command += ["-H", f"{name}: {value}"]
        command += ["--latency", "-s", script.name, url]
        began = time.time()
        with trio.fail_after(seconds + 60):
            done = await trio.run_process(command, capture_stdout=True, capture_stderr=True)
        ended = time.time()
    return dataclasses.replace(parse_wrk(done.stdout.decode()), began=began, ended=ended)


async def _measure(gateway: Server, results: Results, token: str) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    results.load.append(os.getloadavg())
    for route in ROUTES:
        request = _load.get_request(f"/{route}/x").replace(
            b"\r\n\r\n", f"\r\nAuthorization: Bearer {token}\r\n\r\n".encode(), 1
        )
        status, body = await _load.call(gateway.host, gateway.port, request)
        if status != 200 or b'"ok": true' not in body:
            raise RuntimeError(f"GET /{route}/x answered {status} {body!r}")
        await wrk_get(f"{gateway.url}/{route}/x", 1, headers)  # warm-up, not counted
    for _ in range(results.rounds):
        for route in ROUTES:
            before = cpu_seconds(gateway.pid)
            run = await wrk_get(f"{gateway.url}/{route}/x", results.seconds, headers)
            used = cpu_seconds(gateway.pid) - before
            if run.ok != run.answers or run.socket_errors:
                raise RuntimeError(f"/{route}: {run.answers - run.ok} non-2xx answers")
            results.runs.setdefault(route, []).append(run)
            results.cpu.setdefault(route, []).append(used / run.ok * 1e6 if run.ok else math.inf)
    results.load.append(os.getloadavg())


def measure(quick: bool) -> Results:
    results = Results(seconds=3.0 if quick else 10.0, rounds=2 if quick else 5)
    with tempfile.TemporaryDirectory(prefix="pipework-edge-") as folder:
        jwks, token = signed_token(Path(folder))
        with started(jwks) as gateway:
            trio.run(_measure, gateway, results, token)
    return results


def _versus(results: Results, route: str, scenario: str) -> dict[str, Any]:
    plain, subject = results.best("plain"), results.best(route)
    throughput = subject.rps / plain.rps if plain.rps else 0.0
    return {
        "scenario": scenario,
        "subject_us": 1e6 / subject.rps,
        "baseline": "the same route, bare",
        "baseline_us": 1e6 / plain.rps,
        "ratio": plain.rps / subject.rps,
        "goal": f"≥ {GOAL}× req/s (ratio ≤ {1 / GOAL:.2f}×)",
        "note": f"{subject.rps:,.0f} vs {plain.rps:,.0f} req/s: {throughput:.2f}× "
        f"({'met' if throughput >= GOAL else 'missed'}); CPU per answer "
        f"{results.cpu_us(route):,.0f} vs {results.cpu_us('plain'):,.0f} µs",
    }


def rows(results: Results) -> list[dict[str, Any]]:
    load = ", ".join(f"{a:.2f}" for a, _, _ in results.load)
    return [
        _versus(results, "limited", "proxy GET behind a rate limit (decided, never reached)"),
        _versus(
            results,
            "limited-jwt",
            "proxy GET behind a JWT check (ES256) and the rate limit",
        ),
        {"markdown": [f"Load average (1 min) at the start and the end: {load}."]},
    ]


def run(quick: bool) -> list[dict[str, Any]]:
    return rows(measure(quick))
