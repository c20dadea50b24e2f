"""The HTTP container under real load, each server in its own process (hypercorn's trio worker
on 127.0.0.1), against a bare quart-trio app on the same server function with the same
options and the same garbage-collector threshold (a container raises the young one while
it serves), measured in the same run. **Throughput**: `wrk -t2 -c64 -d5s --latency` (without
wrk, an in-repo trio client whose ceiling is reported) POSTing `{"n": 21}` to a 1-pipe sync
route (its pipe awaits one checkpoint) and to a bare route that reads the body and awaits
the same; rows are µs per request (1 / throughput; ratio = bare's req/s over pipework's) and
p99 latency, best of the rounds, the two servers taking turns. **One backend call**: the
same load on a sync route whose one pipe is the built-in HTTP pipe calling a raw trio
responder in its own process (`GET /x`, answering `42`), against the bare route above, in
the same run. **Parking**: N connections on raw trio sockets each park one sync request
(pipework: the first pipe suspends for a signal, so the job holds no worker; bare: the
handler awaits a `trio.Event`); the row is the server's RSS growth per parked request in
**KB** (not µs), then all are released and every answer is checked. **Logging**: the
throughput load on the same pipework server twice, once logging as `pipework serve` does by
default (INFO, one access line per request, text, to a file) and once logging nothing, the
two taking turns in the same run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from . import _load
from ._export import cpu_seconds
from ._load import LoadResult, Server
from ._serve import raise_open_files_limit

BODY = '{"n": 21}'
ANSWER = b"42"


def _check_echo(served: Server) -> None:
    request = _load.post_request("/echo", BODY.encode(), close=True)
    got = trio.run(_load.call, served.host, served.port, request)
    if got != (200, ANSWER):
        raise RuntimeError(f"the {served.kind} server answered POST /echo with {got!r}")


def _loader() -> tuple[Callable[[Server, float], LoadResult], str]:
    if _load.wrk_path() is not None:

        def by_wrk(served: Server, seconds: float) -> LoadResult:
            return _load.wrk(f"{served.url}/echo", body=BODY, seconds=seconds)

        return by_wrk, "wrk -t2 -c64"

    def by_python(served: Server, seconds: float) -> LoadResult:
        return _load.python_load(served.host, served.port, path="/echo", body=BODY, seconds=seconds)

    return by_python, "in-repo trio client, 64 connections (wrk not installed)"


def throughput(quick: bool) -> list[dict[str, Any]]:
    seconds, rounds = (5.0, 1) if quick else (5.0, 2)
    load, tool = _loader()
    results: dict[str, list[LoadResult]] = {"bare": [], "pipework": []}
    with _load.server("bare") as bare, _load.server("pipework") as ours:
        servers = {"bare": bare, "pipework": ours}
        for served in servers.values():
            _check_echo(served)
            load(served, 1.0)  # warm-up, not counted
        for _ in range(rounds):
            for kind, served in servers.items():
                results[kind].append(load(served, seconds))
    ceiling = ""
    if not tool.startswith("wrk") or not quick:
        with _load.server("raw") as raw:
            _check_echo(raw)
            ceiling = f"; {tool.split(',')[0]} ceiling (raw trio-socket responder): "
            ceiling += f"{load(raw, 2.0).rps:,.0f} req/s"
    b, p = _load.best(results["bare"]), _load.best(results["pipework"])
    runs = f"{rounds} × {seconds:g} s each, best" if rounds > 1 else f"{seconds:g} s each"
    note = f"pipework {p.describe()}; bare {b.describe()} ({tool}, {runs}){ceiling}"
    return [
        {
            "scenario": "container: 1-pipe sync route, POST JSON, µs per request at 64 "
            "connections (1 / throughput)",
            "subject_us": p.us_per_request,
            "baseline": "bare quart-trio route: reads the body, awaits a checkpoint",
            "baseline_us": b.us_per_request,
            "ratio": b.rps / p.rps,
            "goal": "≤ 1.11× (≥ 0.9× bare's req/s)",
            "note": note,
        },
        {
            "scenario": "container: 1-pipe sync route, p99 latency at 64 connections",
            "subject_us": p.p99_us,
            "baseline": "bare quart-trio route (same run)",
            "baseline_us": b.p99_us,
            "ratio": p.p99_us / b.p99_us,
            "goal": "",
            "note": f"p50 {p.p50_us / 1e3:,.1f} ms vs {b.p50_us / 1e3:,.1f} ms",
        },
    ]


def backend_call(quick: bool) -> list[dict[str, Any]]:
    """A route calling one backend against the bare quart-trio route, in the same run."""
    seconds, rounds = (5.0, 1) if quick else (5.0, 2)
    load, tool = _loader()
    results: dict[str, list[LoadResult]] = {"bare": [], "pipework": []}

    def call_load(served: Server, seconds: float) -> LoadResult:
        if tool.startswith("wrk"):
            return _load.wrk(f"{served.url}/call", body=BODY, seconds=seconds)
        return _load.python_load(served.host, served.port, path="/call", body=BODY, seconds=seconds)

    with (
        _load.server("raw") as backend,
        _load.server("bare") as bare,
        _load.server("pipework", "--backend", backend.url) as ours,
    ):
        _check_echo(bare)
        request = _load.post_request("/call", BODY.encode(), close=True)
        got = trio.run(_load.call, ours.host, ours.port, request)
        if got != (200, ANSWER):
            raise RuntimeError(f"the pipework server answered POST /call with {got!r}")
        load(bare, 1.0)
        call_load(ours, 1.0)
        for _ in range(rounds):
            results["bare"].append(load(bare, seconds))
            results["pipework"].append(call_load(ours, seconds))
    b, p = _load.best(results["bare"]), _load.best(results["pipework"])
    runs = f"{rounds} × {seconds:g} s each, best" if rounds > 1 else f"{seconds:g} s each"
    return [
        {
            "scenario": "container: sync route with one backend call (built-in HTTP pipe), "
            "POST JSON, µs per request at 64 connections (1 / throughput)",
            "subject_us": p.us_per_request,
            "baseline": "bare quart-trio route: reads the body, awaits a checkpoint",
            "baseline_us": b.us_per_request,
            "ratio": b.rps / p.rps,
            "goal": "≤ 1.67× (≥ 0.6× bare's req/s)",
            "note": f"pipework {p.describe()}; bare {b.describe()} ({tool}, {runs}); the "
            "backend: a raw trio-socket responder in its own process",
        }
    ]


def _park_in(kind: str, count: int, time_limit: float) -> tuple[float, _load.ParkResult, int]:
    """KB of RSS per parked request, what the parking saw, and the RSS before (KB)."""
    with _load.server(kind, "--parked", str(count + 1000)) as served:
        # A first small round warms up every path a parked request takes.
        warm = trio.run(_park_quietly, served, min(200, count), time_limit)
        if warm.wrong or warm.answered != warm.parked:
            raise RuntimeError(f"the {kind} server failed the warm-up round: {warm}")
        before = served.rss_kb()
        rss: list[int] = []

        async def measure() -> None:
            rss.append(served.rss_kb())

        result = trio.run(
            lambda: _load.park(served.host, served.port, count, measure, time_limit=time_limit)
        )
    per_request = (rss[0] - before) / result.parked if rss and result.parked else float("nan")
    return per_request, result, before


async def _park_quietly(served: Server, count: int, time_limit: float) -> _load.ParkResult:
    async def nothing() -> None:
        pass

    return await _load.park(served.host, served.port, count, nothing, time_limit=time_limit)


def parking(quick: bool) -> list[dict[str, Any]]:
    wanted = 2_000 if quick else 10_000
    limit = raise_open_files_limit()
    count = min(wanted, limit - 200)
    time_limit = 60.0 if quick else 240.0
    bare_kb, bare, bare_before = _park_in("bare", count, time_limit)
    our_kb, ours, our_before = _park_in("pipework", count, time_limit)

    def summary(kb: float, seen: _load.ParkResult, before: int) -> str:
        return (
            f"{seen.parked:,} parked, {seen.answered - seen.wrong:,}/{count:,} answered "
            f"right, {kb:,.1f} KB each over {before / 1024:,.0f} MB, parked in "
            f"{seen.park_seconds:,.1f} s, answered {seen.release_seconds:,.1f} s after release"
        )

    capped = "" if count == wanted else f" (capped at {count:,} by RLIMIT_NOFILE)"
    return [
        {
            "scenario": f"container: RSS per parked sync request, {count:,} parked "
            f"(values in KB, not µs){capped}",
            "subject_us": our_kb,
            "baseline": "bare quart-trio handler awaiting a trio.Event",
            "baseline_us": bare_kb,
            "ratio": our_kb / bare_kb,
            "goal": "10,000 at ≤ 24 KB each",
            "note": f"pipework: {summary(our_kb, ours, our_before)}; "
            f"bare: {summary(bare_kb, bare, bare_before)}",
            "unit": "KB",
        }
    ]


def logging_cost(quick: bool) -> list[dict[str, Any]]:
    """The 1-pipe sync route with the default logging of ``pipework serve`` (INFO, the
    access log on: one line per request, text to a file) against the same server logging
    nothing, in the same run, the two taking turns."""
    seconds, rounds = (5.0, 1) if quick else (5.0, 2)
    load, tool = _loader()
    results: dict[str, list[LoadResult]] = {"off": [], "on": []}
    # The servers' CPU per request too: other load on the machine changes it less than
    # their throughput.
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    with (
        _load.server("pipework") as off,
        _load.server("pipework", "--log", "text") as on,
    ):
        servers = {"off": off, "on": on}
        for served in servers.values():
            _check_echo(served)
            load(served, 1.0)  # warm-up, not counted
        for _ in range(rounds):
            for kind, served in servers.items():
                before = cpu_seconds(served.pid)
                result = load(served, seconds)
                results[kind].append(result)
                if result.requests:
                    spent = cpu_seconds(served.pid) - before
                    cpu[kind].append(spent / result.requests * 1e6)
    quiet, logged = _load.best(results["off"]), _load.best(results["on"])
    runs = f"{rounds} × {seconds:g} s each, best" if rounds > 1 else f"{seconds:g} s each"
    cpus = f"; server CPU per request {min(cpu['on']):,.0f} µs on, {min(cpu['off']):,.0f} µs off"
    return [
        {
            "scenario": "container: 1-pipe sync route with default logging (INFO, one "
            "access line per request, text to a file), µs per request at 64 connections",
            "subject_us": logged.us_per_request,
            "baseline": "the same server logging nothing",
            "baseline_us": quiet.us_per_request,
            "ratio": quiet.rps / logged.rps,
            "goal": "",
            "note": f"logging on {logged.describe()}; off {quiet.describe()} ({tool}, {runs})"
            + cpus,
        }
    ]


def run(quick: bool) -> list[dict[str, Any]]:
    return [*throughput(quick), *logging_cost(quick), *backend_call(quick), *parking(quick)]
