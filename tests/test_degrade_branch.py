"""A branch of several pipes its job can do without (``pw.branch``), in the engine: skipped
or answered by its fallback as a whole when its first pipe's key refuses, has no slot free
at once, too little time is left for what it usually takes, or anything in it fails; what a
half-run branch wrote never reaches the job. No sockets; time is virtual (autojump_clock)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

import pipework as pw

from .test_degrade import Breakers, degraded_total, recs_pool, saturated

# The engine's suite runs on every store: see each_store in conftest.py.
pytestmark = pytest.mark.usefixtures("each_store")


async def load(ctx: pw.Context) -> None:
    ctx.state["product"] = "lamp"


def recs_branch(
    calls: list[str],
    *,
    fail: bool = False,
    seconds: float = 0.0,
    key: str | None = None,
    **marks: Any,
) -> pw.Serial:
    """Two pipes: the first writes, the second may fail or take ``seconds``."""

    async def fetch(ctx: pw.Context) -> None:
        calls.append("fetch")
        ctx.state["raw"] = [1, 2]
        ctx.state["product"] = "changed by a branch that will fail"

    async def rank(ctx: pw.Context) -> None:
        calls.append("rank")
        if seconds:
            await trio.sleep(seconds)
        if fail:
            raise ConnectionError("the ranker reset the connection")
        ctx.state["recs"] = ["shade"]

    return pw.branch(pw.Pipe(fetch, "fetch", key=key), pw.Pipe(rank, "rank", key=key), **marks)


# -- declaring it ------------------------------------------------------------------------------


def test_a_branch_is_named_from_its_pipes_unless_given_a_name() -> None:
    derived = recs_branch([], optional=True)
    assert derived.name == "fetch+rank"
    assert derived.degradable
    stage = pw.all_of(load, derived, recs_branch([], optional=True, name="recs"))
    assert stage.names == ("load", "fetch+rank", "recs")


@pytest.mark.parametrize(
    ("marks", "message"),
    [
        ({}, "mark it optional=True or give it a fallback"),
        ({"optional": "yes"}, "optional must be True or False"),
        ({"fallback": {"degraded": {}}}, "sets 'degraded'"),
        ({"fallback": {"at": object()}}, "fallback"),
        ({"fallback": pw.Pipe(load, "cached")}, "a fallback pipe is for a pipe"),
        ({"name": "", "optional": True}, "name must be a non-empty string"),
    ],
)
def test_a_branch_without_a_usable_mark_is_refused(marks: dict[str, Any], message: str) -> None:
    with pytest.raises(pw.RegistrationError, match=message):
        pw.branch(load, load, **marks)


# -- when it ends --------------------------------------------------------------------------------


async def test_a_failing_branch_is_dropped_whole_and_its_fallback_answers(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = pw.Engine()
    calls: list[str] = []
    fallback = {"recs": [], "recs_hidden": True}
    engine.chain("page", load, pw.all_of(recs_branch(calls, fail=True, fallback=fallback)))
    async with engine:
        job_id = await engine.submit("page")
        result, degraded = await engine.wait_answer(job_id)
    assert calls == ["fetch", "rank"]
    # Nothing the branch wrote before it failed (raw, product) reached the job.
    assert result == {
        "product": "lamp",
        "recs": [],
        "recs_hidden": True,
        "degraded": {"fetch+rank": "error"},
    }
    assert degraded == {"fetch+rank": "error"}
    assert degraded_total(engine, "page", "fetch+rank", "error") == 1


async def test_a_branch_that_ends_well_is_merged_and_not_recorded(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = pw.Engine()
    calls: list[str] = []
    engine.chain("page", load, pw.all_of(recs_branch(calls, optional=True)))
    async with engine:
        result = await engine.run("page")
    assert result["recs"] == ["shade"]
    assert "degraded" not in result


async def test_a_branch_on_keys_of_its_own_is_degraded_when_it_fails(
    autojump_clock: trio.abc.Clock,
) -> None:
    # Its pipes' key is not the chain's: the stage runs its branches as child jobs.
    engine = pw.Engine(pool=recs_pool())
    calls: list[str] = []
    stage = pw.all_of(load, recs_branch(calls, fail=True, key="recs", optional=True))
    engine.chain("page", stage)
    async with engine:
        result = await engine.run("page")
    assert calls == ["fetch", "rank"]
    assert result == {"product": "lamp", "degraded": {"fetch+rank": "error"}}


async def test_its_own_timeout_degrades_it_and_the_stage_goes_on(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = pw.Engine()
    calls: list[str] = []
    branch = recs_branch(calls, seconds=5, timeout=1, fallback={"recs": []})
    engine.chain("page", pw.all_of(load, branch))
    async with engine:
        start = trio.current_time()
        result = await engine.run("page")
        assert trio.current_time() - start == 1
    assert result == {"product": "lamp", "recs": [], "degraded": {"fetch+rank": "timeout"}}


async def test_the_stages_timeout_is_not_degraded(autojump_clock: trio.abc.Clock) -> None:
    engine = pw.Engine()
    branch = recs_branch([], seconds=5, optional=True)
    engine.chain("page", pw.all_of(load, branch, timeout=1))
    async with engine:
        with pytest.raises(pw.DeadlineExceeded):
            await engine.run("page")


async def test_under_settle_a_degraded_branch_ends_ok(autojump_clock: trio.abc.Clock) -> None:
    engine = pw.Engine()
    engine.chain("page", pw.all_of(load, recs_branch([], fail=True, optional=True), settle=True))
    async with engine:
        result = await engine.run("page")
    assert result["outcomes"] == {"load": {"outcome": "ok"}, "fetch+rank": {"outcome": "ok"}}
    assert result["degraded"] == {"fetch+rank": "error"}


async def test_a_cancelled_job_is_not_degraded(autojump_clock: trio.abc.Clock) -> None:
    engine = pw.Engine()
    engine.chain("page", pw.all_of(load, recs_branch([], seconds=5, optional=True)))
    async with engine:
        job_id = await engine.submit("page")
        await trio.sleep(1)
        await engine.cancel(job_id)
        with pytest.raises(pw.JobCancelled):
            await engine.wait(job_id)
    assert degraded_total(engine, "page", "fetch+rank", "error") == 0


# -- before it runs ------------------------------------------------------------------------------


async def test_a_refusing_first_key_skips_the_whole_branch(
    autojump_clock: trio.abc.Clock,
) -> None:
    breakers = Breakers()
    breakers.open.add("recs")
    engine = pw.Engine(pool=recs_pool(), refusals=breakers)
    calls: list[str] = []
    engine.chain("page", pw.all_of(load, recs_branch(calls, key="recs", fallback={"recs": []})))
    async with engine:
        result = await engine.run("page")
        assert pool_admitted(engine, "recs") == 0
    assert calls == []
    assert result == {"product": "lamp", "recs": [], "degraded": {"fetch+rank": "refused"}}
    assert degraded_total(engine, "page", "fetch+rank", "refused") == 1


def pool_admitted(engine: pw.Engine, key: str) -> int:
    pool = engine.pool
    assert isinstance(pool, pw.WeightedPool)
    return pool.statistics().keys[key].admitted


async def test_too_little_time_for_what_the_branch_usually_takes_skips_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = pw.Engine()
    calls: list[str] = []
    engine.chain("page", load, pw.all_of(recs_branch(calls, seconds=2, optional=True)))
    async with engine:
        await engine.run("page", timeout=10)  # it ran: the branch takes 2 s
        start = trio.current_time()
        result = await engine.run("page", timeout=1.5)
        assert trio.current_time() == start
    assert calls == ["fetch", "rank"]
    assert result == {"product": "lamp", "degraded": {"fetch+rank": "deadline"}}


async def test_no_slot_free_for_its_first_pipe_skips_it_without_waiting(
    autojump_clock: trio.abc.Clock,
) -> None:
    pool = recs_pool()
    engine = pw.Engine(pool=pool)
    calls: list[str] = []
    stage = pw.all_of(load, recs_branch(calls, key="recs", fallback={"recs": []}))
    engine.chain("page", stage)
    async with engine, saturated(pool, "recs"):
        start = trio.current_time()
        result = await engine.run("page")
        assert trio.current_time() == start  # no wait for the saturated key
    assert calls == []
    assert result == {"product": "lamp", "recs": [], "degraded": {"fetch+rank": "no_slot"}}
    assert degraded_total(engine, "page", "fetch+rank", "no_slot") == 1


def test_a_marked_branch_outside_a_parallel_stage_is_refused() -> None:
    marked = recs_branch([], optional=True)
    with pytest.raises(pw.RegistrationError, match="only a branch of all_of"):
        pw.serial(load, marked)
    engine = pw.Engine()
    with pytest.raises(pw.RegistrationError, match=r"chain 'page': item 0 is branch 'fetch\+rank'"):
        engine.chain("page", marked)
    graph = pw.graph(pw.node("a", load), pw.node("recs", marked, after=["a"]))
    assert graph.names == ("a", "recs")  # a graph names its nodes: the record says "recs"


async def test_a_graph_nodes_chain_is_degraded_under_the_nodes_name(
    autojump_clock: trio.abc.Clock,
) -> None:
    engine = pw.Engine()

    async def show(ctx: pw.Context) -> None:
        ctx.state["shown"] = ctx.state.get("recs", "none")

    recs = recs_branch([], fail=True, fallback={"recs": "fallback"})
    engine.chain(
        "page",
        pw.graph(
            pw.node("load", load),
            pw.node("recs", recs, after=["load"]),
            pw.node("show", show, after=["recs"]),
        ),
    )
    async with engine:
        result = await engine.run("page")
    assert result == {
        "product": "lamp",
        "recs": "fallback",
        "shown": "fallback",  # a node after it starts from what its fallback set
        "degraded": {"recs": "error"},
    }


async def test_in_an_any_of_a_degraded_branch_may_answer(autojump_clock: trio.abc.Clock) -> None:
    engine = pw.Engine()

    async def slow(ctx: pw.Context) -> None:
        await trio.sleep(5)
        ctx.state["recs"] = "slow"

    engine.chain("page", pw.any_of(slow, recs_branch([], fail=True, fallback={"recs": []})))
    async with engine:
        start = trio.current_time()
        result = await engine.run("page")
        assert trio.current_time() == start
    assert result == {"recs": [], "degraded": {"fetch+rank": "error"}}


async def test_a_branch_run_as_a_child_job_is_measured_too(autojump_clock: trio.abc.Clock) -> None:
    engine = pw.Engine(pool=recs_pool())
    calls: list[str] = []
    engine.chain("page", load, pw.all_of(recs_branch(calls, seconds=2, key="recs", optional=True)))
    async with engine:
        await engine.run("page", timeout=10)  # it ran, as a child job: it takes 2 s
        result = await engine.run("page", timeout=1.5)
    assert calls == ["fetch", "rank"]
    assert result == {"product": "lamp", "degraded": {"fetch+rank": "deadline"}}
