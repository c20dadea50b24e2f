"""Tracing's cost under real load, each server in its own process: the container's 1-pipe
sync route (`POST /echo`, as in bench_container) with tracing **on** -- OpenTelemetry's
SDK, every trace sampled, spans batched (`BatchSpanProcessor`) and exported over OTLP/HTTP
to a raw trio-socket responder in its own process -- against the same server with tracing
**off** (the default: no layer, nothing of OpenTelemetry imported), in the same run, the
two taking turns. A request makes three spans when on: the server's, its job's step's and
its pipe's (the pipe calls no backend). Load: `wrk -t2 -c64` (else the in-repo trio
client); rows are µs per request (1 / throughput; ratio = off's req/s over on's), the
server process's CPU time per request (user + system, its export thread included: on a
shared machine the steadier figure) and p99 latency."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import trio

from . import _load
from ._load import LoadResult, Server
from .bench_container import ANSWER, BODY, _check_echo, _loader


def _cpu_seconds(pid: int) -> float:
    """User and system CPU time of process ``pid`` so far, its threads included."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(quick: bool) -> list[dict[str, Any]]:
    seconds, rounds = (5.0, 1) if quick else (5.0, 3)
    load, tool = _loader()
    results: dict[str, list[LoadResult]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}  # seconds per request, each round
    with (
        _load.server("raw") as sink,
        _load.server("pipework") as off,
        _load.server("pipework", "--trace-to", sink.url) as on,
    ):
        servers: dict[str, Server] = {"off": off, "on": on}
        for served in servers.values():
            _check_echo(served)
            load(served, 1.0)  # warm-up, not counted
        for _ in range(rounds):
            for kind, served in servers.items():
                before = _cpu_seconds(served.pid)
                result = load(served, seconds)
                results[kind].append(result)
                cpu[kind].append((_cpu_seconds(served.pid) - before) / result.requests)
        # The spans went out: the sink received OTLP posts (it answers every request).
        request = _load.post_request("/echo", BODY.encode(), close=True)
        if trio.run(_load.call, on.host, on.port, request) != (200, ANSWER):
            raise RuntimeError("the traced server stopped answering")
    f, n = _load.best(results["off"]), _load.best(results["on"])
    cpu_off, cpu_on = min(cpu["off"]) * 1e6, min(cpu["on"]) * 1e6
    runs = f"{rounds} × {seconds:g} s each, best" if rounds > 1 else f"{seconds:g} s each"
    return [
        {
            "scenario": "tracing on (SDK, 100% sampled, batched OTLP/HTTP to a local "
            "receiver): 1-pipe sync route, POST JSON, µs per request at 64 connections",
            "subject_us": n.us_per_request,
            "baseline": "the same server with tracing off (same run)",
            "baseline_us": f.us_per_request,
            "ratio": f.rps / n.rps,
            "goal": "",
            "note": f"on {n.describe()}; off {f.describe()} ({tool}, {runs})",
        },
        {
            "scenario": "tracing on: 1-pipe sync route, the server's CPU time per request",
            "subject_us": cpu_on,
            "baseline": "tracing off (same run)",
            "baseline_us": cpu_off,
            "ratio": cpu_on / cpu_off,
            "goal": "",
            "note": f"user + system time of the server process over each round, by its "
            f"requests; least of {rounds} round(s)",
        },
        {
            "scenario": "tracing on: 1-pipe sync route, p99 latency at 64 connections",
            "subject_us": n.p99_us,
            "baseline": "tracing off (same run)",
            "baseline_us": f.p99_us,
            "ratio": n.p99_us / f.p99_us,
            "goal": "",
            "note": f"p50 {n.p50_us / 1e3:,.1f} ms vs {f.p50_us / 1e3:,.1f} ms",
        },
    ]
