"""The weighted pool wired into the engine: a hanging backend stays a local failure."""

from __future__ import annotations

import pytest
import trio

import pipework as pw

from ._redis import wait_idle

# The engine's suite runs on both stores: see each_store in conftest.py.
pytestmark = pytest.mark.usefixtures("each_store")


async def run_scenario(b_jobs: int) -> tuple[list[float], list[BaseException], int]:
    """Four clients each run ten 1-second "a" jobs back to back while ``b_jobs`` jobs for a
    backend that never answers pile up. Returns a's finish times, b's errors, a's rejects."""
    pool = pw.WeightedPool(
        10,
        keys={"a": pw.Weights(reserve=4), "b": pw.Weights(limit=4, wait_timeout=5)},
    )
    engine = pw.Engine(pool=pool)

    @engine.pipe(key="a")
    async def call_a(ctx: pw.Context) -> None:
        await trio.sleep(1)

    @engine.pipe(key="b")
    async def call_b(ctx: pw.Context) -> None:
        await trio.sleep_forever()  # the backend hangs

    engine.chain("a", call_a)
    engine.chain("b", call_b)
    finished: list[float] = []
    b_errors: list[BaseException] = []
    a_rejected = 0
    start = trio.current_time()

    async def client() -> None:
        nonlocal a_rejected
        for _ in range(10):
            try:
                await engine.run("a")
            except pw.Rejected:
                a_rejected += 1
            finished.append(trio.current_time() - start)

    async def b_caller() -> None:
        try:
            await engine.run("b")
        except pw.Rejected as exc:
            b_errors.append(exc)
            assert trio.current_time() - start == pytest.approx(5)

    async with engine, trio.open_nursery() as nursery:
        for _ in range(b_jobs):
            nursery.start_soon(b_caller)
        async with trio.open_nursery() as clients:
            for _ in range(4):
                clients.start_soon(client)
        nursery.cancel_scope.cancel()  # b's admitted jobs never end on their own
    return sorted(finished), b_errors, a_rejected


async def test_a_hanging_backend_does_not_slow_a_reserved_one(
    autojump_clock: trio.abc.Clock,
) -> None:
    idle_times, _, _ = await run_scenario(b_jobs=0)
    noisy_times, b_errors, a_rejected = await run_scenario(b_jobs=20)
    # a completes at exactly the same virtual times with b hanging as with b idle.
    assert noisy_times == idle_times
    assert idle_times[-1] == pytest.approx(10)
    assert a_rejected == 0
    # b holds its limit of 4; the other 16 are rejected at their 5 s wait timeout.
    assert len(b_errors) == 16
    assert {e.reason for e in b_errors if isinstance(e, pw.Rejected)} == {"wait_timeout"}
    assert all(isinstance(e, pw.Rejected) and e.key == "b" for e in b_errors)


async def test_weights_changed_live_govern_the_next_admission(
    autojump_clock: trio.abc.Clock,
) -> None:
    pool = pw.WeightedPool(4, keys={"s": pw.Weights(limit=1)})
    engine = pw.Engine(pool=pool)
    running = 0
    peak = 0

    @engine.pipe(key="s")
    async def work(ctx: pw.Context) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await trio.sleep(1)
        running -= 1

    engine.chain("s", work)
    async with engine:
        start = trio.current_time()
        ids = [await engine.submit("s") for _ in range(4)]
        await trio.sleep(0.5)
        assert peak == 1
        generation = pool.reconfigure(pool.config.with_weights("s", pw.Weights(limit=3)))
        assert generation == pool.statistics().config_generation
        for job_id in ids:
            await engine.wait(job_id)
        # 1 s for the first, then the other three together: 2 s in all.
        assert trio.current_time() - start == pytest.approx(2)
        assert peak == 3


async def test_accepted_work_waits_out_the_load_new_work_is_refused(
    autojump_clock: trio.abc.Clock,
) -> None:
    pool = pw.WeightedPool(4, keys={"s": pw.Weights(limit=1, wait_timeout=1, max_waiting=1)})
    engine = pw.Engine(pool=pool)

    @engine.pipe(key="s")
    async def hold(ctx: pw.Context) -> None:
        await trio.sleep(5)

    @engine.pipe
    async def park(ctx: pw.Context) -> None:
        await ctx.suspend("go")

    @engine.pipe(key="s")
    async def after(ctx: pw.Context) -> None:
        ctx.state["done"] = trio.current_time()

    engine.chain("hold", hold)
    engine.chain("resume", park, after)
    async with engine:
        start = trio.current_time()
        holder = await engine.submit("hold")
        resumed = await engine.submit("resume")
        await wait_idle()
        await engine.signal(resumed, "go")  # its next step needs "s", held for 5 s
        await wait_idle()
        new = await engine.submit("hold")  # new work: "s" already has a waiter
        with pytest.raises(pw.Rejected) as refused:
            await engine.wait(new)
        assert refused.value.reason == "queue_full"
        result = await engine.wait(resumed)  # waited 5 s, past the 1 s wait timeout
        assert result["done"] - start == pytest.approx(5)
        await engine.wait(holder)
