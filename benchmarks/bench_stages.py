"""Parallel-stage overhead: the per-branch cost of ``all_of(4)`` (each branch a snapshot, a
task in the parent's step with its cancel scope, a delta and a merge) against a bare trio
nursery running the same four awaits. Two figures: the whole job's cost, parent included,
divided by four; and the cost per branch over the parent job — the ``all_of(4)`` job less a
job running one such pipe, divided by four — against the nursery job less one await, divided
by four (what a nursery task adds). Times are the process's CPU time: this machine's other
load stretches wall-clock time, not the work done."""

from __future__ import annotations

import statistics
import time
from typing import Any

import trio

import pipework as pw

BRANCHES = 4


async def _branch(ctx: pw.Context) -> None:
    await trio.lowlevel.checkpoint()
    ctx.state[ctx.pipe.name] = 1


def _bare(jobs: int, branches: bool = True) -> float:
    """A nursery of the branches per job; ``branches`` False: one await per job instead."""

    async def branch(state: dict[str, Any], name: str) -> None:
        await trio.lowlevel.checkpoint()
        state[name] = 1

    async def job() -> None:
        state: dict[str, Any] = {"user_id": 7}
        if not branches:
            await branch(state, "b0")
            return
        async with trio.open_nursery() as nursery:
            for n in range(BRANCHES):
                nursery.start_soon(branch, state, f"b{n}")

    async def main() -> float:
        start = time.process_time()
        async with trio.open_nursery() as nursery:
            for _ in range(jobs):
                nursery.start_soon(job)
        return time.process_time() - start

    return trio.run(main)


def _engine(jobs: int, branches: bool = True) -> float:
    """Jobs of ``all_of`` the branches; ``branches`` False: jobs of one such pipe."""
    engine = pw.Engine(
        pool=pw.WeightedPool(jobs * (BRANCHES + 1)),
        queue_capacity=jobs + 1,
        store=pw.MemoryJobStore(retain_count=jobs + 1),
    )
    if branches:
        engine.chain("c", pw.all_of(*(pw.Pipe(_branch, f"b{n}") for n in range(BRANCHES))))
    else:
        engine.chain("c", pw.Pipe(_branch, "b0"))

    async def main() -> float:
        async with engine:  # started before the clock starts
            start = time.process_time()
            ids = [await engine.submit("c", {"user_id": 7}) for _ in range(jobs)]
            for job_id in ids:
                await engine.wait(job_id)
            return time.process_time() - start

    return trio.run(main)


def run(quick: bool) -> list[dict[str, Any]]:
    jobs = 500 if quick else 3_000
    repeats = 3 if quick else 5
    # Interleaved, so that the four measures share the machine's load alike.
    times: dict[str, list[float]] = {"bare": [], "bare_one": [], "ours": [], "ours_one": []}
    for _ in range(repeats):
        times["bare"].append(_bare(jobs))
        times["bare_one"].append(_bare(jobs, branches=False))
        times["ours"].append(_engine(jobs))
        times["ours_one"].append(_engine(jobs, branches=False))
    us = {name: statistics.median(t) / jobs * 1e6 for name, t in times.items()}
    bare, ours = us["bare"] / BRANCHES, us["ours"] / BRANCHES
    bare_over = (us["bare"] - us["bare_one"]) / BRANCHES
    ours_over = (us["ours"] - us["ours_one"]) / BRANCHES
    return [
        {
            "scenario": f"all_of({BRANCHES}), {jobs:,} jobs: whole job / {BRANCHES}",
            "subject_us": ours,
            "baseline": f"bare trio nursery of {BRANCHES} tasks per job",
            "baseline_us": bare,
            "ratio": ours / bare,
            "goal": "",
            "note": f"{ours:,.1f} µs CPU per branch, the parent job's share included",
        },
        {
            "scenario": f"all_of({BRANCHES}), {jobs:,} jobs: cost per branch over the parent job",
            "subject_us": ours_over,
            "baseline": "a nursery task over one await",
            "baseline_us": bare_over,
            "ratio": ours_over / bare_over,
            "goal": "≤ 50 µs per branch",
            "note": (
                f"CPU per job: all_of {us['ours']:,.1f} µs, one pipe {us['ours_one']:,.1f} µs; "
                f"bare: nursery {us['bare']:,.1f} µs, one await {us['bare_one']:,.1f} µs"
            ),
        },
    ]
