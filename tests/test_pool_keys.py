"""A job's pool key (a route's tenant): the admission key of the steps that would run under
the chain's key, kept with the job through hand-offs, branches and the store."""

from __future__ import annotations

import pytest
import trio

import pipework as pw

from ._redis import wait_idle

# The engine's suite runs on both stores: see each_store in conftest.py.
pytestmark = pytest.mark.usefixtures("each_store")


def tenants_pool() -> pw.WeightedPool:
    return pw.WeightedPool(
        10,
        keys={"tenant:a": pw.Weights(limit=1), "tenant:b": pw.Weights(limit=1)},
    )


async def test_one_tenants_held_slot_does_not_block_another(
    autojump_clock: trio.abc.Clock,
) -> None:
    pool = tenants_pool()
    engine = pw.Engine(pool=pool)
    release = {"a": trio.Event(), "b": trio.Event()}
    ran: list[str] = []

    @engine.pipe()  # no key of its own: the job's pool key
    async def work(ctx: pw.Context) -> None:
        ran.append(ctx.state["who"])
        await release[ctx.state["who"]].wait()

    engine.chain("work", work)
    async with engine:
        first_a = await engine.submit("work", {"who": "a"}, pool_key="tenant:a")
        second_a = await engine.submit("work", {"who": "a"}, pool_key="tenant:a")
        await wait_idle()
        stats = pool.statistics().keys
        assert (stats["tenant:a"].in_use, stats["tenant:a"].waiting) == (1, 1)
        # Tenant b's limit is its own: its job runs, and ends, while a's waits.
        release["b"].set()
        assert await engine.run("work", {"who": "b"}, pool_key="tenant:b") is not None
        assert ran == ["a", "b"]
        stats = pool.statistics().keys
        assert (stats["tenant:a"].in_use, stats["tenant:a"].waiting) == (1, 1)
        assert stats["tenant:b"].admitted == 1
        assert "default" not in stats  # no step ran under the chain's key
        release["a"].set()
        await engine.wait(first_a)
        await engine.wait(second_a)
    assert ran == ["a", "b", "a"]


async def test_the_pool_key_survives_hand_offs_and_branches(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A pipe with a key of its own keeps it; the keyless steps after it (a hand-off through
    the queue and the store) and a forked stage's branches run under the job's pool key."""
    pool = tenants_pool()
    engine = pw.Engine(pool=pool)
    gate = trio.Event()
    seen: list[tuple[str, dict[str, int]]] = []

    def held() -> dict[str, int]:
        return {k: s.in_use for k, s in pool.statistics().keys.items() if s.in_use}

    @engine.pipe()
    async def first(ctx: pw.Context) -> None:
        seen.append(("first", held()))

    @engine.pipe(key="svc")  # a service's key: it bounds the backend, whoever calls
    async def service(ctx: pw.Context) -> None:
        seen.append(("service", held()))

    @engine.pipe()
    async def left(ctx: pw.Context) -> None:
        await gate.wait()
        ctx.state["left"] = 1

    @engine.pipe()
    async def right(ctx: pw.Context) -> None:
        seen.append(("right", held()))
        ctx.state["right"] = 1

    engine.chain("mixed", first, service, pw.all_of(left, right))
    async with engine:
        job = await engine.submit("mixed", pool_key="tenant:a")
        await wait_idle()
        gate.set()
        await engine.wait(job)
    assert seen[0] == ("first", {"tenant:a": 1})
    assert seen[1] == ("service", {"svc": 1})
    # The branches: under tenant a's key (its limit of 1 lends the parent's slot to one
    # branch at a time, or the branches take the key's slot in turn).
    name, holding = seen[2]
    assert name == "right"
    assert set(holding) == {"tenant:a"}
    assert pool.statistics().keys["tenant:a"].admitted >= 2
    assert "default" not in pool.statistics().keys


async def test_without_a_pool_key_the_chains_key_is_used(
    autojump_clock: trio.abc.Clock,
) -> None:
    pool = tenants_pool()
    engine = pw.Engine(pool=pool)

    @engine.pipe()
    async def work(ctx: pw.Context) -> None:
        return None

    engine.chain("work", work, key="reports")
    async with engine:
        await engine.run("work")
    assert pool.statistics().keys["reports"].admitted == 1
    assert pool.statistics().keys["tenant:a"].admitted == 0


async def test_a_pool_key_must_be_a_non_empty_string() -> None:
    engine = pw.Engine()

    @engine.pipe()
    async def work(ctx: pw.Context) -> None:
        return None

    engine.chain("work", work)
    async with engine:
        with pytest.raises(ValueError, match="pool_key"):
            await engine.submit("work", pool_key="")


@pytest.mark.parametrize("limited", [True, False], ids=["forked", "in-step"])
async def test_a_branch_it_can_do_without_is_judged_by_the_key_it_would_run_under(
    autojump_clock: trio.abc.Clock, limited: bool
) -> None:
    """A ``pw.branch`` whose first pipe has no key runs under the job's pool key, so that
    key's refusals are the ones asked before it starts: whether its stage runs as child
    jobs (the key is limited) or inside the parent's step."""
    from .test_degrade import Breakers

    breakers = Breakers()
    breakers.open.add("tenant:a")
    pool = tenants_pool() if limited else pw.WeightedPool(10)
    engine = pw.Engine(pool=pool, refusals=breakers)

    async def load(ctx: pw.Context) -> None:
        ctx.state["product"] = "lamp"

    async def recommend(ctx: pw.Context) -> None:
        ctx.state["recs"] = ["shade"]

    branch = pw.branch(pw.Pipe(recommend, "recommend"), optional=True, name="recs")
    engine.chain("page", load, pw.all_of(pw.Pipe(load, "again"), branch))
    async with engine:
        refused = await engine.run("page", pool_key="tenant:a")
        # A tenant with no limit of its own: its branch finds a slot free at once.
        served = await engine.run("page", pool_key="tenant:c")
    assert refused["degraded"] == {"recs": "refused"}
    assert served["recs"] == ["shade"]
    assert "tenant:a" in breakers.asked
