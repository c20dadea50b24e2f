"""Small timing helpers shared by the scenarios."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import trio

import pipework as pw


def median_of(repeats: int, measure: Callable[..., float], *args: Any) -> float:
    """The median of ``repeats`` calls of ``measure(*args)`` (each one a fresh run)."""
    return statistics.median(measure(*args) for _ in range(repeats))


def time_jobs(engine: pw.Engine, chain: str, state: dict[str, Any], jobs: int) -> float:
    """Seconds to submit ``jobs`` jobs on ``chain`` and wait for every one, in a fresh
    ``trio.run`` (the engine started before the clock starts)."""

    async def main() -> float:
        async with engine:
            start = time.perf_counter()
            ids = [await engine.submit(chain, dict(state)) for _ in range(jobs)]
            for job_id in ids:
                await engine.wait(job_id)
            return time.perf_counter() - start

    return trio.run(main)
