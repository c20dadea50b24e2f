"""What a board write costs through the Redis backplane next to the local one, in one run.

Scenarios, each against the local backplane (one process, versions counted in place) on the
same boards: a write awaited until it is applied in the writing process (one Lua script,
then the process's own reader applies it from the board's log); the same write awaited
until a second process's boards (a second ``Boards`` in the same trio run, on the same
Redis) have applied it, which is what a follower elsewhere waits for; and eight writers at
once. A ``redis-server`` is started for the run (no persistence). µs per write, the median
of the repetitions.

    .venv/bin/python -m benchmarks --only bench_board_redis [--quick]
"""

from __future__ import annotations

import time
from typing import Any

import trio

from pipework.board import Backplane, Boards, BoardSettings, BoardSpec, Change, Version
from pipework.redis._backplane import RedisBackplane

from ._redis import redis_server
from ._timing import median_of

BASELINE = "LocalBackplane"
WRITERS = 8


def _boards(backplane: Backplane | None) -> Boards:
    spec = BoardSpec("b", BoardSettings(window=0.01, max_resources=10_000_000))
    return Boards([spec], backplane=backplane)


def _measure(writes: int, url: str | None, scenario: str) -> float:
    """Seconds per write (``url`` None: the local backplane)."""
    prefix = f"bench{time.monotonic_ns()}"

    def plane() -> Backplane | None:
        return None if url is None else RedisBackplane(url, prefix=prefix)

    async def main() -> float:
        a = _boards(plane())
        b = _boards(plane()) if url is not None and scenario == "elsewhere" else None
        async with trio.open_nursery() as nursery:
            await nursery.start(a.run)
            if b is not None:
                await nursery.start(b.run)
            await a.write(Change("b", "create", "r", 0))
            other = b if b is not None else a

            async def applied(version: Version) -> None:
                while True:
                    if other.cores["b"].position >= version:
                        return
                    await trio.lowlevel.checkpoint()  # the other process's reader is coming

            async def writer(count: int) -> None:
                for n in range(count):
                    version = await a.write(Change("b", "update", "r", n))
                    if scenario == "elsewhere":
                        await applied(version)

            start = time.perf_counter()
            if scenario == "concurrent":
                async with trio.open_nursery() as writers:
                    for _ in range(WRITERS):
                        writers.start_soon(writer, writes // WRITERS)
            else:
                await writer(writes)
            elapsed = time.perf_counter() - start
            nursery.cancel_scope.cancel()
        return elapsed / writes

    return trio.run(main)


def run(quick: bool) -> list[dict[str, Any]]:
    writes, repeats = (400, 3) if quick else (4000, 5)
    rows = []
    with redis_server("bench_board_redis") as url:
        for scenario, label in (
            ("here", "a write, awaited until applied in its process"),
            ("elsewhere", "a write, awaited until applied in a second process"),
            ("concurrent", f"{WRITERS} writers at once, per write"),
        ):
            local = median_of(repeats, _measure, writes, None, scenario)
            redis = median_of(repeats, _measure, writes, url, scenario)
            rows.append(
                {
                    "scenario": label,
                    "subject_us": redis * 1e6,
                    "baseline": BASELINE,
                    "baseline_us": local * 1e6,
                    "ratio": redis / local,
                    "note": f"{1 / redis:,.0f} writes/s on Redis",
                }
            )
    return rows
