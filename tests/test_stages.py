"""Parallel stages through the engine: times are virtual (autojump_clock) and exact."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

import pipework as pw
from pipework.dispatcher._job import Job

from ._redis import wait_idle

# The engine's suite runs on both stores: see each_store in conftest.py.
pytestmark = pytest.mark.usefixtures("each_store")


def sleeper(name: str, seconds: float, key: str | None = None) -> pw.Pipe:
    async def run(ctx: pw.Context) -> None:
        await trio.sleep(seconds)
        ctx.state[name] = seconds

    return pw.Pipe(run, name, key=key)


def failing(name: str, seconds: float, exc: BaseException) -> pw.Pipe:
    async def run(ctx: pw.Context) -> None:
        await trio.sleep(seconds)
        raise exc

    return pw.Pipe(run, name)


async def test_all_of_finishes_at_the_slowest_branch(autojump_clock: trio.abc.Clock) -> None:
    engine = pw.Engine()
    engine.chain("c", pw.all_of(sleeper("a", 1), sleeper("b", 3), sleeper("c", 2)))
    async with engine:
        start = trio.current_time()
        result = await engine.run("c", {"x": 0})
        assert trio.current_time() - start == pytest.approx(3)
    assert result == {"x": 0, "a": 1, "b": 3, "c": 2}


async def test_all_of_first_failure_cancels_the_rest(autojump_clock: trio.abc.Clock) -> None:
    engine = pw.Engine()
    boom = ValueError("quote service said no")
    cleaned: list[str] = []

    async def slow(ctx: pw.Context) -> None:
        try:
            await trio.sleep(10)
        finally:
            cleaned.append("slow")

    engine.chain("order", pw.all_of(pw.Pipe(slow, "slow"), failing("quote", 1, boom)))
    async with engine:
        start = trio.current_time()
        with pytest.raises(ValueError, match="quote service said no") as info:
            await engine.run("order")
        assert info.value is boom
        assert trio.current_time() - start == pytest.approx(1)
        assert any("chain 'order' > all_of[0] > branch 'quote'" in n for n in boom.__notes__)
        await wait_idle()
    assert cleaned == ["slow"]


async def test_any_of_takes_the_fastest_success(autojump_clock: trio.abc.Clock) -> None:
    engine = pw.Engine()
    cleanup: list[str] = []
    late_writes: list[str] = []

    async def stubborn(ctx: pw.Context) -> None:
        # Ignores cancellation for a while and writes to its own snapshot late.
        with trio.CancelScope(shield=True):
            await trio.sleep(5)
        ctx.state["price"] = 999
        late_writes.append("stubborn")

    async def slow(ctx: pw.Context) -> None:
        try:
            await trio.sleep(10)
            ctx.state["price"] = 10
        finally:
            cleanup.append("slow")

    engine.chain(
        "search",
        pw.any_of(
            pw.Pipe(slow, "slow"),
            failing("broken", 0.5, RuntimeError("mirror down")),
            sleeper("fast", 2),
            pw.Pipe(stubborn, "stubborn"),
        ),
    )
    async with engine:
        start = trio.current_time()
        job_id = await engine.submit("search", {"q": "tea"})
        result = await engine.wait(job_id)
        assert trio.current_time() - start == pytest.approx(2)
        assert result == {"q": "tea", "fast": 2}
        await trio.sleep(10)  # let the stubborn loser finish late
        assert late_writes == ["stubborn"]
        assert cleanup == ["slow"]
        assert (await engine.status(job_id)).result == {"q": "tea", "fast": 2}


async def test_any_of_all_failed_raises_every_error(autojump_clock: trio.abc.Clock) -> None:
    engine = pw.Engine()
    e1, e2 = RuntimeError("a down"), KeyError("b")
    engine.chain("c", pw.any_of(failing("a", 1, e1), failing("b", 2, e2)))
    async with engine:
        start = trio.current_time()
        with pytest.raises(ExceptionGroup) as info:
            await engine.run("c")
        assert trio.current_time() - start == pytest.approx(2)
    assert set(info.value.exceptions) == {e1, e2}


async def test_quorum_succeeds_at_the_kth_success(autojump_clock: trio.abc.Clock) -> None:
    engine = pw.Engine()
    engine.chain(
        "c", pw.quorum(2, sleeper("a", 3), sleeper("b", 1), sleeper("c", 2), sleeper("d", 9))
    )
    async with engine:
        start = trio.current_time()
        result = await engine.run("c")
        assert trio.current_time() - start == pytest.approx(2)
    assert result == {"b": 1, "c": 2}


async def test_quorum_fails_when_k_becomes_unreachable(autojump_clock: trio.abc.Clock) -> None:
    engine = pw.Engine()
    e1, e2 = RuntimeError("one"), RuntimeError("two")
    engine.chain("c", pw.quorum(2, failing("a", 1, e1), sleeper("b", 5), failing("c", 2, e2)))
    async with engine:
        start = trio.current_time()
        with pytest.raises(ExceptionGroup) as info:
            await engine.run("c")
        # At t=2 two of three failed: 2 successes are out of reach, though b still runs.
        assert trio.current_time() - start == pytest.approx(2)
    assert set(info.value.exceptions) == {e1, e2}


async def test_seed_graph_runs_nodes_when_their_parents_are_done(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = pw.Engine()
    started: dict[str, float] = {}
    callbacks: list[tuple[str, str]] = []
    t0 = 0.0

    def timed(name: str, seconds: float, fail: bool = False) -> pw.Pipe:
        async def run(ctx: pw.Context) -> None:
            started[name] = trio.current_time() - t0
            await trio.sleep(seconds)
            if fail:
                raise RuntimeError(f"{name} failed")
            ctx.state[name] = trio.current_time() - t0

        return pw.Pipe(run, name)

    def record(end: pw.BranchEnd) -> None:
        callbacks.append((end.node, end.outcome))

    engine.chain(
        "seed",
        pw.graph(
            pw.node("A", timed("A", 1), on_success=record),
            pw.node("B", timed("B", 3), on_success=record),
            pw.node("C", timed("C", 0.5, fail=True), detach=True, on_error=record),
            pw.node("D", timed("D", 1), after=["A"], on_success=record),
            pw.node("E", timed("E", 1), after=["B", "D"], on_success=record),
        ),
    )
    async with engine:
        t0 = trio.current_time()
        result = await engine.run("seed")
        assert trio.current_time() - t0 == pytest.approx(4)
    assert started == pytest.approx({"A": 0, "B": 0, "C": 0, "D": 1, "E": 3})
    assert result == pytest.approx({"A": 1, "B": 3, "D": 2, "E": 4})
    assert sorted(callbacks) == [("A", "ok"), ("B", "ok"), ("C", "error"), ("D", "ok"), ("E", "ok")]


def test_graph_cycle_is_refused_at_registration_naming_it() -> None:
    async def noop(ctx: pw.Context) -> None:
        return None

    with pytest.raises(pw.RegistrationError, match=r"graph 'g': cycle a -> b -> c -> a"):
        pw.graph(
            pw.node("a", noop, after=["c"]),
            pw.node("b", noop, after=["a"]),
            pw.node("c", noop, after=["b"]),
            name="g",
        )
    with pytest.raises(pw.RegistrationError, match="detached node 'a' as a parent"):
        pw.graph(pw.node("a", noop, detach=True), pw.node("b", noop, after=["a"]))


async def test_all_of_of_any_of_of_serial_chains_merges(autojump_clock: trio.abc.Clock) -> None:
    engine = pw.Engine()

    def put(key: str, value: Any, seconds: float) -> pw.Pipe:
        async def run(ctx: pw.Context) -> None:
            await trio.sleep(seconds)
            ctx.state[key] = value

        return pw.Pipe(run, f"{key}={value}@{seconds}")

    engine.chain(
        "c",
        pw.all_of(
            pw.any_of(
                pw.serial(put("user", "slow", 2), put("user_src", "a", 0)),
                pw.serial(put("user", "fast", 1), put("user_src", "b", 0.5)),
            ),
            pw.any_of(
                pw.serial(put("price", 10, 3)),
                pw.serial(put("price", 12, 1), put("currency", "EUR", 1)),
            ),
        ),
    )
    async with engine:
        start = trio.current_time()
        result = await engine.run("c", {"base": True})
        assert trio.current_time() - start == pytest.approx(2)
    assert result == {
        "base": True,
        "user": "fast",
        "user_src": "b",
        "price": 12,
        "currency": "EUR",
    }


async def test_conflicting_branches_raise_merge_conflict() -> None:
    engine = pw.Engine()

    def put(name: str, value: int) -> pw.Pipe:
        async def run(ctx: pw.Context) -> None:
            ctx.state["total"] += value

        return pw.Pipe(run, name)

    engine.chain("strict", pw.all_of(put("a", 1), put("b", 2)))
    engine.chain(
        "summed", pw.all_of(put("c", 1), put("d", 2), merge=pw.MergePolicy(keys={"total": "sum"}))
    )
    async with engine:
        with pytest.raises(pw.MergeConflict) as info:
            await engine.run("strict", {"total": 0})
        assert info.value.key == "total"
        assert info.value.branches == ("a", "b")
        assert await engine.run("summed", {"total": 10}) == {"total": 13}


async def test_suspended_branch_resumes_and_the_join_completes(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = pw.Engine()

    async def approve(ctx: pw.Context) -> None:
        await ctx.suspend("approved", into="approval")

    engine.chain("c", pw.all_of(sleeper("fetch", 1), pw.Pipe(approve, "approve")))
    async with engine:
        job_id = await engine.submit("c")
        await trio.sleep(5)
        view = await engine.status(job_id)
        assert view.status is pw.Status.RUNNING  # waiting at the join, holding nothing
        await engine.signal(job_id, "approved", {"by": "ops"})
        assert await engine.wait(job_id) == {"fetch": 1, "approval": {"by": "ops"}}


async def test_settle_records_every_outcome(autojump_clock: trio.abc.Clock) -> None:
    engine = pw.Engine()
    engine.chain(
        "c",
        pw.all_of(sleeper("a", 1), failing("b", 2, KeyError("nope")), sleeper("c", 3), settle=True),
    )
    async with engine:
        result = await engine.run("c")
    assert result["a"] == 1
    assert result["c"] == 3
    assert result["outcomes"] == {
        "a": {"outcome": "ok"},
        "b": {"outcome": "error", "error": {"type": "KeyError", "message": "'nope'"}},
        "c": {"outcome": "ok"},
    }


async def test_max_concurrency_caps_running_branches(autojump_clock: trio.abc.Clock) -> None:
    engine = pw.Engine()
    engine.chain("c", pw.all_of(*(sleeper(f"s{i}", 1) for i in range(5)), max_concurrency=2))
    async with engine:
        start = trio.current_time()
        await engine.run("c")
        assert trio.current_time() - start == pytest.approx(3)  # 2 + 2 + 1


async def test_stage_timeout_and_branch_isolation(autojump_clock: trio.abc.Clock) -> None:
    engine = pw.Engine()
    seen: list[Any] = []

    async def writer(ctx: pw.Context) -> None:
        ctx.state["shared"].append("writer")
        await trio.sleep(1)

    async def reader(ctx: pw.Context) -> None:
        await trio.sleep(2)
        seen.append(list(ctx.state["shared"]))

    engine.chain(
        "iso", pw.all_of(pw.Pipe(writer, "writer"), pw.Pipe(reader, "reader"), merge="last")
    )
    engine.chain("slow", pw.all_of(sleeper("a", 1), sleeper("b", 10), timeout=4))
    async with engine:
        result = await engine.run("iso", {"shared": []})
        assert seen == [[]]  # the reader never saw its sibling's write
        assert result["shared"] == ["writer"]
        start = trio.current_time()
        with pytest.raises(pw.DeadlineExceeded) as info:
            await engine.run("slow")
        assert trio.current_time() - start == pytest.approx(4)
        assert info.value.scope == "stage"


async def test_cancelling_a_parent_cancels_its_branches(autojump_clock: trio.abc.Clock) -> None:
    engine = pw.Engine()
    cleaned: list[str] = []

    async def forever(ctx: pw.Context) -> None:
        try:
            await trio.sleep_forever()
        finally:
            cleaned.append(ctx.pipe.name)

    engine.chain("c", pw.all_of(pw.Pipe(forever, "x"), pw.Pipe(forever, "y")))
    async with engine:
        job_id = await engine.submit("c")
        await trio.sleep(1)
        await engine.cancel(job_id)
        with pytest.raises(pw.JobCancelled):
            await engine.wait(job_id)
        await wait_idle()
    assert sorted(cleaned) == ["x", "y"]


branch_seconds = st.lists(st.integers(min_value=1, max_value=20), min_size=2, max_size=5)


@pytest.mark.parametrize("each_store", ["memory", "copying"], indirect=True)
@given(branch_seconds)
def test_merged_state_never_depends_on_completion_order(durations: list[int]) -> None:
    _merged_in_any_order(durations)


@pytest.mark.parametrize("each_store", ["redis"], indirect=True)
@settings(settings.get_profile("pipework-redis"))
@given(branch_seconds)
def test_merged_state_never_depends_on_completion_order_on_redis(durations: list[int]) -> None:
    _merged_in_any_order(durations)


def _merged_in_any_order(durations: list[int]) -> None:
    async def main() -> Any:
        engine = pw.Engine()
        pipes = []
        for i, seconds in enumerate(durations):

            async def run(ctx: pw.Context, i: int = i, seconds: int = seconds) -> None:
                await trio.sleep(seconds)
                ctx.state["log"] = [*ctx.state["log"], f"b{i}"]
                ctx.state[f"k{i}"] = i

            pipes.append(pw.Pipe(run, f"b{i}"))
        engine.chain("c", pw.all_of(*pipes, merge=pw.MergePolicy(keys={"log": "extend"})))
        async with engine:
            return await engine.run("c", {"log": ["start"]})

    result = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    n = len(durations)
    assert result["log"] == ["start", *(f"b{i}" for i in range(n))]
    assert all(result[f"k{i}"] == i for i in range(n))


async def test_a_parent_at_a_join_round_trips_through_msgpack() -> None:
    import msgpack

    from pipework.dispatcher._job import Job

    engine = pw.Engine()

    async def wait(ctx: pw.Context) -> None:
        await ctx.suspend("go")

    engine.chain("c", pw.all_of(sleeper("a", 0), pw.Pipe(wait, "wait")))
    async with engine:
        job_id = await engine.submit("c")
        await wait_idle()
        store = engine.store  # whichever store the suite runs on
        parent = await store.get(job_id)
        assert parent.join is not None
        wire = msgpack.unpackb(msgpack.packb(parent.to_wire()))
        back = Job.from_wire(wire)
        assert back.to_wire() == parent.to_wire()
        assert back.join is not None
        assert back.join.join.outcomes == parent.join.join.outcomes
        await engine.signal(job_id, "go", 1)
        assert await engine.wait(job_id) == {"a": 0, "go": 1}


async def test_branches_never_depend_on_retention(
    autojump_clock: trio.abc.Clock, each_store: type[Any]
) -> None:
    """Branch records are internal: a tiny retention cannot lose a join, nor can branches
    push finished top-level jobs out of it."""
    engine = pw.Engine(store=each_store(retain_count=20))
    engine.chain(
        "c",
        pw.all_of(sleeper("a", 1), sleeper("b", 2), failing("c", 3, KeyError("x")), settle=True),
    )
    async with engine:
        with trio.fail_after(60):
            ids = [await engine.submit("c") for _ in range(20)]
            results = [await engine.wait(job_id) for job_id in ids]
        assert all(r["a"] == 1 and r["b"] == 2 for r in results)
        assert all(r["outcomes"]["c"]["outcome"] == "error" for r in results)
        store = engine.store  # whichever store the suite runs on
        assert len(await store.list()) == 20  # the parents, and no branch left behind


async def test_a_graph_node_reads_what_its_ancestors_wrote(autojump_clock: trio.abc.Clock) -> None:
    engine = pw.Engine()

    def node_pipe(name: str, reads: tuple[str, ...]) -> pw.Pipe:
        async def run(ctx: pw.Context) -> None:
            await trio.sleep(1)
            ctx.state[name] = [ctx.state.get(r) for r in reads]
            ctx.state["log"] = [*ctx.state["log"], name]

        return pw.Pipe(run, name)

    engine.chain(
        "g",
        pw.graph(
            pw.node("A", node_pipe("A", ())),
            pw.node("B", node_pipe("B", ())),
            pw.node("D", node_pipe("D", ("A",)), after=["A"]),
            pw.node("E", node_pipe("E", ("A", "B", "D")), after=["B", "D"]),
            merge=pw.MergePolicy(keys={"log": "extend"}),
        ),
    )
    async with engine:
        result = await engine.run("g", {"log": []})
    assert result["D"] == [[]]  # D saw A's output
    assert result["E"] == [[], [], [[]]]  # E saw A (through D), B and D
    # Each node's addition exactly once: E's result holds its ancestors', merged B then D
    # (declaration order), and A's through D.
    assert result["log"] == ["B", "A", "D", "E"]


# -- graph node callbacks: exactly once on every ending ------------------------------------------


class Watched:
    """Builds graph nodes whose callbacks record (callback, node, outcome, error type)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str, str | None]] = []

    def node(
        self, name: str, item: pw.Pipe, *, after: Sequence[str] = (), detach: bool = False
    ) -> pw.GraphNode:
        return pw.node(
            name,
            item,
            after=after,
            detach=detach,
            on_success=self._recorder("on_success"),
            on_error=self._recorder("on_error"),
        )

    def _recorder(self, which: str) -> Callable[[pw.BranchEnd], None]:
        def record(end: pw.BranchEnd) -> None:
            error = None if end.error is None else type(end.error).__name__
            self.calls.append((which, end.node, end.outcome, error))

        return record


def napper(name: str, seconds: float, *, timeout: float | None = None) -> pw.Pipe:
    async def run(ctx: pw.Context) -> None:
        await trio.sleep(seconds)
        ctx.state[name] = seconds

    return pw.Pipe(run, name, timeout=timeout)


async def settled(engine: pw.Engine, job_id: str) -> BaseException:
    """Wait for a job that must fail; return its error once every task has settled."""
    with trio.fail_after(60):
        try:
            await engine.wait(job_id)
        except Exception as exc:
            error: BaseException = exc
        else:
            raise AssertionError(f"job {job_id} did not fail")
        await trio.sleep(30)  # long past every branch's end: a late second call would show
        await wait_idle()
    return error


async def test_a_node_that_hits_its_pipe_timeout_gets_on_error_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = pw.Engine()
    watched = Watched()
    engine.chain(
        "g",
        pw.graph(
            watched.node("fast", napper("fast", 1)),
            watched.node("slow", napper("slow", 10, timeout=2)),
        ),
    )
    async with engine:
        error = await settled(engine, await engine.submit("g"))
    assert isinstance(error, pw.DeadlineExceeded)
    assert sorted(watched.calls) == [
        ("on_error", "slow", "timed_out", "DeadlineExceeded"),
        ("on_success", "fast", "ok", None),
    ]


async def test_nodes_cut_by_the_stage_timeout_get_on_error_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = pw.Engine()
    watched = Watched()
    engine.chain(
        "g",
        pw.graph(
            watched.node("a", napper("a", 1)),
            watched.node("b", napper("b", 10), after=["a"]),
            watched.node("c", napper("c", 1), after=["b"]),  # never starts: no callback
            timeout=3,
        ),
    )
    async with engine:
        start = trio.current_time()
        error = await settled(engine, await engine.submit("g"))
        assert isinstance(error, pw.DeadlineExceeded)
        assert error.scope == "stage"
        assert start + 3 == pytest.approx(error.deadline)
    assert sorted(watched.calls) == [
        ("on_error", "b", "timed_out", "DeadlineExceeded"),
        ("on_success", "a", "ok", None),
    ]


async def test_a_node_cancelled_because_a_sibling_failed_gets_on_error_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = pw.Engine()
    watched = Watched()
    boom = RuntimeError("bad node")
    engine.chain(
        "g",
        pw.graph(
            watched.node("bad", failing("bad", 1, boom)),
            watched.node("slow", napper("slow", 10)),
            watched.node("after", napper("after", 1), after=["slow"]),
        ),
    )
    async with engine:
        error = await settled(engine, await engine.submit("g"))
    assert error is boom
    assert sorted(watched.calls) == [
        ("on_error", "bad", "error", "RuntimeError"),
        ("on_error", "slow", "cancelled", "JobCancelled"),
    ]


async def test_nodes_of_a_cancelled_job_get_on_error_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = pw.Engine()
    watched = Watched()
    engine.chain(
        "g",
        pw.graph(
            watched.node("a", napper("a", 1)),
            watched.node("b", napper("b", 10), after=["a"]),
            watched.node("c", napper("c", 10)),
            watched.node("d", napper("d", 10), detach=True),
        ),
    )
    async with engine:
        job_id = await engine.submit("g")
        await trio.sleep(2)
        await engine.cancel(job_id)
        error = await settled(engine, job_id)
    assert isinstance(error, pw.JobCancelled)
    assert sorted(watched.calls) == [
        ("on_error", "b", "cancelled", "JobCancelled"),
        ("on_error", "c", "cancelled", "JobCancelled"),
        ("on_error", "d", "cancelled", "JobCancelled"),
        ("on_success", "a", "ok", None),
    ]


# -- the join record is plain data: a store may hand back copies ---------------------------------


class RoundTripStore(pw.MemoryJobStore):
    """Every write of a parent waiting at a join goes through ``Job.to_wire`` and msgpack,
    and the parent's join record is replaced by the decoded copy, as a shared store would
    hand it back: nothing can rely on sharing the live record (or its Join) between events.
    ``seen`` keeps each stored record's wire form, one per step of the join."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict[str, Any]] = []

    async def update(self, job: Job) -> None:
        await super().update(job)
        if job.join is not None:
            back = Job.from_wire(msgpack.unpackb(msgpack.packb(job.to_wire())))
            assert back.to_wire() == job.to_wire()
            assert back.join is not None
            job.join = back.join
            self.seen.append(back.join.to_wire())


def outcomes_seen(store: RoundTripStore) -> list[list[str]]:
    return [wire["join"]["status"] for wire in store.seen]


async def test_a_graph_runs_on_join_records_copied_at_every_step(
    autojump_clock: trio.abc.Clock,
) -> None:
    store = RoundTripStore()
    engine = pw.Engine(store=store)
    ended: list[tuple[str, str]] = []

    def node_pipe(name: str, seconds: float, reads: tuple[str, ...]) -> pw.Pipe:
        async def run(ctx: pw.Context) -> None:
            await trio.sleep(seconds)
            if name == "C":
                raise KeyError("audit down")
            ctx.state[name] = [ctx.state.get(r) for r in reads]
            ctx.state["log"] = [*ctx.state["log"], name]

        return pw.Pipe(run, name)

    def note(end: pw.BranchEnd) -> None:
        ended.append((end.node, end.outcome))

    engine.chain(
        "g",
        pw.graph(
            pw.node("A", node_pipe("A", 1, ())),
            pw.node("B", node_pipe("B", 3, ())),
            pw.node("C", node_pipe("C", 0.5, ()), detach=True, on_error=note),
            pw.node("D", node_pipe("D", 1, ("A",)), after=["A"]),
            pw.node("E", node_pipe("E", 1, ("A", "B", "D")), after=["B", "D"], on_success=note),
            merge=pw.MergePolicy(keys={"log": "extend"}),
        ),
    )
    async with engine:
        start = trio.current_time()
        result = await engine.run("g", {"log": []})
        assert trio.current_time() - start == pytest.approx(4)
        await wait_idle()
    assert outcomes_seen(store) == [
        ["running", "running", "running", "waiting", "waiting"],  # forked
        ["running", "running", "error", "waiting", "waiting"],  # C failed (detached)
        ["ok", "running", "error", "running", "waiting"],  # A done: D starts from it
        ["ok", "running", "error", "ok", "waiting"],
        ["ok", "ok", "error", "ok", "running"],  # B done: E starts from B and D
    ]
    last = store.seen[-1]
    assert [i for i, _ in last["deltas"]] == [0, 1, 3]
    assert [i for i, _ in last["errors"]] == [2]
    assert last["errors"][0][1][:2] == ["KeyError", "'audit down'"]
    assert result["D"] == [[]]
    assert result["E"] == [[], [], [[]]]
    assert result["log"] == ["B", "A", "D", "E"]  # every change once, from copied deltas
    assert sorted(ended) == [("C", "error"), ("E", "ok")]


async def test_a_settle_all_of_runs_on_join_records_copied_at_every_step(
    autojump_clock: trio.abc.Clock,
) -> None:
    store = RoundTripStore()
    engine = pw.Engine(store=store)
    engine.chain(
        "c",
        pw.all_of(
            sleeper("a", 1),
            failing("b", 2, KeyError("nope")),
            sleeper("c", 3),
            failing("d", 9, RuntimeError("late")),
            settle=True,
            timeout=4,
        ),
    )
    async with engine:
        result = await engine.run("c", {"x": 0})
    assert outcomes_seen(store) == [
        ["running", "running", "running", "running"],
        ["ok", "running", "running", "running"],
        ["ok", "error", "running", "running"],
        ["ok", "error", "ok", "running"],
    ]
    timed_out = result["outcomes"].pop("d")
    assert timed_out["outcome"] == "timed_out"
    assert timed_out["error"]["type"] == "DeadlineExceeded"
    assert result == {
        "x": 0,
        "a": 1,
        "c": 3,
        "outcomes": {
            "a": {"outcome": "ok"},
            "b": {"outcome": "error", "error": {"type": "KeyError", "message": "'nope'"}},
            "c": {"outcome": "ok"},
        },
    }


class ForgetfulErrors(dict[str, BaseException]):
    """A dispatcher's side table of branch exceptions that keeps nothing: as if every branch
    had ended in another process."""

    def __setitem__(self, key: str, value: BaseException) -> None:
        pass


async def test_a_branch_error_from_another_process_surfaces_as_its_record(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = pw.Engine(store=RoundTripStore())
    engine._dispatcher.flight.branch_errors = ForgetfulErrors()
    engine.chain("order", pw.all_of(sleeper("slow", 10), failing("quote", 1, KeyError("x"))))
    async with engine:
        with pytest.raises(pw.JobFailed) as info:
            await engine.run("order")
    assert info.value.error_type == "KeyError"
    assert str(info.value) == "'x'"
    assert info.value.where == "chain 'order' > all_of[0] > branch 'quote' > pipe 'quote'"


async def test_branch_exceptions_are_kept_only_while_their_join_needs_them(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = pw.Engine()
    boom = RuntimeError("boom")

    async def forever(ctx: pw.Context) -> None:
        await trio.sleep_forever()

    engine.chain("all", pw.all_of(sleeper("a", 5), failing("b", 1, boom)))
    engine.chain("any", pw.any_of(failing("a", 1, boom), sleeper("b", 2)))
    engine.chain("settle", pw.all_of(failing("a", 1, boom), sleeper("b", 2), settle=True))
    engine.chain(
        "detached",
        pw.graph(pw.node("a", sleeper("a", 1)), pw.node("d", failing("d", 3, boom), detach=True)),
    )
    engine.chain("cancelled", pw.any_of(failing("a", 1, boom), pw.Pipe(forever, "forever")))
    side_table = engine._dispatcher.flight.branch_errors
    async with engine:
        with pytest.raises(RuntimeError):
            await engine.run("all")
        await engine.run("any")
        await engine.run("settle")
        await engine.run("detached")
        job_id = await engine.submit("cancelled")
        await trio.sleep(2)
        assert side_table  # a's error waits for the join to resolve
        await engine.cancel(job_id)
        await trio.sleep(10)
        await wait_idle()
        assert side_table == {}
