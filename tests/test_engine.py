"""The engine end to end, in process: serial chains, timeouts, suspend/resume, overload,
cancellation and errors. Time is virtual (autojump_clock), so every time is exact."""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import Any

import pytest
import trio
import trio.testing

import pipework as pw
from pipework import MemoryEventQueue
from pipework.dispatcher._events import Event, Expire, RunJob

from ._redis import wait_idle

# The engine's suite runs on both stores: see each_store in conftest.py.
pytestmark = pytest.mark.usefixtures("each_store")


def make_engine(**kwargs: Any) -> pw.Engine:
    return pw.Engine(**kwargs)


async def test_serial_chain_result() -> None:
    engine = make_engine()

    @engine.pipe
    async def load(ctx: pw.Context) -> None:
        ctx.state["user"] = {"id": ctx.state["user_id"], "name": "ada"}

    @engine.pipe
    async def greet(ctx: pw.Context) -> None:
        ctx.state["greeting"] = f"hello {ctx.state['user']['name']}"

    engine.chain("hello", load, greet, result="greeting")
    async with engine:
        assert await engine.run("hello", {"user_id": 7}) == "hello ada"


async def test_chain_without_result_returns_whole_state() -> None:
    engine = make_engine()

    @engine.pipe
    async def one(ctx: pw.Context) -> None:
        ctx.state["a"] = 1

    engine.chain("c", one, pw.serial(one, one))
    async with engine:
        job_id = await engine.submit("c", {"b": 2})
        assert await engine.wait(job_id) == {"a": 1, "b": 2}
        view = await engine.status(job_id)
        assert view.status is pw.Status.DONE
        assert view.result == {"a": 1, "b": 2}
        assert view.retain_until is not None


async def test_pipe_timeout_fires_at_exact_virtual_time(autojump_clock: trio.abc.Clock) -> None:
    engine = make_engine()

    @engine.pipe(timeout=1.5)
    async def slow(ctx: pw.Context) -> None:
        await trio.sleep(10)

    engine.chain("c", slow)
    async with engine:
        start = trio.current_time()
        with pytest.raises(pw.DeadlineExceeded) as info:
            await engine.run("c")
        assert trio.current_time() - start == pytest.approx(1.5)
        assert info.value.scope == "pipe"
        assert "chain 'c' > pipe 'slow'" in str(info.value)


async def test_stage_timeout_spans_its_pipes(autojump_clock: trio.abc.Clock) -> None:
    engine = make_engine()

    @engine.pipe
    async def one_second(ctx: pw.Context) -> None:
        await trio.sleep(1)

    engine.chain("c", one_second, pw.serial(one_second, one_second, one_second, timeout=2.5))
    async with engine:
        start = trio.current_time()
        job_id = await engine.submit("c")
        with pytest.raises(pw.DeadlineExceeded) as info:
            await engine.wait(job_id)
        # 1 s before the stage, then the stage's 2.5 s: 3.5 s, not 4.
        assert trio.current_time() - start == pytest.approx(3.5)
        assert info.value.scope == "stage"
        assert (await engine.status(job_id)).status is pw.Status.FAILED


async def test_job_timeout_bounds_pipe_and_stage(autojump_clock: trio.abc.Clock) -> None:
    engine = make_engine()

    @engine.pipe(timeout=10)
    async def one_second(ctx: pw.Context) -> None:
        assert ctx.remaining <= 10
        await trio.sleep(1)

    engine.chain("c", one_second, pw.serial(one_second, one_second, timeout=5), timeout=2.25)
    async with engine:
        start = trio.current_time()
        job_id = await engine.submit("c")
        with pytest.raises(pw.DeadlineExceeded) as info:
            await engine.wait(job_id)
        assert trio.current_time() - start == pytest.approx(2.25)
        assert info.value.scope == "job"
        assert (await engine.status(job_id)).status is pw.Status.EXPIRED


async def test_submit_timeout_overrides_chain_timeout(autojump_clock: trio.abc.Clock) -> None:
    engine = make_engine()

    @engine.pipe
    async def forever(ctx: pw.Context) -> None:
        await trio.sleep_forever()

    engine.chain("c", forever, timeout=100)
    async with engine:
        start = trio.current_time()
        with pytest.raises(pw.DeadlineExceeded):
            await engine.run("c", timeout=0.75)
        assert trio.current_time() - start == pytest.approx(0.75)


async def test_suspend_then_signal_continues_at_cursor(autojump_clock: trio.abc.Clock) -> None:
    engine = make_engine()
    calls: list[str] = []

    @engine.pipe
    async def first(ctx: pw.Context) -> None:
        calls.append("first")
        ctx.state["n"] = 1

    @engine.pipe(key="payments")
    async def wait_paid(ctx: pw.Context) -> None:
        calls.append("wait_paid")
        await ctx.suspend("paid", into="payment")

    @engine.pipe
    async def last(ctx: pw.Context) -> None:
        calls.append("last")
        ctx.state["total"] = ctx.state["payment"]["amount"] + ctx.state["n"]

    engine.chain("order", first, wait_paid, last)
    async with engine:
        job_id = await engine.submit("order")
        await wait_idle()
        view = await engine.status(job_id)
        assert view.status is pw.Status.SUSPENDED
        assert view.waiting_for == "paid"
        await trio.sleep(30)  # suspended jobs hold nothing and wait as long as they must
        await engine.signal(job_id, "paid", {"amount": 12})
        result = await engine.wait(job_id)
    assert result["total"] == 13
    assert calls == ["first", "wait_paid", "last"]


async def test_signal_that_arrives_while_running_is_kept() -> None:
    engine = make_engine()
    go = trio.Event()

    @engine.pipe
    async def hand_out_callback(ctx: pw.Context) -> None:
        await go.wait()  # the backend answers before we get to suspend
        await ctx.suspend("done")

    engine.chain("c", hand_out_callback)
    async with engine:
        job_id = await engine.submit("c")
        await wait_idle()
        await engine.signal(job_id, "done", "early")
        go.set()
        assert await engine.wait(job_id) == {"done": "early"}


async def test_an_early_signal_kept_at_a_join_resumes_one_branch(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A signal sent to a parent waiting at its join before any branch suspends for it is
    kept on the parent, and taken by one branch only, however many suspend for it at once;
    the join still hears every branch's end and the job finishes."""
    engine = make_engine()

    async def wait_for_go(ctx: pw.Context) -> None:
        await trio.sleep(1)
        await ctx.suspend("go", timeout=5)

    async def fail(ctx: pw.Context) -> None:
        await trio.sleep(1)
        raise ValueError("a branch's bug")

    # Keys of their own: the stage forks child jobs, and the parent waits in the store.
    first = engine.pipe(name="first", key="a")(wait_for_go)
    second = engine.pipe(name="second", key="b")(wait_for_go)
    third = engine.pipe(name="third", key="c")(fail)
    engine.chain("c", pw.all_of(first, second, third, settle=True, merge="last"))
    async with engine:
        job_id = await engine.submit("c")
        await trio.sleep(0.5)
        await engine.signal(job_id, "go", "once")
        with trio.fail_after(60):
            result = await engine.wait(job_id)
    outcomes = {name: info["outcome"] for name, info in result["outcomes"].items()}
    assert sorted([outcomes["first"], outcomes["second"]]) == ["ok", "timed_out"]
    assert outcomes["third"] == "error"
    assert result["go"] == "once"


async def test_signal_errors_are_clear() -> None:
    engine = make_engine()

    @engine.pipe
    async def park(ctx: pw.Context) -> None:
        await ctx.suspend("paid")

    @engine.pipe
    async def noop(ctx: pw.Context) -> None:
        return None

    engine.chain("park", park)
    engine.chain("noop", noop)
    async with engine:
        with pytest.raises(pw.JobNotFound, match="no job with id 'nope'"):
            await engine.signal("nope", "paid")
        done = await engine.submit("noop")
        await engine.wait(done)
        with pytest.raises(pw.SignalError, match="is done; signal 'paid' can only reach"):
            await engine.signal(done, "paid")
        parked = await engine.submit("park")
        await wait_idle()
        with pytest.raises(pw.SignalError, match="waiting for signal 'paid', not 'shipped'"):
            await engine.signal(parked, "shipped")
        with pytest.raises(pw.StateError) as info:
            await engine.signal(parked, "paid", {"when": object()})
        assert info.value.path == "payload.when"
        await engine.cancel(parked)


async def _until_suspended(engine: pw.Engine, count: int = 1) -> None:
    """Until ``count`` jobs (branches included) are suspended: a condition, not a time."""
    while len(await engine.store.list(pw.Status.SUSPENDED)) < count:
        await wait_idle()


async def _signal_all(engine: pw.Engine, job_id: str, name: str, count: int) -> list[Any]:
    """Send ``count`` signals ``name`` at once, payloads 0, 1, ...: what each one got, by
    payload (None: delivered, else the SignalError)."""
    outcomes: list[Any] = [None] * count

    async def send(n: int) -> None:
        try:
            await engine.signal(job_id, name, n)
        except pw.SignalError as exc:
            outcomes[n] = exc

    async with trio.open_nursery() as nursery:
        for n in range(count):
            nursery.start_soon(send, n)
    return outcomes


async def test_a_signal_sent_many_times_at_once_resumes_the_job_once() -> None:
    """Eight deliveries of one signal to a job suspended for it: one resumes it, the seven
    others are refused (none is kept for later: the job took its signal), and the job's
    state holds the one delivered payload."""
    engine = make_engine()
    release = trio.Event()

    @engine.pipe
    async def park(ctx: pw.Context) -> None:
        await ctx.suspend("paid", into="payment")

    @engine.pipe
    async def after(ctx: pw.Context) -> None:
        await release.wait()

    engine.chain("c", park, after)
    async with engine:
        job_id = await engine.submit("c")
        await _until_suspended(engine)
        outcomes = await _signal_all(engine, job_id, "paid", 8)
        release.set()
        with trio.fail_after(60):
            result = await engine.wait(job_id)
    delivered = [n for n, outcome in enumerate(outcomes) if outcome is None]
    assert len(delivered) == 1, outcomes
    for outcome in outcomes:
        if outcome is not None:
            assert "already delivered" in str(outcome)
    assert result == {"payment": delivered[0]}


async def test_a_repeated_signal_is_refused_until_the_job_suspends_for_it_again() -> None:
    """A job that took a signal (delivered while suspended, or kept and taken when it
    suspended) refuses a repeat while it runs on; suspended for that name again, it takes
    the next one."""
    engine = make_engine()
    arrived = [trio.Event() for _ in range(3)]
    gates = [trio.Event() for _ in range(3)]

    @engine.pipe
    async def first(ctx: pw.Context) -> None:
        await ctx.suspend("step", into="one")

    @engine.pipe
    async def gated(ctx: pw.Context) -> None:
        gate = ctx.state.setdefault("gate", 0)
        arrived[gate].set()
        await gates[gate].wait()
        ctx.state["gate"] += 1

    @engine.pipe
    async def second(ctx: pw.Context) -> None:
        await ctx.suspend("step", into="two")

    @engine.pipe
    async def early(ctx: pw.Context) -> None:
        await ctx.suspend("go", into="three")

    engine.chain("c", first, gated, second, gated, early, gated)
    async with engine:
        job_id = await engine.submit("c")
        await _until_suspended(engine)
        await engine.signal(job_id, "step", 1)  # delivered: the job runs on to a gate
        with pytest.raises(pw.SignalError, match="'step' was already delivered"):
            await engine.signal(job_id, "step", "repeat")
        gates[0].set()
        await _until_suspended(engine)
        await engine.signal(job_id, "step", 2)  # suspended for it again: taken
        await engine.signal(job_id, "go", 3)  # early: kept until the job suspends for it
        gates[1].set()  # ...which takes it without parking, and runs on to the last gate
        await arrived[2].wait()
        with pytest.raises(pw.SignalError, match="'go' was already delivered"):
            await engine.signal(job_id, "go", "repeat")
        gates[2].set()
        with trio.fail_after(60):
            result = await engine.wait(job_id)
    assert result == {"one": 1, "two": 2, "three": 3, "gate": 3}


async def test_of_two_early_signals_of_one_name_one_is_kept_and_one_refused() -> None:
    """Signals sent while the job runs its step are kept for it, one per name: a second of
    that name is refused, whichever record (the store's or the step's) holds the first."""
    engine = make_engine()
    arrived, release = trio.Event(), trio.Event()

    @engine.pipe
    async def work(ctx: pw.Context) -> None:
        arrived.set()
        await release.wait()
        await ctx.suspend("go", into="go")

    engine.chain("c", work)
    async with engine:
        job_id = await engine.submit("c")
        await arrived.wait()
        outcomes = await _signal_all(engine, job_id, "go", 2)
        release.set()
        with trio.fail_after(60):
            result = await engine.wait(job_id)
    refused = [outcome for outcome in outcomes if outcome is not None]
    assert len(refused) == 1, outcomes
    assert "already pending" in str(refused[0])
    assert result == {"go": 1 - outcomes.index(refused[0])}


async def test_a_signal_sent_to_a_job_and_taken_by_a_branch_is_not_taken_twice() -> None:
    """Two branches suspended for one signal name: the job they belong to takes one signal
    for each and refuses a third, rather than keep it for no one."""
    engine = make_engine()
    release = trio.Event()

    async def wait_go(ctx: pw.Context) -> None:
        await ctx.suspend("go", into=ctx.pipe.name)

    async def after(ctx: pw.Context) -> None:
        await release.wait()

    # Keys of their own: the stage forks child jobs, and the parent waits in the store.
    engine.chain(
        "c",
        pw.all_of(pw.Pipe(wait_go, "a", key="a"), pw.Pipe(wait_go, "b", key="b")),
        pw.Pipe(after, "after"),
    )
    async with engine:
        job_id = await engine.submit("c")
        await _until_suspended(engine, 2)
        outcomes = await _signal_all(engine, job_id, "go", 3)
        release.set()
        with trio.fail_after(60):
            result = await engine.wait(job_id)
    refused = [outcome for outcome in outcomes if outcome is not None]
    assert len(refused) == 1, outcomes
    assert "already delivered" in str(refused[0])
    assert sorted([result["a"], result["b"], outcomes.index(refused[0])]) == [0, 1, 2]


async def test_suspend_timeout_fails_at_exact_time(autojump_clock: trio.abc.Clock) -> None:
    engine = make_engine()

    @engine.pipe
    async def park(ctx: pw.Context) -> None:
        await ctx.suspend("paid", timeout=60)

    engine.chain("c", park)
    async with engine:
        start = trio.current_time()
        job_id = await engine.submit("c")
        with pytest.raises(pw.DeadlineExceeded) as info:
            await engine.wait(job_id)
        assert trio.current_time() - start == pytest.approx(60)
        assert info.value.scope == "suspend"
        assert (await engine.status(job_id)).status is pw.Status.FAILED


async def test_job_deadline_while_suspended_expires_it(autojump_clock: trio.abc.Clock) -> None:
    engine = make_engine()

    @engine.pipe
    async def park(ctx: pw.Context) -> None:
        await ctx.suspend("paid", timeout=60)

    engine.chain("c", park, timeout=20)
    async with engine:
        start = trio.current_time()
        job_id = await engine.submit("c")
        with pytest.raises(pw.DeadlineExceeded) as info:
            await engine.wait(job_id)
        assert trio.current_time() - start == pytest.approx(20)
        assert info.value.scope == "job"
        assert (await engine.status(job_id)).status is pw.Status.EXPIRED
        with pytest.raises(pw.SignalError):
            await engine.signal(job_id, "paid")


async def test_unserializable_state_is_rejected_with_key_path() -> None:
    engine = make_engine()

    @engine.pipe
    async def bad(ctx: pw.Context) -> None:
        ctx.state["user"] = {"tags": ["a", {1, 2}]}

    engine.chain("c", bad)
    async with engine:
        with pytest.raises(pw.StateError) as info:
            await engine.submit("c", {"ok": 1, "when": {"at": object()}})
        assert info.value.path == "state.when.at"
        assert "state.when.at holds object" in str(info.value)
        with pytest.raises(pw.StateError) as info:
            await engine.run("c")
        assert info.value.path == "state.user.tags[1]"
        assert any("pipe 'bad'" in note for note in info.value.__notes__)


async def test_full_queue_refuses_at_once_and_loses_nothing() -> None:
    engine = make_engine(pool=pw.WeightedPool(1), queue_capacity=2)
    release = trio.Event()
    finished: list[int] = []

    @engine.pipe
    async def work(ctx: pw.Context) -> None:
        await release.wait()
        finished.append(ctx.state["n"])

    engine.chain("c", work)
    async with engine:
        accepted = [await engine.submit("c", {"n": 0})]
        await wait_idle()  # job 0 holds the only slot
        accepted.append(await engine.submit("c", {"n": 1}))
        accepted.append(await engine.submit("c", {"n": 2}))
        with pytest.raises(pw.Overloaded) as info:
            await engine.submit("c", {"n": 3})
        assert info.value.retry_after > 0
        assert engine.queue.statistics().depth == 2
        release.set()
        results = [await engine.wait(job_id) for job_id in accepted]
    assert sorted(finished) == [0, 1, 2]
    assert [r["n"] for r in results] == [0, 1, 2]


async def test_an_event_put_while_the_consumer_waits_may_be_handed_off_without_waking_it() -> None:
    queue = MemoryEventQueue()
    handed: list[Event] = []

    def handoff(event: Event) -> bool:
        if isinstance(event, RunJob):
            handed.append(event)
            return True
        return False

    queue.handoff = handoff
    taken: list[Event] = []

    async def consume() -> None:
        while True:
            taken.extend(await queue.get_batch())

    queue.put_nowait(RunJob("first"))  # nobody waits: queued
    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        await trio.testing.wait_all_tasks_blocked()
        assert taken == [RunJob("first")]
        assert handed == []
        queue.put_nowait(RunJob("second"))  # the consumer waits on an empty queue
        assert handed == [RunJob("second")]
        queue.put_nowait(Expire("third", 1))  # not taken by the hand-off: queued
        queue.put_nowait(RunJob("fourth"))  # behind a queued event: queued too
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert taken == [RunJob("first"), Expire("third", 1), RunJob("fourth")]
    assert handed == [RunJob("second")]
    assert queue.statistics().depth == 4  # each counts until its work acknowledges it


async def test_cancelling_a_running_job_cancels_its_pipe() -> None:
    engine = make_engine()
    cleaned_up = trio.Event()

    @engine.pipe
    async def forever(ctx: pw.Context) -> None:
        try:
            await trio.sleep_forever()
        finally:
            cleaned_up.set()

    engine.chain("c", forever)
    async with engine:
        job_id = await engine.submit("c")
        await wait_idle()
        assert (await engine.status(job_id)).status is pw.Status.RUNNING
        await engine.cancel(job_id)
        with pytest.raises(pw.JobCancelled):
            await engine.wait(job_id)
        assert cleaned_up.is_set()
        assert (await engine.status(job_id)).status is pw.Status.CANCELLED


async def test_cancelling_suspended_and_queued_jobs() -> None:
    engine = make_engine(pool=pw.WeightedPool(1))
    release = trio.Event()

    @engine.pipe
    async def park(ctx: pw.Context) -> None:
        await ctx.suspend("x")

    @engine.pipe
    async def hold(ctx: pw.Context) -> None:
        await release.wait()

    engine.chain("park", park)
    engine.chain("hold", hold)
    async with engine:
        parked = await engine.submit("park")
        await wait_idle()
        first = await engine.submit("hold")
        second = await engine.submit("hold")
        await wait_idle()
        # Trio schedules the two steps in either order: one holds the slot, one waits.
        statuses = {(await engine.status(j)).status: j for j in (first, second)}
        assert set(statuses) == {pw.Status.RUNNING, pw.Status.QUEUED}
        holder, queued = statuses[pw.Status.RUNNING], statuses[pw.Status.QUEUED]
        await engine.cancel(parked)
        await engine.cancel(queued)
        for job_id in (parked, queued):
            with pytest.raises(pw.JobCancelled):
                await engine.wait(job_id)
        release.set()
        assert await engine.wait(holder) == {}


async def test_pipe_exception_is_the_same_object_with_stage_path() -> None:
    engine = make_engine()
    raised: list[BaseException] = []

    @engine.pipe
    async def quote(ctx: pw.Context) -> None:
        exc = KeyError("price")
        raised.append(exc)
        raise exc

    @engine.pipe
    async def ok(ctx: pw.Context) -> None:
        return None

    engine.chain("order", ok, pw.serial(ok, quote))
    async with engine:
        job_id = await engine.submit("order", correlation_id="corr-1")
        with pytest.raises(KeyError) as info:
            await engine.wait(job_id)
        assert info.value is raised[0]
        note = info.value.__notes__[-1]
        assert "chain 'order' > serial[1] > pipe 'quote'" in note
        assert job_id in note
        assert "corr-1" in note
        view = await engine.status(job_id)
        assert view.error is not None
        assert view.error.type == "KeyError"
        assert view.error.where == "chain 'order' > serial[1] > pipe 'quote'"


async def test_same_key_pipes_share_one_step_and_key_changes_hand_off() -> None:
    engine = make_engine()
    keys: list[str] = []

    async def record(ctx: pw.Context) -> None:
        keys.append(ctx.key)

    a1 = engine.pipe(name="a1", key="a")(record)
    a2 = engine.pipe(name="a2", key="a")(record)
    a3 = engine.pipe(name="a3", key="a")(record)
    b1 = engine.pipe(name="b1", key="b")(record)
    engine.chain("c", a1, a2, a3, b1)
    async with engine:
        await engine.run("c")
        # One submission plus one hand-off (a -> b): the three "a" pipes shared a step. On
        # a shared store, a hand-off to a key with a slot free at once runs on in the same
        # step, with no event of its own (Dispatcher._go_on_under).
        in_process = engine._dispatcher.nowait is not None
        assert engine.queue.statistics().accepted == (2 if in_process else 1)
    assert keys == ["a", "a", "a", "b"]


async def test_blocking_pipe_runs_in_a_thread() -> None:
    engine = make_engine()
    import threading

    main_thread = threading.get_ident()

    def crunch(ctx: pw.Context) -> None:
        ctx.state["thread"] = threading.get_ident() != main_thread
        ctx.state["sum"] = sum(range(1000))

    engine.registry.add_pipe(pw.Pipe(crunch, "crunch", blocking=True))
    engine.chain("c", "crunch")
    async with engine:
        assert await engine.run("c") == {"thread": True, "sum": 499500}


async def test_progress_and_output_chunks() -> None:
    engine = make_engine()
    step = trio.Event()

    @engine.pipe
    async def export(ctx: pw.Context) -> None:
        await ctx.progress(1, 2, "half")
        await step.wait()
        for i in range(3):
            await ctx.emit({"row": i})
        await ctx.progress(2, 2, "done")

    engine.chain("c", export)
    async with engine:
        job_id = await engine.submit("c", stream=True)
        await wait_idle()
        assert (await engine.status(job_id)).progress == pw.Progress(1, 2, "half")
        step.set()
        chunks = [chunk async for chunk in engine.stream(job_id)]
        assert chunks == [{"row": 0}, {"row": 1}, {"row": 2}]
        assert (await engine.status(job_id)).progress == pw.Progress(2, 2, "done")


@pytest.mark.parametrize("branched", [False, True], ids=["own-pipe", "in-a-branch"])
async def test_a_stream_whose_reader_left_cancels_its_job(
    autojump_clock: trio.abc.Clock, branched: bool
) -> None:
    """A stream route's client hung up: its reader closed the stream while the pipe still
    emits. The job is cancelled, as a hang-up cancels it; it used to fail with the
    channel's BrokenResourceError, as if the pipe had a bug."""
    engine = make_engine()

    @engine.pipe
    async def export(ctx: pw.Context) -> None:
        for i in range(100):
            await ctx.emit({"row": i})

    engine.chain("c", pw.all_of(export) if branched else export, timeout=60)
    async with engine:
        job_id = await engine.submit("c", stream=True)
        async with aclosing(engine.stream(job_id)) as chunks:
            async for chunk in chunks:
                assert chunk == {"row": 0}
                break  # the reader leaves
        with pytest.raises(pw.JobCancelled):
            await engine.wait(job_id)
        assert (await engine.status(job_id)).status is pw.Status.CANCELLED


async def test_progress_moves_the_jobs_updated_at() -> None:
    """A job's ``updated_at`` is its last change, and progress is a change: a client polling
    a long export sees when it last moved, in the top-level job and from a branch."""
    engine = make_engine()
    reported: dict[str, float] = {}
    gate = trio.Event()

    @engine.pipe
    async def export(ctx: pw.Context) -> None:
        reported[ctx.path] = time.time()
        await ctx.progress(1, 2)
        await gate.wait()

    engine.chain("flat", export)
    engine.chain("branched", pw.all_of(export, export))
    async with engine:
        for chain in ("flat", "branched"):
            reported.clear()
            gate = trio.Event()
            job_id = await engine.submit(chain)
            await wait_idle()
            view = await engine.status(job_id)
            assert view.progress is not None
            assert view.updated_at >= max(reported.values())
            gate.set()
            await engine.wait(job_id)


async def test_registration_errors() -> None:
    engine = make_engine()

    async def a(ctx: pw.Context) -> None:
        return None

    def sync(ctx: pw.Context) -> None:
        return None

    with pytest.raises(pw.RegistrationError, match="unknown pipe 'missing'"):
        engine.chain("c", "missing")
    with pytest.raises(pw.RegistrationError, match="not an async function"):
        engine.pipe(sync)
    with pytest.raises(pw.RegistrationError, match="at least one"):
        engine.chain("empty")
    engine.chain("c", a)
    with pytest.raises(pw.RegistrationError, match="already registered"):
        engine.chain("c", a)
    async with engine:
        with pytest.raises(pw.RegistrationError, match="unknown chain 'nope'"):
            await engine.submit("nope")


async def test_submit_needs_a_running_engine() -> None:
    engine = make_engine()

    @engine.pipe
    async def a(ctx: pw.Context) -> None:
        return None

    engine.chain("c", a)
    with pytest.raises(RuntimeError, match="not running"):
        await engine.submit("c")


async def test_authorize_needs_the_owner_token_and_reveals_nothing() -> None:
    engine = make_engine()

    @engine.pipe
    async def a(ctx: pw.Context) -> None:
        return None

    engine.chain("c", a)
    async with engine:
        job_id = await engine.submit("c", token="s3cret")
        assert (await engine.authorize(job_id, "s3cret")).id == job_id
        # Text no token can be (a lone surrogate cannot even be encoded) is a wrong token.
        for wrong in ("nope", None, "s3cr\u00e9t", "\udcff"):
            with pytest.raises(pw.JobNotFound) as info:
                await engine.authorize(job_id, wrong)
            assert str(info.value) == f"no job with id {job_id!r}"
        untokened = await engine.submit("c")
        with pytest.raises(pw.JobNotFound):
            await engine.authorize(untokened, "")


async def test_callback_url_comes_from_the_container_hook() -> None:
    engine = make_engine()
    urls: list[str] = []

    @engine.pipe
    async def hand_out(ctx: pw.Context) -> None:
        urls.append(ctx.callback_url("paid", ttl=60))

    engine.chain("c", hand_out)
    async with engine:
        with pytest.raises(RuntimeError, match="need an HTTP container"):
            await engine.run("c")
        engine.set_callback_factory(lambda job, signal, ttl: f"/cb/{job}/{signal}?ttl={ttl:g}")
        job_id = await engine.submit("c")
        await engine.wait(job_id)
    assert urls == [f"/cb/{job_id}/paid?ttl=60"]


async def test_a_swapped_plan_runs_new_jobs_and_old_ones_keep_theirs() -> None:
    engine = make_engine()
    calls: list[str] = []

    def recorder(name: str) -> pw.Pipe:
        async def run(ctx: pw.Context) -> None:
            calls.append(name)
            if name == "wait":
                await ctx.suspend("go")

        return pw.Pipe(run, name)

    engine.chain("c", recorder("a"), recorder("wait"), recorder("b"))
    async with engine:
        old = await engine.submit("c")
        await wait_idle()
        assert engine.plan_generation == 1
        registry = pw.Registry()
        registry.chain("c", recorder("x"), recorder("y"))
        assert engine.swap_registry(registry) == 2
        new = await engine.submit("c")
        await engine.wait(new)
        await engine.signal(old, "go")
        await engine.wait(old)
    assert calls == ["a", "wait", "x", "y", "b"]


# -- lifecycle -------------------------------------------------------------------------


async def test_leaving_the_block_cancels_running_jobs_and_the_engine_can_start_again() -> None:
    engine = make_engine()
    started = trio.Event()
    cleaned_up: list[str] = []

    @engine.pipe
    async def forever(ctx: pw.Context) -> None:
        started.set()
        try:
            await trio.sleep_forever()
        finally:
            cleaned_up.append(ctx.job_id)

    @engine.pipe
    async def quick(ctx: pw.Context) -> None:
        ctx.state["ok"] = True

    engine.chain("forever", forever)
    engine.chain("quick", quick, result="ok")
    async with engine:
        job_id = await engine.submit("forever")
        await started.wait()
    assert cleaned_up == [job_id]
    with pytest.raises(RuntimeError, match="not running"):
        await engine.submit("quick")
    async with engine:
        assert await engine.run("quick") is True


async def test_the_blocks_own_exception_leaves_it_unchanged() -> None:
    engine = make_engine()
    error = ValueError("the caller's own")
    with pytest.raises(ValueError, match="the caller's own") as info:
        async with engine:
            raise error
    assert info.value is error


async def test_a_crash_inside_the_engine_is_not_swallowed() -> None:
    class BrokenQueue(pw.MemoryEventQueue):
        async def get_batch(self, limit: int = 256) -> list[Any]:
            raise RuntimeError("the queue broke")

    engine = make_engine(queue=BrokenQueue(10))
    with pytest.RaisesGroup(
        pytest.RaisesExc(RuntimeError, match="the queue broke"), flatten_subgroups=True
    ):
        async with engine:
            await trio.sleep_forever()  # cancelled by the crash


async def test_outer_cancellation_goes_through_the_engine(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = make_engine()
    with trio.move_on_after(5) as scope:
        async with engine:
            await trio.sleep_forever()
    assert scope.cancelled_caught
    assert trio.current_time() == 5


async def test_an_engine_runs_once_at_a_time() -> None:
    engine = make_engine()
    async with engine:
        with pytest.raises(RuntimeError, match="already running"):
            async with engine:
                pass  # pragma: no cover - the body never runs
        assert engine.plan_generation == 1  # still running, untouched


# -- the readiness probe ---------------------------------------------------------------


async def test_probe_survives_a_registry_swap_and_leaves_no_trace() -> None:
    engine = make_engine()
    async with engine:
        await engine.probe(1.0)
        engine.swap_registry(pw.Registry())
        await engine.probe(1.0)
        assert await engine.store.list() == []  # finished probes drop their records
    assert engine.registry.chains == {}
    assert b"canary" not in engine.metrics.exposition()


async def test_probe_passes_when_every_worker_is_busy(autojump_clock: trio.abc.Clock) -> None:
    # Readiness has a lane of its own: a full pool is busy, not unready.
    engine = make_engine(pool=pw.WeightedPool(1))

    @engine.pipe
    async def hold(ctx: pw.Context) -> None:
        await trio.sleep_forever()

    engine.chain("hold", hold)
    async with engine:
        await engine.submit("hold")
        await engine.submit("hold")  # and one waiting for the slot
        await wait_idle()
        start = trio.current_time()
        await engine.probe(2.0)
        assert trio.current_time() - start < 2.0


class _StuckQueue(MemoryEventQueue):
    """A dispatcher that takes one batch and then never hands it over."""

    async def get_batch(self, limit: int = 256) -> list[Event]:
        await super().get_batch(limit)
        await trio.sleep_forever()
        raise AssertionError("unreachable")


async def test_probe_fails_in_time_when_no_worker_is_free(autojump_clock: trio.abc.Clock) -> None:
    engine = make_engine(queue=_StuckQueue())
    async with engine:
        start = trio.current_time()
        with pytest.raises((trio.TooSlowError, pw.Overloaded)):
            await engine.probe(2.0)
        assert trio.current_time() - start == pytest.approx(2.0)
