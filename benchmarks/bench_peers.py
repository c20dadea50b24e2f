"""The published comparison: the same two-route gateway written three ways, each in its own
process, under a real load generator, in one run. Route A calls a fast backend; route B
calls a backend that can be made to hang or to answer slowly. The backends are tiny raw
trio servers (`benchmarks/peers/backend.py`), one process each.

- **(a) pipework**: [benchmarks/peers/gateway.toml](../benchmarks/peers/gateway.toml) served
  by `pipework.Gateway` (what `pipework serve FILE` runs): 64 workers, a reserve of 32 for
  A's service, a limit of 16 for B's. Also as `pipework serve FILE --workers 2`: two
  worker processes accepting from one listening socket that their supervising process
  bound, each with its own memory store and pool (with the memory store this works for
  `sync` and `stream` routes, as here: the request parks in the process that runs its job;
  see docs/operations.md); and, to measure that choice, as 2 independent processes on one
  port with `SO_REUSEPORT` (one accept queue each, the kernel spreading connections).
- **(b) Starlette** on uvicorn (one process, asyncio loop, h11), one shared
  `httpx.AsyncClient` (its default pool of 100 connections), no bulkheads.
- **(c) Flask** on waitress, a WSGI server with a fixed thread pool (4 threads, its
  default, and 8), one shared `httpx.Client`; waitress's `connection_limit` is raised
  from 100 to 1,000 so that the thread pool alone decides who is served. On two idle
  cores its threads contend for the GIL across cores (a request changes threads several
  times: waitress's I/O thread, a worker, the trigger back) and the 8-thread gateway serves
  about a tenth of what it serves on one core, so it also runs pinned to one CPU
  (`--one-core`), and the goal row compares against the better of the two.

Every Python gateway runs with the same garbage-collector settings, those of `pipework
serve`: the young generation's threshold 50,000 (the interpreter's default is 700) and the
start-up heap frozen (`gc.freeze()`), set in the Starlette and Flask processes too (`--gc
serving` of `benchmarks/peers/serve.py`).
Every gateway gives a backend call 5 s, answers a timeout 504 and logs at WARNING (no access
lines). Load on A: `wrk -t2 -c64 --timeout 10s` (GET /a); a Lua hook counts the 2xx answers
per second, and **req/s counts 2xx answers only** (an error answered fast is not
throughput); p50/p99 are wrk's, over every answer; requests still unanswered when a run
ends count nowhere (wrk's timeout, 10 s, outlasts a run), so a starved route A shows few
answers, few errors and the latency of those few. Load on B: 200 keep-alive connections
from a trio client in the benchmark process, each sending its next GET /b when the last is
answered (at most one a second per connection). Scenarios: A alone; A while B hangs (B
answers nothing until the caller gives up; wrk starts 2 s after the 200 connections); A
while B answers after 2 s. The gateways take turns within each scenario; between runs B is
set back to fast and every hanging call released. The plot shows A's 2xx answers per second
while B starts hanging a third of the way in. The machine's other load moves absolute
numbers (its load average at the start and the end is given with the results); compare
within a run.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import math
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from . import _load
from ._load import ROOT, Server

PLOT = ROOT / "docs" / "peers-throughput.png"
SERVE = "benchmarks.peers.serve"
BACKEND = "benchmarks.peers.backend"
#: wrk's connections on route A, and the connections hanging on route B.
A_CONNECTIONS = 64
B_CONNECTIONS = 200
#: The least time between two requests on one B connection.
B_PACE = 1.0
SLOW = 2.0


@dataclass(frozen=True)
class Peer:
    """One gateway: a name for tables, what it is, how to start it."""

    name: str
    label: str
    kind: str
    args: tuple[str, ...] = ()
    processes: int = 1


PEERS = (
    Peer("pipework", "(a) pipework, 1 process", "pipework"),
    Peer(
        "pipework ×2",
        "(a) pipework serve --workers 2 (one shared socket)",
        "pipework",
        ("--workers", "2"),
    ),
    Peer(
        "pipework ×2 rp",
        "(a) pipework, 2 processes (SO_REUSEPORT)",
        "pipework",
        processes=2,
    ),
    Peer("starlette", "(b) Starlette + httpx on uvicorn, 1 process", "starlette"),
    Peer("flask 4t", "(c) Flask on waitress, 4 threads", "flask", ("--threads", "4")),
    Peer("flask 8t", "(c) Flask on waitress, 8 threads", "flask", ("--threads", "8")),
    Peer(
        "flask 8t 1c",
        "(c) Flask on waitress, 8 threads, pinned to one core",
        "flask",
        ("--threads", "8", "--one-core"),
    ),
)
#: The Flask configurations the goal row compares against: the better one counts.
FLASK_8T = ("flask 8t", "flask 8t 1c")
SCENARIOS = ("alone", "hang", "slow")
SCENARIO_TEXT = {
    "alone": "A alone",
    "hang": f"A while {B_CONNECTIONS} connections hang on B",
    "slow": f"A while B answers in {SLOW:g} s ({B_CONNECTIONS} connections)",
}


# -- wrk on route A ------------------------------------------------------------------------

_WRK_SCRIPT = """\
wrk.method = "GET"
local threads = {}
function setup(thread)
  table.insert(threads, thread)
end
function init(args)
  ok, bad = {}, {}
end
function response(status, headers, body)
  local t = os.time()
  if status >= 200 and status < 300 then
    ok[t] = (ok[t] or 0) + 1
  else
    bad[t] = (bad[t] or 0) + 1
  end
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests": %d, "duration_us": %d, "connect": %d, "read": %d, ' ..
    '"write": %d, "status": %d, "timeout": %d, "p50_us": %.0f, "p99_us": %.0f}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99)))
  for _, thread in ipairs(threads) do
    for _, kind in ipairs({"ok", "bad"}) do
      for t, n in pairs(thread:get(kind)) do
        io.write(string.format("WRK_SECOND %d %s %d\\n", t, kind, n))
      end
    end
  end
end
"""


@dataclass(frozen=True)
class ARun:
    """One wrk run on route A."""

    seconds: float
    answers: int
    ok: int
    socket_errors: int
    p50_us: float
    p99_us: float
    #: epoch second -> 2xx answers in it
    per_second: dict[int, int]
    #: when wrk was started and when it had ended (epoch seconds)
    began: float = math.nan
    ended: float = math.nan

    def seconds_inside(self) -> dict[int, int]:
        """2xx answers in each whole second of the run, zeros included."""
        whole = range(math.ceil(self.began), math.floor(self.ended))
        return {second: self.per_second.get(second, 0) for second in whole}

    @property
    def rps(self) -> float:
        """2xx answers per second."""
        return self.ok / self.seconds if self.seconds else 0.0

    @property
    def errors(self) -> int:
        return self.answers - self.ok + self.socket_errors

    def p50(self) -> str:
        return _ms(self.p50_us) if self.answers else "—"

    def p99(self) -> str:
        return _ms(self.p99_us) if self.answers else "—"

    def describe(self) -> str:
        text = f"{self.rps:,.0f} req/s, p50 {self.p50()}, p99 {self.p99()}"
        return text + (f", {self.errors:,} errors" if self.errors else "")


def _ms(us: float) -> str:
    return f"{us / 1e3:,.1f} ms" if us < 1e6 else f"{us / 1e6:,.2f} s"


def parse_wrk(stdout: str) -> ARun:
    summary: dict[str, Any] | None = None
    ok: collections.Counter[int] = collections.Counter()
    for line in stdout.splitlines():
        if line.startswith("WRK_JSON "):
            summary = json.loads(line.removeprefix("WRK_JSON "))
        elif line.startswith("WRK_SECOND "):
            _, second, kind, count = line.split()
            if kind == "ok":
                ok[int(second)] += int(count)
    if summary is None:
        raise RuntimeError(f"wrk printed no summary:\n{stdout}")
    socket_errors = sum(summary[k] for k in ("connect", "read", "write", "timeout"))
    return ARun(
        seconds=summary["duration_us"] / 1e6,
        answers=summary["requests"],
        ok=sum(ok.values()),
        socket_errors=socket_errors,
        p50_us=float(summary["p50_us"]),
        p99_us=float(summary["p99_us"]),
        per_second=dict(ok),
    )


async def wrk_a(url: str, seconds: float, connections: int = A_CONNECTIONS) -> ARun:
    """``wrk -t2 -cC -dSs --timeout 10s --latency`` GETting ``url`` (C: 64 unless said)."""
    executable = _load.wrk_path()
    if executable is None:
        raise RuntimeError("wrk is not installed (scripts/ensure-bench-tools installs it)")
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as script:
        script.write(_WRK_SCRIPT)
        script.flush()
        command = [executable, "-t2", f"-c{connections}", f"-d{seconds:g}s"]
        command += ["--timeout", "10s", "--latency", "-s", script.name, url]
        began = time.time()
        with trio.fail_after(seconds + 60):
            done = await trio.run_process(command, capture_stdout=True, capture_stderr=True)
        ended = time.time()
    return dataclasses.replace(parse_wrk(done.stdout.decode()), began=began, ended=ended)


# -- the load on route B -------------------------------------------------------------------


@dataclass
class BTally:
    """What the connections on route B got."""

    statuses: collections.Counter[int] = field(default_factory=collections.Counter)
    failures: int = 0

    def describe(self) -> str:
        parts = [f"{n:,}×{status}" for status, n in sorted(self.statuses.items())]
        if self.failures:
            parts.append(f"{self.failures:,} dropped")
        return ", ".join(parts) or "no answer"


async def hold_b(served: Server, tally: BTally) -> None:
    """B_CONNECTIONS keep-alive connections, each sending GET /b when the last is answered
    (at most one a second), until cancelled."""
    request = f"GET /b HTTP/1.1\r\nHost: {served.host}\r\n\r\n".encode()

    async def connection() -> None:
        while True:
            sent = trio.current_time()
            try:
                stream = await trio.open_tcp_stream(served.host, served.port)
            except OSError:
                tally.failures += 1
                await trio.sleep_until(sent + B_PACE)
                continue
            async with stream:
                reader = _load.ResponseReader(stream)
                keep_alive = True
                while keep_alive:
                    try:
                        await stream.send_all(request)
                        status, keep_alive, _ = await reader.response()
                    except (OSError, ConnectionError, trio.BrokenResourceError):
                        tally.failures += 1
                        break
                    tally.statuses[status] += 1
                    await trio.sleep_until(sent + B_PACE)
                    sent = trio.current_time()
            await trio.sleep_until(sent + B_PACE)

    async with trio.open_nursery() as nursery:
        for _ in range(B_CONNECTIONS):
            nursery.start_soon(connection)


# -- one gateway through the scenarios -------------------------------------------------------


async def _get(served: Server, path: str) -> tuple[int, bytes]:
    return await _load.call(served.host, served.port, _load.get_request(path))


async def set_mode(backend: Server, mode: str) -> None:
    request = _load.post_request("/_mode", mode.encode(), close=True)
    status, body = await _load.call(backend.host, backend.port, request)
    if status != 200:
        raise RuntimeError(f"the B backend refused mode {mode!r}: {body!r}")


async def settle(gateway: Server, backend: Server) -> None:
    """B fast again, nothing held at B, and the gateway answering B at once."""
    await set_mode(backend, "fast")
    last = "nothing yet"
    with trio.move_on_after(90):
        while True:
            stats = json.loads((await _get(backend, "/_stats"))[1])
            last = f"B's backend holds {stats['waiting']} calls"
            if stats["waiting"] == 0:
                start = trio.current_time()
                status, _ = await _get(gateway, "/b")
                took = trio.current_time() - start
                last = f"GET /b answered {status} in {took:.2f} s"
                if status == 200 and took < 0.5:
                    return
            await trio.sleep(0.5)
    raise RuntimeError(f"the {gateway.kind} gateway at {gateway.url} did not settle: {last}")


async def steady(
    gateway: Server,
    backend: Server,
    scenario: str,
    seconds: float,
    ramp: float,
    connections: int = A_CONNECTIONS,
) -> tuple[ARun, BTally]:
    tally = BTally()
    if scenario == "alone":
        return await wrk_a(f"{gateway.url}/a", seconds, connections), tally
    await set_mode(backend, "hang" if scenario == "hang" else f"slow {SLOW:g}")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold_b, gateway, tally)
        await trio.sleep(ramp)
        result = await wrk_a(f"{gateway.url}/a", seconds, connections)
        nursery.cancel_scope.cancel()
    await settle(gateway, backend)
    return result, tally


async def timeline(
    gateway: Server, backend: Server, seconds: int, hang_at: float
) -> tuple[ARun, float, BTally]:
    """wrk on A for ``seconds``; B starts hanging at ``hang_at``. Returns the run, the epoch
    time B started hanging, and what B got."""
    tally = BTally()
    runs: list[ARun] = []
    finished = trio.Event()

    async def load() -> None:
        runs.append(await wrk_a(f"{gateway.url}/a", seconds))
        finished.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(load)
        await trio.sleep(hang_at)
        await set_mode(backend, "hang")
        started = time.time()
        async with trio.open_nursery() as hanging:
            hanging.start_soon(hold_b, gateway, tally)
            await finished.wait()
            hanging.cancel_scope.cancel()
    await settle(gateway, backend)
    return runs[0], started, tally


# -- the run ---------------------------------------------------------------------------------


@dataclass
class Results:
    runs: dict[tuple[str, str], list[tuple[ARun, BTally]]] = field(
        default_factory=lambda: collections.defaultdict(list)
    )
    timelines: dict[str, tuple[ARun, float, BTally]] = field(default_factory=dict)
    ceiling: ARun | None = None
    #: The machine's load averages when the run started and when it ended.
    load: list[tuple[float, float, float]] = field(default_factory=list)

    def best(self, peer: str, scenario: str) -> tuple[ARun, BTally]:
        return max(self.runs[peer, scenario], key=lambda run: run[0].rps)


@contextlib.contextmanager
def _started(peer: Peer, a: Server, b: Server) -> Iterator[Server]:
    args = ("--a", a.url, "--b", b.url, *peer.args)
    with contextlib.ExitStack() as stack:
        if peer.processes == 1:
            first = stack.enter_context(_load.server(peer.kind, *args, module=SERVE))
        else:
            first = stack.enter_context(
                _load.server(peer.kind, *args, "--reuse-port", module=SERVE)
            )
            for _ in range(peer.processes - 1):
                port = ("--port", str(first.port))
                stack.enter_context(
                    _load.server(peer.kind, *args, "--reuse-port", *port, module=SERVE)
                )
        yield first


async def _measure(
    servers: dict[str, Server], a: Server, b: Server, quick: bool, results: Results
) -> None:
    seconds, rounds, ramp = (4, 1, 2.0) if quick else (8, 2, 2.0)
    results.load.append(os.getloadavg())
    for name, served in servers.items():
        for path in ("/a", "/b"):
            status, body = await _get(served, path)
            if status != 200 or b'"ok":true' not in body.replace(b" ", b""):
                raise RuntimeError(f"{name} answered GET {path} with {status} {body!r}")
        await wrk_a(f"{served.url}/a", 1)  # warm-up, not counted
    results.ceiling = await wrk_a(f"{a.url}/a", 3 if quick else 5)
    for _ in range(rounds):
        for scenario in SCENARIOS:
            for name, served in servers.items():
                results.runs[name, scenario].append(
                    await steady(served, b, scenario, seconds, ramp)
                )
    length = 12 if quick else 24
    for name, served in servers.items():
        results.timelines[name] = await timeline(served, b, length, length / 3)
    results.load.append(os.getloadavg())


def enter_all(
    stack: contextlib.ExitStack, managers: Sequence[contextlib.AbstractContextManager[Server]]
) -> list[Server]:
    """Enter the managers at once (each in a thread: starting a process takes a second or
    two); every one entered is exited with ``stack``, even when another failed."""
    with concurrent.futures.ThreadPoolExecutor(len(managers)) as threads:
        futures = [threads.submit(manager.__enter__) for manager in managers]
        concurrent.futures.wait(futures)
    for manager, future in zip(managers, futures, strict=True):
        if future.exception() is None:
            stack.push(manager)
    return [future.result() for future in futures]


@contextlib.contextmanager
def started(peers: Sequence[Peer]) -> Iterator[tuple[Server, Server, dict[str, Server]]]:
    """The two backends and the peers' gateways, each in its own process."""
    with contextlib.ExitStack() as stack:
        a, b = enter_all(stack, [_load.server(name, module=BACKEND) for name in "AB"])
        gateways = enter_all(stack, [_started(peer, a, b) for peer in peers])
        yield a, b, {peer.name: served for peer, served in zip(peers, gateways, strict=True)}


def measure(quick: bool) -> Results:
    results = Results()
    with started(PEERS) as (a, b, servers):
        trio.run(_measure, servers, a, b, quick, results)
    return results


# -- the report ------------------------------------------------------------------------------


def plot(results: Results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 5), dpi=100)
    for peer in PEERS:
        run, started, _ = results.timelines[peer.name]
        counts = run.seconds_inside()
        xs = [second + 0.5 - started for second in counts]
        ys = list(counts.values())
        axes.plot(xs, ys, marker="o", markersize=3, label=peer.label)
    axes.axvline(0, color="grey", linestyle="--", linewidth=1)
    axes.annotate(
        f" {B_CONNECTIONS} connections start hanging on B",
        xy=(0, 1),
        xycoords=("data", "axes fraction"),
        va="top",
        fontsize=9,
        color="grey",
    )
    axes.set_xlabel("seconds since B started hanging")
    axes.set_ylabel("route A: 2xx answers per second")
    axes.set_title(f"Route A under wrk -c{A_CONNECTIONS} as route B starts hanging")
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="upper right", bbox_to_anchor=(1.0, 0.93))
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)


def _kept(results: Results, peer: str, scenario: str) -> float:
    alone = results.best(peer, "alone")[0].rps
    return results.best(peer, scenario)[0].rps / alone if alone else math.nan


def table(results: Results) -> list[str]:
    lines = [
        "| gateway | scenario | A: 2xx req/s | A: p50 | A: p99 | A: errors | "
        "kept (÷ A alone) | B's answers |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for peer in PEERS:
        for scenario in SCENARIOS:
            run, tally = results.best(peer.name, scenario)
            kept = "" if scenario == "alone" else f"{_kept(results, peer.name, scenario):.2f}"
            lines.append(
                f"| {peer.label} | {SCENARIO_TEXT[scenario]} | {run.rps:,.0f} | "
                f"{run.p50()} | {run.p99()} | {run.errors:,} | {kept} | "
                f"{tally.describe() if scenario != 'alone' else ''} |"
            )
    return lines


def rows(results: Results, quick: bool) -> list[dict[str, Any]]:
    def alone(peer: str) -> ARun:
        return results.best(peer, "alone")[0]

    def versus(subject: str, baseline: str, goal: str) -> dict[str, Any]:
        ours, theirs = alone(subject), alone(baseline)
        labels = {peer.name: peer.label for peer in PEERS}
        return {
            "scenario": f"peers, A alone: {labels[subject]}, µs per 2xx answer (1 / req/s)",
            "subject_us": 1e6 / ours.rps,
            "baseline": labels[baseline],
            "baseline_us": 1e6 / theirs.rps,
            "ratio": theirs.rps / ours.rps,
            "goal": goal,
            "note": f"{subject}: {ours.describe()}; {baseline}: {theirs.describe()}",
        }

    hang, _ = results.best("pipework", "hang")
    quiet = alone("pipework")
    others = ", ".join(f"{peer.name} {_kept(results, peer.name, 'hang'):.2f}" for peer in PEERS[1:])
    ceiling = results.ceiling
    assert ceiling is not None
    seconds, rounds = (4, 1) if quick else (8, 2)
    runs = f"{rounds} rounds of {seconds} s, best" if rounds > 1 else f"{seconds} s each"
    timelines = ", ".join(
        f"{peer.name}: {results.timelines[peer.name][0].ok:,} 2xx on A, "
        f"B {results.timelines[peer.name][2].describe()}"
        for peer in PEERS
    )
    return [
        versus("pipework", "starlette", "≤ 1.0× (≥ 1.0× (b)'s req/s)"),
        versus("pipework", "flask 8t", "report"),
        versus("pipework", "flask 8t 1c", "report"),
        versus(
            "pipework ×2",
            max(FLASK_8T, key=lambda name: alone(name).rps),
            "≤ 1.0× (≥ 1.0× (c)'s req/s, 8 threads, its better configuration)",
        ),
        versus("pipework ×2 rp", "pipework ×2", "report"),
        {
            "scenario": f"peers, pipework (1 process): A while {B_CONNECTIONS} connections "
            "hang on B, µs per 2xx answer",
            "subject_us": 1e6 / hang.rps if hang.rps else math.inf,
            "baseline": "pipework, A alone (same run)",
            "baseline_us": 1e6 / quiet.rps,
            "ratio": quiet.rps / hang.rps if hang.rps else math.inf,
            "goal": "≤ 1.11× (A keeps ≥ 0.9)",
            "note": f"kept {_kept(results, 'pipework', 'hang'):.2f}; the others kept: {others}",
        },
        {
            "scenario": "peers, pipework (1 process): A's p99 while B hangs",
            "subject_us": hang.p99_us,
            "baseline": "pipework, A's p99 alone (same run)",
            "baseline_us": quiet.p99_us,
            "ratio": hang.p99_us / quiet.p99_us,
            "goal": "≤ 2×",
            "note": f"p50 {hang.p50()} vs {quiet.p50()}",
        },
        {
            "markdown": [
                f"Every gateway and scenario ({runs}; wrk -t2 -c{A_CONNECTIONS}; wrk's "
                f"ceiling, against the fast backend directly: {ceiling.rps:,.0f} req/s, "
                f"p99 {_ms(ceiling.p99_us)}; the machine's load average "
                f"{results.load[0][0]:.2f} at the start, {results.load[-1][0]:.2f} at the "
                "end):",
                "",
                *table(results),
                "",
                f"![Route A's 2xx answers per second as {B_CONNECTIONS} connections start "
                f"hanging on route B](peers-throughput.png)",
                "",
                f"The plot's runs: {timelines}.",
            ]
        },
    ]


def run(quick: bool) -> list[dict[str, Any]]:
    results = measure(quick)
    plot(results, PLOT)
    return rows(results, quick)
