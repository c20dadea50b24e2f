"""A property: whatever mix of misbehaving pipes runs on one engine — raising, grouping,
suspending from child tasks, hanging past timeouts, swallowing or causing cancellation,
being cancelled from outside at any moment — every job reaches a final status, no slot
is held, the queue is empty, and a fresh well-behaved job still completes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pipework as pw

# The engine's suite runs on every store: see each_store in conftest.py (on Redis, the
# smaller "pipework-redis" profile).

BEHAVIOURS = (
    "ok",
    "raise",
    "error_group",
    "cancelled_group",
    "suspend_child",
    "suspend",
    "hang",
    "swallow_timeout",
    "swallow_cancel",
    "cancel_self",
    "base_exception",
    "blocking",
)


FINAL = {pw.Status.DONE, pw.Status.FAILED, pw.Status.CANCELLED, pw.Status.EXPIRED}


@dataclass(frozen=True)
class Plan:
    chains: list[tuple[str, list[str]]]  # (shape, behaviours)
    cancel_at: list[float | None]
    signal_at: list[float | None]


def _pipes(engine: pw.Engine) -> dict[str, pw.Pipe]:
    async def ok(ctx: pw.Context) -> None:
        await trio.sleep(0.5)
        ctx.state.setdefault("ok", 0)
        ctx.state["ok"] += 1

    async def raise_(ctx: pw.Context) -> None:
        await trio.sleep(0.25)
        raise ValueError("a pipe's bug")

    async def error_group(ctx: pw.Context) -> None:
        async def fail() -> None:
            raise KeyError("child")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fail)
            nursery.start_soon(trio.sleep, 1)

    async def cancelled_group(ctx: pw.Context) -> None:
        # A library's nursery cancelled from inside: Cancelled travels in a group.
        with trio.move_on_after(0.5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.sleep_forever)
                nursery.start_soon(trio.sleep_forever)
        await trio.sleep(0.5)

    async def suspend_child(ctx: pw.Context) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ctx.suspend, "go")
            await trio.sleep(1)

    async def suspend(ctx: pw.Context) -> None:
        await ctx.suspend("go", timeout=4)

    async def hang(ctx: pw.Context) -> None:
        await trio.sleep_forever()

    async def swallow_timeout(ctx: pw.Context) -> None:
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            return

    async def swallow_cancel(ctx: pw.Context) -> None:
        try:
            await trio.sleep(1)
        except trio.Cancelled:
            ctx.state["swallowed"] = True

    async def cancel_self(ctx: pw.Context) -> None:
        await engine.cancel(ctx.job_id)
        await trio.sleep(1)

    async def base_exception(ctx: pw.Context) -> None:
        raise GeneratorExit

    def blocking(ctx: pw.Context) -> None:
        ctx.state["thread"] = True

    functions: dict[str, Any] = {
        "ok": ok,
        "raise": raise_,
        "error_group": error_group,
        "cancelled_group": cancelled_group,
        "suspend_child": suspend_child,
        "suspend": suspend,
        "hang": hang,
        "swallow_timeout": swallow_timeout,
        "swallow_cancel": swallow_cancel,
        "cancel_self": cancel_self,
        "base_exception": base_exception,
    }
    pipes = {
        name: engine.pipe(name=name, timeout=3, key=f"k{i % 3}")(fn)
        for i, (name, fn) in enumerate(functions.items())
    }
    pipes["blocking"] = engine.pipe(name="blocking", blocking=True, timeout=3)(blocking)
    return pipes


def _declare(engine: pw.Engine, plan: Plan) -> list[str]:
    pipes = _pipes(engine)
    names = []
    for i, (shape, behaviours) in enumerate(plan.chains):
        steps: list[Any] = [pipes[b] for b in behaviours]
        if shape == "all_of" and len(steps) > 1:
            steps = [pw.all_of(*steps, merge="last")]
        elif shape == "any_of" and len(steps) > 1:
            steps = [pw.any_of(*steps)]
        elif shape == "settle" and len(steps) > 1:
            steps = [pw.all_of(*steps, settle=True, merge="last")]
        elif shape == "graph" and len(steps) > 1:
            nodes = [
                pw.node(f"n{j}", s, after=[f"n{j - 1}"] if j else []) for j, s in enumerate(steps)
            ]
            steps = [pw.graph(*nodes, merge="last")]
        engine.chain(f"c{i}", *steps, timeout=20)
        names.append(f"c{i}")

    async def healthy(ctx: pw.Context) -> None:
        ctx.state["healthy"] = True

    engine.chain("healthy", engine.pipe(name="healthy")(healthy))
    return names


async def _scenario(plan: Plan, store: type[Any]) -> None:
    pool = pw.WeightedPool(4, keys={"k1": pw.Weights(limit=1)})
    engine = pw.Engine(pool=pool, store=store(retain_seconds=1e9))  # kept while checks poll
    chains = _declare(engine, plan)
    async with engine:
        jobs = [await engine.submit(chain) for chain in chains]

        async def outside(job_id: str, cancel: float | None, signal: float | None) -> None:
            events = sorted(
                [(t, what) for t, what in ((cancel, "cancel"), (signal, "signal")) if t is not None]
            )
            for at, what in events:
                await trio.sleep_until(start + at)
                try:
                    if what == "cancel":
                        await engine.cancel(job_id)
                    else:
                        await engine.signal(job_id, "go", {"n": 1})
                except pw.PipeworkError:
                    pass  # finished, or not waiting for it: both are fine outcomes

        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for job_id, cancel, signal in zip(jobs, plan.cancel_at, plan.signal_at, strict=True):
                nursery.start_soon(outside, job_id, cancel, signal)
        await trio.sleep(60)  # past every deadline: nothing may still be active...
        # ...but a blocking pipe's thread runs in real time while the virtual clock jumps:
        # its job ends, and its slot frees, when the thread returns (and the branch's end it
        # reports is an event the queue holds until the dispatcher has taken it in, a few
        # round trips on a shared store). A losing branch of a stage run in its parent's
        # step holds no slot of its own once the stage resolved, and reports its end when
        # its thread returns: so the poll (each poll a virtual second) also waits until no
        # step or branch is running. A real leak fails the asserts below after the last poll.
        for _ in range(100_000):
            statuses = [(await engine.status(j)).status for j in jobs]
            if (
                all(s in FINAL for s in statuses)
                and pool.statistics().in_use == 0
                and engine.queue.statistics().depth == 0
                and _running_tasks(engine) == 0
            ):
                break
            await trio.sleep(1)

        for job_id in jobs:
            view = await engine.status(job_id)
            assert view.status in FINAL, (job_id, view)
        stats = pool.statistics()
        assert stats.in_use == 0
        assert stats.waiting == 0
        assert engine.queue.statistics().depth == 0
        assert _running_tasks(engine) == 0
        assert (await engine.run("healthy"))["healthy"] is True


def _running_tasks(engine: pw.Engine) -> int:
    """Steps, in-step branches and callbacks still running: they run in the dispatcher's
    nursery beside its one timer task and the step runners parked between steps (the engine
    has no public count of them)."""
    nursery = engine._dispatcher.flight.nursery
    assert nursery is not None
    return len(nursery.child_tasks) - 1 - len(engine._dispatcher.steps.runners.idle)


times = st.one_of(st.none(), st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0, 1.5, 2.5, 3.5]))


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    n = draw(st.integers(1, 5))
    chains = [
        (
            draw(st.sampled_from(["serial", "all_of", "any_of", "settle", "graph"])),
            draw(st.lists(st.sampled_from(BEHAVIOURS), min_size=1, max_size=4)),
        )
        for _ in range(n)
    ]
    return Plan(
        chains,
        [draw(times) for _ in range(n)],
        [draw(times) for _ in range(n)],
    )


# The store class is the same for every example: the fixture need not be reset.
@pytest.mark.parametrize("each_store", ["memory", "copying"], indirect=True)
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(plan=plans())
def test_misbehaving_pipes_never_stop_the_engine(plan: Plan, each_store: type[Any]) -> None:
    _run(plan, each_store)


@pytest.mark.parametrize("each_store", ["redis"], indirect=True)
@settings(
    settings.get_profile("pipework-redis"),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(plan=plans())
def test_misbehaving_pipes_never_stop_the_engine_on_redis(
    plan: Plan, each_store: type[Any]
) -> None:
    _run(plan, each_store)


def _run(plan: Plan, store: type[Any]) -> None:
    trio.run(_scenario, plan, store, clock=trio.testing.MockClock(autojump_threshold=0))
