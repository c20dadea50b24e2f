"""A property of degradation under any load: a pipe degraded for want of a slot never held
one. Jobs whose ``all_of`` has an optional branch on a key held at or near its limit, with
any pool, any holders and any timing: every job ends done; each optional pipe either ran or
was degraded, never both; the key granted exactly its holders and the runs (a degraded
branch took none); and no pipe of the key ever ran beyond its limit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

import pipework as pw

HANG_GUARD = 100.0  # virtual seconds: a job that waits for ever fails the example at once


@dataclass(frozen=True)
class Load:
    max_workers: int
    limit: int  # the optional pipe's key's (0: paused)
    holders: int  # slots of that key held from the start
    release_at: float | None  # when the holders let go (None: never)
    jobs: list[tuple[float, float, float]]  # submitted at, optional pipe's time, other's


@st.composite
def loads(draw: st.DrawFn) -> Load:
    limit = draw(st.integers(0, 2))
    job = st.tuples(
        st.sampled_from([0.0, 0.25, 1.0]),
        st.sampled_from([0.0, 0.5, 2.0]),
        st.sampled_from([0.0, 1.0]),
    )
    return Load(
        # Two slots beyond the key's limit at least: the other branches always get theirs.
        max_workers=draw(st.integers(limit + 2, 6)),
        limit=limit,
        holders=draw(st.integers(0, limit)),
        release_at=draw(st.sampled_from([None, 0.5, 1.5])),
        jobs=draw(st.lists(job, min_size=1, max_size=8)),
    )


@settings(max_examples=100)
@given(loads())
def test_a_branch_degraded_for_want_of_a_slot_never_held_one(load: Load) -> None:
    limit = load.limit
    pool = pw.WeightedPool(load.max_workers, keys={"recs": pw.Weights(limit=limit)})
    engine = pw.Engine(pool=pool)
    ran: list[str] = []
    over_limit: list[int] = []

    async def recommend(ctx: pw.Context) -> None:
        in_use = pool.statistics().keys["recs"].in_use
        if in_use > limit:
            over_limit.append(in_use)
        ran.append(ctx.state["n"])
        await trio.sleep(ctx.state["recs_take"])
        ctx.state["recs"] = True

    async def other(ctx: pw.Context) -> None:
        await trio.sleep(ctx.state["other_take"])
        ctx.state["other"] = True

    engine.chain(
        "page",
        pw.all_of(
            pw.Pipe(other, "other"),
            pw.Pipe(recommend, "recommend", key="recs", optional=True),
        ),
    )

    async def main() -> tuple[list[dict[str, Any]], int]:
        release = trio.Event()

        async def hold() -> None:
            async with pool.slot("recs"):
                await release.wait()

        async def submit(n: int, at: float, recs_take: float, other_take: float) -> str:
            await trio.sleep_until(at)
            state = {"n": str(n), "recs_take": recs_take, "other_take": other_take}
            return await engine.submit("page", state)

        with trio.fail_after(HANG_GUARD):
            async with engine, trio.open_nursery() as nursery:
                for _ in range(load.holders):
                    nursery.start_soon(hold)
                await trio.testing.wait_all_tasks_blocked()
                if load.release_at is not None:
                    nursery.start_soon(_release_at, release, load.release_at)
                ids = [await submit(n, *job) for n, job in enumerate(load.jobs)]
                results = [await engine.wait(job_id) for job_id in ids]
                admitted = pool.statistics().keys["recs"].admitted
                release.set()
        return results, admitted

    results, admitted = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    degraded = {str(r["n"]) for r in results if r.get("degraded") == {"recommend": "no_slot"}}
    assert all(r["other"] is True for r in results)
    assert {str(r["n"]) for r in results if r.get("recs")} == set(ran)
    assert set(ran).isdisjoint(degraded)
    assert set(ran) | degraded == {str(n) for n in range(len(results))}
    assert admitted == load.holders + len(ran)
    assert over_limit == []


async def _release_at(release: trio.Event, at: float) -> None:
    await trio.sleep_until(at)
    release.set()
