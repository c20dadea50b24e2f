"""A hand-off on the Redis store to a key with a slot free at once runs on in the same step
(Dispatcher._go_on_under): one write of the record (the cursor, the new key, running)
before the next pipe runs, the slot traded, no event and no step of its own. A key with no
slot free hands off through the queue, as on the memory store."""

from __future__ import annotations

import secrets
from typing import Any

import trio

import pipework as pw
from pipework.redis import RedisJobStore

from ._redis import RedisServer


def _steps(engine: pw.Engine) -> list[Any]:
    """The events whose steps the engine runs from now on."""
    runners = engine._dispatcher.steps.runners
    step = runners._step
    events: list[Any] = []

    async def counted(event: Any, scope: trio.CancelScope) -> bool:
        events.append(event)
        return await step(event, scope)

    runners._step = counted
    return events


async def test_a_hand_off_to_a_free_key_runs_on_in_the_same_step(
    redis_server: RedisServer,
) -> None:
    prefix = f"h{secrets.token_hex(6)}"
    pool = pw.WeightedPool(4)
    engine = pw.Engine(store=RedisJobStore(redis_server.url, prefix=prefix), pool=pool)
    seen: dict[str, Any] = {}

    @engine.pipe(key="a")
    async def first(ctx: pw.Context) -> None:
        ctx.state["first"] = True

    @engine.pipe(key="b")
    async def second(ctx: pw.Context) -> None:
        async with RedisJobStore(redis_server.url, prefix=prefix) as other:
            record = await other.get(ctx.job_id)  # as any process sees it
        seen["record"] = (record.status, record.key, record.frames[0].index, record.state)
        stats = pool.statistics()
        seen["held"] = {key: k.in_use for key, k in stats.keys.items()}

    engine.chain("c", first, second)
    steps = _steps(engine)
    async with engine:
        with trio.fail_after(10):
            assert await engine.run("c") == {"first": True}
    assert len(steps) == 1  # one step ran both pipes
    # Written before the second pipe ran: its cursor past the first, under the new key.
    assert seen["record"] == (pw.Status.RUNNING, "b", 1, {"first": True})
    assert seen["held"] == {"a": 0, "b": 1}  # the slot traded, not both held
    assert pool.statistics().in_use == 0


async def test_a_hand_off_to_a_busy_key_goes_through_the_queue(
    redis_server: RedisServer,
) -> None:
    prefix = f"h{secrets.token_hex(6)}"
    pool = pw.WeightedPool(4, keys={"b": pw.Weights(limit=1)})
    engine = pw.Engine(store=RedisJobStore(redis_server.url, prefix=prefix), pool=pool)
    release = trio.Event()
    entered = trio.Event()

    @engine.pipe(key="b")
    async def block(ctx: pw.Context) -> None:
        entered.set()
        await release.wait()

    @engine.pipe(key="a")
    async def first(ctx: pw.Context) -> None:
        ctx.state["first"] = True

    @engine.pipe(key="b")
    async def second(ctx: pw.Context) -> None:
        ctx.state["second"] = True

    engine.chain("blocker", block)
    engine.chain("c", first, second)
    async with engine:
        with trio.fail_after(10):
            blocker = await engine.submit("blocker")
            await entered.wait()
            steps = _steps(engine)
            job_id = await engine.submit("c")
            for _ in range(1000):  # handed off: queued under b while b's one slot is held
                view = await engine.status(job_id)
                if view.status is pw.Status.QUEUED and view.key == "b":
                    break
                await trio.sleep(0.01)
            else:
                raise AssertionError(f"not handed off through the queue: {view}")
            release.set()
            assert await engine.wait(job_id) == {"first": True, "second": True}
            await engine.wait(blocker)
    assert [e.job_id for e in steps] == [job_id, job_id]  # two steps: one per key
