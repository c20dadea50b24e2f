"""Proxy routes against the proxies people put in front of a service: the same three
routes, passed through as they came, by four gateways, each in its own process, in one run.
Route A goes to a fast backend answering a small JSON body, B to one that can be made to
hang (both the raw trio backends of bench_peers, `benchmarks/peers/backend.py`), and
`/bulk` to a raw trio backend that sends and swallows large bodies
(`benchmarks/peers/bulk_backend.py`).

- **(1) pipework**: [benchmarks/peers/proxy.toml](../benchmarks/peers/proxy.toml) served by
  `pipework.Gateway` (what `pipework serve FILE` runs): three proxy routes; A's service has
  a reserve of 32 slots and B's a limit of 16 (the rest wait for a slot, up to 10 s).
- **(a) nginx** and **(b) HAProxy**, from Debian's packages (installed with apt-get when
  missing), each started from a generated configuration on a free port, in one process
  (nginx: one worker; HAProxy: one thread), kept-alive connections to the backends; nginx
  buffers neither bodies (`proxy_request_buffering off`, `proxy_buffering off`), HAProxy
  caps B's server at 16 connections (`maxconn 16`, the rest queue up to 10 s):
  `benchmarks/peers/native.py`.
- **(c) Starlette** on uvicorn (one process, asyncio loop, h11) with a hand-written
  streaming proxy on one shared `httpx.AsyncClient` (its keep-alive pool raised to its 100
  connections), no bulkheads: `benchmarks/peers/starlette_proxy.py`.

**Its HTTP/1.1 server** (the small GET only, in quick mode too): (1) is served by
pipework's own HTTP/1.1 server (`pipework/container/_h1_server.py`, the default), and
**(1')** is the same gateway served by hypercorn (`[server] http1_server = "hypercorn"`),
so the two servers are compared in the same run. docs/design.md, "What a proxied request
costs", says where a proxied request's time goes.

**Garbage collector.** Every Python gateway runs with the same settings, those of
`pipework serve`: the young generation's threshold 50,000 (the interpreter's default is
700) and the start-up heap frozen, set in the Starlette process too; one more row measures
pipework with the interpreter's thresholds and nothing frozen.

Every gateway gives a backend 5 s (to connect, and to answer) and logs no access line.
Measures: **small GET**: `wrk -t2 -c32 --timeout 10s` on GET /a, req/s counting 2xx answers
only, and the gateway process's CPU time per 2xx answer (`/proc/PID/schedstat`; other load
on the machine moves it less than req/s; the least of the rounds); **streams**: 10 `curl`
processes at once each downloading (GET, `Content-Length`) or uploading (PUT of a file,
`Content-Length`, no `Expect`) a body through `/bulk`, with the gateway process's resident
memory (VmRSS) read every 20 ms: its growth is the highest reading minus the one just
before the 10 started (MB are 2^20 bytes); **A while B hangs**: 200 keep-alive connections
on B (as in bench_peers: the next GET /b when the last is answered, at most one a second
each), B answering nothing until the gateway gives up, and wrk on A from 2 s later; *kept*
is A's req/s then ÷ A's req/s alone. The gateways take turns within each measure; each
req/s is the best of the rounds. The load average of the machine (2 cores shared with other
work) is given with the results: other load moves absolute numbers, compare within a run.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import trio

from . import _load
from ._load import Server
from .bench_peers import B_CONNECTIONS, ARun, BTally, enter_all, steady, wrk_a
from .peers import native

SERVE = "benchmarks.peers.proxy_serve"
BACKEND = "benchmarks.peers.backend"
BULK = "benchmarks.peers.bulk_backend"
#: wrk's connections on route A, and the streams at once.
CONNECTIONS = 32
STREAMS = 10
MB = 1 << 20
#: The goal's bound on the gateway's memory growth while streaming.
RSS_GOAL_MB = 16


@dataclass(frozen=True)
class Gateway:
    """One gateway: a name for tables, what it is, how to start it."""

    name: str
    label: str
    kind: str
    args: tuple[str, ...] = ()
    native: bool = False
    #: Measured in the small GET only (a variant of another gateway).
    variant: bool = False
    #: A variant measured in quick mode too.
    quick: bool = False


GATEWAYS = (
    Gateway("pipework", "(1) pipework, proxy routes", "pipework"),
    Gateway(
        "pipework hypercorn",
        "(1') pipework, proxy routes, served by hypercorn",
        "pipework",
        ("--http1", "hypercorn"),
        variant=True,
        quick=True,
    ),
    Gateway("nginx", "(a) nginx", "nginx", native=True),
    Gateway("haproxy", "(b) HAProxy", "haproxy", native=True),
    Gateway("starlette", "(c) Starlette + httpx on uvicorn", "starlette"),
    Gateway(
        "pipework gc700",
        "(1) pipework, the interpreter's GC thresholds",
        "pipework",
        ("--gc", "interpreter"),
        variant=True,
    ),
)
#: The gateways every measure runs on; the variants run the small GET only (in quick mode
#: only those marked ``quick``).
MAIN = tuple(g for g in GATEWAYS if not g.variant)
QUICK = tuple(g for g in GATEWAYS if not g.variant or g.quick)


@dataclass(frozen=True)
class Settings:
    seconds: float
    rounds: int
    ramp: float
    stream_bytes: int
    gateways: tuple[Gateway, ...]
    warm_up: bool

    @staticmethod
    def of(quick: bool) -> Settings:
        if quick:
            return Settings(2, 1, 1.0, 5 * MB, QUICK, warm_up=False)
        return Settings(8, 3, 2.0, 100 * MB, GATEWAYS, warm_up=True)


# -- streams ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamRun:
    """``STREAMS`` bodies at once through one gateway, one way."""

    seconds: float
    ok: int
    failed: list[str]
    moved: int  # bytes, all streams together
    rss_before_kb: int
    rss_peak_kb: int
    rss_after_kb: int

    @property
    def growth_mb(self) -> float:
        return (self.rss_peak_kb - self.rss_before_kb) / 1024

    @property
    def mb_per_s(self) -> float:
        return self.moved / MB / self.seconds if self.seconds else 0.0

    def describe(self) -> str:
        text = f"{self.seconds:.1f} s, {self.mb_per_s:,.0f} MB/s, RSS +{self.growth_mb:.1f} MB"
        return text + (f", {len(self.failed)} failed" if self.failed else "")


def cpu_seconds(pid: int) -> float:
    """The CPU time process ``pid`` has run (its threads together), in seconds."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9


def curl_path() -> str:
    found = shutil.which("curl")
    if found is None:
        raise RuntimeError("curl is not installed (apt-get install curl)")
    return found


async def _curl(command: list[str], size: int, down: bool, failed: list[str]) -> int:
    """One transfer; the bytes it moved (0 if it failed, with why in ``failed``)."""
    done = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)
    lines = done.stdout.decode(errors="replace").strip().splitlines()
    status = lines[-1] if lines else ""
    if done.returncode == 0 and status == "200" and down:
        return size
    if done.returncode == 0 and status == "200" and lines[:1] == [f'{{"received": {size}}}']:
        return size
    failed.append(f"curl {done.returncode}, {lines!r}, {done.stderr.decode()[-200:]!r}")
    return 0


async def streams(served: Server, direction: str, size: int, upload: Path) -> StreamRun:
    """``STREAMS`` downloads (``direction`` ``down``) or uploads (``up``) of ``size`` bytes
    at once through ``served``, its RSS sampled meanwhile."""
    curl = curl_path()
    base = [curl, "-s", "--max-time", "600", "-w", "\\n%{http_code}"]
    if direction == "down":
        command = [*base, "-o", "/dev/null", f"{served.url}/bulk/down/{size}"]
    else:
        command = [*base, "-H", "Expect:", "-T", str(upload), f"{served.url}/bulk/up"]
    failed: list[str] = []
    moved = 0
    before = peak = served.rss_kb()
    finished = trio.Event()

    async def transfer() -> None:
        nonlocal moved
        got = await _curl(command, size, direction == "down", failed)
        moved += got  # after the await: ``moved`` is read once this transfer is done

    async def sample() -> None:
        nonlocal peak
        while not finished.is_set():
            peak = max(peak, served.rss_kb())
            with trio.move_on_after(0.02):
                await finished.wait()

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample)
        async with trio.open_nursery() as transfers:
            for _ in range(STREAMS):
                transfers.start_soon(transfer)
        seconds = time.perf_counter() - start
        finished.set()
    peak = max(peak, served.rss_kb())
    ok = STREAMS - len(failed)
    return StreamRun(seconds, ok, failed, moved, before, peak, served.rss_kb())


# -- the run ---------------------------------------------------------------------------------


@dataclass
class Results:
    settings: Settings
    small: dict[str, list[ARun]] = field(default_factory=lambda: collections.defaultdict(list))
    #: The gateway's CPU µs per 2xx answer in each small-GET run.
    cpu: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    hang: dict[str, list[tuple[ARun, BTally]]] = field(
        default_factory=lambda: collections.defaultdict(list)
    )
    down: dict[str, StreamRun] = field(default_factory=dict)
    up: dict[str, StreamRun] = field(default_factory=dict)
    ceiling: ARun | None = None
    load: list[tuple[float, float, float]] = field(default_factory=list)

    def alone(self, name: str) -> ARun:
        return max(self.small[name], key=lambda run: run.rps)

    def cpu_us(self, name: str) -> float:
        return min(self.cpu[name])

    def hanging(self, name: str) -> tuple[ARun, BTally]:
        return max(self.hang[name], key=lambda run: run[0].rps)

    def kept(self, name: str) -> float:
        alone = self.alone(name).rps
        return self.hanging(name)[0].rps / alone if alone else math.nan


async def _check(served: Server) -> None:
    """Every route answers through ``served`` (before anything is measured)."""
    for path in ("/a", "/b", "/bulk/x"):
        status, body = await _load.call(served.host, served.port, _load.get_request(path))
        if status != 200 or b'"ok": true' not in body:
            raise RuntimeError(f"{served.kind} answered GET {path} with {status} {body!r}")


async def _measure(
    servers: dict[str, Server], a: Server, b: Server, upload: Path, results: Results
) -> None:
    s = results.settings
    results.load.append(os.getloadavg())
    for served in servers.values():
        await _check(served)
        if s.warm_up:
            await wrk_a(f"{served.url}/a", 1, CONNECTIONS)  # not counted
    results.ceiling = await wrk_a(f"{a.url}/a", s.seconds / 2, CONNECTIONS)
    for _ in range(s.rounds):
        for name, served in servers.items():
            before = cpu_seconds(served.pid)
            run = await wrk_a(f"{served.url}/a", s.seconds, CONNECTIONS)
            used = cpu_seconds(served.pid) - before
            results.small[name].append(run)
            results.cpu[name].append(used / run.ok * 1e6 if run.ok else math.inf)
    for gateway in MAIN:
        served = servers[gateway.name]
        results.down[gateway.name] = await streams(served, "down", s.stream_bytes, upload)
        results.up[gateway.name] = await streams(served, "up", s.stream_bytes, upload)
    for _ in range(s.rounds):
        for gateway in MAIN:
            served = servers[gateway.name]
            hung = await steady(served, b, "hang", s.seconds, s.ramp, CONNECTIONS)
            results.hang[gateway.name].append(hung)
    results.load.append(os.getloadavg())


@contextlib.contextmanager
def _started(gateway: Gateway, urls: dict[str, str]) -> Iterator[Server]:
    if gateway.native:
        with native.started(gateway.kind, urls) as served:
            yield served
        return
    args = ("--a", urls["a"], "--b", urls["b"], "--bulk", urls["bulk"], *gateway.args)
    with _load.server(gateway.kind, *args, module=SERVE) as served:
        yield served


@contextlib.contextmanager
def started(
    gateways: Sequence[Gateway],
) -> Iterator[tuple[Server, Server, dict[str, Server]]]:
    """The three backends and the gateways, each in its own process."""
    for gateway in gateways:
        if gateway.native:
            native.ensure_installed(gateway.kind)  # before anything starts: apt-get is slow
    with contextlib.ExitStack() as stack:
        a, b, bulk = enter_all(
            stack,
            [
                _load.server("A", module=BACKEND),
                _load.server("B", module=BACKEND),
                _load.server("bulk", module=BULK),
            ],
        )
        urls = {"a": a.url, "b": b.url, "bulk": bulk.url}
        servers = enter_all(stack, [_started(g, urls) for g in gateways])
        yield a, b, {g.name: served for g, served in zip(gateways, servers, strict=True)}


def measure(quick: bool) -> Results:
    results = Results(Settings.of(quick))
    with (
        tempfile.NamedTemporaryFile(prefix="pipework-bench-", suffix=".bin") as upload,
        started(results.settings.gateways) as (a, b, servers),
    ):
        upload.truncate(results.settings.stream_bytes)  # zeros, read from the page cache
        upload.flush()
        trio.run(_measure, servers, a, b, Path(upload.name), results)
    return results


# -- the report ------------------------------------------------------------------------------


def _ms(us: float) -> str:
    return f"{us / 1e3:,.1f} ms" if us < 1e6 else f"{us / 1e6:,.2f} s"


def _label(name: str) -> str:
    return next(g.label for g in GATEWAYS if g.name == name)


def table(results: Results) -> list[str]:
    lines = [
        "| gateway | small GET: 2xx req/s | p50 | p99 | CPU per answer | A while B hangs: "
        "req/s | kept (÷ A alone) | B's answers | 10 × down | 10 × up |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for gateway in results.settings.gateways:
        alone = results.alone(gateway.name)
        cells = [gateway.label, f"{alone.rps:,.0f}", alone.p50(), alone.p99()]
        cells.append(f"{results.cpu_us(gateway.name):,.0f} µs")
        if gateway.variant:
            cells += ["", "", "", "", ""]
        else:
            hang, tally = results.hanging(gateway.name)
            cells += [f"{hang.rps:,.0f}", f"{results.kept(gateway.name):.2f}", tally.describe()]
            cells += [results.down[gateway.name].describe(), results.up[gateway.name].describe()]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def goals(results: Results) -> list[str]:
    """The issue's table: each measure against its goal."""
    ours = results.alone("pipework").rps
    starlette, haproxy = results.alone("starlette").rps, results.alone("haproxy").rps

    def cpu(baseline: str) -> str:
        ratio = results.cpu_us(baseline) / results.cpu_us("pipework")
        return f"; by CPU per answer {ratio:.3g}×"

    down, up = results.down["pipework"], results.up["pipework"]
    size = results.settings.stream_bytes // MB
    return [
        "| measure, same run | measured | goal |",
        "|---|---|---|",
        f"| small proxied GET, req/s vs (c), one process each | {ours / starlette:.2f}× "
        f"({ours:,.0f} vs {starlette:,.0f}{cpu('starlette')}) | ≥ 1.5× |",
        f"| small proxied GET, req/s vs (b) HAProxy, one process each | {ours / haproxy:.3f}× "
        f"({ours:,.0f} vs {haproxy:,.0f}{cpu('haproxy')}) | report |",
        f"| RSS growth while streaming {size} MB down, {STREAMS} at once | "
        f"{down.growth_mb:.1f} MB | ≤ {RSS_GOAL_MB} MB |",
        f"| RSS growth while streaming {size} MB up, {STREAMS} at once | "
        f"{up.growth_mb:.1f} MB | ≤ {RSS_GOAL_MB} MB |",
        f"| A while {B_CONNECTIONS} connections hang on B, both proxied, ÷ A alone | "
        f"{results.kept('pipework'):.2f} (HAProxy {results.kept('haproxy'):.2f}) | ≥ 0.9 |",
    ]


def _versus(results: Results, subject: str, baseline: str, goal: str) -> dict[str, Any]:
    ours, theirs = results.alone(subject), results.alone(baseline)
    return {
        "scenario": f"small proxied GET: {_label(subject)}, µs per 2xx answer (1 / req/s)",
        "subject_us": 1e6 / ours.rps,
        "baseline": _label(baseline),
        "baseline_us": 1e6 / theirs.rps,
        "ratio": theirs.rps / ours.rps,
        "goal": goal,
        "note": f"{subject}: {ours.describe()}, CPU {results.cpu_us(subject):,.0f} µs per "
        f"answer; {baseline}: {theirs.describe()}, CPU {results.cpu_us(baseline):,.0f} µs",
    }


def _memory(results: Results, direction: str) -> dict[str, Any]:
    runs = results.down if direction == "down" else results.up
    ours, theirs = runs["pipework"], runs["starlette"]
    others = "; ".join(f"{name}: {runs[name].describe()}" for name in ("nginx", "haproxy"))
    size = results.settings.stream_bytes // MB
    return {
        "scenario": f"RSS growth while streaming {STREAMS} × {size} MB {direction} at once",
        "subject_us": ours.growth_mb,
        "unit": "MB",
        "baseline": _label("starlette"),
        "baseline_us": theirs.growth_mb,
        "ratio": ours.growth_mb / theirs.growth_mb if theirs.growth_mb > 0 else math.inf,
        "goal": f"≤ {RSS_GOAL_MB} MB (pipework's)",
        "note": f"pipework: {ours.describe()}; starlette: {theirs.describe()}; {others}",
    }


def _transfer(results: Results, direction: str, baseline: str) -> dict[str, Any]:
    runs = results.down if direction == "down" else results.up
    ours, theirs = runs["pipework"], runs[baseline]
    size = results.settings.stream_bytes // MB
    return {
        "scenario": f"{STREAMS} × {size} MB {direction} at once, s for all",
        "subject_us": ours.seconds,
        "unit": "s",
        "baseline": _label(baseline),
        "baseline_us": theirs.seconds,
        "ratio": ours.seconds / theirs.seconds,
        "goal": "report",
        "note": f"pipework {ours.mb_per_s:,.0f} MB/s, {baseline} {theirs.mb_per_s:,.0f} MB/s",
    }


def rows(results: Results) -> list[dict[str, Any]]:
    hang, _ = results.hanging("pipework")
    quiet = results.alone("pipework")
    kept = ", ".join(f"{g.name} {results.kept(g.name):.2f}" for g in MAIN)
    ceiling = results.ceiling
    assert ceiling is not None
    s = results.settings
    runs = f"{s.rounds} rounds of {s.seconds:g} s, best" if s.rounds > 1 else f"{s.seconds:g} s"
    start, end = results.load[0], results.load[-1]
    versions = ", ".join(
        [native.version("nginx"), native.version("haproxy")]
        + [f"{name} {version(name)}" for name in ("starlette", "uvicorn", "httpx")]
    )
    measured = {g.name for g in s.gateways}
    variants = [
        _versus(results, name, baseline, "report")
        for name, baseline in (
            ("pipework hypercorn", "pipework"),
            ("pipework gc700", "pipework"),
        )
        if name in measured
    ]
    return [
        _versus(results, "pipework", "starlette", "≤ 0.67× (≥ 1.5× (c)'s req/s)"),
        _versus(results, "pipework", "haproxy", "report"),
        _versus(results, "pipework", "nginx", "report"),
        *variants,
        _memory(results, "down"),
        _memory(results, "up"),
        _transfer(results, "down", "starlette"),
        _transfer(results, "down", "haproxy"),
        _transfer(results, "up", "starlette"),
        _transfer(results, "up", "haproxy"),
        {
            "scenario": f"A while {B_CONNECTIONS} connections hang on B, µs per 2xx answer",
            "subject_us": 1e6 / hang.rps if hang.rps else math.inf,
            "baseline": "pipework, A alone (same run)",
            "baseline_us": 1e6 / quiet.rps,
            "ratio": quiet.rps / hang.rps if hang.rps else math.inf,
            "goal": "≤ 1.11× (A keeps ≥ 0.9)",
            "note": f"kept: {kept}",
        },
        {
            "markdown": [
                "The issue's table:",
                "",
                *goals(results),
                "",
                f"Every gateway ({runs}; wrk -t2 -c{CONNECTIONS}; wrk's ceiling, against A's "
                f"backend directly: {ceiling.rps:,.0f} req/s, p99 {_ms(ceiling.p99_us)}; "
                f"load average {start[0]:.2f} at the start, {end[0]:.2f} at the end; "
                f"{versions}):",
                "",
                *table(results),
            ]
        },
    ]


def run(quick: bool) -> list[dict[str, Any]]:
    return rows(measure(quick))
