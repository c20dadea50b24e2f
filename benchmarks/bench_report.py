"""The report example (seed 000): one hot report, and 20 report requests at once against
the PDF stage as pools of 1, 2 and 4 worker processes (each its own headless Chromium),
all served in this run by ``examples/report`` on a real socket, with the shipped
``achievement`` template. The pool of 1 is the seed's single ``synchronized`` PDF worker.

Each service's start-up is timed (its workers start at once). After a warm-up (every
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

from examples.report.config import ReportConfig
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
        self.start_up = 0.0
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
                started = time.perf_counter()
                serving: Serving = await nursery.start(functools.partial(serve, config, stop=stop))
                client = await clients.enter_async_context(
                    httpx.AsyncClient(
                        base_url=serving.url,
                        timeout=300,
                        limits=httpx.Limits(max_connections=CONCURRENT),
                        trust_env=False,
                    )
                )
                arm = _Arm(client, size)
                arm.start_up = time.perf_counter() - started
                arms.append(arm)
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
    for size in SIZES:
        arm = by_size[size]
        rows.append(
            {
                "scenario": f"start-up, pool of {size}: serving",
                "subject_us": round(arm.start_up * 1e3, 1),
                "baseline": "pool of 1",
                "baseline_us": round(single.start_up * 1e3, 1),
                "ratio": round(arm.start_up / single.start_up, 2),
                "unit": "ms",
                "goal": "report only",
                "note": "templates, every worker's browser and first page, the server; "
                "the workers start at once",
            }
        )
    return rows
