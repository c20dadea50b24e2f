"""Nothing a pipe does can stop the engine: each step is a boundary that ends its own job —
with the original exceptions kept — and leaves every other job running."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import random
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio
from quart import Response
from quart_trio import QuartTrio

import pipework as pw
from pipework.container import serve

from ._redis import wait_idle

# The engine's suite runs on both stores: see each_store in conftest.py.
pytestmark = pytest.mark.usefixtures("each_store")


async def _ok(ctx: pw.Context) -> None:
    ctx.state["ok"] = True


async def _assert_engine_serves_on(engine: pw.Engine) -> None:
    """A fresh well-behaved job completes, no slot is held, the queue is empty."""
    assert (await engine.run("healthy"))["ok"] is True
    pool = engine.pool
    assert isinstance(pool, pw.WeightedPool)
    assert pool.statistics().in_use == 0
    assert engine.queue.statistics().depth == 0


def _engine() -> pw.Engine:
    engine = pw.Engine()
    engine.chain("healthy", engine.pipe(name="ok")(_ok))
    return engine


async def test_suspend_from_a_child_task_is_refused_clearly(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = _engine()

    @engine.pipe
    async def sneaky(ctx: pw.Context) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ctx.suspend, "later")
            await trio.sleep(1)

    engine.chain("c", sneaky)
    async with engine:
        job_id = await engine.submit("c")
        with pytest.raises(pw.PipeContractError, match="child task") as info:
            await engine.wait(job_id)
        assert "pipe 'sneaky'" in str(info.value)
        assert isinstance(info.value.__cause__, BaseExceptionGroup)  # the original, kept
        assert (await engine.status(job_id)).status is pw.Status.FAILED
        await _assert_engine_serves_on(engine)


async def test_an_exception_group_from_a_pipes_nursery_fails_only_its_job(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = _engine()

    async def boom(n: int) -> None:
        await trio.sleep(n)
        raise ValueError(f"child {n}")

    @engine.pipe
    async def fan_out(ctx: pw.Context) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(boom, 1)
            nursery.start_soon(trio.sleep, 5)

    engine.chain("c", fan_out)
    async with engine:
        with pytest.raises(ExceptionGroup) as info:
            await engine.run("c")
        assert info.group_contains(ValueError, match="child 1")
        await _assert_engine_serves_on(engine)


async def test_a_pipe_raising_a_base_exception_fails_only_its_job() -> None:
    engine = _engine()

    class Odd(BaseException):
        pass

    @engine.pipe
    async def odd(ctx: pw.Context) -> None:
        raise Odd("not an error")

    @engine.pipe
    async def exits(ctx: pw.Context) -> None:
        raise SystemExit(3)

    engine.chain("odd", odd)
    engine.chain("exits", exits)
    async with engine:
        for chain in ("odd", "exits"):
            with pytest.raises(pw.PipeContractError, match="not an error a job can end with"):
                await engine.run(chain)
        await _assert_engine_serves_on(engine)


async def test_a_pipe_that_returns_no_awaitable_fails_clearly() -> None:
    engine = _engine()

    @engine.pipe
    async def placeholder(ctx: pw.Context) -> None:
        return None

    # What a broken integration can produce: a function that passed registration but
    # returns something that cannot be awaited.
    object.__setattr__(placeholder, "fn", lambda ctx: 42)
    engine.chain("c", placeholder)
    async with engine:
        with pytest.raises(pw.PipeContractError, match="returned int, not an awaitable"):
            await engine.run("c")
        await _assert_engine_serves_on(engine)


async def test_a_pipe_that_swallows_its_timeout_still_times_out(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = _engine()

    @engine.pipe(timeout=2)
    async def stubborn(ctx: pw.Context) -> None:
        try:
            await trio.sleep(10)
        except trio.Cancelled:
            ctx.state["swallowed"] = True  # and returns as if nothing happened

    engine.chain("c", stubborn)
    async with engine:
        start = trio.current_time()
        with pytest.raises(pw.DeadlineExceeded) as info:
            await engine.run("c")
        assert info.value.scope == "pipe"
        assert trio.current_time() - start == pytest.approx(2)
        await _assert_engine_serves_on(engine)


_STEP_VAR: contextvars.ContextVar[str] = contextvars.ContextVar("step_var", default="unset")


async def test_a_context_variable_a_pipe_sets_stays_with_its_step() -> None:
    # Steps share their runners' tasks: each still starts in a context of its own.
    engine = _engine()
    seen: dict[str, tuple[str, str]] = {}

    @engine.pipe
    async def marks(ctx: pw.Context) -> None:
        before = _STEP_VAR.get()
        _STEP_VAR.set(ctx.job_id)
        await trio.lowlevel.checkpoint()
        seen[ctx.job_id] = (before, _STEP_VAR.get())

    engine.chain("c", marks)
    async with engine:
        ids = [await engine.submit("c") for _ in range(3)]
        for job_id in ids:
            await engine.wait(job_id)
        for _ in range(3):  # one after another: each step on the runner the last one left
            ids.append(await engine.submit("c"))
            await engine.wait(ids[-1])
    assert seen == {job_id: ("unset", job_id) for job_id in ids}


async def test_a_cancelled_step_leaves_its_runner_serving(
    autojump_clock: trio.abc.Clock,
) -> None:
    # The cancel spends the runner's scope: the next steps run in a fresh one, uncancelled.
    engine = _engine()

    @engine.pipe
    async def slow(ctx: pw.Context) -> None:
        await trio.sleep(10)

    engine.chain("c", slow)
    async with engine:
        for _ in range(3):
            job_id = await engine.submit("c")
            await trio.sleep(1)
            await engine.cancel(job_id)
            with pytest.raises(pw.JobCancelled):
                await engine.wait(job_id)
            assert (await engine.run("healthy"))["ok"] is True
        await _assert_engine_serves_on(engine)


async def test_a_timed_out_step_and_a_timed_step_leave_their_runner_serving(
    autojump_clock: trio.abc.Clock,
) -> None:
    # A pipe's deadline rides on the runner's scope: one that fired spends it (the next
    # steps run in a fresh one), one that did not is taken off before the next step.
    engine = _engine()

    @engine.pipe(timeout=1)
    async def slow(ctx: pw.Context) -> None:
        await trio.sleep(10)

    @engine.pipe(timeout=1)
    async def quick(ctx: pw.Context) -> None:
        await trio.sleep(0.5)
        ctx.state["quick"] = True

    engine.chain("slow", slow)
    engine.chain("quick", quick)
    async with engine:
        for _ in range(3):
            with pytest.raises(pw.DeadlineExceeded):
                await engine.run("slow")
            assert (await engine.run("healthy"))["ok"] is True
            assert (await engine.run("quick"))["quick"] is True
            await trio.sleep(5)  # past the deadline the quick step had set
            assert (await engine.run("healthy"))["ok"] is True
        await _assert_engine_serves_on(engine)


async def test_a_pipe_that_swallows_a_cancel_is_still_cancelled(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = _engine()
    after: list[str] = []

    @engine.pipe
    async def stubborn(ctx: pw.Context) -> None:
        try:
            await trio.sleep(10)
        except trio.Cancelled:
            return

    @engine.pipe
    async def next_one(ctx: pw.Context) -> None:
        after.append("ran")

    engine.chain("c", stubborn, next_one)
    async with engine:
        job_id = await engine.submit("c")
        await trio.sleep(1)
        await engine.cancel(job_id)
        with pytest.raises(pw.JobCancelled):
            await engine.wait(job_id)
        assert after == []
        await _assert_engine_serves_on(engine)


@pytest.mark.parametrize("cancel_at", [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 2.999, 3.5])
async def test_a_cancel_inside_a_pipes_own_nursery_ends_the_job(
    autojump_clock: trio.abc.Clock, cancel_at: float
) -> None:
    engine = _engine()

    async def child(delay: float) -> None:
        with trio.CancelScope() as inner:  # a library's own scopes and nurseries
            inner.deadline = trio.current_time() + 10
            await trio.sleep(delay)

    @engine.pipe
    async def connect(ctx: pw.Context) -> None:
        # Like trio.open_tcp_stream inside httpx: a cancel arrives as a group.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(child, 1)
            nursery.start_soon(child, 2)
            await trio.sleep(0.5)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(child, 1)
        ctx.state["connected"] = True

    engine.chain("c", connect)
    async with engine:
        job_id = await engine.submit("c")
        await trio.sleep(cancel_at)
        view = await engine.cancel(job_id)
        with trio.fail_after(60):
            if cancel_at < 3:
                with pytest.raises(pw.JobCancelled):
                    await engine.wait(job_id)
                assert (await engine.status(job_id)).status is pw.Status.CANCELLED
            else:  # it had finished already: a cancel changes nothing
                assert view.status is pw.Status.DONE
        await _assert_engine_serves_on(engine)


async def test_a_bookkeeping_failure_fails_that_job_and_logs_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class FlakyStore(pw.MemoryJobStore):
        """Fails one write of a poisoned job, as a broken store or a bug would."""

        failed = False

        async def update(self, job: Any) -> None:
            if job.state.get("poison") and not self.failed and job.status is pw.Status.RUNNING:
                self.failed = True
                raise RuntimeError("the store lost its connection")
            await super().update(job)

    engine = pw.Engine(store=FlakyStore())
    engine.chain("healthy", engine.pipe(name="ok")(_ok))
    async with engine:
        with (
            caplog.at_level(logging.ERROR, logger="pipework"),
            pytest.raises(pw.InternalError, match="failed inside the engine") as info,
        ):
            await engine.run("healthy", {"poison": True})
        assert isinstance(info.value.__cause__, RuntimeError)
        assert any(
            r.exc_info and "the store lost its connection" in str(r.exc_info[1])
            for r in caplog.records
        )
        await _assert_engine_serves_on(engine)


# -- a real backend whose answers close the connection ------------------------------------


def _closing_backend() -> QuartTrio:
    app = QuartTrio("closing")

    @app.route("/")
    async def answer() -> Response:
        await trio.sleep(0.001)
        return Response("{}", content_type="application/json", headers={"Connection": "close"})

    return app


@pytest.fixture
async def closing_backend(nursery: trio.Nursery) -> AsyncIterator[str]:
    stop = trio.Event()
    address = await nursery.start(
        functools.partial(
            serve, _closing_backend(), port=0, shutdown_trigger=stop, graceful_timeout=1
        )
    )
    yield address.url
    stop.set()


async def test_cancels_landing_anywhere_in_a_real_backend_call_end_every_job(
    closing_backend: str,
) -> None:
    engine = _engine()
    client = httpx.AsyncClient(base_url=closing_backend, timeout=5)

    @engine.pipe
    async def call(ctx: pw.Context) -> None:
        response = await client.get("/")
        ctx.state["status"] = response.status_code

    engine.chain("c", call, timeout=10)
    rng = random.Random(7)
    jobs: list[str] = []
    with trio.fail_after(60):
        async with client, engine:
            for _ in range(150):
                job_id = await engine.submit("c")
                jobs.append(job_id)
                await trio.sleep(rng.choice([0, 0, 0.0005, 0.001, 0.002]))
                await engine.cancel(job_id)
            for job_id in jobs:
                with contextlib.suppress(pw.JobCancelled):
                    await engine.wait(job_id)
            statuses = {(await engine.status(j)).status for j in jobs}
            assert statuses <= {pw.Status.CANCELLED, pw.Status.DONE}
            assert pw.Status.CANCELLED in statuses
            await _assert_engine_serves_on(engine)


async def test_a_graph_callback_that_raises_anything_never_stops_the_engine(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    engine = _engine()

    class Odd(BaseException):
        pass

    def bad_callback(end: pw.BranchEnd) -> None:
        raise Odd(f"callback for {end.node}")

    async def grouping_callback(end: pw.BranchEnd) -> None:
        async def fail() -> None:
            raise KeyError("child")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fail)

    engine.chain(
        "c",
        pw.graph(
            pw.node("a", _ok, on_success=bad_callback),
            pw.node("b", _ok, after=["a"], on_success=grouping_callback),
        ),
    )
    async with engine:
        with caplog.at_level(logging.ERROR, logger="pipework"):
            assert (await engine.run("c"))["ok"] is True
            await wait_idle()
        failed = [r for r in caplog.records if "callback failed" in r.getMessage()]
        assert [r.getMessage().split()[2] for r in failed] == ["'a'", "'b'"]
        await _assert_engine_serves_on(engine)
