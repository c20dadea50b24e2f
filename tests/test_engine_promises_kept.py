"""Promises the docs make about parallel stages' deadlines and about admission, pinned
through the public API on every store, for stages run in their parent's step and forked
as child jobs alike. Time is virtual (autojump_clock)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

import pipework as pw

from ._redis import wait_idle

pytestmark = pytest.mark.usefixtures("each_store")

# A branch pipe under the chain's own key runs in its parent's step; under another key the
# stage is forked as child jobs (docs/stages.md).
RUNS = [pytest.param(None, id="in-step"), pytest.param("other", id="forked")]


def _stages(limit: float) -> list[Any]:
    return [
        pytest.param(lambda *b: pw.any_of(*b, timeout=limit), id="any_of"),
        pytest.param(lambda *b: pw.quorum(1, *b, timeout=limit), id="quorum-1"),
        pytest.param(lambda *b: pw.quorum(2, *b, timeout=limit), id="quorum-2"),
    ]


def _slow_branches(engine: pw.Engine, key: str | None) -> tuple[pw.Pipe, pw.Pipe]:
    @engine.pipe(name="slow_a", key=key)
    async def slow_a(ctx: pw.Context) -> None:
        await trio.sleep(100)

    @engine.pipe(name="slow_b", key=key)
    async def slow_b(ctx: pw.Context) -> None:
        await trio.sleep(100)

    return slow_a, slow_b


# -- 1. a stage whose timeout runs out fails with DeadlineExceeded(scope="stage") --------


@pytest.mark.parametrize("key", RUNS)
@pytest.mark.parametrize("stage", _stages(3))
async def test_a_stage_timeout_fails_the_stage_with_one_deadline_exceeded(
    autojump_clock: trio.abc.Clock, key: str | None, stage: Any
) -> None:
    engine = pw.Engine()
    engine.chain("c", stage(*_slow_branches(engine, key)), timeout=60)
    async with engine:
        start = trio.current_time()
        job_id = await engine.submit("c")
        with pytest.raises(pw.DeadlineExceeded) as info:
            await engine.wait(job_id)
        assert trio.current_time() - start == pytest.approx(3)
        assert info.value.scope == "stage"
        assert info.value.where.startswith("chain 'c' > ")
        status = await engine.status(job_id)
        assert status.status is pw.Status.FAILED
        assert status.error is not None
        assert status.error.type == "DeadlineExceeded"


# -- 2. the job's own deadline inside such a stage makes the job expired -----------------


@pytest.mark.parametrize("key", RUNS)
@pytest.mark.parametrize("stage", _stages(30))
async def test_the_jobs_deadline_inside_a_stage_expires_the_job(
    autojump_clock: trio.abc.Clock, key: str | None, stage: Any
) -> None:
    engine = pw.Engine()
    engine.chain("c", stage(*_slow_branches(engine, key)), timeout=5)
    async with engine:
        start = trio.current_time()
        job_id = await engine.submit("c")
        with pytest.raises(pw.DeadlineExceeded) as info:
            await engine.wait(job_id)
        assert trio.current_time() - start == pytest.approx(5)
        assert info.value.scope == "job"
        assert (await engine.status(job_id)).status is pw.Status.EXPIRED


async def test_a_stage_whose_branches_all_failed_on_their_own_still_raises_every_error(
    autojump_clock: trio.abc.Clock,
) -> None:
    """What the fix of 1 and 2 keeps: an any_of whose branches failed of their own errors
    (not of the stage's time) raises the group of them."""
    engine = pw.Engine()

    @engine.pipe
    async def fails(ctx: pw.Context) -> None:
        raise KeyError("x")

    @engine.pipe(timeout=1)
    async def times_out(ctx: pw.Context) -> None:
        await trio.sleep(10)

    engine.chain("c", pw.any_of(fails, times_out, timeout=30))
    async with engine:
        with pytest.RaisesGroup(KeyError, pw.DeadlineExceeded):
            await engine.run("c")


# -- 3. a key reconfigured to a limit while an in-step stage runs on it still counts ------


async def test_a_key_limited_while_an_in_step_stage_runs_counts_its_branches(
    autojump_clock: trio.abc.Clock,
) -> None:
    """docs/stages.md: a key limited while its stage runs "still counts: the branches' next
    pipes take slots of their own"."""
    pool = pw.WeightedPool(8, keys={"k": pw.Weights()})
    engine = pw.Engine(pool=pool)
    gate = trio.Event()
    running = 0
    most = 0

    @engine.pipe(key="k")
    async def first(ctx: pw.Context) -> None:
        await gate.wait()

    @engine.pipe(key="k")
    async def second(ctx: pw.Context) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await trio.sleep(1)
        running -= 1

    branch = pw.serial(first, second)
    engine.chain("c", pw.all_of(branch, branch, branch), key="k", timeout=600)
    async with engine:
        job_id = await engine.submit("c")
        await wait_idle()
        pool.reconfigure(pool.config.with_weights("k", pw.Weights(limit=1)))
        gate.set()
        await engine.wait(job_id)
        assert most == 1
        assert pool.statistics().in_use == 0


async def test_a_key_limited_under_max_concurrency_never_starves_later_branches(
    autojump_clock: trio.abc.Clock,
) -> None:
    pool = pw.WeightedPool(8, keys={"k": pw.Weights()})
    engine = pw.Engine(pool=pool)
    gate = trio.Event()

    @engine.pipe(key="k")
    async def first(ctx: pw.Context) -> None:
        await gate.wait()

    @engine.pipe(key="k")
    async def second(ctx: pw.Context) -> None:
        await trio.sleep(1)

    branch = pw.serial(first, second)
    stage = pw.all_of(branch, branch, branch, branch, max_concurrency=2)
    engine.chain("c", stage, key="k", timeout=600)
    async with engine:
        job_id = await engine.submit("c")
        await wait_idle()
        pool.reconfigure(pool.config.with_weights("k", pw.Weights(limit=1)))
        gate.set()
        await engine.wait(job_id)  # raised Rejected (wait timeout) before the fix


# -- 4. a step promised never to be refused for a pause waits the pause out --------------


async def test_an_admitted_job_handing_off_to_a_paused_key_waits_out_the_pause(
    autojump_clock: trio.abc.Clock,
) -> None:
    pool = pw.WeightedPool(8, keys={"x": pw.Weights(), "y": pw.Weights()}, wait_timeout=0.5)
    engine = pw.Engine(pool=pool)

    @engine.pipe(key="x")
    async def on_x(ctx: pw.Context) -> None:
        pool.reconfigure(pool.config.with_weights("y", pw.Weights(limit=0)))  # paused

    @engine.pipe(key="y")
    async def on_y(ctx: pw.Context) -> None:
        ctx.state["ran_on_y"] = True

    engine.chain("c", on_x, on_y, timeout=60)
    async with engine:
        job_id = await engine.submit("c", admit=True)
        await trio.sleep(1)
        assert (await engine.status(job_id)).status is pw.Status.QUEUED
        pool.reconfigure(pool.config.with_weights("y", pw.Weights()))
        assert (await engine.wait(job_id))["ran_on_y"] is True


async def test_an_admitted_job_waiting_for_a_busy_key_waits_out_its_pause(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The pause comes while the step already waits in the key's queue."""
    pool = pw.WeightedPool(8, keys={"y": pw.Weights(limit=1)}, wait_timeout=0.5)
    engine = pw.Engine(pool=pool)
    release = trio.Event()

    @engine.pipe(key="y")
    async def hold(ctx: pw.Context) -> None:
        await release.wait()

    @engine.pipe(key="x")
    async def on_x(ctx: pw.Context) -> None:
        return None

    @engine.pipe(key="y")
    async def on_y(ctx: pw.Context) -> None:
        ctx.state["ran_on_y"] = True

    engine.chain("blocker", hold, timeout=60)
    engine.chain("c", on_x, on_y, timeout=60)
    async with engine:
        blocker = await engine.submit("blocker")
        await wait_idle()
        job_id = await engine.submit("c", admit=True)
        await wait_idle()
        assert pool.statistics().keys["y"].waiting == 1
        pool.reconfigure(pool.config.with_weights("y", pw.Weights(limit=0)))
        await trio.sleep(1)
        assert (await engine.status(job_id)).status is pw.Status.QUEUED
        pool.reconfigure(pool.config.with_weights("y", pw.Weights(limit=1)))
        release.set()
        await engine.wait(blocker)
        assert (await engine.wait(job_id))["ran_on_y"] is True


async def test_a_resumed_step_waits_out_a_pause(autojump_clock: trio.abc.Clock) -> None:
    pool = pw.WeightedPool(8, keys={"y": pw.Weights()}, wait_timeout=0.5)
    engine = pw.Engine(pool=pool)

    @engine.pipe(key="y")
    async def park(ctx: pw.Context) -> None:
        await ctx.suspend("go")

    @engine.pipe(key="y")
    async def after(ctx: pw.Context) -> None:
        ctx.state["after"] = True

    engine.chain("c", park, after, timeout=60)
    async with engine:
        job_id = await engine.submit("c")
        await wait_idle()
        pool.reconfigure(pool.config.with_weights("y", pw.Weights(limit=0)))
        await engine.signal(job_id, "go", 1)
        await trio.sleep(1)
        assert (await engine.status(job_id)).status is pw.Status.QUEUED
        pool.reconfigure(pool.config.with_weights("y", pw.Weights()))
        assert (await engine.wait(job_id))["after"] is True


async def test_a_job_not_admitted_is_still_refused_for_a_pause(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The other side of 4: every other step fails fast under a pause."""
    pool = pw.WeightedPool(8, keys={"y": pw.Weights(limit=0)}, wait_timeout=0.5)
    engine = pw.Engine(pool=pool)

    @engine.pipe(key="y")
    async def on_y(ctx: pw.Context) -> None:
        return None

    engine.chain("c", on_y, timeout=60)
    async with engine:
        with pytest.raises(pw.Rejected) as info:
            await engine.run("c")
        assert info.value.reason == "paused"
