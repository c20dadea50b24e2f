"""Documented promises of the engine, each pinned through the public API: stage timers,
blocking pipes, progress and chunks from branches, adaptive limits, the limit a
DeadlineExceeded names, and registration errors. Time is virtual (autojump_clock). Each
test declares its pipes and chains on a running engine (the ``engine`` fixture)."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import trio

import pipework as pw

from ._redis import wait_idle

# The engine's suite runs on every store: the engine fixture is each_store's (conftest.py).

# -- 1. a stage's timer starts when the stage is entered ---------------------------------


async def test_stage_timer_starts_when_the_stage_is_entered(
    autojump_clock: trio.abc.Clock,
    engine: pw.Engine,
) -> None:
    @engine.pipe
    async def park(ctx: pw.Context) -> None:
        await ctx.suspend("go")

    @engine.pipe
    async def step(ctx: pw.Context) -> None:
        await trio.sleep(1)
        ctx.state["stepped"] = True

    engine.chain("c", park, pw.serial(step, timeout=5))
    start = trio.current_time()
    job_id = await engine.submit("c")
    await trio.sleep(10)
    assert (await engine.status(job_id)).status is pw.Status.SUSPENDED
    await engine.signal(job_id, "go")
    result = await engine.wait(job_id)
    assert result["stepped"] is True
    assert trio.current_time() - start == pytest.approx(11)


async def test_a_stage_entered_after_a_resume_still_times_out_on_its_own_clock(
    autojump_clock: trio.abc.Clock,
    engine: pw.Engine,
) -> None:
    @engine.pipe
    async def park(ctx: pw.Context) -> None:
        await ctx.suspend("go")

    @engine.pipe
    async def slow(ctx: pw.Context) -> None:
        await trio.sleep(10)

    engine.chain("c", park, pw.serial(slow, timeout=5))
    job_id = await engine.submit("c")
    await trio.sleep(10)
    await engine.signal(job_id, "go")
    resumed = trio.current_time()
    with pytest.raises(pw.DeadlineExceeded) as info:
        await engine.wait(job_id)
    assert trio.current_time() - resumed == pytest.approx(5)
    assert info.value.scope == "stage"


# -- 2. blocking pipes: a timeout or cancel takes effect when the thread returns ---------


async def _until_the_thread_returns(engine: pw.Engine, job_id: str) -> None:
    """Spin (never idle) until the job ends: under the autojump clock an idle run would
    jump virtual time ahead while the pipe's thread still runs in real time."""
    while (await engine.status(job_id)).status not in FINAL:
        await trio.lowlevel.checkpoint()


FINAL = {pw.Status.DONE, pw.Status.FAILED, pw.Status.CANCELLED, pw.Status.EXPIRED}


def _blocking_pipe(engine: pw.Engine, release: threading.Event, **options: Any) -> pw.Pipe:
    def crunch(ctx: pw.Context) -> None:
        release.wait()
        ctx.state["written_by_thread"] = True

    return engine.pipe(name="crunch", blocking=True, **options)(crunch)


async def test_blocking_pipe_timeout_takes_effect_when_the_thread_returns(
    autojump_clock: trio.abc.Clock,
    engine: pw.Engine,
) -> None:
    release = threading.Event()
    crunch = _blocking_pipe(engine, release, timeout=1)
    engine.chain("c", crunch)
    job_id = await engine.submit("c", {"n": 1})
    await trio.sleep(5)
    assert (await engine.status(job_id)).status is pw.Status.RUNNING
    release.set()
    await _until_the_thread_returns(engine, job_id)
    with pytest.raises(pw.DeadlineExceeded) as info:
        await engine.wait(job_id)
    assert info.value.scope == "pipe"
    assert "pipe 'crunch'" in info.value.where
    job = await engine.store.get(job_id)
    assert job.status is pw.Status.FAILED
    assert "written_by_thread" not in job.state


async def test_blocking_pipe_job_deadline_expires_the_job(
    autojump_clock: trio.abc.Clock,
    engine: pw.Engine,
) -> None:
    release = threading.Event()
    crunch = _blocking_pipe(engine, release)
    engine.chain("c", crunch, timeout=2)
    job_id = await engine.submit("c")
    await trio.sleep(5)
    release.set()
    await _until_the_thread_returns(engine, job_id)
    with pytest.raises(pw.DeadlineExceeded) as info:
        await engine.wait(job_id)
    assert info.value.scope == "job"
    assert (await engine.status(job_id)).status is pw.Status.EXPIRED


async def test_blocking_pipe_cancel_takes_effect_when_the_thread_returns(
    autojump_clock: trio.abc.Clock,
    engine: pw.Engine,
) -> None:
    release = threading.Event()
    crunch = _blocking_pipe(engine, release)
    engine.chain("c", crunch)
    job_id = await engine.submit("c")
    await trio.sleep(1)
    await engine.cancel(job_id)
    release.set()
    await _until_the_thread_returns(engine, job_id)
    with pytest.raises(pw.JobCancelled):
        await engine.wait(job_id)
    job = await engine.store.get(job_id)
    assert job.status is pw.Status.CANCELLED
    assert "written_by_thread" not in job.state


# -- 3. progress and chunks from branches reach the parent job ---------------------------


async def test_progress_from_a_branch_reaches_the_parent(
    autojump_clock: trio.abc.Clock, engine: pw.Engine
) -> None:
    gate = trio.Event()

    @engine.pipe
    async def fetch(ctx: pw.Context) -> None:
        await ctx.progress(3, 10, "rows")
        await gate.wait()

    @engine.pipe
    async def other(ctx: pw.Context) -> None:
        await gate.wait()

    engine.chain("c", pw.all_of(fetch, other))
    job_id = await engine.submit("c")
    await wait_idle()
    progress = (await engine.status(job_id)).progress
    assert progress is not None
    assert (progress.done, progress.total, progress.message) == (3, 10, "rows")
    assert progress.branch == "chain 'c' > all_of[0] > branch 'fetch' > pipe 'fetch'"
    gate.set()
    await engine.wait(job_id)


async def test_chunks_from_branches_reach_the_parents_stream(
    autojump_clock: trio.abc.Clock,
    engine: pw.Engine,
) -> None:
    @engine.pipe
    async def first(ctx: pw.Context) -> None:
        await ctx.emit("a")

    @engine.pipe
    async def second(ctx: pw.Context) -> None:
        await trio.sleep(1)
        await ctx.emit("b")

    @engine.pipe
    async def after(ctx: pw.Context) -> None:
        await ctx.emit("c")

    engine.chain("c", pw.all_of(first, second), after)
    job_id = await engine.submit("c", stream=True)
    chunks = [chunk async for chunk in engine.stream(job_id)]
    assert chunks == ["a", "b", "c"]
    # Without a stream, the chunks are kept with the parent's output.
    job_id = await engine.submit("c")
    await engine.wait(job_id)
    assert (await engine.store.get(job_id)).output == ["a", "b", "c"]


# -- 4. adaptive limits shrink only on the backend's trouble -----------------------------


@pytest.fixture
async def adaptive(each_store: type[Any]) -> AsyncIterator[tuple[pw.Engine, pw.WeightedPool]]:
    """A running engine whose pool limits key "svc" adaptively (8 at most, 1 at least)."""
    pool = pw.WeightedPool(16, keys={"svc": pw.Weights(limit=8, adaptive=pw.Adaptive(min_limit=1))})
    async with pw.Engine(pool=pool) as engine:
        yield engine, pool


def _adaptive_limit(pool: pw.WeightedPool) -> float | None:
    return pool.statistics().keys["svc"].adaptive_limit


@pytest.mark.parametrize(
    "error",
    [KeyError("missing"), ValueError("bad"), pw.BackendError("teapot", service="svc", status=418)],
    ids=["KeyError", "ValueError", "backend-4xx"],
)
async def test_a_pipes_own_bug_never_changes_the_limit(
    autojump_clock: trio.abc.Clock, adaptive: tuple[pw.Engine, pw.WeightedPool], error: Exception
) -> None:
    engine, pool = adaptive

    @engine.pipe(key="svc")
    async def buggy(ctx: pw.Context) -> None:
        raise error

    engine.chain("c", buggy)
    before = _adaptive_limit(pool)
    for _ in range(5):
        with pytest.raises(type(error)):
            await engine.run("c")
        await trio.sleep(1)
    assert _adaptive_limit(pool) == before


@pytest.mark.parametrize(
    "make_error",
    [
        lambda: pw.BackendError("down", service="svc", status=503),
        lambda: pw.BackendError("refused", service="svc"),
        lambda: ConnectionRefusedError("refused"),
        lambda: TimeoutError("slow"),
    ],
    ids=["5xx", "connect", "os-error", "timeout"],
)
async def test_backend_trouble_shrinks_the_limit(
    autojump_clock: trio.abc.Clock,
    adaptive: tuple[pw.Engine, pw.WeightedPool],
    make_error: Callable[[], Exception],
) -> None:
    engine, pool = adaptive

    @engine.pipe(key="svc")
    async def call(ctx: pw.Context) -> None:
        raise make_error()

    engine.chain("c", call)
    before = _adaptive_limit(pool)
    assert before is not None
    with pytest.raises(Exception):  # noqa: B017, PT011 - any of the parametrized errors
        await engine.run("c")
    after = _adaptive_limit(pool)
    assert after is not None
    assert after < before


async def test_a_pipe_timeout_shrinks_the_limit(
    autojump_clock: trio.abc.Clock, adaptive: tuple[pw.Engine, pw.WeightedPool]
) -> None:
    engine, pool = adaptive

    @engine.pipe(key="svc", timeout=1)
    async def hang(ctx: pw.Context) -> None:
        await trio.sleep_forever()

    engine.chain("c", hang)
    before = _adaptive_limit(pool)
    assert before is not None
    with pytest.raises(pw.DeadlineExceeded):
        await engine.run("c")
    after = _adaptive_limit(pool)
    assert after is not None
    assert after < before


# -- 6. DeadlineExceeded names the limit that fired --------------------------------------


async def test_the_earliest_stage_bound_is_named_with_the_stage_path(
    autojump_clock: trio.abc.Clock,
    engine: pw.Engine,
) -> None:
    @engine.pipe(timeout=30)
    async def slow(ctx: pw.Context) -> None:
        await trio.sleep(20)

    engine.chain("c", slow, pw.serial(pw.serial(slow, timeout=8), timeout=3), timeout=100)
    job_id = await engine.submit("c")
    with pytest.raises(pw.DeadlineExceeded) as info:
        await engine.wait(job_id)
    assert info.value.scope == "stage"
    # The outer serial (3 s) fired, not the inner one (8 s) nor the pipe (30 s).
    assert info.value.where == "chain 'c' > serial[1]"
    assert "chain 'c' > serial[1]" in str(info.value)
    error = (await engine.status(job_id)).error
    assert error is not None
    assert error.where == "chain 'c' > serial[1]"


async def test_a_stage_bound_fires_while_a_pipe_in_it_is_suspended(
    autojump_clock: trio.abc.Clock,
    engine: pw.Engine,
) -> None:
    @engine.pipe
    async def park(ctx: pw.Context) -> None:
        await ctx.suspend("go", timeout=60)

    engine.chain("c", _noop, pw.serial(park, timeout=4), timeout=100)
    start = trio.current_time()
    job_id = await engine.submit("c")
    with pytest.raises(pw.DeadlineExceeded) as info:
        await engine.wait(job_id)
    assert trio.current_time() - start == pytest.approx(4)
    assert info.value.scope == "stage"
    assert info.value.where == "chain 'c' > serial[1]"


async def test_the_suspend_timeout_is_named_when_it_is_the_earliest(
    autojump_clock: trio.abc.Clock,
    engine: pw.Engine,
) -> None:
    @engine.pipe
    async def park(ctx: pw.Context) -> None:
        await ctx.suspend("go", timeout=2)

    engine.chain("c", _noop, pw.serial(park, timeout=4), timeout=100)
    with pytest.raises(pw.DeadlineExceeded) as info:
        await engine.run("c")
    assert info.value.scope == "suspend"
    assert info.value.where == "chain 'c' > serial[1] > pipe 'park'"


async def test_the_pipe_bound_is_named_when_it_is_the_earliest(
    autojump_clock: trio.abc.Clock,
    engine: pw.Engine,
) -> None:
    @engine.pipe(timeout=1)
    async def slow(ctx: pw.Context) -> None:
        await trio.sleep(20)

    engine.chain("c", _noop, pw.serial(slow, timeout=4), timeout=100)
    with pytest.raises(pw.DeadlineExceeded) as info:
        await engine.run("c")
    assert info.value.scope == "pipe"
    assert info.value.where == "chain 'c' > serial[1] > pipe 'slow'"


# -- 7. every wrong declaration is a RegistrationError -----------------------------------


async def _noop(ctx: pw.Context) -> None:
    return None


def _declarations() -> list[tuple[str, Callable[[], object], str]]:
    # Deliberately wrong arguments: typed Any so that only the runtime checks judge them.
    p: Any = pw
    engine: Any = pw.Engine()
    return [
        ("all_of merge dict", lambda: p.all_of(_noop, _noop, merge={"a": 1}), "merge"),
        ("all_of merge type", lambda: p.all_of(_noop, merge=3), "merge"),
        ("quorum k type", lambda: p.quorum("2", _noop, _noop), "k"),
        ("stage timeout type", lambda: p.serial(_noop, timeout="5"), "timeout"),
        ("parallel timeout", lambda: p.any_of(_noop, timeout="1"), "timeout"),
        ("max_concurrency", lambda: p.all_of(_noop, max_concurrency="2"), "max_concurrency"),
        ("settle type", lambda: p.all_of(_noop, settle="yes"), "settle"),
        ("branch type", lambda: p.all_of(_noop, 42), "branch"),
        ("serial item", lambda: p.serial(_noop, None), "item"),
        ("pipe timeout", lambda: engine.pipe(name="p1", timeout="1")(_noop), "timeout"),
        ("pipe key", lambda: engine.pipe(name="p2", key=3)(_noop), "key"),
        ("pipe name", lambda: engine.pipe(name=7)(_noop), "name"),
        ("chain timeout", lambda: engine.chain("c1", _noop, timeout="2"), "timeout"),
        ("chain key", lambda: engine.chain("c2", _noop, key=None), "key"),
        ("chain result", lambda: engine.chain("c3", _noop, result=1), "result"),
        ("chain name", lambda: engine.chain(5, _noop), "name"),
        ("graph node after", lambda: p.graph(p.node("a", _noop, after="b")), "after"),
        ("graph node type", lambda: p.graph("a"), "node"),
        ("graph callback", lambda: p.graph(p.node("a", _noop, on_success=1)), "on_success"),
        (
            "merge policy key",
            lambda: p.all_of(_noop, merge=p.MergePolicy(keys={"a": "nope"})),
            "a",
        ),
    ]


@pytest.mark.parametrize(
    ("label", "declare", "option"), _declarations(), ids=[d[0] for d in _declarations()]
)
def test_every_wrong_declaration_is_a_registration_error(
    label: str, declare: Callable[[], object], option: str
) -> None:
    with pytest.raises(pw.RegistrationError) as info:
        declare()
    assert option in str(info.value), f"{label}: the message should name {option!r}"
