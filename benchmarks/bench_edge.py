"""Edge policy's cost: the same proxy route, bare, behind a rate limit, and behind a JWT check
and a rate limit keyed by its identity, in one gateway process, in one run. The limits (one
keyed by the client's address, one by the identity) are so large that they are never
reached (every request is decided, none refused): what is measured is what deciding costs a request that passes. The
route goes to the raw trio backend of bench_peers (`benchmarks/peers/backend.py`, a small
JSON body at once); the gateway is `pipework.Gateway` serving the file
`benchmarks/_edge_serve.py` writes (the memory store, no access log).

Measures: `wrk -t2 -c32 --timeout 10s` GETting each route in turn, rounds alternating;
each route's req/s (2xx answers) is the best of its rounds, and the gateway process's CPU
time per 2xx answer (`/proc/PID/schedstat`) the least. The ratio is the limited route's
cost per request (1 / req/s) over the bare route's: the goal, at least 0.9 times the bare
route's throughput, is a ratio of at most 1.11. The JWT route verifies an RS256 token
(2048-bit key made here, its JWKS a file) on every request: one token, sent by every
request, as a client holding one access token does.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import jwt
import trio
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

from . import _load
from ._load import Server
from .bench_peers import ARun, enter_all, wrk_a
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


def signing_key(folder: str) -> tuple[str, str]:
    """A JWKS file of one RS256 key (written under ``folder``) and a token it verifies."""
    from ._edge_serve import AUDIENCE, ISSUER

    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = {**RSAAlgorithm.to_jwk(private.public_key(), as_dict=True), "kid": "bench-1"}
    path = os.path.join(folder, "jwks.json")
    with open(path, "w", encoding="utf-8") as file:
        json.dump({"keys": [jwk]}, file)
    now = int(time.time())
    claims = {"sub": "bench", "iss": ISSUER, "aud": AUDIENCE, "iat": now, "exp": now + 86_400}
    return path, jwt.encode(claims, private, algorithm="RS256", headers={"kid": "bench-1"})


@contextlib.contextmanager
def started(jwks: str) -> Iterator[Server]:
    with contextlib.ExitStack() as stack:
        (backend,) = enter_all(stack, [_load.server("A", module=BACKEND)])
        serve = _load.server("pipework", "--backend", backend.url, "--jwks", jwks, module=SERVE)
        (gateway,) = enter_all(stack, [serve])
        yield gateway


async def _measure(gateway: Server, results: Results, routes: tuple[str, ...], token: str) -> None:
    results.load.append(os.getloadavg())
    bearer = [f"Authorization: Bearer {token}"]
    headers = {route: bearer if "jwt" in route else [] for route in routes}
    for route in routes:
        request = _load.get_request(f"/{route}/x")
        if headers[route]:  # the header before the blank line that ends the head
            request = request[:-2] + headers[route][0].encode() + b"\r\n\r\n"
        status, body = await _load.call(gateway.host, gateway.port, request)
        if status != 200 or b'"ok": true' not in body:
            raise RuntimeError(f"GET /{route}/x answered {status} {body!r}")
        # A warm-up, not counted.
        await wrk_a(f"{gateway.url}/{route}/x", 1, CONNECTIONS, headers[route])
    for _ in range(results.rounds):
        for route in routes:
            before = cpu_seconds(gateway.pid)
            run = await wrk_a(
                f"{gateway.url}/{route}/x", results.seconds, CONNECTIONS, headers[route]
            )
            used = cpu_seconds(gateway.pid) - before
            if run.ok != run.answers or run.socket_errors:
                raise RuntimeError(f"/{route}: {run.answers - run.ok} non-2xx answers")
            results.runs.setdefault(route, []).append(run)
            results.cpu.setdefault(route, []).append(used / run.ok * 1e6 if run.ok else math.inf)
    results.load.append(os.getloadavg())


def measure(quick: bool) -> Results:
    from ._edge_serve import ROUTES

    results = Results(seconds=3.0 if quick else 10.0, rounds=2 if quick else 5)
    with tempfile.TemporaryDirectory() as folder:
        jwks, token = signing_key(folder)
        with started(jwks) as gateway:
            trio.run(_measure, gateway, results, ROUTES, token)
    return results


def rows(results: Results) -> list[dict[str, Any]]:
    plain, limited = results.best("plain"), results.best("limited")
    throughput = limited.rps / plain.rps if plain.rps else 0.0
    jwt_run = results.best("limited-jwt")
    jwt_throughput = jwt_run.rps / plain.rps if plain.rps else 0.0
    load = ", ".join(f"{a:.2f}" for a, _, _ in results.load)
    return [
        {
            "scenario": "proxy GET behind a rate limit (decided, never reached)",
            "subject_us": 1e6 / limited.rps,
            "baseline": "the same route, no limit",
            "baseline_us": 1e6 / plain.rps,
            "ratio": plain.rps / limited.rps,
            "goal": f"≥ {GOAL}× req/s (ratio ≤ {1 / GOAL:.2f}×)",
            "note": f"{limited.rps:,.0f} vs {plain.rps:,.0f} req/s: {throughput:.2f}× "
            f"({'met' if throughput >= GOAL else 'missed'})",
        },
        {
            "scenario": "gateway CPU per answer, behind the rate limit",
            "subject_us": results.cpu_us("limited"),
            "baseline": "the same route, no limit",
            "baseline_us": results.cpu_us("plain"),
            "ratio": results.cpu_us("limited") / results.cpu_us("plain"),
            "note": "the least of the rounds",
        },
        {
            "scenario": "proxy GET behind a JWT check (RS256) and a rate limit on its identity",
            "subject_us": 1e6 / jwt_run.rps,
            "baseline": "the same route, no limit, no JWT",
            "baseline_us": 1e6 / plain.rps,
            "ratio": plain.rps / jwt_run.rps,
            "goal": f"≥ {GOAL}× req/s (ratio ≤ {1 / GOAL:.2f}×)",
            "note": f"{jwt_run.rps:,.0f} vs {plain.rps:,.0f} req/s: {jwt_throughput:.2f}× "
            f"({'met' if jwt_throughput >= GOAL else 'missed'})",
        },
        {
            "scenario": "gateway CPU per answer, behind the JWT check and the rate limit",
            "subject_us": results.cpu_us("limited-jwt"),
            "baseline": "the same route, no limit, no JWT",
            "baseline_us": results.cpu_us("plain"),
            "ratio": results.cpu_us("limited-jwt") / results.cpu_us("plain"),
            "note": "the least of the rounds",
        },
        {"markdown": [f"Load average (1 min) at the start and the end: {load}."]},
    ]


def run(quick: bool) -> list[dict[str, Any]]:
    return rows(measure(quick))
