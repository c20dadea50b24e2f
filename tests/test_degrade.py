"""Pipes a job can do without, in the engine: skipped or answered by their fallback when
their key has no slot free at once, refuses calls, has too little time left, or when they
fail; recorded in the state, the metrics and the job's view. No sockets; time is virtual
(autojump_clock) and exact."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import pytest
import trio

import pipework as pw

from ._redis import wait_idle

# The engine's suite runs on every store: see each_store in conftest.py.
pytestmark = pytest.mark.usefixtures("each_store")


class Breakers:
    """A stand-in for the services' circuit breakers: the keys in ``open`` refuse calls."""

    def __init__(self) -> None:
        self.open: set[str] = set()
        self.asked: list[str] = []

    def refusing(self, key: str) -> bool:
        self.asked.append(key)
        return key in self.open


class Learning(pw.WeightedPool):
    """A weighted pool that remembers what each pipe's end taught it (key, ok)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.taught: list[tuple[str, bool]] = []

    def record(self, key: str, *, ok: bool, latency: float) -> None:
        self.taught.append((key, ok))
        super().record(key, ok=ok, latency=latency)


class Plain:
    """A pool with only the Admission interface: it cannot say at once whether a slot is
    free (no ``grant_nowait``)."""

    def __init__(self, pool: pw.WeightedPool) -> None:
        self.pool = pool

    def slot(
        self, key: str, *, deadline: float = math.inf, continuing: bool = False
    ) -> AbstractAsyncContextManager[None]:
        return self.pool.slot(key, deadline=deadline, continuing=continuing)

    def record(self, key: str, *, ok: bool, latency: float) -> None:
        self.pool.record(key, ok=ok, latency=latency)


@asynccontextmanager
async def saturated(pool: pw.WeightedPool, key: str, slots: int = 1) -> AsyncIterator[trio.Event]:
    """``key`` held at its limit by ``slots`` holders of its slots (set the event to let
    them go early)."""
    release = trio.Event()

    async def hold() -> None:
        async with pool.slot(key):
            await release.wait()

    async with trio.open_nursery() as nursery:
        for _ in range(slots):
            nursery.start_soon(hold)
        await wait_idle()
        assert pool.statistics().keys[key].in_use == slots
        yield release
        release.set()


def degraded_total(engine: pw.Engine, route: str, pipe: str, reason: str) -> float:
    labels = {"route": route, "pipe": pipe, "reason": reason}
    return engine.metrics.registry.get_sample_value("pipework_degraded_total", labels) or 0.0


async def load(ctx: pw.Context) -> None:
    ctx.state["product"] = "lamp"


async def after(ctx: pw.Context) -> None:
    ctx.state["shown"] = sorted(k for k in ctx.state if k != "degraded")


def recommender(calls: list[str], seconds: float = 0.0, **options: Any) -> pw.Pipe:
    async def recommend(ctx: pw.Context) -> None:
        calls.append(ctx.job_id)
        ctx.state["partial"] = True  # written before it can fail: never seen if it does
        if seconds:
            await trio.sleep(seconds)
        ctx.state["recs"] = ["shade"]
        del ctx.state["partial"]

    return pw.Pipe(recommend, "recommend", key=options.pop("key", "recs"), **options)


def recs_pool() -> pw.WeightedPool:
    return pw.WeightedPool(4, keys={"recs": pw.Weights(limit=1)})


# -- no slot free at once ----------------------------------------------------------------------


async def test_an_optional_pipe_whose_key_has_no_slot_free_is_skipped_at_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    pool = recs_pool()
    engine = pw.Engine(pool=pool)
    calls: list[str] = []
    engine.chain("page", load, recommender(calls, optional=True), after)
    async with engine, saturated(pool, "recs"):
        start = trio.current_time()
        job_id = await engine.submit("page")
        result, degraded = await engine.wait_answer(job_id)
        assert trio.current_time() == start  # no wait for the saturated key
        view = await engine.status(job_id)
    assert calls == []
    assert result == {
        "product": "lamp",
        "degraded": {"recommend": "no_slot"},
        "shown": ["product"],
    }
    assert degraded == view.degraded == {"recommend": "no_slot"}
    stats = pool.statistics().keys["recs"]
    assert stats.admitted == 1  # the holder's: the skipped pipe never held one
    assert stats.rejected == dict.fromkeys(pw.Rejected.REASONS, 0)
    assert degraded_total(engine, "page", "recommend", "no_slot") == 1


async def test_with_a_slot_free_it_runs_and_nothing_is_recorded(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = pw.Engine(pool=recs_pool())
    calls: list[str] = []
    engine.chain("page", load, recommender(calls, optional=True), after)
    async with engine:
        job_id = await engine.submit("page")
        result, degraded = await engine.wait_answer(job_id)
        assert (await engine.status(job_id)).degraded == {}
    assert calls == [job_id]
    assert result == {"product": "lamp", "recs": ["shade"], "shown": ["product", "recs"]}
    assert degraded == {}


async def test_a_fallback_mapping_answers_in_its_place(autojump_clock: trio.abc.Clock) -> None:
    pool = recs_pool()
    engine = pw.Engine(pool=pool)
    calls: list[str] = []
    fallback = {"recs": [], "recs_hidden": True}
    engine.chain("page", load, recommender(calls, fallback=fallback), after)
    async with engine, saturated(pool, "recs"):
        first = await engine.run("page")
        first["recs"].append("edited by its reader")
        second = await engine.run("page")
    assert calls == []
    for result in (first, second):
        assert result["recs_hidden"] is True
        assert result["degraded"] == {"recommend": "no_slot"}
    assert second["recs"] == []  # each degraded run gets a fresh copy


async def test_a_fallback_pipe_runs_in_its_place_holding_no_slot(
    autojump_clock: trio.abc.Clock,
) -> None:
    pool = Learning(4, keys={"recs": pw.Weights(limit=1)})
    engine = pw.Engine(pool=pool)
    calls: list[str] = []
    seen: list[tuple[int, dict[str, Any]]] = []

    async def cached(ctx: pw.Context) -> None:
        seen.append((pool.statistics().in_use, dict(ctx.state["degraded"])))
        await trio.sleep(0.25)
        ctx.state["recs"] = ["from the cache"]

    cache = pw.Pipe(cached, "cached", key="recs")  # its key is not used as a fallback
    engine.chain("page", load, recommender(calls, fallback=cache), after)
    async with engine, saturated(pool, "recs"):
        start = trio.current_time()
        result = await engine.run("page")
        assert trio.current_time() - start == 0.25
    assert calls == []
    assert seen == [(1, {"recommend": "no_slot"})]  # the holder's slot only
    assert result["recs"] == ["from the cache"]
    # Neither the degraded pipe's key nor the fallback's time taught the pool anything.
    assert [key for key, _ in pool.taught] == ["default", "default"]


async def test_a_fallback_pipe_that_fails_fails_the_job(autojump_clock: trio.abc.Clock) -> None:
    pool = recs_pool()
    engine = pw.Engine(pool=pool)

    async def cached(ctx: pw.Context) -> None:
        raise LookupError("the cache is empty")

    engine.chain("page", load, recommender([], fallback=pw.Pipe(cached, "cached")), after)
    async with engine, saturated(pool, "recs"):
        with pytest.raises(LookupError, match="the cache is empty"):
            await engine.run("page")


async def test_a_pool_that_cannot_say_at_once_is_waited_for(
    autojump_clock: trio.abc.Clock,
) -> None:
    pool = recs_pool()
    engine = pw.Engine(pool=Plain(pool))
    calls: list[str] = []
    engine.chain("page", load, recommender(calls, optional=True))
    async with engine, saturated(pool, "recs") as release:
        start = trio.current_time()
        job_id = await engine.submit("page")
        await trio.sleep(1)
        release.set()
        result = await engine.wait(job_id)
        assert trio.current_time() - start == 1
    assert calls == [job_id]
    assert "degraded" not in result


# -- refused, and too little time --------------------------------------------------------------


async def test_a_refusing_key_degrades_it_without_a_hand_off_to_that_key(
    autojump_clock: trio.abc.Clock,
) -> None:
    pool = recs_pool()
    breakers = Breakers()
    engine = pw.Engine(pool=pool, refusals=breakers)
    calls: list[str] = []
    engine.chain("page", load, recommender(calls, fallback={"recs": []}), after)
    async with engine:
        breakers.open.add("recs")
        refused = await engine.run("page")
        assert pool.statistics().keys["recs"].admitted == 0  # never handed off to recs
        breakers.open.clear()
        served = await engine.run("page")
    assert refused["degraded"] == {"recommend": "refused"}
    assert refused["recs"] == []
    assert served["recs"] == ["shade"]
    assert "degraded" not in served
    assert len(calls) == 1
    assert set(breakers.asked) == {"recs"}  # asked only for the pipes a job can do without
    assert degraded_total(engine, "page", "recommend", "refused") == 1


async def test_a_refusing_key_does_not_touch_pipes_a_job_needs(
    autojump_clock: trio.abc.Clock,
) -> None:
    breakers = Breakers()
    breakers.open.add("recs")
    engine = pw.Engine(pool=recs_pool(), refusals=breakers)
    calls: list[str] = []
    engine.chain("page", recommender(calls))
    async with engine:
        assert await engine.run("page") == {"recs": ["shade"]}
    assert breakers.asked == []


async def test_too_little_time_left_for_what_it_usually_takes_skips_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = pw.Engine(pool=recs_pool())
    calls: list[str] = []
    engine.chain("page", load, recommender(calls, seconds=2, optional=True), after)
    async with engine:
        await engine.run("page", timeout=10)  # it ran: it takes 2 s
        start = trio.current_time()
        result = await engine.run("page", timeout=1.5)
        assert trio.current_time() == start
    assert len(calls) == 1
    assert result["degraded"] == {"recommend": "deadline"}
    assert result["shown"] == ["product"]


async def test_a_pipe_skipped_for_time_is_tried_again_after_a_few_skips(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = pw.Engine()
    ran: list[float] = []

    async def recommend(ctx: pw.Context) -> None:
        ran.append(ctx.state["takes"])
        await trio.sleep(ctx.state["takes"])

    engine.chain("page", pw.Pipe(recommend, "recommend", optional=True))
    async with engine:
        await engine.run("page", {"takes": 1.0})  # it usually takes 1 s now
        outcomes = []
        for _ in range(4):
            result = await engine.run("page", {"takes": 0.1}, timeout=0.7)
            outcomes.append(result.get("degraded", {}).get("recommend", "ran"))
    # Skipped with 0.7 s left while it takes 1 s, then 0.8 s; tried at 0.64 s, and measured.
    assert outcomes == ["deadline", "deadline", "ran", "ran"]
    assert ran == [1.0, 0.1, 0.1]


# -- it fails ----------------------------------------------------------------------------------


async def test_an_error_is_degraded_and_what_the_pipe_wrote_is_dropped(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = pw.Engine()

    async def recommend(ctx: pw.Context) -> None:
        ctx.state["partial"] = True
        ctx.state["product"] = "changed"
        raise ConnectionError("recommender reset the connection")

    engine.chain("page", load, pw.Pipe(recommend, "recommend", fallback={"recs": []}), after)
    async with engine:
        result = await engine.run("page")
    assert result == {
        "product": "lamp",
        "recs": [],
        "degraded": {"recommend": "error"},
        "shown": ["product", "recs"],
    }
    errors = engine.metrics.registry.get_sample_value(
        "pipework_pipe_duration_seconds_count", {"pipe": "recommend", "outcome": "error"}
    )
    assert errors == 1  # counted as the failure it was
    assert degraded_total(engine, "page", "recommend", "error") == 1


async def test_its_own_timeout_is_degraded_and_the_step_goes_on(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = pw.Engine(pool=recs_pool())
    calls: list[str] = []
    engine.chain("page", load, recommender(calls, seconds=5, optional=True, timeout=1), after)
    async with engine:
        start = trio.current_time()
        result = await engine.run("page")
        assert trio.current_time() - start == 1
    assert result == {
        "product": "lamp",
        "degraded": {"recommend": "timeout"},
        "shown": ["product"],
    }


async def test_its_stages_time_running_out_fails_the_stage_as_ever(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = pw.Engine()
    calls: list[str] = []
    slow = recommender(calls, seconds=5, key=None, optional=True)
    engine.chain("staged", pw.serial(load, slow, timeout=1), after)
    engine.chain("whole", load, slow, after, timeout=1)
    async with engine:
        with pytest.raises(pw.DeadlineExceeded) as stage:
            await engine.run("staged")
        assert stage.value.scope == "stage"
        job_id = await engine.submit("whole")
        with pytest.raises(pw.DeadlineExceeded) as whole:
            await engine.wait(job_id)
        assert whole.value.scope == "job"
        assert (await engine.status(job_id)).status is pw.Status.EXPIRED


async def test_a_cancelled_job_is_cancelled_not_degraded(autojump_clock: trio.abc.Clock) -> None:
    engine = pw.Engine()
    calls: list[str] = []
    engine.chain("page", load, recommender(calls, seconds=5, key=None, optional=True), after)
    async with engine:
        job_id = await engine.submit("page")
        await trio.sleep(1)
        await engine.cancel(job_id)
        with pytest.raises(pw.JobCancelled):
            await engine.wait(job_id)
        view = await engine.status(job_id)
    assert view.status is pw.Status.CANCELLED
    assert view.degraded == {}


async def test_an_optional_pipe_may_suspend_its_job(autojump_clock: trio.abc.Clock) -> None:
    engine = pw.Engine()

    async def approve(ctx: pw.Context) -> None:
        ctx.state["asked"] = True
        await ctx.suspend("approved")

    engine.chain("page", pw.Pipe(approve, "approve", optional=True), after)
    async with engine:
        job_id = await engine.submit("page")
        await wait_idle()
        assert (await engine.status(job_id)).status is pw.Status.SUSPENDED
        await engine.signal(job_id, "approved", "yes")
        result = await engine.wait(job_id)
    assert result == {"asked": True, "approved": "yes", "shown": ["approved", "asked"]}


# -- parallel branches -------------------------------------------------------------------------


async def test_an_all_of_keeps_its_other_branches_when_one_is_degraded(
    autojump_clock: trio.abc.Clock,
) -> None:
    pool = recs_pool()
    engine = pw.Engine(pool=pool)
    calls: list[str] = []
    engine.chain("page", pw.all_of(load, recommender(calls, optional=True)), after)
    async with engine, saturated(pool, "recs"):
        start = trio.current_time()
        result = await engine.run("page")
        assert trio.current_time() == start
    assert calls == []
    assert result == {
        "product": "lamp",
        "degraded": {"recommend": "no_slot"},
        "shown": ["product"],
    }
    assert pool.statistics().keys["recs"].admitted == 1


async def test_branches_degraded_apart_are_all_recorded(autojump_clock: trio.abc.Clock) -> None:
    pool = pw.WeightedPool(8, keys={"recs": pw.Weights(limit=1), "ads": pw.Weights(limit=1)})
    breakers = Breakers()
    engine = pw.Engine(pool=pool, refusals=breakers)

    async def advertise(ctx: pw.Context) -> None:
        ctx.state["ads"] = ["ad"]

    ads = pw.Pipe(advertise, "ads", key="ads", fallback={"ads": []})
    engine.chain("page", load, pw.all_of(load, recommender([], optional=True), ads), after)
    breakers.open.add("ads")
    async with engine, saturated(pool, "recs"):
        result = await engine.run("page")
    assert result["degraded"] == {"recommend": "no_slot", "ads": "refused"}
    assert result["ads"] == []


async def test_a_settle_stage_merges_what_remains(autojump_clock: trio.abc.Clock) -> None:
    pool = recs_pool()
    engine = pw.Engine(pool=pool)

    async def stock(ctx: pw.Context) -> None:
        raise KeyError("sku")

    engine.chain(
        "page",
        pw.all_of(load, pw.Pipe(stock, "stock"), recommender([], optional=True), settle=True),
    )
    async with engine, saturated(pool, "recs"):
        result = await engine.run("page")
    assert result["product"] == "lamp"
    assert result["degraded"] == {"recommend": "no_slot"}
    assert {name: o["outcome"] for name, o in result["outcomes"].items()} == {
        "load": "ok",
        "stock": "error",
        "recommend": "ok",
    }


async def test_in_an_any_of_a_degraded_branch_is_a_success(autojump_clock: trio.abc.Clock) -> None:
    pool = recs_pool()
    engine = pw.Engine(pool=pool)

    async def slow_recs(ctx: pw.Context) -> None:
        await trio.sleep(5)
        ctx.state["recs"] = ["slow"]

    fallback = {"recs": ["fallback"]}
    engine.chain(
        "page", pw.any_of(recommender([], fallback=fallback), pw.Pipe(slow_recs, "slow_recs"))
    )
    async with engine, saturated(pool, "recs"):
        start = trio.current_time()
        result = await engine.run("page")
        assert trio.current_time() == start
    assert result == {"recs": ["fallback"], "degraded": {"recommend": "no_slot"}}


async def test_a_branch_in_its_parents_step_is_degraded_there(
    autojump_clock: trio.abc.Clock,
) -> None:
    pool = pw.WeightedPool(4)
    breakers = Breakers()
    engine = pw.Engine(pool=pool, refusals=breakers)
    calls: list[str] = []
    engine.chain("page", pw.all_of(load, recommender(calls, key=None, optional=True)), after)
    breakers.open.add("default")
    async with engine:
        result = await engine.run("page")
    assert calls == []
    assert result["degraded"] == {"recommend": "refused"}
    assert pool.statistics().keys["default"].admitted == 1  # the stage ran in one step


async def test_a_branch_whose_key_became_limited_is_degraded_rather_than_lent_a_slot(
    autojump_clock: trio.abc.Clock,
) -> None:
    pool = pw.WeightedPool(4)
    engine = pw.Engine(pool=pool)
    calls: list[str] = []

    async def first(ctx: pw.Context) -> None:
        await trio.sleep(1)

    async def other(ctx: pw.Context) -> None:
        await trio.sleep(2)
        ctx.state["other"] = True

    branch = pw.serial(pw.Pipe(first, "first"), recommender(calls, key=None, optional=True))
    engine.chain("page", pw.all_of(branch, pw.Pipe(other, "other")))
    async with engine:
        start = trio.current_time()
        job_id = await engine.submit("page")
        await trio.sleep(0.5)
        # The parent holds the key's only slot now: the branch's next pipe would wait.
        pool.reconfigure(pool.config.with_weights("default", pw.Weights(limit=1)))
        result = await engine.wait(job_id)
        assert trio.current_time() - start == 2
    assert calls == []
    assert result == {"other": True, "degraded": {"recommend": "no_slot"}}


# -- what the job shows ------------------------------------------------------------------------


async def test_a_branch_of_a_forked_stage_records_it_in_the_parents_view(
    autojump_clock: trio.abc.Clock,
) -> None:
    pool = recs_pool()
    engine = pw.Engine(pool=pool)

    async def wait_approval(ctx: pw.Context) -> None:
        await ctx.suspend("approved")

    engine.chain(
        "page",
        pw.all_of(pw.Pipe(wait_approval, "wait_approval"), recommender([], optional=True)),
        result="recs",
    )
    async with engine, saturated(pool, "recs"):
        job_id = await engine.submit("page")
        await wait_idle()
        await engine.signal(job_id, "approved", True)
        result, degraded = await engine.wait_answer(job_id)
    assert result is None  # the chain answers "recs", which it did without
    assert degraded == {"recommend": "no_slot"}
