"""The report example (seed 000): one hot report, and 20 report requests at once against
the PDF stage as pools of 1, 2 and 4 worker processes (each its own headless Chromium),
all served in this run by ``examples/report`` on a real socket, with the shipped
``achievement`` template. The pool of 1 is the seed's single ``synchronized`` PDF worker.

First a pool of 4 workers is started and closed twice, its workers launched at once (as
the service does) and one after another (as it did): the time until every worker is ready
(its browser up, its page made, a warm-up page rendered). Then, after a warm-up (every
worker renders), one hot report is sent at a time to the pool of 4 (``HOT`` of them: the
median is the row); then the services take turns: each round sends 20 requests at once to
one of them and waits for all. Rows are per-request latency (p50, p99 over every request of
every round) and each round's time to finish all 20, in **ms**. On a 2-core machine four
browsers share two cores, so a pool cannot be four times faster; the ratio says how much
of the queueing it removes. The seed's own figures (260 to 300 ms for one hot request, a
1 to 1.5 s queueing window for 20 with a pool of 4) are quoted beside ours.

    .venv/bin/python -m benchmarks --only bench_report [--quick]
"""

from __future__ import annotations

import functools
import json
import statistics
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import trio

import pipework as pw
from examples.report.config import ReportConfig
from examples.report.pdf import PdfWorker, WorkerLauncher, WorkerSettings
from examples.report.service import Serving, serve

SAMPLE = Path(__file__).resolve().parent.parent / "examples" / "report" / "sample.json"
CONCURRENT = 20
SIZES = (4, 2, 1)
SEED_HOT = "seed 000: 260–300 ms hot"
SEED_BURST = "seed 000: 1,000–1,500 ms (its estimate)"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class _Arm:
    """One service and what its rounds measured."""

    def __init__(self, client: httpx.AsyncClient, pool_size: int) -> None:
        self.client = client
        self.pool_size = pool_size
        self.latencies: list[float] = []
        self.walls: list[float] = []
        self.hot: list[float] = []
        self.failed = 0

    async def burst(self, count: int, *, record: bool, hot: bool = False) -> None:
        body = json.loads(SAMPLE.read_text())

        async def one() -> None:
            start = time.perf_counter()
            response = await self.client.post("/reports", json=body)
            if response.status_code != 200:
                self.failed += 1
            elif record:
                self.latencies.append(time.perf_counter() - start)
            elif hot:
                self.hot.append(time.perf_counter() - start)

        start = time.perf_counter()
        async with trio.open_nursery() as clients:
            for _ in range(count):
                clients.start_soon(one)
        if record:
            self.walls.append(time.perf_counter() - start)


async def _start_up(size: int, *, concurrent: bool) -> float:
    """Seconds until a pool of ``size`` workers is ready (then it is closed)."""
    pool: pw.ResourcePool[PdfWorker] = pw.ResourcePool(
        WorkerLauncher(WorkerSettings()),
        size,
        borrow_timeout=300.0,
        launch_timeout=120.0,
        name="pdf",
        concurrent_start=concurrent,
    )
    started = time.perf_counter()
    async with pool:
        return time.perf_counter() - started


async def _measure(sizes: tuple[int, ...], rounds: int, hot: int) -> list[_Arm]:
    """Serve one report service per pool size, warm each up, time ``hot`` single reports on
    the first, then give them rounds in turn, so that whatever else loads the machine weighs
    on all alike."""
    with tempfile.TemporaryDirectory(prefix="bench-report-") as directory:
        stop = trio.Event()
        async with trio.open_nursery() as nursery, AsyncExitStack() as clients:
            arms = []
            for size in sizes:
                config = ReportConfig(
                    port=0,
                    storage=Path(directory) / str(size),
                    pool_size=size,
                    borrow_timeout=300.0,
                    timeout=300.0,
                )
                serving: Serving = await nursery.start(functools.partial(serve, config, stop=stop))
                client = await clients.enter_async_context(
                    httpx.AsyncClient(
                        base_url=serving.url,
                        timeout=300,
                        limits=httpx.Limits(max_connections=CONCURRENT),
                        trust_env=False,
                    )
                )
                arms.append(_Arm(client, size))
            for arm in arms:
                await arm.burst(arm.pool_size * 2, record=False)  # every worker has rendered
            for _ in range(hot):
                await arms[0].burst(1, record=False, hot=True)
            for _ in range(rounds):
                for arm in arms:
                    await arm.burst(CONCURRENT, record=True)
            stop.set()
    return arms


def run(quick: bool) -> list[dict[str, Any]]:
    rounds = 2 if quick else 5
    hot = 10 if quick else 30
    at_once = trio.run(functools.partial(_start_up, 4, concurrent=True))
    in_turn = trio.run(functools.partial(_start_up, 4, concurrent=False))
    arms = trio.run(_measure, SIZES, rounds, hot)
    by_size = {arm.pool_size: arm for arm in arms}
    single = by_size[1]
    baseline = "pool of 1 (the seed's synchronized worker)"
    failures = sum(arm.failed for arm in arms)
    note = f"{rounds} rounds × {CONCURRENT} requests each, taking turns; {failures} failed"
    pooled = by_size[4]
    hot_ms = statistics.median(pooled.hot) * 1e3
    rows: list[dict[str, Any]] = [
        {
            "scenario": "one hot report, pool of 4 (median)",
            "subject_us": round(hot_ms, 1),
            "baseline": SEED_HOT,
            "baseline_us": 280.0,
            "ratio": round(hot_ms / 280.0, 2),
            "unit": "ms",
            "goal": "≤ 400 ms",
            "note": f"median of {hot}, one at a time; p90 "
            f"{_percentile(pooled.hot, 0.9) * 1e3:,.0f} ms",
        }
    ]
    for size in SIZES:
        arm = by_size[size]
        wall = statistics.median(arm.walls) * 1e3
        base = statistics.median(single.walls) * 1e3
        rows.append(
            {
                "scenario": f"20 at once, pool of {size}: all 20 done",
                "subject_us": round(wall, 1),
                "baseline": baseline,
                "baseline_us": round(base, 1),
                "ratio": round(wall / base, 2),
                "unit": "ms",
                "goal": f"≤ 3,000 ms ({SEED_BURST})" if size == 4 else "report only",
                "note": f"median of the rounds; p50 latency "
                f"{_percentile(arm.latencies, 0.5) * 1e3:,.0f} ms, p99 "
                f"{_percentile(arm.latencies, 0.99) * 1e3:,.0f} ms; {note}",
            }
        )
    rows.append(
        {
            "scenario": "start-up, pool of 4: every worker ready",
            "subject_us": round(at_once * 1e3, 1),
            "baseline": "the same, one after another",
            "baseline_us": round(in_turn * 1e3, 1),
            "ratio": round(at_once / in_turn, 2),
            "unit": "ms",
            "goal": "report only",
            "note": "each worker: its process, its browser, its page and a warm-up render; "
            "once each",
        }
    )
    return rows
