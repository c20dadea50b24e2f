"""Engine overhead: jobs through a 1-pipe and a 5-pipe serial chain, against bare trio
spawning one task per job that does the same awaits. Times are the process's CPU time
(both sides run in this one thread: the machine's other load stretches wall-clock time,
not the work done), and the two sides take turns, so that they share the machine alike."""

from __future__ import annotations

import statistics
import time
from typing import Any

import trio

import pipework as pw


async def _checkpoint_pipe(ctx: pw.Context) -> None:
    await trio.lowlevel.checkpoint()


def _bare(jobs: int, awaits: int, workers: int | None) -> float:
    limiter = trio.CapacityLimiter(workers) if workers else None

    async def job() -> None:
        if limiter is None:
            for _ in range(awaits):
                await trio.lowlevel.checkpoint()
            return
        async with limiter:
            for _ in range(awaits):
                await trio.lowlevel.checkpoint()

    async def main() -> float:
        start = time.process_time()
        async with trio.open_nursery() as nursery:
            for _ in range(jobs):
                nursery.start_soon(job)
        return time.process_time() - start

    return trio.run(main)


def _engine(jobs: int, pipes: int, workers: int) -> float:
    engine = pw.Engine(
        pool=pw.WeightedPool(workers, default=pw.Weights(max_waiting=jobs)),
        queue_capacity=jobs + 1,
        store=pw.MemoryJobStore(retain_count=jobs + 1),
    )
    names = []
    for n in range(pipes):
        engine.registry.add_pipe(pw.Pipe(_checkpoint_pipe, f"p{n}"))
        names.append(f"p{n}")
    engine.chain("c", *names)

    async def main() -> float:
        async with engine:  # started before the clock starts
            start = time.process_time()
            ids = [await engine.submit("c", {}) for _ in range(jobs)]
            for job_id in ids:
                await engine.wait(job_id)
            return time.process_time() - start

    return trio.run(main)


def run(quick: bool) -> list[dict[str, Any]]:
    jobs = 2_000 if quick else 20_000
    repeats = 3 if quick else 5
    rows = []
    for pipes, workers in ((1, jobs), (5, jobs), (1, 64)):
        limited = workers < jobs
        bares, ourses = [], []
        for _ in range(repeats):  # in turns
            bares.append(_bare(jobs, pipes, workers if limited else None))
            ourses.append(_engine(jobs, pipes, workers))
        bare = statistics.median(bares) / jobs * 1e6
        ours = statistics.median(ourses) / jobs * 1e6
        rows.append(
            {
                "scenario": f"engine: {pipes}-pipe serial chain, {jobs:,} jobs, "
                f"{'no slot waits' if workers == jobs else f'{workers} workers'}",
                "subject_us": ours,
                "baseline": f"bare trio: a task per job, {pipes} checkpoint(s)"
                + (f", CapacityLimiter({workers})" if limited else ""),
                "baseline_us": bare,
                "ratio": ours / bare,
                "goal": "≤ 2.0×" if pipes == 1 and workers == jobs else "",
                "note": f"{1e6 / ours:,.0f} jobs/s vs {1e6 / bare:,.0f} tasks/s (CPU time)",
            }
        )
    return rows
