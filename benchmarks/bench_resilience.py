"""Upstream resilience beside HAProxy: one service of three replicas behind route A, the
replicas made to fail in four ways while a steady load runs, each scenario measured for
pipework and for HAProxy in the same run; and a route whose optional branch calls a
saturated service, measured for pipework alone.

- **The replicas**: three raw trio servers, one process each
  (`benchmarks/resilience/replica.py`), whose behaviour the benchmark switches while the
  load runs: answer at once; hang (never answer, health checks included); answer 503 to a
  share of the calls drawn at random (health checks pass); be down (503 to every call and
  check); answer a share of the calls after a delay. Each logs every call it gets, with the
  `X-Request-ID` the client sent (both gateways pass it on), so the calls reaching the
  replicas are counted there, retries and hedges told from first tries.
- **pipework**: [benchmarks/resilience/gateway.toml](../benchmarks/resilience/gateway.toml)
  served by `pipework.Gateway` (what `pipework serve FILE` runs): the service's three
  `hosts` (balanced by `p2c`), health checks every second (2 failed take a host out, 2
  passed bring it back), outlier ejection after 5 failures in a row (Envoy's rules: 30 s
  the first time, one host of three at most), the circuit breaker (50 % of at least 20
  tries in 10 s, or no host left; open 2 s, then 3 probes), one retry on another host (a
  failed connection, a reset, a try's 0.25 s timeout, 502/503/504), within the retry
  budget's defaults (retries in flight at most 20 % of the calls in progress, 3 at least;
  in any 10 s at most 20 % of the calls sent in them, plus 1 a second). Route A is a chain
  of one HTTP pipe to the service (`GET /a`); the file's proxy route to the same service
  (`/p`: the same hosts, balancer, checks and breaker, but never hedged) takes the load
  instead with `ROUTE = "proxy"` or `measure(quick, route="proxy")` (a scenario's
  `route`). The hedging scenario adds `[services.replicas.hedge]`: a second try to another
  host once a call has waited the service's p95, at most one per call.
- **HAProxy** from Debian's packages (installed with apt-get when missing; the benchmark
  fails, never skips, when it cannot be), configured the same way as far as it goes
  (`benchmarks/resilience/haproxy.py`): `balance random(2)`, `option httpchk` with the
  same interval and thresholds, `observe layer7` with `error-limit 5` and
  `on-error mark-down`, `retries 1`, `option redispatch 1`,
  `retry-on conn-failure empty-response response-timeout 502 503 504`,
  `timeout server 250ms`; one process, one thread. It has no circuit breaker (a backend
  whose servers are all down answers 503 at once, which is compared with the open breaker)
  and no hedging (its nearest, the retry after 250 ms without an answer, is what it runs
  in the hedging scenario).

**Load.** `wrk` with 16 connections (one per thread), each sending its next `GET` after a
pause drawn at random for each request: exponential, with a mean of 80 ms, from each
connection's own seeded generator (the same draws in every run, and for both gateways).
That is the closed-system model of a population of independent clients, each pausing
("thinking") between an answer and its next request: about 200 requests a second in all,
well below what either gateway serves, whose starts are spread as independent clients'
are (the gaps between them vary as a Poisson process's do), so latency shows the
resilience, not a queue. A fixed 80 ms pause, which this benchmark had first, did not:
wrk calls the script's `delay()` before each connection's first request too, so all 16
started together, the gateway answered them together, and they stayed in step for the
whole run -- a burst of 16 requests every 80 ms or so, each waiting for the others' share
of the gateway's CPU. Spreading the first requests over one pause does not last either:
requests that meet once are answered together, their connections' next requests then
start together, and the fixed pause never separates them again, so the connections fall
back into bunches within seconds. The random pause separates them at every request.
`python -m benchmarks.resilience.loads` runs the quick mode with each load in turns and
compares them. `python -m benchmarks.resilience.probe` runs one scenario of the full
mode through pipework alone, a few times, to look at one figure closely. Each request
carries its own `X-Request-ID`. A Lua script records every
request's start (`CLOCK_MONOTONIC`, the clock the benchmark and the replicas read too),
its time to the answer and the status; a request whose connection failed counts as a
failure, one still out when the load stops as a failure if it had waited 1 s. The
replicas' behaviour changes at set times into the run. Each gateway is started afresh for
each scenario, warmed up for a second or two with every replica fast, and stopped after
it (so no state crosses scenarios); the two take turns.

**Scenarios** (times of the full mode; the quick mode shortens them, and says how):
*healthy* (every replica fast: the reference p99); *hang* (one replica hangs from t = 5 s,
judged from t = 10 s); *503s* (one replica answers 503 to 30 % of its calls); *down*
(every replica down from t = 5 s to t = 15 s, then back, through route A and again
through the proxy route `/p`; the gateway's state read every 0.1 s: pipework's breaker
from the admin API's service document, not from `/metrics`, whose exposition read that
often stalled the gateway being timed; HAProxy's backend from its statistics page;
"after the breaker opens" is from the first reading open, and "closes" is the time from
the replicas' return to the last answer that was not a 2xx); *tail* (one replica answers
10 % of its calls after 1 s; pipework hedges); *degrade*, pipework's alone (below).

**Degradation** (the issue's fifth scenario), through pipework only: HAProxy has no
counterpart, no optional part of a request to leave out, so it has no row. The gateway
file gets service B (a fourth replica process, `limit = 16` in the pool: as many as the
load's connections), route D (`GET /d`), whose chain is an `all_of` of the replicas' pipe
and an optional pipe to B (`optional = true`, `timeout = 1`), and a route whose calls to
B are the other work that saturates it (`benchmarks/resilience/serve.py`'s `DEGRADE`).
Route D's throughput is measured at capacity, the load's 16 connections sending each
request as soon as the last is answered (at 200 requests a second any route keeps its
throughput), in phases of 5 s (quick: 3 s): *alone*, B free and fast (every request's
branch calls B), and *B saturated*, B's replica holding every call it gets and 16 calls of
the other route holding every slot of B (so each branch of route D finds none free at
once), in turns, three times each (quick: twice). The figures: route D's 2xx answers a
second saturated ÷ alone (the goal: ≥ 0.95), and the share of its answers whose
`Pipework-Degraded` header marks them degraded while B is saturated (the goal: every
one); the calls of route D that reached B are counted at B.

Rows give pipework's figure, HAProxy's in the same run and pipework's ÷ HAProxy's (route
D's: with B saturated, alone in the same run, and their ratio); the goal is pipework's.
The machine's load (2 cores shared with other work) moves latencies more than shares:
compare within a run.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from . import _load
from ._load import Server
from .bench_peers import enter_all
from .peers import native
from .resilience import haproxy, serve

REPLICA = "benchmarks.resilience.replica"
SERVE = "benchmarks.resilience.serve"
#: The route the load goes to: "pipe" (a chain of one HTTP pipe) or "proxy" (a proxy
#: route), for every scenario that does not say.
ROUTE = "pipe"
PATHS = {"pipe": "/a", "proxy": "/p"}
#: Route D: the degradation scenario's (``resilience/serve.py``'s DEGRADE).
DEGRADE_PATH = "/d"
#: wrk's connections (one per thread), and each one's pause between an answer and its
#: next request, in ms: about 200 requests a second in all.
CONNECTIONS = 16
PAUSE_MS = 80
#: How each connection's pauses are drawn: "exponential" (each pause drawn at random, the
#: mean PAUSE_MS), "staggered" (PAUSE_MS each, the connections' first requests spread over
#: one pause) or "fixed" (PAUSE_MS each, every connection's first request at once).
THINKS = ("exponential", "staggered", "fixed")
#: The degradation scenario's load instead: as fast as each connection is answered.
AT_ONCE = "none"
THINK = "exponential"
#: A request still out when the load stops counts as failed if it waited this long.
STALLED = 1.0
#: How often the gateway's state is read in the scenario that reads it.
POLL = 0.1
#: The breaker's wait in gateway.toml, and the longest a probe takes (one try: its
#: per_try_timeout): the time-to-close goal is their sum.
BREAKER_WAIT = 2.0
PROBE = 0.25
#: pipework's retry budget (per cent of the calls, in flight and in volume; its floor of
#: 1 retry a second comes on top): the goal on the load retries add while every replica
#: is down.
RETRY_BUDGET = 20.0

# -- load: wrk, every request timed ------------------------------------------------------

_WRK_SCRIPT = """\
-- Written by benchmarks/bench_resilience.py. One connection per thread, so request() and
-- response() alternate: each request's start (CLOCK_MONOTONIC, us), time to its answer and
-- status. A request() with one still out means that one's connection failed (status 0).
local ffi = require("ffi")
ffi.cdef[[
typedef struct { long tv_sec; long tv_nsec; } pw_timespec;
int clock_gettime(int clk_id, pw_timespec *tp);
]]
local clock = ffi.new("pw_timespec")
local function now_us()
  ffi.C.clock_gettime(1, clock)
  return tonumber(clock.tv_sec) * 1000000 + math.floor(tonumber(clock.tv_nsec) / 1000)
end

local threads = {}
function setup(thread)
  table.insert(threads, thread)
  thread:set("id", #threads)
end

function init(args)
  pause = tonumber(args[1])
  think = args[2]
  connections = tonumber(args[3])
  tag = args[4]
  sent = 0
  records = {}
  math.randomseed(id)  -- each connection its own draws, the same in every run
end

-- wrk calls delay() before each request, the first one included.
function delay()
  if think == "none" then
    return 0
  end
  if think == "exponential" then
    return math.floor(-math.log(1 - math.random()) * pause + 0.5)
  end
  if think == "staggered" and sent == 0 then
    return math.floor((id - 1) * pause / connections + 0.5)
  end
  return pause
end

function request()
  local now = now_us()
  -- wrk calls request() once before the run to check the script: a request() still out
  -- before this thread's first answer is that call, not a failure.
  if started and answered then
    records[#records + 1] = started .. " " .. (now - started) .. " 0"
  end
  sent = sent + 1
  started = now
  return wrk.format(nil, nil, {["X-Request-ID"] = tag .. id .. "-" .. sent})
end

function response(status, headers, body)
  local now = now_us()
  -- What the answer's Pipework-Degraded says (its first reason), "-" when it has none.
  local degraded = "-"
  for name, value in pairs(headers) do
    if string.lower(name) == "pipework-degraded" then
      degraded = string.match(value, "reason=([%w_]+)") or "?"
    end
  end
  records[#records + 1] = started .. " " .. (now - started) .. " " .. status .. " " .. degraded
  started = nil
  answered = true
end

function done(summary, latency, requests)
  for _, thread in ipairs(threads) do
    for _, record in ipairs(thread:get("records")) do
      io.write("R ", record, "\\n")
    end
    local open = thread:get("started")
    if open then
      io.write("U ", open, "\\n")
    end
  end
end
"""


@dataclass(frozen=True, slots=True)
class Answer:
    """One request: its start (s since the run began), its time to the answer (s), the
    status (0: its connection failed, no answer) and the reason its ``Pipework-Degraded``
    header gave ("": none)."""

    start: float
    latency: float
    status: int
    degraded: str = ""

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


def parse_wrk(stdout: str, origin: float) -> tuple[list[Answer], list[float]]:
    """The requests our script printed (``origin``: the run's start, monotonic seconds), and
    the starts of those still out when it stopped."""
    answers: list[Answer] = []
    unfinished: list[float] = []
    for line in stdout.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "R":
            start, latency, status, *mark = rest.split()
            degraded = "" if mark in ([], ["-"]) else mark[0]
            answers.append(
                Answer(int(start) / 1e6 - origin, int(latency) / 1e6, int(status), degraded)
            )
        elif kind == "U":
            unfinished.append(int(rest) / 1e6 - origin)
    if not answers and not unfinished:
        raise RuntimeError(f"wrk recorded no request:\n{stdout[-2000:]}")
    answers.sort(key=lambda a: a.start)
    return answers, sorted(unfinished)


async def wrk(
    url: str, seconds: float, think: str | None = None, tag: str = "w"
) -> tuple[float, str]:
    """Our script under ``wrk`` on ``url`` for ``seconds``, each connection's pauses drawn
    as ``think`` says (:data:`THINKS`; None: :data:`THINK`), each request's id beginning
    with ``tag``: when it started (monotonic seconds) and what it printed."""
    think = THINK if think is None else think
    if think not in (*THINKS, AT_ONCE):
        raise ValueError(f"think must be one of {', '.join(THINKS)}, not {think!r}")
    if seconds < 1 or seconds != int(seconds):
        raise ValueError(f"wrk runs whole seconds, not {seconds:g}")
    executable = _load.wrk_path()
    if executable is None:
        raise RuntimeError("wrk is not installed (scripts/ensure-bench-tools installs it)")
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as script:
        script.write(_WRK_SCRIPT)
        script.flush()
        command = [executable, f"-t{CONNECTIONS}", f"-c{CONNECTIONS}", f"-d{seconds:g}s"]
        command += ["--timeout", "10s", "-s", script.name, url, "--", str(PAUSE_MS), think]
        command += [str(CONNECTIONS), tag]
        began = time.monotonic()
        with trio.fail_after(seconds + 60):
            done = await trio.run_process(command, capture_stdout=True, capture_stderr=True)
    return began, done.stdout.decode()


# -- the scenarios -----------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    """At ``at`` seconds into the run (0: before it starts), the replicas' behaviours
    (``replica.py``'s modes, one per replica; None leaves one as it is)."""

    at: float
    modes: tuple[str | None, str | None, str | None]
    name: str


@dataclass(frozen=True)
class Scenario:
    name: str
    label: str
    seconds: float
    changes: tuple[Change, ...] = ()
    #: When the scenario is judged from (s into the run).
    judged_from: float = 0.0
    hedge: bool = False
    poll: bool = False
    #: "pipe" or "proxy": which of the gateway's routes to the service the load goes to.
    route: str = "pipe"
    #: The degradation scenario: route D through pipework alone, ``rounds`` times its
    #: two phases (B free, B saturated) of ``seconds`` each.
    degrade: bool = False
    rounds: int = 1

    @property
    def path(self) -> str:
        return DEGRADE_PATH if self.degrade else PATHS[self.route]


@dataclass(frozen=True)
class Times:
    """The scenarios' phases, in seconds into a run."""

    healthy: float
    hang_at: float
    hang_judged: float
    hang_end: float
    fail: float
    down_at: float
    back_at: float
    down_end: float
    tail: float
    #: The degradation scenario: each phase's length, and how many times both run.
    degrade: float
    degrade_rounds: int


FULL = Times(15, 5, 10, 30, 20, 5, 15, 30, 20, 5, 3)
QUICK = Times(4, 2, 5, 9, 6, 2, 7, 12, 8, 3, 2)


def scenarios(quick: bool, route: str | None = None) -> tuple[Scenario, ...]:
    """The scenarios with the mode's times (the quick mode shortens every phase), their
    load on ``route`` (None: :data:`ROUTE`)."""
    t = QUICK if quick else FULL
    route = ROUTE if route is None else route
    if route not in PATHS:
        raise ValueError(f"route must be one of {', '.join(PATHS)}, not {route!r}")
    fast = ("fast", "fast", "fast")
    return (
        Scenario("healthy", "every replica fast", t.healthy, route=route),
        Scenario(
            "hang",
            f"one replica hangs from t = {t.hang_at:g} s",
            t.hang_end,
            (Change(t.hang_at, ("hang", None, None), "hang"),),
            judged_from=t.hang_judged,
            route=route,
        ),
        Scenario(
            "503",
            "one replica answers 503 to 30 % of its calls (GET)",
            t.fail,
            (Change(0, ("fail 0.3", None, None), "fail"),),
            route=route,
        ),
        *(
            Scenario(
                "down" if on == route else f"down-{on}",
                f"every replica down (503) from t = {t.down_at:g} s, back at t = {t.back_at:g} s"
                + ("" if on == route else f", through the {on} route (`{PATHS[on]}`)"),
                t.down_end,
                (Change(t.down_at, ("down",) * 3, "down"), Change(t.back_at, fast, "back")),
                poll=True,
                route=on,
            )
            # A pipe route's refusal costs more than a proxy route's: both are measured.
            for on in ((route, "proxy") if route == "pipe" else (route,))
        ),
        Scenario(
            "tail",
            "one replica answers 10 % of its calls after 1 s; "
            + ("pipework hedges" if route == "pipe" else "a proxy route does not hedge"),
            t.tail,
            (Change(0, ("tail 0.1 1", None, None), "tail"),),
            hedge=True,
            route=route,
        ),
        Scenario(
            "degrade",
            "route D, an `all_of` of the replicas' pipe and an optional pipe to service B, "
            f"B saturated at its limit ({serve.B_LIMIT} slots held by other calls)",
            t.degrade,
            degrade=True,
            rounds=t.degrade_rounds,
        ),
    )


# -- the replicas and gateways ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Call:
    """A call a replica got: when (s since the run began), its request id, which replica,
    and what it was given (``ok``, ``503``, ``hang``, ``slow``)."""

    at: float
    request_id: str
    replica: int
    outcome: str


async def _send(replica: Server, method: str, path: str, body: bytes = b"") -> bytes:
    request = (
        _load.post_request(path, body, close=True) if method == "POST" else _load.get_request(path)
    )
    status, answer = await _load.call(replica.host, replica.port, request)
    if status != 200:
        raise RuntimeError(f"replica {replica.kind} answered {method} {path} with {status}")
    return answer


async def set_modes(replicas: Sequence[Server], modes: Sequence[str | None]) -> None:
    for replica, mode in zip(replicas, modes, strict=True):
        if mode is not None:
            await _send(replica, "POST", "/_mode", mode.encode())


async def calls(replicas: Sequence[Server], origin: float) -> tuple[list[Call], int]:
    """Every call the replicas logged since their last reset, and the health checks."""
    found: list[Call] = []
    checks = 0
    for n, replica in enumerate(replicas):
        log = json.loads(await _send(replica, "GET", "/_log"))
        found += [Call(t - origin, rid, n, outcome) for t, rid, outcome in log["calls"]]
        checks += log["health"]
    found.sort(key=lambda c: c.at)
    return found, checks


@dataclass(frozen=True)
class Gateway:
    name: str
    label: str


GATEWAYS = (
    Gateway("pipework", "pipework"),
    Gateway("haproxy", "HAProxy"),
)


@dataclass(frozen=True)
class Served:
    """A gateway serving; how to read its state (``open`` or ``closed``) and what it has
    counted so far (retries, ejections...)."""

    server: Server
    state: Callable[[], Awaitable[str]]
    counters: Callable[[], Awaitable[dict[str, float]]]


#: pipework's counters read from ``/metrics``: our name, the family and its labels.
PIPEWORK_COUNTERS = {
    "retries": ("pipework_backend_retries_total", 'kind="retry"'),
    "hedges": ("pipework_backend_retries_total", 'kind="hedge"'),
    "budget spent": ("pipework_backend_retry_budget_exhausted_total", ""),
    "ejections": ("pipework_backend_host_ejections_total", ""),
    "breaker opened": ("pipework_backend_breaker_opened_total", ""),
    "refused": ("pipework_backend_refused_total", ""),
}


async def _metrics(server: Server) -> list[tuple[str, str, float]]:
    """pipework's ``/metrics`` as (family, labels, value) of the service's samples."""
    status, body = await _load.call(server.host, server.port, _load.get_request("/metrics"))
    if status != 200:
        raise RuntimeError(f"pipework's /metrics answered {status}")
    samples = []
    for line in body.decode().splitlines():
        name, brace, rest = line.partition("{")
        if brace and 'service="replicas"' in rest:
            labels, _, value = rest.rpartition("} ")
            samples.append((name, labels, float(value)))
    return samples


async def pipework_state_from_metrics(server: Server) -> str:
    """The breaker's state as the benchmark first read it, from ``/metrics`` (kept to
    measure what reading it ten times a second costs: ``benchmarks.resilience.probe``)."""
    for name, labels, value in await _metrics(server):
        if name == "pipework_backend_breaker_state" and value == 1:
            return "closed" if 'state="closed"' in labels else "open"
    return "closed"  # no series yet: no call was made


async def pipework_state(server: Server) -> str:
    """The breaker's state, from the admin API's service document (half open counts as
    open: calls are still refused). Not from ``/metrics``: its exposition costs the gateway
    several milliseconds of CPU, and read ten times a second it made the p99 it was
    polled to time (docs/resilience.md, "Measured")."""
    request = (
        "GET /admin/services/replicas HTTP/1.1\r\n"
        f"Host: {_load.HOST}\r\nAuthorization: Bearer {serve.admin_token()}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    status, body = await _load.call(server.host, server.port, request)
    if status != 200:
        raise RuntimeError(f"pipework's /admin/services/replicas answered {status}")
    state = json.loads(body)["breaker"]["state"]
    return "closed" if state == "closed" else "open"


async def pipework_counters(server: Server) -> dict[str, float]:
    samples = await _metrics(server)
    return {
        key: sum(v for name, labels, v in samples if name == family and label in labels)
        for key, (family, label) in PIPEWORK_COUNTERS.items()
    }


@contextlib.contextmanager
def started(
    gateway: Gateway, replicas: Sequence[Server], scenario: Scenario, b: Server | None = None
) -> Iterator[Served]:
    """``gateway`` serving the scenario in front of ``replicas`` (and, for the degradation
    scenario, of service B's replica ``b``)."""
    hosts = [replica.url for replica in replicas]
    if scenario.degrade and (gateway.name != "pipework" or b is None):
        raise ValueError("the degradation scenario runs on pipework, with B's replica")
    if gateway.name == "haproxy":
        with haproxy.started(hosts) as (server, stats_port):
            yield Served(
                server, lambda: haproxy.state(stats_port), lambda: haproxy.counters(stats_port)
            )
        return
    args = [arg for host in hosts for arg in ("--host", host)]
    args += ["--hedge"] if scenario.hedge else []
    args += ["--degrade", b.url] if scenario.degrade and b is not None else []
    serve.admin_token()  # in the environment the gateway inherits
    with _load.server("pipework", *args, module=SERVE) as server:
        yield Served(server, lambda: pipework_state(server), lambda: pipework_counters(server))


# -- one run -------------------------------------------------------------------------------


@dataclass
class Run:
    """One scenario through one gateway."""

    gateway: str
    scenario: Scenario
    answers: list[Answer]
    unfinished: list[float]
    calls: list[Call]
    checks: int
    #: When each change was made (s since the run began).
    changed: dict[str, float] = field(default_factory=dict)
    #: The gateway's state as read: (s since the run began, ``open``/``closed``).
    states: list[tuple[float, str]] = field(default_factory=list)
    #: What the gateway counted during the run (retries, ejections...).
    counted: dict[str, float] = field(default_factory=dict)

    def counted_text(self) -> str:
        return ", ".join(f"{n:,.0f} {name}" for name, n in self.counted.items() if n)

    @property
    def end(self) -> float:
        return self.scenario.seconds

    @property
    def sent(self) -> int:
        """Every request the load sent, answered or not."""
        return len(self.answers) + len(self.unfinished)

    def requests(self, start: float = 0.0, end: float = math.inf) -> list[Answer]:
        """The requests started in [start, end): those answered (or failed), and those
        still out when the load stopped that had waited :data:`STALLED` (status 0)."""
        found = [a for a in self.answers if start <= a.start < end]
        stalled = [
            Answer(t, self.end - t, 0)
            for t in self.unfinished
            if start <= t < end and t < self.end - STALLED
        ]
        return found + stalled

    def calls_in(self, start: float = -math.inf, end: float = math.inf) -> list[Call]:
        return [c for c in self.calls if start <= c.at < end]

    def opened(self, after: float) -> float:
        """When the gateway was first read open after ``after`` (NaN: never)."""
        return next((t for t, state in self.states if t >= after and state == "open"), math.nan)


async def _check(served: Served, path: str) -> None:
    server = served.server
    status, body = await _load.call(server.host, server.port, _load.get_request(path))
    if status != 200 or b'"ok":true' not in body.replace(b" ", b""):
        raise RuntimeError(f"{server.kind} answered GET {path} with {status} {body!r}")


async def run_one(
    gateway: Gateway,
    served: Served,
    replicas: Sequence[Server],
    scenario: Scenario,
    warm_up: float,
    think: str | None = None,
) -> Run:
    url = served.server.url + scenario.path
    await _check(served, scenario.path)
    await wrk(url, warm_up, think)  # keep-alive connections, latency estimates: not counted
    for replica in replicas:
        await _send(replica, "POST", "/_reset")
    before = [c for c in scenario.changes if c.at <= 0]
    for change in before:
        await set_modes(replicas, change.modes)
    counted = await served.counters()
    states: list[tuple[float, str]] = []
    output: list[tuple[float, str]] = []
    finished = trio.Event()

    async def load() -> None:
        output.append(await wrk(url, scenario.seconds, think))
        finished.set()

    changed: dict[str, float] = {}
    async with trio.open_nursery() as nursery:
        origin = time.monotonic()
        start = trio.current_time()
        nursery.start_soon(load)
        if scenario.poll:

            async def poll() -> None:
                while not finished.is_set():
                    state = await served.state()
                    states.append((time.monotonic() - origin, state))
                    with trio.move_on_after(POLL):
                        await finished.wait()

            nursery.start_soon(poll)
        for change in scenario.changes:
            if change.at <= 0:
                continue
            await trio.sleep_until(start + change.at)
            changed[change.name] = time.monotonic() - origin
            await set_modes(replicas, change.modes)
    after = await served.counters()
    began, stdout = output[0]
    # The load's own start is the origin: the changes were timed from just before it.
    shift = began - origin
    answers, unfinished = parse_wrk(stdout, began)
    found, checks = await calls(replicas, began)
    await set_modes(replicas, ("fast", "fast", "fast"))  # answers whatever still hangs
    return Run(
        gateway.name,
        scenario,
        answers,
        unfinished,
        found,
        checks,
        {c.name: 0.0 for c in before} | {name: t - shift for name, t in changed.items()},
        [(t - shift, state) for t, state in states],
        {name: after[name] - counted[name] for name in after},
    )


@dataclass(frozen=True)
class Phase:
    """One phase of the degradation scenario: route D under the load, B free or saturated;
    what the load recorded, and the calls of route D that reached B."""

    saturated: bool
    seconds: float
    answers: list[Answer]
    unfinished: list[float]
    calls_to_b: int

    def requests(self) -> list[Answer]:
        """Every request answered (or failed); those still out at the end did not wait
        long at this load, and are left out."""
        return self.answers


async def _hold(served: Served, n: int) -> None:
    """A call of the holding route: it holds a slot of B until B answers it."""
    request = (
        f"GET /hold HTTP/1.1\r\nHost: {served.server.host}\r\nX-Request-ID: hold-{n}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    status, body = await _load.call(served.server.host, served.server.port, request)
    if status != 200:
        raise RuntimeError(f"pipework answered GET /hold with {status}: {body[:200]!r}")


async def _logged(replica: Server, tag: str | None = None) -> int:
    """The calls ``replica`` logged since its last reset (only those whose request id
    begins with ``tag``, if given)."""
    calls = json.loads(await _send(replica, "GET", "/_log"))["calls"]
    return sum(1 for _, rid, _ in calls if tag is None or rid.startswith(tag))


async def run_degrade(
    served: Served, replicas: Sequence[Server], b: Server, scenario: Scenario, warm_up: float
) -> list[Phase]:
    """Route D under the load, as fast as it answers, in phases of ``scenario.seconds``:
    B free (route D alone: its optional branch calls B) and B saturated (B's replica holds
    every call, and as many calls of the holding route as B's limit hold every slot of B),
    the two in turns, ``scenario.rounds`` times each."""
    url = served.server.url + scenario.path
    await _check(served, scenario.path)
    await wrk(url, warm_up, AT_ONCE)  # keep-alive connections, B's branch's mean: not counted
    phases: list[Phase] = []
    for turn in range(scenario.rounds):
        # Each round in the other order, so that neither phase always comes first.
        for saturated in (False, True) if turn % 2 == 0 else (True, False):
            async with trio.open_nursery() as nursery:
                if saturated:
                    await set_modes([b], ["hang"])
                    await _send(b, "POST", "/_reset")
                    for n in range(serve.B_LIMIT):
                        nursery.start_soon(_hold, served, n)
                    # Every slot of B is held once B holds as many calls.
                    with trio.fail_after(10):
                        while await _logged(b) < serve.B_LIMIT:  # noqa: ASYNC110 - another process
                            await trio.sleep(0.02)
                for replica in (*replicas, b):
                    await _send(replica, "POST", "/_reset")
                # The phase's own ids: a request the last run left out may still reach B.
                tag = f"d{len(phases)}-"
                began, stdout = await wrk(url, scenario.seconds, AT_ONCE, tag)
                answers, unfinished = parse_wrk(stdout, began)
                calls_to_b = await _logged(b, tag)
                if saturated:
                    await set_modes([b], ["fast"])  # answers the held calls: B free again
            phases.append(Phase(saturated, scenario.seconds, answers, unfinished, calls_to_b))
    return phases


@dataclass
class Results:
    scenarios: tuple[Scenario, ...]
    quick: bool
    think: str = THINK
    runs: dict[tuple[str, str], Run] = field(default_factory=dict)
    load: list[tuple[float, float, float]] = field(default_factory=list)
    #: The degradation scenario's phases (pipework only: HAProxy has no counterpart).
    phases: list[Phase] = field(default_factory=list)

    def run(self, scenario: str, gateway: str) -> Run:
        return self.runs[scenario, gateway]

    def scenario(self, name: str) -> Scenario:
        return next(s for s in self.scenarios if s.name == name)


def measure(quick: bool, route: str | None = None, think: str | None = None) -> Results:
    """Every scenario through both gateways, the load on ``route`` (None: :data:`ROUTE`),
    its pauses drawn as ``think`` says (None: :data:`THINK`)."""
    native.ensure_installed("haproxy")  # before anything starts: apt-get is slow
    if _load.wrk_path() is None:
        raise RuntimeError("wrk is not installed (scripts/ensure-bench-tools installs it)")
    think = THINK if think is None else think
    if think not in THINKS:
        raise ValueError(f"think must be one of {', '.join(THINKS)}, not {think!r}")
    results = Results(scenarios(quick, route), quick, think)
    warm_up = 1.0 if quick else 2.0
    results.load.append(os.getloadavg())
    with contextlib.ExitStack() as stack:
        replicas = enter_all(stack, [_load.server(f"r{n}", module=REPLICA) for n in (1, 2, 3)])
        for turn, scenario in enumerate(results.scenarios):
            if scenario.degrade:
                (b,) = enter_all(stack, [_load.server("b", module=REPLICA)])
                with started(GATEWAYS[0], replicas, scenario, b) as served:
                    results.phases = trio.run(run_degrade, served, replicas, b, scenario, warm_up)
                continue
            # The gateways take turns going first.
            order = GATEWAYS if turn % 2 == 0 else GATEWAYS[::-1]
            for gateway in order:
                with started(gateway, replicas, scenario) as served:
                    results.runs[scenario.name, gateway.name] = trio.run(
                        run_one, gateway, served, replicas, scenario, warm_up, think
                    )
    results.load.append(os.getloadavg())
    return results


# -- figures -------------------------------------------------------------------------------


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile by nearest rank (NaN for no values)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def ok_share(requests: Sequence[Answer]) -> float:
    """The share of 2xx answers among ``requests``, in per cent."""
    return 100 * sum(a.ok for a in requests) / len(requests) if requests else math.nan


def latencies(requests: Sequence[Answer]) -> list[float]:
    """The times to the answer of the requests answered (a failed connection is none)."""
    return [a.latency for a in requests if a.status]


@dataclass(frozen=True)
class Figures:
    """What a scenario's goals name, for one gateway."""

    values: dict[str, float]
    note: str


def healthy(run: Run) -> Figures:
    requests = run.requests()
    lat = latencies(requests)
    values = {
        "p50": quantile(lat, 0.5) * 1e3,
        "p99": quantile(lat, 0.99) * 1e3,
        "ok": ok_share(requests),
        "rps": len(requests) / run.end,
    }
    note = (
        f"{values['rps']:,.0f} req/s, p50 {values['p50']:.1f} ms, p99 {values['p99']:.1f} ms, "
        f"{values['ok']:.2f} % 2xx"
    )
    return Figures(values, note)


def hang(run: Run, reference: Run) -> Figures:
    judged = run.requests(run.scenario.judged_from)
    during = run.requests(run.changed["hang"], run.scenario.judged_from)
    p99 = quantile(latencies(judged), 0.99) * 1e3
    healthy_p99 = healthy(reference).values["p99"]
    late = len(run.calls_in(run.scenario.judged_from))
    hung = sum(1 for c in run.calls_in(run.scenario.judged_from) if c.outcome == "hang")
    values = {"ok": ok_share(judged), "p99": p99, "p99_ratio": p99 / healthy_p99}
    note = (
        f"after t = {run.scenario.judged_from:g} s: {sum(a.ok for a in judged):,} 2xx of "
        f"{len(judged):,}, p99 {p99:.1f} ms vs {healthy_p99:.1f} ms healthy; {hung:,} of "
        f"{late:,} calls went to the hanging replica; from the hang to t = "
        f"{run.scenario.judged_from:g} s: {ok_share(during):.1f} % 2xx"
    )
    return Figures(values, note)


def failing(run: Run) -> Figures:
    requests = run.requests()
    reached = run.calls_in()
    failed = sum(1 for c in reached if c.outcome == "503")
    values = {"ok": ok_share(requests), "calls": len(reached) / run.sent}
    note = (
        f"{sum(a.ok for a in requests):,} 2xx of {len(requests):,} requests; the replicas got "
        f"{len(reached):,} calls ({failed:,} answered 503) for {run.sent:,} sent"
    )
    return Figures(values, note)


def down(run: Run) -> Figures:
    went, back = run.changed["down"], run.changed["back"]
    opened = run.opened(went)
    refused_from = opened if not math.isnan(opened) else went
    refused = [a for a in run.requests(refused_from, back) if not a.ok]
    p99 = quantile(latencies(refused), 0.99) * 1e3
    reached = run.calls_in(went, back)
    first_tries = len({c.request_id for c in reached})
    extra = 100 * (len(reached) - first_tries) / first_tries if first_tries else 0.0
    after = run.requests(back)
    failures = [a.start for a in after if not a.ok]
    closed = (max(failures) - back) if failures else 0.0
    first_ok = min((a.start for a in after if a.ok), default=math.nan) - back
    statuses: dict[int, int] = {}
    for a in refused:
        statuses[a.status] = statuses.get(a.status, 0) + 1
    asked = len(run.requests(went, back))
    values = {"p99": p99, "extra": extra, "closed": closed}
    opened_text = (
        f"read open {opened - went:.2f} s after the replicas went down"
        if not math.isnan(opened)
        else "never read open (p99 over the whole time down)"
    )
    note = (
        f"{opened_text}; then {len(refused):,} answers not 2xx "
        f"({', '.join(f'{n:,}×{s}' for s, n in sorted(statuses.items()))}), p50 "
        f"{quantile(latencies(refused), 0.5) * 1e3:.2f} ms; while down the replicas got "
        f"{len(reached):,} calls for {asked:,} requests ({first_tries:,} reached them); "
        f"back: first 2xx after {first_ok:.2f} s, every answer 2xx after {closed:.2f} s"
    )
    return Figures(values, note)


def tail(run: Run) -> Figures:
    requests = run.requests()
    lat = latencies(requests)
    p50, p99 = quantile(lat, 0.5) * 1e3, quantile(lat, 0.99) * 1e3
    reached = run.calls_in()
    slow = sum(1 for c in reached if c.outcome == "slow")
    extra = 100 * (len(reached) - run.sent) / run.sent
    values = {"ratio": p99 / p50, "extra": extra, "p50": p50, "p99": p99}
    note = (
        f"p50 {p50:.1f} ms, p99 {p99:.1f} ms, {ok_share(requests):.2f} % 2xx; the replicas "
        f"got {len(reached):,} calls ({slow:,} slow) for {run.sent:,} requests sent"
    )
    return Figures(values, note)


def degrade(phases: Sequence[Phase]) -> Figures:
    """Route D's throughput (2xx answers a second) with B saturated and alone, over all
    the phases of each, and the share of its answers marked degraded."""

    def of(saturated: bool) -> tuple[list[Answer], float, int]:
        chosen = [p for p in phases if p.saturated == saturated]
        answers = [a for p in chosen for a in p.requests()]
        return answers, sum(p.seconds for p in chosen), sum(p.calls_to_b for p in chosen)

    (held, held_s, held_b), (alone, alone_s, alone_b) = of(True), of(False)
    rps = {
        name: sum(a.ok for a in found) / s
        for name, found, s in (("saturated", held, held_s), ("alone", alone, alone_s))
    }
    marked = {
        name: 100 * sum(bool(a.degraded) for a in found) / len(found) if found else math.nan
        for name, found in (("saturated", held), ("alone", alone))
    }
    reasons: dict[str, int] = {}
    for a in held:
        if a.degraded:
            reasons[a.degraded] = reasons.get(a.degraded, 0) + 1
    ratio = rps["saturated"] / rps["alone"] if rps["alone"] else math.nan
    values = {
        "throughput": ratio,
        "cost": 1 / ratio if ratio else math.inf,
        "saturated_rps": rps["saturated"],
        "alone_rps": rps["alone"],
        "marked": marked["saturated"],
        "marked_alone": marked["alone"],
    }

    def summary(found: list[Answer]) -> str:
        lat = latencies(found)
        return (
            f"p50 {quantile(lat, 0.5) * 1e3:.1f} ms, p99 {quantile(lat, 0.99) * 1e3:.1f} ms, "
            f"{ok_share(found):.2f} % 2xx"
        )

    note = (
        f"throughput {ratio:.2f}× the route alone: {rps['saturated']:,.0f} req/s with B "
        f"saturated ({summary(held)}; {marked['saturated']:.2f} % of the answers marked "
        f"degraded: {', '.join(f'{n:,}×{r}' for r, n in sorted(reasons.items())) or 'none'}; "
        f"{held_b:,} calls of route D reached B), {rps['alone']:,.0f} req/s alone "
        f"({summary(alone)}; {marked['alone']:.2f} % marked degraded; {alone_b:,} calls to B)"
    )
    return Figures(values, note)


def figures(results: Results, scenario: str, gateway: str) -> Figures:
    run = results.run(scenario, gateway)
    if scenario == "hang":
        return hang(run, results.run("healthy", gateway))
    return figures_of(scenario, run)


def figures_of(scenario: str, run: Run) -> Figures:
    """The figures of a run of ``scenario`` that needs no other run (every one but *hang*)."""
    if scenario == "healthy":
        return healthy(run)
    if scenario == "503":
        return failing(run)
    if scenario.startswith("down"):
        return down(run)
    return tail(run)


def scenario_named(name: str, route: str) -> Scenario:
    """The full mode's scenario ``name`` with its load on ``route``."""
    return next(s for s in scenarios(False, route) if s.name == name)


# -- the report ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Goal:
    """A row of the report: the scenario, the figure (a key of its :class:`Figures`) and
    its unit, what it is, the goal's text and its bound (None: reported only; ``higher``:
    the figure must be at least the bound, else at most)."""

    scenario: str
    key: str
    unit: str
    what: str
    goal: str
    bound: float | None = None
    higher: bool = False

    def met(self, value: float) -> bool | None:
        if self.bound is None:
            return None
        return value >= self.bound if self.higher else value <= self.bound


GOALS = (
    Goal("healthy", "p99", "ms", "p99", "report (the reference)"),
    Goal("hang", "ok", "%", "2xx share after t = {judged} s", "≥ 99.5 %", 99.5, higher=True),
    Goal("hang", "p99_ratio", "×", "p99 after t = {judged} s ÷ healthy p99", "≤ 1.5×", 1.5),
    Goal("503", "ok", "%", "client-visible 2xx share", "≥ 99.5 %", 99.5, higher=True),
    Goal("503", "calls", "×", "calls reaching the replicas ÷ requests", "≤ 1.25×", 1.25),
    Goal("down", "p99", "ms", "p99 of the answers not 2xx after the breaker opens", "≤ 5 ms", 5),
    Goal(
        "down-proxy", "p99", "ms", "p99 of the answers not 2xx after the breaker opens", "≤ 5 ms", 5
    ),
    Goal(
        "down",
        "extra",
        "%",
        "load from retries while down (calls ÷ requests that reached a replica − 1)",
        f"≤ {RETRY_BUDGET:g} %",
        RETRY_BUDGET,
    ),
    Goal(
        "down",
        "closed",
        "s",
        "time from the replicas' return to the last answer not 2xx",
        f"≤ {BREAKER_WAIT:g} s + one probe ({PROBE:g} s)",
        BREAKER_WAIT + PROBE,
    ),
    Goal("tail", "ratio", "×", "p99 ÷ p50", "≤ 3×", 3),
    Goal(
        "tail",
        "extra",
        "%",
        "extra calls (calls reaching the replicas ÷ requests − 1)",
        "≤ 10 %",
        10,
    ),
)


def rows(results: Results) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    noted: set[str] = set()
    for goal in GOALS:
        ours = figures(results, goal.scenario, "pipework")
        theirs = figures(results, goal.scenario, "haproxy")
        mine, base = ours.values[goal.key], theirs.values[goal.key]
        scenario = results.scenario(goal.scenario)
        met = goal.met(mine)
        verdict = "" if met is None else ("met" if met else "missed")
        # The scenario's figures once, on its first row.
        if goal.scenario in noted:
            note = verdict
        else:
            noted.add(goal.scenario)
            note = "; ".join(
                part
                for part in (verdict, f"pipework: {ours.note}", f"HAProxy: {theirs.note}")
                if part
            )
        what = goal.what.format(judged=f"{scenario.judged_from:g}")
        found.append(
            {
                "scenario": f"{scenario.label}: {what}",
                "subject_us": mine,
                "unit": goal.unit,
                "baseline": "HAProxy, same run",
                "baseline_us": base,
                "ratio": mine / base if base else math.inf,
                "goal": goal.goal,
                "note": note,
            }
        )
    if results.phases:
        found += degrade_rows(results)
    return found


#: The degradation scenario's goal: the route keeps this share of its throughput alone.
KEEPS = 0.95


def degrade_rows(results: Results) -> list[dict[str, Any]]:
    """The degradation scenario's rows: pipework alone (HAProxy has no counterpart), route
    D with B saturated against the same route with B free, in the same run."""
    scenario = next(s for s in results.scenarios if s.degrade)
    ours = degrade(results.phases)
    values = ours.values
    kept = values["throughput"] >= KEEPS
    marked = values["marked"] >= 100
    alone = "the same route alone (B free: its branch calls B), same run"
    return [
        {
            "scenario": f"{scenario.label}: µs per answer (1 / throughput), "
            f"{CONNECTIONS} connections without pause",
            "subject_us": 1e6 / values["saturated_rps"],
            "baseline": alone,
            "baseline_us": 1e6 / values["alone_rps"],
            "ratio": values["cost"],
            "goal": f"≥ {KEEPS:g}× the throughput alone (≤ {1 / KEEPS:.2f}× its cost)",
            "note": f"{'met' if kept else 'missed'}; pipework: {ours.note}; no HAProxy "
            "row: it has no counterpart (no optional part of a request to leave out)",
        },
        {
            "scenario": f"{scenario.label}: share of the answers marked degraded "
            "(`Pipework-Degraded`)",
            "subject_us": values["marked"],
            "unit": "%",
            "baseline": "every answer",
            "baseline_us": 100.0,
            "ratio": values["marked"] / 100,
            "goal": "every answer (100 %)",
            "note": "met" if marked else "missed",
        },
    ]


def table(results: Results) -> list[str]:
    lines = [
        "| scenario | gateway | requests | 2xx | p50 | p99 | calls to the replicas | "
        "health checks | the gateway counted |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for scenario in results.scenarios:
        if scenario.degrade:
            lines += _phase_lines(scenario, results.phases)
            continue
        for gateway in GATEWAYS:
            run = results.run(scenario.name, gateway.name)
            requests = run.requests()
            lat = latencies(requests)
            lines.append(
                f"| {scenario.label} | {gateway.label} | {len(requests):,} | "
                f"{ok_share(requests):.2f} % | {quantile(lat, 0.5) * 1e3:.1f} ms | "
                f"{quantile(lat, 0.99) * 1e3:.1f} ms | {len(run.calls):,} | {run.checks:,} | "
                f"{run.counted_text()} |"
            )
    return lines


def _phase_lines(scenario: Scenario, phases: Sequence[Phase]) -> list[str]:
    """The degradation scenario's rows of the table: B free, then B saturated, each over
    all its phases."""
    lines = []
    for saturated, what in ((False, "B free (the route alone)"), (True, "B saturated")):
        chosen = [p for p in phases if p.saturated == saturated]
        requests = [a for p in chosen for a in p.requests()]
        lat = latencies(requests)
        marked = sum(bool(a.degraded) for a in requests)
        lines.append(
            f"| route D, {what}: {len(chosen)} × {scenario.seconds:g} s without pause | "
            f"pipework | {len(requests):,} | {ok_share(requests):.2f} % | "
            f"{quantile(lat, 0.5) * 1e3:.1f} ms | {quantile(lat, 0.99) * 1e3:.1f} ms | "
            f"{sum(p.calls_to_b for p in chosen):,} to B | | {marked:,} answers marked "
            "degraded |"
        )
    return lines


def report(results: Results) -> list[dict[str, Any]]:
    start, end = results.load[0], results.load[-1]
    mode = (
        "quick mode: every phase shortened, as the scenarios' labels say"
        if results.quick
        else "full mode"
    )
    route = {
        "pipe": f"route A, `GET {PATHS['pipe']}`, a chain of one HTTP pipe",
        "proxy": f"route A, `GET {PATHS['proxy']}`, a proxy route",
    }
    routes = ", ".join(sorted({route[s.route] for s in results.scenarios if not s.degrade}))
    pauses = {
        "exponential": f"pauses between an answer and the next request on each drawn at "
        f"random, exponential, mean {PAUSE_MS} ms",
        "staggered": f"{PAUSE_MS} ms between an answer and the next request on each, the "
        f"first requests spread over {PAUSE_MS} ms",
        "fixed": f"{PAUSE_MS} ms between an answer and the next request on each",
    }
    details = [
        f"Every scenario, whole runs ({mode}; {routes}; wrk, {CONNECTIONS} connections, "
        f"{pauses[results.think]}; route D's scenario without pause; "
        f"{native.version('haproxy')}; the machine's load average {start[0]:.2f} at the "
        f"start, {end[0]:.2f} at the end):",
        "",
        *table(results),
    ]
    return [*rows(results), {"markdown": details}]


def run(quick: bool) -> list[dict[str, Any]]:
    return report(measure(quick))
