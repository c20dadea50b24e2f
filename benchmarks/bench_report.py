"""The report example (seed 000): 20 report requests at once against the PDF stage as a
pool of 4 worker processes (each its own headless Chromium) and, as the baseline, a pool
of 1 — the seed's single ``synchronized`` PDF worker — both served in this run by
``examples/report`` on a real socket, with the shipped ``achievement`` template. After a
warm-up (every worker renders), the two services take turns: each round sends 20 requests
at once to one of them and waits for all. Rows are per-request latency (p50, p99 over every
request of every round) and each round's time to finish all 20, in **ms**. On a 2-core
machine four browsers share two cores, so the pool cannot be four times faster; the ratio
says how much of the queueing it removes.

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
        self.failed = 0

    async def burst(self, count: int, *, record: bool) -> None:
        body = json.loads(SAMPLE.read_text())

        async def one() -> None:
            start = time.perf_counter()
            response = await self.client.post("/reports", json=body)
            if response.status_code != 200:
                self.failed += 1
            elif record:
                self.latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        async with trio.open_nursery() as clients:
            for _ in range(count):
                clients.start_soon(one)
        if record:
            self.walls.append(time.perf_counter() - start)


async def _measure(sizes: tuple[int, ...], rounds: int) -> list[_Arm]:
    """Serve one report service per pool size, warm each up, then give them rounds in
    turn, so that whatever else loads the machine weighs on both alike."""
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
            for _ in range(rounds):
                for arm in arms:
                    await arm.burst(CONCURRENT, record=True)
            stop.set()
    return arms


def run(quick: bool) -> list[dict[str, Any]]:
    rounds = 2 if quick else 5
    pooled, single = trio.run(_measure, (4, 1), rounds)
    baseline = "pool of 1 (the seed's synchronized worker)"
    failures = pooled.failed + single.failed
    note = f"{rounds} rounds × {CONCURRENT} requests each, taking turns; {failures} failed"
    rows = []
    for scenario, pick in (
        ("20 at once, pool of 4: p50 latency", lambda a: _percentile(a.latencies, 0.5)),
        ("20 at once, pool of 4: p99 latency", lambda a: _percentile(a.latencies, 0.99)),
        ("20 at once, pool of 4: all 20 done", lambda a: statistics.median(a.walls)),
    ):
        subject, base = pick(pooled) * 1e3, pick(single) * 1e3
        rows.append(
            {
                "scenario": scenario,
                "subject_us": round(subject, 1),
                "baseline": baseline,
                "baseline_us": round(base, 1),
                "ratio": round(subject / base, 2),
                "unit": "ms",
                "goal": "report only",
                "note": note if "all 20" not in scenario else "median of the rounds",
            }
        )
    return rows
