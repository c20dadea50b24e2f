"""The weighted pool under trio: virtual time (``autojump_clock``), no sleeps, and a hang
guard around every test that waits."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import trio
import trio.testing
from trio.testing import wait_all_tasks_blocked

from pipework import Adaptive, Admission, PoolConfig, Rejected, WeightedPool, Weights

GUARD = 60.0  # virtual seconds: a hang autojumps here and fails instead of blocking


@dataclass
class Step:
    """One step through the pool: when it was admitted or why it was refused."""

    key: str
    deadline: float = math.inf
    finish: trio.Event = field(default_factory=trio.Event)
    admitted_at: float | None = None
    error: Rejected | None = None
    refused_at: float | None = None
    cancelled: bool = False

    async def run(self, pool: WeightedPool) -> None:
        try:
            async with pool.slot(self.key, deadline=self.deadline):
                self.admitted_at = trio.current_time()
                await self.finish.wait()
        except Rejected as error:
            self.error = error
            self.refused_at = trio.current_time()
        except trio.Cancelled:
            self.cancelled = True
            raise


async def start(nursery: trio.Nursery, pool: WeightedPool, *steps: Step) -> None:
    """Start the steps one by one: trio does not run tasks started together in order."""
    for step in steps:
        nursery.start_soon(step.run, pool)
        await wait_all_tasks_blocked()


async def finish(*steps: Step) -> None:
    for step in steps:
        step.finish.set()
    await wait_all_tasks_blocked()


def test_weighted_pool_is_an_admission() -> None:
    pool: Admission = WeightedPool(4)
    assert pool.slot("a") is not None


async def test_a_key_at_its_limit_does_not_delay_other_keys(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool = WeightedPool(4, keys={"slow": Weights(limit=1)})
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            holder, blocked, other = Step("slow"), Step("slow"), Step("other")
            await start(nursery, pool, holder, blocked)
            await trio.sleep(1.0)
            await start(nursery, pool, other)
            assert (blocked.admitted_at, other.admitted_at) == (None, 1.0)
            await trio.sleep(1.0)
            await finish(holder)
            assert blocked.admitted_at == 2.0
            await finish(blocked, other)


async def test_a_reserved_key_gets_its_slot_while_others_saturate_the_pool(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool = WeightedPool(4, keys={"users": Weights(reserve=1)})
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            crowd = [Step("search") for _ in range(4)]
            await start(nursery, pool, *crowd)
            assert [s.admitted_at is not None for s in crowd] == [True, True, True, False]
            users = Step("users")
            await start(nursery, pool, users)
            assert users.admitted_at == 0.0
            stats = pool.statistics()
            assert (stats.in_use, stats.in_use_shared, stats.waiting) == (4, 3, 1)
            await finish(users, *crowd)


async def test_a_freed_slot_is_handed_to_the_waiter_not_a_newcomer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool = WeightedPool(1)
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            waiter, newcomer = Step("a"), Step("b")
            async with pool.slot("a"):
                await start(nursery, pool, waiter)
            # No checkpoint since the release: the waiter has not run, yet the slot is its.
            assert pool.statistics().in_use == 1
            await start(nursery, pool, newcomer)
            assert (waiter.admitted_at, newcomer.admitted_at) == (0.0, None)
            await finish(waiter, newcomer)
            assert newcomer.admitted_at == 0.0


async def test_wait_timeout_rejects_at_the_exact_virtual_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool = WeightedPool(1, wait_timeout=2.5)
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            holder = Step("a")
            await start(nursery, pool, holder)
            t0 = trio.current_time()
            with pytest.raises(Rejected) as info:
                async with pool.slot("a"):
                    pytest.fail("admitted while the only slot was held")
            assert trio.current_time() - t0 == 2.5
            assert (info.value.reason, info.value.key) == ("wait_timeout", "a")
            assert pool.statistics().keys["a"].rejected["wait_timeout"] == 1
            await finish(holder)


async def test_the_job_deadline_ends_the_wait_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool = WeightedPool(1, keys={"a": Weights(wait_timeout=5.0)})
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            holder = Step("a")
            await start(nursery, pool, holder)
            late = Step("a", deadline=trio.current_time() + 1.25)
            await start(nursery, pool, late)
            await trio.sleep(2.0)
            assert late.error is not None
            assert (late.error.reason, late.refused_at) == ("deadline", 1.25)
            assert pool.statistics().waiting == 0
            await finish(holder)


async def test_a_deadline_shorter_than_the_predicted_wait_is_refused_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool = WeightedPool(1)
    with trio.fail_after(GUARD):
        for _ in range(3):  # teach the pool that a step holds its slot for two seconds
            async with pool.slot("a"):
                await trio.sleep(2.0)
        async with trio.open_nursery() as nursery:
            holder = Step("a")
            await start(nursery, pool, holder)
            t0 = trio.current_time()
            with pytest.raises(Rejected) as info:
                async with pool.slot("a", deadline=t0 + 1.0):
                    pytest.fail("admitted past its deadline")
            assert trio.current_time() == t0
            assert info.value.reason == "deadline"
            assert info.value.retry_after == pytest.approx(2.0)
            await finish(holder)


async def test_a_full_queue_is_refused_at_once(autojump_clock: trio.testing.MockClock) -> None:
    pool = WeightedPool(1, keys={"a": Weights(max_waiting=1)})
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            holder, waiter, extra = Step("a"), Step("a"), Step("a")
            await start(nursery, pool, holder, waiter, extra)
            assert extra.error is not None
            assert extra.error.reason == "queue_full"
            await finish(holder, waiter)


async def test_shrinking_a_limit_revokes_nothing_and_admits_nothing_until_drained(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool = WeightedPool(3)
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            running = [Step("a") for _ in range(3)]
            blocked = Step("a")
            await start(nursery, pool, *running, blocked)
            generation = pool.reconfigure(pool.config.with_weights("a", Weights(limit=1)))
            await wait_all_tasks_blocked()
            stats = pool.statistics()
            assert (stats.config_generation, generation) == (2, 2)
            assert (stats.keys["a"].in_use, stats.keys["a"].debt) == (3, 2)
            assert not any(s.cancelled or s.error for s in running)
            await finish(running[0])
            await finish(running[1])
            assert blocked.admitted_at is None
            await trio.sleep(1.0)
            await finish(running[2])
            assert blocked.admitted_at == 1.0
            await finish(blocked)


async def test_raising_a_limit_wakes_waiters_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool = WeightedPool(8, keys={"a": Weights(limit=1)})
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            steps = [Step("a") for _ in range(3)]
            await start(nursery, pool, *steps)
            await trio.sleep(5.0)
            pool.reconfigure(pool.config.with_weights("a", Weights(limit=3)))
            await wait_all_tasks_blocked()
            assert [s.admitted_at for s in steps] == [0.0, 5.0, 5.0]
            await finish(*steps)


async def test_pause_refuses_new_and_waiting_steps_and_unpause_admits_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool = WeightedPool(1)
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            holder, waiter = Step("a"), Step("a")
            await start(nursery, pool, holder, waiter)
            pool.reconfigure(pool.config.with_weights("a", Weights(limit=0)))
            await wait_all_tasks_blocked()
            assert waiter.error is not None
            assert waiter.error.reason == "paused"
            assert holder.error is None
            assert holder.admitted_at is not None  # admitted before the pause: keeps running
            refused = Step("a")
            await start(nursery, pool, refused)
            assert refused.error is not None
            assert refused.error.reason == "paused"
            await finish(holder)
            pool.reconfigure(pool.config.with_weights("a", Weights()))
            resumed = Step("a")
            await start(nursery, pool, resumed)
            assert resumed.admitted_at is not None
            await finish(resumed)


@pytest.mark.parametrize("wait_timeout", [None, 10.0])
async def test_cancelled_while_waiting_withdraws_cleanly(
    autojump_clock: trio.testing.MockClock, wait_timeout: float | None
) -> None:
    pool = WeightedPool(1, wait_timeout=wait_timeout)
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            holder = Step("a")
            await start(nursery, pool, holder)
            with trio.move_on_after(1.0) as scope:
                async with pool.slot("a"):
                    pytest.fail("admitted while the only slot was held")
            assert scope.cancelled_caught
            stats = pool.statistics()
            assert (stats.waiting, stats.keys["a"].rejected["wait_timeout"]) == (0, 0)
            await finish(holder)
            assert pool.statistics().in_use == 0


async def test_a_grant_that_lands_during_cancellation_is_given_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool = WeightedPool(1)
    entered = False

    async def waiter(scope: trio.CancelScope) -> None:
        nonlocal entered
        with scope:
            async with pool.slot("a"):
                entered = True

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            scope = trio.CancelScope()
            async with pool.slot("a"):
                nursery.start_soon(waiter, scope)
                await wait_all_tasks_blocked()
            # Leaving the slot granted it to the waiter; cancel before the waiter has run.
            scope.cancel()
            await wait_all_tasks_blocked()
        assert scope.cancelled_caught
        assert not entered
        stats = pool.statistics()
        assert (stats.in_use, stats.waiting, stats.admitted) == (0, 0, 2)


async def test_a_slot_context_is_entered_once() -> None:
    pool = WeightedPool(2)
    slot = pool.slot("a")
    async with slot:
        with pytest.raises(RuntimeError, match="entered only once"):
            await slot.__aenter__()


async def test_recorded_failures_shrink_the_adaptive_limit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool = WeightedPool(16, keys={"api": Weights(limit=12, adaptive=Adaptive(min_limit=2))})
    with trio.fail_after(GUARD):
        assert pool.statistics().keys["api"].effective_limit == 12
        async with pool.slot("api"):
            pool.record("api", ok=False, latency=0.2)
        assert pool.statistics().keys["api"].effective_limit == 6
        pool.record("unknown", ok=False, latency=0.2)  # no adaptive limit: nothing to do


async def test_a_step_in_a_thread_holds_its_slot() -> None:
    pool = WeightedPool(2)
    with trio.fail_after(GUARD):
        async with pool.slot("blocking"):
            stats = await trio.to_thread.run_sync(trio.from_thread.run_sync, pool.statistics)
    assert stats.keys["blocking"].in_use == 1
    assert pool.statistics().in_use == 0


async def test_a_pool_built_from_a_config_uses_it() -> None:
    config = PoolConfig(
        max_workers=2, keys={"a": Weights(reserve=2)}, default=Weights(max_waiting=0)
    )
    pool = WeightedPool.from_config(config)
    assert pool.config is config
    with pytest.raises(Rejected, match="max_waiting"):
        async with pool.slot("b"):  # every slot is reserved for "a", and "b" may not queue
            pytest.fail("admitted without a free slot")


def test_a_config_with_too_many_reserves_never_reaches_the_pool() -> None:
    pool = WeightedPool(4, keys={"a": Weights(reserve=2)})
    with pytest.raises(ValueError, match="reserves add up to 6"):
        pool.reconfigure(PoolConfig(max_workers=4, keys={"a": Weights(reserve=6)}))
    assert pool.config_generation == 1
