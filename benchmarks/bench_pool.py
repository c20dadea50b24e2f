"""What a ``WeightedPool.slot`` costs next to a bare ``trio.CapacityLimiter``, in one run.

Scenarios: an uncontended acquire + release (the hot path: a slot is free, nobody waits); a
contended hand-off (one slot, four tasks: every release hands the slot to a parked waiter),
without a wait bound and with one (the pool's wait timeout against the limiter inside
``trio.move_on_after``: either way each wait pays for a cancel scope); and a contended
hand-off across four keys sharing two slots (the fair-share choice at work). Subject and
baseline alternate inside one ``trio.run``; each row is the median of the repetitions, in
microseconds per acquire.

    .venv/bin/python benchmarks/bench_pool.py [--quick]
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from types import TracebackType

import trio

from pipework.dispatcher._weighted import WeightedPool
from pipework.dispatcher._weighted_config import Weights

BASELINE = "trio.CapacityLimiter"
KEYS = ("users", "search", "billing", "export")

Timer = Callable[[], Awaitable[float]]


def _pool(max_workers: int, wait_timeout: float | None = 10.0) -> WeightedPool:
    # Weights like a small gateway's, so lookups and accounting are not a trivial case.
    keys = {"users": Weights(reserve=1), "search": Weights(limit=16)}
    return WeightedPool(max_workers, keys=keys, wait_timeout=wait_timeout)


class _BoundedLimiter:
    """``trio.CapacityLimiter`` with its wait bounded the way pipework bounds every wait."""

    def __init__(self, total: int, timeout: float) -> None:
        self._limiter = trio.CapacityLimiter(total)
        self._timeout = timeout

    async def __aenter__(self) -> None:
        with trio.move_on_after(self._timeout):
            await self._limiter.acquire()
            return
        raise TimeoutError

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._limiter.release()


def _uncontended(make: Callable[[], AbstractAsyncContextManager[None]], n: int) -> Timer:
    async def timed() -> float:
        start = time.perf_counter()
        for _ in range(n):
            async with make():
                pass
        return (time.perf_counter() - start) / n * 1e6

    return timed


def _contended(
    make: Callable[[str], AbstractAsyncContextManager[None]], tasks: int, n: int
) -> Timer:
    async def worker(key: str) -> None:
        for _ in range(n):
            async with make(key):
                pass  # releasing without a checkpoint: the next acquire finds a waiter first

    async def timed() -> float:
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(tasks):
                nursery.start_soon(worker, KEYS[i % len(KEYS)])
        return (time.perf_counter() - start) / (tasks * n) * 1e6

    return timed


def _measure(subject: Timer, baseline: Timer, reps: int) -> tuple[float, float]:
    async def main() -> tuple[float, float]:
        await subject()  # warm-up
        await baseline()
        ours: list[float] = []
        theirs: list[float] = []
        for _ in range(reps):
            ours.append(await subject())
            theirs.append(await baseline())
        return statistics.median(ours), statistics.median(theirs)

    gc.disable()  # as timeit does: a collection landing in one side's loop is noise
    try:
        return trio.run(main)
    finally:
        gc.enable()


def _row(
    scenario: str, baseline: str, us: tuple[float, float], goal: str, note: str
) -> dict[str, object]:
    subject_us, baseline_us = us
    return {
        "scenario": scenario,
        "subject_us": round(subject_us, 3),
        "baseline": baseline,
        "baseline_us": round(baseline_us, 3),
        "ratio": round(subject_us / baseline_us, 2),
        "goal": goal,
        "note": note,
    }


def run(quick: bool) -> list[dict[str, object]]:
    n, per_task, reps = (20_000, 2_500, 3) if quick else (50_000, 5_000, 5)
    bounded = f"{BASELINE} + move_on_after"
    rows = []

    pool, limiter = _pool(64), trio.CapacityLimiter(64)
    us = _measure(
        _uncontended(lambda: pool.slot("users"), n), _uncontended(lambda: limiter, n), reps
    )
    note = f"median of {reps} × {n:,} `async with`; both make one schedule point per acquire"
    rows.append(_row("uncontended acquire + release", BASELINE, us, "≤ 1.5×", note))

    pool, limiter = _pool(1, wait_timeout=None), trio.CapacityLimiter(1)
    us = _measure(
        _contended(lambda _key: pool.slot("users"), 4, per_task),
        _contended(lambda _key: limiter, 4, per_task),
        reps,
    )
    note = "per acquire; no wait bound on either side; each release hands the slot over"
    rows.append(_row("contended hand-off, 1 slot, 4 tasks", BASELINE, us, "report only", note))

    pool, bounded_limiter = _pool(1), _BoundedLimiter(1, 10.0)
    us = _measure(
        _contended(lambda _key: pool.slot("users"), 4, per_task),
        _contended(lambda _key: bounded_limiter, 4, per_task),
        reps,
    )
    note = "per acquire; a 10 s wait bound on both sides: each wait enters a cancel scope"
    rows.append(_row("contended hand-off, bounded wait", bounded, us, "report only", note))

    pool, bounded_limiter = _pool(2), _BoundedLimiter(2, 10.0)
    us = _measure(
        _contended(lambda key: pool.slot(key), 8, per_task),
        _contended(lambda _key: bounded_limiter, 8, per_task),
        reps,
    )
    note = "per acquire; the pool also picks the least-served key (the limiter is FIFO)"
    rows.append(_row("contended, 2 slots, 8 tasks, 4 keys", bounded, us, "report only", note))
    return rows


if __name__ == "__main__":
    for row in run(quick="--quick" in sys.argv):
        print(
            f"{row['scenario']:<36} {row['subject_us']:>8} µs  vs {row['baseline_us']:>8} µs "
            f"({row['baseline']})  ratio {row['ratio']}  goal {row['goal']}"
        )
