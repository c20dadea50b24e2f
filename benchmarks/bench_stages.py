"""Parallel-stage overhead: the per-branch cost of ``all_of(4)`` (each branch a snapshot, a
task in the parent's step with its cancel scope, a delta and a merge; the whole job's cost,
parent included, divided by four) against a bare trio nursery running the same four
awaits."""

from __future__ import annotations

import time
from typing import Any

import trio

import pipework as pw

from ._timing import median_of, time_jobs

BRANCHES = 4


async def _branch(ctx: pw.Context) -> None:
    await trio.lowlevel.checkpoint()
    ctx.state[ctx.pipe.name] = 1


def _bare(jobs: int) -> float:
    async def branch(state: dict[str, Any], name: str) -> None:
        await trio.lowlevel.checkpoint()
        state[name] = 1

    async def job() -> None:
        state: dict[str, Any] = {"user_id": 7}
        async with trio.open_nursery() as nursery:
            for n in range(BRANCHES):
                nursery.start_soon(branch, state, f"b{n}")

    async def main() -> float:
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(jobs):
                nursery.start_soon(job)
        return time.perf_counter() - start

    return trio.run(main)


def _engine(jobs: int) -> float:
    engine = pw.Engine(
        pool=pw.WeightedPool(jobs * (BRANCHES + 1)),
        queue_capacity=jobs + 1,
        store=pw.MemoryJobStore(retain_count=jobs + 1),
    )
    engine.chain("c", pw.all_of(*(pw.Pipe(_branch, f"b{n}") for n in range(BRANCHES))))

    return time_jobs(engine, "c", {"user_id": 7}, jobs)


def run(quick: bool) -> list[dict[str, Any]]:
    jobs = 500 if quick else 3_000
    repeats = 3 if quick else 5
    per_branch = jobs * BRANCHES
    bare = median_of(repeats, _bare, jobs) / per_branch * 1e6
    ours = median_of(repeats, _engine, jobs) / per_branch * 1e6
    return [
        {
            "scenario": f"all_of({BRANCHES}), {jobs:,} jobs: cost per branch",
            "subject_us": ours,
            "baseline": f"bare trio nursery of {BRANCHES} tasks per job",
            "baseline_us": bare,
            "ratio": ours / bare,
            "goal": "≤ 50 µs per branch",
            "note": f"{ours:,.1f} µs per branch",
        }
    ]
