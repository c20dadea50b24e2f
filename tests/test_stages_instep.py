"""Parallel stages inside the parent's step: which slots branches take, and a stage that
turns durable when a branch suspends. Times are virtual (autojump_clock) and exact."""

from __future__ import annotations

import contextvars

import pytest
import trio

import pipework as pw

from ._redis import wait_idle

# The engine's suite runs on both stores: see each_store in conftest.py.
pytestmark = pytest.mark.usefixtures("each_store")


def sleeper(name: str, seconds: float, key: str | None = None) -> pw.Pipe:
    async def run(ctx: pw.Context) -> None:
        await trio.sleep(seconds)
        ctx.state[name] = seconds

    return pw.Pipe(run, name, key=key)


async def test_branches_of_the_parents_unlimited_key_run_under_its_slot(
    autojump_clock: trio.abc.Clock,
) -> None:
    pool = pw.WeightedPool(1)
    engine = pw.Engine(pool=pool)
    engine.chain("c", pw.all_of(*(sleeper(f"b{i}", 1) for i in range(3))))
    async with engine:
        start = trio.current_time()
        job_id = await engine.submit("c")
        await trio.sleep(0.5)
        assert pool.statistics().in_use == 1  # the parent's slot, shared by its branches
        assert await engine.wait(job_id) == {"b0": 1, "b1": 1, "b2": 1}
        assert trio.current_time() - start == pytest.approx(1)
        assert pool.statistics().in_use == 0


async def test_branches_of_a_limited_key_each_hold_a_slot_of_their_own(
    autojump_clock: trio.abc.Clock,
) -> None:
    pool = pw.WeightedPool(4, keys={"search": pw.Weights(limit=1)})
    engine = pw.Engine(pool=pool)
    engine.chain("c", pw.all_of(*(sleeper(f"b{i}", 1, key="search") for i in range(3))))
    async with engine:
        start = trio.current_time()
        job_id = await engine.submit("c")
        await trio.sleep(0.5)
        held = pool.statistics().keys["search"].in_use
        assert held == 1  # the key's limit counts every branch: one runs at a time
        assert await engine.wait(job_id) == {"b0": 1, "b1": 1, "b2": 1}
        assert trio.current_time() - start == pytest.approx(3)
        assert pool.statistics().in_use == 0


async def test_a_branch_of_another_key_takes_that_keys_slot(
    autojump_clock: trio.abc.Clock,
) -> None:
    pool = pw.WeightedPool(4)
    engine = pw.Engine(pool=pool)
    engine.chain("c", pw.all_of(sleeper("a", 1), sleeper("b", 1, key="users")))
    async with engine:
        job_id = await engine.submit("c")
        await trio.sleep(0.5)
        keys = pool.statistics().keys
        assert keys["default"].in_use == 1  # the parent (and branch a, under its slot)
        assert keys["users"].in_use == 1
        assert await engine.wait(job_id) == {"a": 1, "b": 1}


async def test_a_suspending_branch_outlives_the_step_and_the_rest_report_by_events(
    autojump_clock: trio.abc.Clock,
) -> None:
    pool = pw.WeightedPool(4)
    engine = pw.Engine(pool=pool)

    async def approve(ctx: pw.Context) -> None:
        await ctx.suspend("approved", into="approval")

    engine.chain(
        "c",
        pw.all_of(pw.Pipe(approve, "approve"), sleeper("slow", 3)),
        sleeper("after", 1),
    )
    async with engine:
        job_id = await engine.submit("c")
        await trio.sleep(1)
        # The branch suspended at once: the join is on the parent's record now, while the
        # slow branch still runs in the step.
        assert (await engine.status(job_id)).status is pw.Status.RUNNING
        await trio.sleep(3)
        assert pool.statistics().in_use == 0  # the step ended: waiting at the join
        await engine.signal(job_id, "approved", {"by": "ops"})
        assert await engine.wait(job_id) == {
            "slow": 3,
            "approval": {"by": "ops"},
            "after": 1,
        }


async def test_cancelling_the_parent_cancels_its_in_step_branches(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = pw.Engine()
    cleaned: list[str] = []

    async def slow(ctx: pw.Context) -> None:
        try:
            await trio.sleep(10)
        finally:
            cleaned.append(ctx.pipe.name)

    engine.chain("c", pw.any_of(pw.Pipe(slow, "x"), pw.Pipe(slow, "y")))
    async with engine:
        job_id = await engine.submit("c")
        await trio.sleep(1)
        await engine.cancel(job_id)
        with pytest.raises(pw.JobCancelled):
            await engine.wait(job_id)
        await wait_idle()
        assert sorted(cleaned) == ["x", "y"]
        assert trio.current_time() == pytest.approx(1)


async def test_parents_holding_every_slot_leave_their_branches_of_another_key_none(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A stage whose branches need slots of their own is forked: its parent's step ends at
    the fork and holds nothing while they wait, so parents filling the pool cannot starve
    their own branches (each would otherwise wait out its wait timeout and fail)."""
    pool = pw.WeightedPool(2, wait_timeout=5.0)
    engine = pw.Engine(pool=pool)
    engine.chain(
        "c", pw.all_of(sleeper("a", 1, key="users"), sleeper("b", 1, key="users")), timeout=60
    )
    async with engine:
        ids = [await engine.submit("c") for _ in range(4)]
        for job_id in ids:
            assert await engine.wait(job_id) == {"a": 1, "b": 1}
        assert pool.statistics().in_use == 0


async def test_branches_of_several_pipes_run_each_in_order_within_the_step(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A branch of pipes only runs them one after another in its own task: each sees what
    the one before it wrote, and the parent merges what each branch wrote last."""
    pool = pw.WeightedPool(4)
    engine = pw.Engine(pool=pool)

    def step(name: str, seconds: float) -> pw.Pipe:
        async def run(ctx: pw.Context) -> None:
            await trio.sleep(seconds)
            trail = ctx.state.get(name, [])
            ctx.state[name] = [*trail, ctx.pipe.name]

        return pw.Pipe(run, f"{name}{seconds:g}")

    engine.chain(
        "c",
        pw.all_of(pw.serial(step("a", 1), step("a", 2), step("a", 3)), pw.serial(step("b", 4))),
        step("after", 1),
    )
    async with engine:
        start = trio.current_time()
        job_id = await engine.submit("c")
        await trio.sleep(0.5)
        assert pool.statistics().in_use == 1  # one step: the branches share its slot
        assert await engine.wait(job_id) == {
            "a": ["a1", "a2", "a3"],
            "b": ["b4"],
            "after": ["after1"],
        }
        assert trio.current_time() - start == pytest.approx(7)


async def test_an_in_step_branch_pipe_timeout_fails_the_stage_at_that_pipe(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = pw.Engine()
    engine.chain(
        "c",
        pw.all_of(
            pw.serial(sleeper("quick", 1), pw.Pipe(sleeper("slow", 10).fn, "slow", timeout=2)),
            sleeper("other", 20),
        ),
    )
    async with engine:
        start = trio.current_time()
        job_id = await engine.submit("c")
        with pytest.raises(pw.DeadlineExceeded) as caught:
            await engine.wait(job_id)
        assert caught.value.scope == "pipe"
        assert "pipe 'slow'" in caught.value.where
        assert trio.current_time() - start == pytest.approx(3)  # the sibling was cancelled


async def test_an_in_step_branch_with_a_timeout_of_its_own_keeps_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A branch whose sequence has a timeout (or holds a stage) starts from the cursor the
    chain's walk gives it, with its own limit, and still runs in the parent's step."""
    pool = pw.WeightedPool(4)
    engine = pw.Engine(pool=pool)
    engine.chain(
        "c",
        pw.all_of(
            pw.serial(sleeper("a", 1), sleeper("b", 10), timeout=3),
            pw.serial(sleeper("c", 1), pw.serial(sleeper("d", 1))),
            settle=True,
        ),
    )
    async with engine:
        start = trio.current_time()
        job_id = await engine.submit("c")
        await trio.sleep(0.5)
        assert pool.statistics().in_use == 1  # forked, its branches would hold two
        result = await engine.wait(job_id)
        assert trio.current_time() - start == pytest.approx(3)
        assert (result["c"], result["d"]) == (1, 1)
        assert "a" not in result  # the timed-out branch's writes are not merged
        assert result["outcomes"]["branch[0]"]["outcome"] == "timed_out"
        assert result["outcomes"]["branch[1]"] == {"outcome": "ok"}


async def test_a_branch_reusing_a_runner_sees_its_own_parents_context_and_a_fresh_scope(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Branches run on runner tasks kept between branches: a branch still sees the context
    of the step that started it (not a previous branch's), a runner whose branch lost (its
    scope cancelled) runs the next branch uncancelled, and no runner is left parked once no
    stage runs."""
    engine = pw.Engine()
    tag: contextvars.ContextVar[str] = contextvars.ContextVar("tag", default="none")
    seen: list[tuple[str, str]] = []
    cleaned: list[str] = []

    async def mark(ctx: pw.Context) -> None:
        tag.set(ctx.state["who"])

    async def read(ctx: pw.Context) -> None:
        await trio.sleep(ctx.state["wait"])
        seen.append((ctx.state["who"], tag.get()))
        tag.set("a branch's own")  # stays with this branch
        ctx.state[ctx.pipe.name] = tag.get()

    async def slow(ctx: pw.Context) -> None:
        try:
            await trio.sleep(100)
        finally:
            cleaned.append(ctx.state["who"])

    engine.chain(
        "c",
        pw.Pipe(mark, "mark"),
        pw.all_of(pw.Pipe(read, "r1"), pw.Pipe(read, "r2")),
        pw.any_of(pw.Pipe(read, "fast"), pw.Pipe(slow, "slow")),
    )
    engine.chain("keep", pw.all_of(sleeper("long", 50)))  # a stage running throughout
    async with engine:
        keep = await engine.submit("keep")
        await trio.sleep(1)
        first = await engine.submit("c", {"who": "first", "wait": 1})
        result = await engine.wait(first)
        assert cleaned == ["first"]  # the loser was cancelled; its runner is free again
        second = await engine.submit("c", {"who": "second", "wait": 2})
        assert await engine.wait(second) == {
            "who": "second",
            "wait": 2,
            "r1": "a branch's own",
            "r2": "a branch's own",
            "fast": "a branch's own",
        }
        assert result["fast"] == "a branch's own"
        assert seen == [(who, who) for who in ("first",) * 3 + ("second",) * 3]
        assert cleaned == ["first", "second"]
        await engine.wait(keep)
        await wait_idle()
        assert engine._dispatcher.steps.branch_runners.idle == []


@pytest.mark.parametrize("early", [False, True], ids=["signal-after", "signal-before"])
async def test_a_branch_of_pipes_suspending_midway_resumes_at_its_next_pipe(
    autojump_clock: trio.abc.Clock, early: bool
) -> None:
    """A branch of pipes keeps its place without a cursor until a pipe raises: one that
    suspends at its second pipe gets its cursor then, and goes on at its third — after the
    signal, as a child job with a record of its own, or at once in the step when the signal
    had come already. No pipe runs twice."""
    engine = pw.Engine()
    ran: list[str] = []

    def step(name: str) -> pw.Pipe:
        async def run(ctx: pw.Context) -> None:
            ran.append(name)
            await trio.sleep(1)
            ctx.state[name] = True

        return pw.Pipe(run, name)

    async def wait_for_go(ctx: pw.Context) -> None:
        ran.append("wait")
        await ctx.suspend("go", into="go")

    engine.chain(
        "c",
        pw.all_of(pw.serial(step("first"), pw.Pipe(wait_for_go, "wait"), step("third")), step("b")),
        step("after"),
    )
    async with engine:
        job_id = await engine.submit("c")
        await trio.sleep(0.5 if early else 2)
        await engine.signal(job_id, "go", {"ok": 1})
        assert await engine.wait(job_id) == {
            "first": True,
            "go": {"ok": 1},
            "third": True,
            "b": True,
            "after": True,
        }
    assert sorted(ran) == ["after", "b", "first", "third", "wait"]


async def test_a_runner_keeps_no_deadline_of_a_branch_it_ran_before(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A pipe's timeout rides on its runner's scope while the pipe runs: a branch the same
    runner takes later (kept parked by a stage still running) has no deadline from it."""
    engine = pw.Engine()
    engine.chain("keep", pw.all_of(sleeper("long", 100)))
    engine.chain("timed", pw.all_of(pw.Pipe(sleeper("t", 1).fn, "t", timeout=5)))
    engine.chain("slow", pw.all_of(sleeper("s", 30)))
    async with engine:
        keep = await engine.submit("keep")
        await trio.sleep(1)
        assert await engine.run("timed") == {"t": 1}
        assert len(engine._dispatcher.steps.branch_runners.idle) == 1
        start = trio.current_time()
        assert await engine.run("slow") == {"s": 30}
        assert trio.current_time() - start == pytest.approx(30)
        await engine.wait(keep)
