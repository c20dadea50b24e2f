"""ResourcePool with fake resources: lending, waiting, timeouts, replacement, start-up and
shutdown, at exact virtual times."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import pytest
import trio
import trio.testing

import pipework as pw

HANG_GUARD = 600.0


@dataclass
class Fake:
    number: int
    closed: bool = False


@dataclass
class Factory:
    """Makes numbered fakes; told to fail or hang for chosen calls."""

    fail: set[int] = field(default_factory=set)
    hang: set[int] = field(default_factory=set)
    failing: bool = False  # every call fails while set
    calls: int = 0
    made: list[Fake] = field(default_factory=list)
    in_use: int = 0
    most_in_use: int = 0

    async def __call__(self) -> Fake:
        self.calls += 1
        number = self.calls  # taken before the launch: several may run at once
        await trio.sleep(0.5)  # a launch takes time
        if number in self.hang:
            await trio.sleep_forever()
        if self.failing or number in self.fail:
            raise OSError(f"launch {number} failed")
        fake = Fake(number)
        self.made.append(fake)
        return fake

    async def close(self, fake: Fake) -> None:
        await trio.sleep(0.1)
        fake.closed = True


def make_pool(factory: Factory, size: int = 2, **options: object) -> pw.ResourcePool[Fake]:
    settings: dict[str, object] = {"borrow_timeout": 5.0, "launch_timeout": 2.0}
    settings.update(options)
    return pw.ResourcePool(factory, size, close=factory.close, name="fakes", **settings)  # type: ignore[arg-type]  # settings are the keyword options


async def test_all_made_at_start_up_and_closed_at_shutdown(autojump_clock: object) -> None:
    factory = Factory()
    pool = make_pool(factory, size=3)
    with trio.fail_after(HANG_GUARD):
        async with pool:
            assert trio.current_time() == pytest.approx(1.5)  # one after the other
            assert [f.number for f in factory.made] == [1, 2, 3]
            stats = pool.statistics()
            assert (stats.size, stats.capacity, stats.idle, stats.borrowed) == (3, 3, 3, 0)
        assert all(f.closed for f in factory.made)
        assert pool.statistics().capacity == 0
        with pytest.raises(pw.ResourcePoolClosed):
            async with pool.borrow():
                pass  # pragma: no cover - the body never runs


async def test_at_most_size_borrowed_and_the_next_gets_the_returned_one(
    autojump_clock: object,
) -> None:
    factory = Factory()
    pool = make_pool(factory, size=2)
    got: list[tuple[str, float, int]] = []
    in_use = most = 0

    async def user(label: str, hold: float) -> None:
        nonlocal in_use, most
        async with pool.borrow() as fake:
            in_use += 1
            most = max(most, in_use)
            got.append((label, trio.current_time(), fake.number))
            await trio.sleep(hold)
            in_use -= 1

    with trio.fail_after(HANG_GUARD):
        async with pool, trio.open_nursery() as nursery:
            t0 = trio.current_time()
            nursery.start_soon(user, "a", 1.0)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(user, "b", 3.0)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(user, "c", 1.0)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(user, "d", 1.0)
            await trio.testing.wait_all_tasks_blocked()
            assert pool.statistics().waiting == 2
    assert most == 2
    times = {label: (at - t0, number) for label, at, number in got}
    # c waited for a's resource (back at 1.0), d for c's (2.0), FIFO.
    assert times == {"a": (0, 1), "b": (0, 2), "c": (1.0, 1), "d": (2.0, 1)}
    assert factory.calls == 2  # nothing replaced


async def test_borrow_timeout_at_its_exact_virtual_time(autojump_clock: object) -> None:
    pool = make_pool(Factory(), size=1, borrow_timeout=5.0)
    with trio.fail_after(HANG_GUARD):
        async with pool, pool.borrow():
            start = trio.current_time()
            with pytest.raises(pw.BorrowTimeout) as caught:
                async with pool.borrow():
                    pass  # pragma: no cover - the body never runs
            assert trio.current_time() - start == 5.0
            assert caught.value.timeout == 5.0
            assert isinstance(caught.value, pw.PipeworkError)
            assert isinstance(caught.value, TimeoutError)
            assert pool.statistics().waiting == 0


async def test_the_callers_cancel_scope_bounds_the_wait(autojump_clock: object) -> None:
    pool = make_pool(Factory(), size=1, borrow_timeout=5.0)
    with trio.fail_after(HANG_GUARD):
        async with pool, pool.borrow():
            start = trio.current_time()
            with trio.move_on_after(2.0):
                async with pool.borrow():
                    pass  # pragma: no cover - the body never runs
            assert trio.current_time() - start == 2.0
            assert pool.statistics().waiting == 0


async def test_failure_closes_and_replaces_in_the_background(
    autojump_clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    factory = Factory()
    pool = make_pool(factory, size=1)
    with trio.fail_after(HANG_GUARD):
        async with pool:
            with pytest.raises(ValueError, match="render failed"):
                async with pool.borrow() as first:
                    raise ValueError("render failed")
            assert pool.statistics().capacity == 0
            start = trio.current_time()
            async with pool.borrow() as second:
                # close (0.1) then launch (0.5)
                assert trio.current_time() - start == pytest.approx(0.6)
                assert first.closed
                assert second.number == 2
            stats = pool.statistics()
            assert (stats.capacity, stats.replacements, stats.discarded) == (1, 1, 1)
            async with pool.borrow() as reported:
                pool.report_broken(reported)
            async with pool.borrow() as third:
                assert third.number == 3
                assert reported.closed
    assert "a borrowed resource failed" in caplog.text


async def test_failed_replacement_warns_lowers_capacity_then_recovers(
    autojump_clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    factory = Factory()
    pool = make_pool(factory, size=2, retry_backoff=1.0, retry_backoff_max=4.0)
    with trio.fail_after(HANG_GUARD), caplog.at_level(logging.WARNING, "pipework.resources"):
        async with pool:
            factory.failing = True
            broke_at = trio.current_time()
            with pytest.raises(RuntimeError):
                async with pool.borrow():
                    raise RuntimeError("worker died")
            # Attempts at 0.1 (after the close), then backoff 1, 2, 4, 4 after each 0.5 launch.
            await trio.sleep(0.1 + 0.5 + 1 + 0.5 + 2 + 0.5 + 0.01)
            stats = pool.statistics()
            assert (stats.size, stats.capacity, stats.failures) == (2, 1, 3)
            assert caplog.text.count("making a replacement failed") == 3
            async with pool.borrow() as other:  # the other resource still serves
                assert other.number == 2
            factory.failing = False
            # The 4th attempt starts at 4.6 + 4 (the backoff) and succeeds at 9.1.
            await trio.sleep_until(broke_at + 9.09)
            assert pool.statistics().capacity == 1
            await trio.sleep_until(broke_at + 9.1)
            await trio.testing.wait_all_tasks_blocked()
            stats = pool.statistics()
            assert (stats.capacity, stats.replacements, stats.failures) == (2, 1, 3)
            assert factory.made[-1].number == 6
            assert caplog.text.count("making a replacement failed") == 3
    assert all(f.closed for f in factory.made)


async def test_start_up_failure_closes_what_was_made(autojump_clock: object) -> None:
    factory = Factory(fail={3})
    pool = make_pool(factory, size=4)
    with trio.fail_after(HANG_GUARD), pytest.raises(pw.ResourceStartupError) as caught:
        async with pool:
            pass  # pragma: no cover - the body never runs
    assert "resource 3 of 4" in str(caught.value)
    assert isinstance(caught.value.__cause__, OSError)
    assert [f.number for f in factory.made] == [1, 2]
    assert all(f.closed for f in factory.made)
    assert factory.calls == 3


async def test_start_up_launch_timeout(autojump_clock: object) -> None:
    factory = Factory(hang={2})
    pool = make_pool(factory, size=3, launch_timeout=2.0)
    start = trio.current_time()
    with trio.fail_after(HANG_GUARD), pytest.raises(ExceptionGroup) as caught:
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run)
    (error,) = caught.value.exceptions
    assert isinstance(error, pw.ResourceStartupError)
    assert "resource 2 of 3 failed (timed out)" in str(error)
    # The first launch (0.5), the second cut at launch_timeout (2.0), the first closed (0.1).
    assert trio.current_time() - start == pytest.approx(0.5 + 2.0 + 0.1)
    assert [f.closed for f in factory.made] == [True]


async def test_shutdown_fails_waiters_and_closes_borrowed_on_return(
    autojump_clock: object,
) -> None:
    factory = Factory()
    pool = make_pool(factory, size=1, borrow_timeout=60.0)
    failures: list[BaseException] = []

    async def waiter() -> None:
        try:
            async with pool.borrow():
                pass  # pragma: no cover - the body never runs
        except pw.ResourcePoolClosed as error:
            failures.append(error)

    with trio.fail_after(HANG_GUARD):
        async with trio.open_nursery() as outer:
            async with trio.open_nursery() as nursery:
                await nursery.start(pool.run)
                held = trio.Event()
                release = trio.Event()

                async def holder() -> None:
                    async with pool.borrow() as fake:
                        held.set()
                        await release.wait()
                        assert not fake.closed

                outer.start_soon(holder)
                await held.wait()
                outer.start_soon(waiter)
                await trio.testing.wait_all_tasks_blocked()
                nursery.cancel_scope.cancel()
            await trio.testing.wait_all_tasks_blocked()  # the woken waiter has run
            assert len(failures) == 1
            assert "shut down" in str(failures[0])
            assert not factory.made[0].closed  # still borrowed
            release.set()
        assert factory.made[0].closed


async def test_metrics(autojump_clock: object) -> None:
    metrics = pw.Metrics()
    factory = Factory()
    pool = pw.ResourcePool(
        factory,
        2,
        borrow_timeout=1.0,
        launch_timeout=2.0,
        close=factory.close,
        name="pdf",
        metrics=metrics,
    )
    with trio.fail_after(HANG_GUARD):
        async with pool, pool.borrow():
            text = metrics.exposition().decode()
            assert 'pipework_resource_pool_size{pool="pdf"} 2.0' in text
            assert 'pipework_resource_pool_borrowed{pool="pdf"} 1.0' in text
            assert 'pipework_resource_pool_idle{pool="pdf"} 1.0' in text
            assert 'pipework_resource_pool_replacements_total{pool="pdf"} 0.0' in text
            assert 'pipework_resource_pool_wait_seconds_count{pool="pdf"} 1.0' in text


@pytest.mark.parametrize(
    ("size", "options"),
    [(0, {}), (2, {"borrow_timeout": 0}), (2, {"retry_backoff": 2.0, "retry_backoff_max": 1.0})],
)
def test_configuration_that_cannot_work(size: int, options: dict[str, float]) -> None:
    with pytest.raises(pw.PoolConfigError):
        make_pool(Factory(), size=size, **options)


async def test_a_concurrent_start_makes_them_all_at_once(autojump_clock: object) -> None:
    factory = Factory()
    pool = make_pool(factory, size=3, concurrent_start=True)
    with trio.fail_after(HANG_GUARD):
        async with pool:
            assert trio.current_time() == pytest.approx(0.5)  # three launches of 0.5 at once
            assert sorted(f.number for f in factory.made) == [1, 2, 3]
            assert pool.statistics().idle == 3
    assert all(f.closed for f in factory.made)


async def test_a_concurrent_start_reports_the_lowest_failure_and_closes_the_rest(
    autojump_clock: object,
) -> None:
    factory = Factory(fail={2, 4}, hang={3})
    pool = make_pool(factory, size=4, launch_timeout=2.0, concurrent_start=True)
    start = trio.current_time()
    with trio.fail_after(HANG_GUARD), pytest.raises(pw.ResourceStartupError) as caught:
        async with pool:
            pass  # pragma: no cover - the body never runs
    # Every launch ran to its end (the hung one to launch_timeout), then the one made closed.
    # Which launch a task got is up to trio's scheduling; the lowest failed task is named.
    message = str(caught.value)
    assert re.search(
        r"making resource [1-3] of 4 failed \((OSError: launch [24] failed|timed out)\)", message
    )
    assert "the 1 made were closed" in message
    assert factory.calls == 4
    assert trio.current_time() - start == pytest.approx(2.0 + 0.1)
    assert [f.closed for f in factory.made] == [True]


async def test_a_concurrent_start_that_fails_everywhere_names_the_first(
    autojump_clock: object,
) -> None:
    factory = Factory(failing=True)
    pool = make_pool(factory, size=4, concurrent_start=True)
    with trio.fail_after(HANG_GUARD), pytest.raises(pw.ResourceStartupError) as caught:
        async with pool:
            pass  # pragma: no cover - the body never runs
    assert "making resource 1 of 4 failed (OSError: launch " in str(caught.value)
    assert isinstance(caught.value.__cause__, OSError)
    assert trio.current_time() == pytest.approx(0.5)


@dataclass
class Closable:
    closed: bool = False

    async def aclose(self) -> None:
        await trio.sleep(0.1)
        self.closed = True


async def test_without_a_close_each_resource_with_aclose_is_closed_by_it(
    autojump_clock: object,
) -> None:
    """The default close: a resource's own aclose() where it has one; a resource without
    one (here a plain number) is simply let go."""
    made: list[object] = []

    async def factory() -> object:
        resource: object = Closable() if len(made) % 2 == 0 else len(made)
        made.append(resource)
        return resource

    with trio.fail_after(HANG_GUARD):
        async with pw.ResourcePool(
            factory, 4, name="mixed", borrow_timeout=5.0, launch_timeout=2.0
        ):
            assert len(made) == 4
    closables = [r for r in made if isinstance(r, Closable)]
    assert len(closables) == 2
    assert all(r.closed for r in closables)
