"""The admin API on a real server: tokens, reading the pool, changing weights live."""

from __future__ import annotations

import pytest
import trio
import trio.testing

import pipework as pw
from pipework.container import ContainerConfig

from .test_container_harness import HANG_GUARD, SECRET, assert_problem, bearer, serving

TOKEN = "admin-token-for-tests"


def config(token: str | None = TOKEN) -> ContainerConfig:
    return ContainerConfig(callback_secret=SECRET, shutdown_grace=1.0, admin_token=token)


def gated_engine() -> tuple[pw.Engine, trio.Event, list[int]]:
    pool = pw.WeightedPool(8, keys={"search": pw.Weights(limit=1)})
    registry = pw.Registry()
    engine = pw.Engine(registry=registry, pool=pool)
    release = trio.Event()
    running: list[int] = [0, 0]  # now, peak

    @engine.pipe(key="search")
    async def search(ctx: pw.Context) -> None:
        running[0] += 1
        running[1] = max(running[1], running[0])
        await release.wait()
        running[0] -= 1

    engine.chain("search", search)
    registry.route("search", path="/search", chain="search", method="POST", mode="async")
    return engine, release, running


async def test_admin_needs_its_token_and_is_off_without_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PIPEWORK_ADMIN_TOKEN", raising=False)
    engine, release, _ = gated_engine()
    release.set()
    with trio.fail_after(HANG_GUARD):
        async with serving(engine, config=config()) as served:
            missing = await served.client.get("/admin/pool")
            wrong = await served.client.get("/admin/pool", headers=bearer("nope"))
            ok = await served.client.get("/admin/pool", headers=bearer(TOKEN))
    assert_problem(missing, 401, "admin-unauthorized")
    assert missing.headers["www-authenticate"].startswith("Bearer")
    assert_problem(wrong, 401, "admin-unauthorized")
    assert ok.status_code == 200
    body = ok.json()
    assert body["max_workers"] == 8
    assert body["keys"]["search"]["limit"] == 1

    engine, release, _ = gated_engine()
    release.set()
    with trio.fail_after(HANG_GUARD):
        async with serving(engine, config=config(token=None)) as served:
            off = await served.client.get("/admin/pool", headers=bearer(TOKEN))
    assert off.status_code == 404


async def test_a_weight_changed_live_governs_the_next_admission() -> None:
    engine, release, running = gated_engine()
    with trio.fail_after(HANG_GUARD):
        async with serving(engine, config=config()) as served:
            jobs = [(await served.client.post("/search", json={})).json() for _ in range(3)]
            await trio.testing.wait_all_tasks_blocked()
            assert running == [1, 1]  # the limit of 1 holds the other two back
            bad = await served.client.put(
                "/admin/pool/keys/search", json={"reserve": 99}, headers=bearer(TOKEN)
            )
            unknown_field = await served.client.put(
                "/admin/pool/keys/search", json={"colour": 1}, headers=bearer(TOKEN)
            )
            changed = await served.client.put(
                "/admin/pool/keys/search", json={"limit": 3}, headers=bearer(TOKEN)
            )
            await trio.testing.wait_all_tasks_blocked()
            assert running == [3, 3]  # the waiters were woken at once
            release.set()
            for job in jobs:
                await served.engine.wait(job["id"])
            after = await served.client.get("/admin/pool", headers=bearer(TOKEN))
    problem = assert_problem(bad, 400, "admin-bad-weights")
    assert "99" in problem["detail"]
    assert_problem(unknown_field, 400, "admin-bad-weights")
    assert changed.status_code == 200
    assert changed.json()["key"]["limit"] == 3
    generation = changed.json()["config_generation"]
    assert after.json()["config_generation"] == generation
    assert after.json()["keys"]["search"]["admitted"] == 3


async def test_reload_without_a_config_file_is_404() -> None:
    engine, release, _ = gated_engine()
    release.set()
    with trio.fail_after(HANG_GUARD):
        async with serving(engine, config=config()) as served:
            response = await served.client.post("/admin/reload", headers=bearer(TOKEN))
    assert_problem(response, 404, "admin-no-config")


def test_live_weights_rebase_keeps_what_the_file_left_alone() -> None:
    from pipework.container._admin import LiveWeights

    file = pw.PoolConfig(8, keys={"a": pw.Weights(reserve=1, limit=4), "b": pw.Weights(limit=2)})
    live = LiveWeights(file)
    current = live.set(file, "a", {"limit": 2, "max_waiting": 5})
    current = live.set(current, "b", {"limit": 6})
    assert live.overrides() == {"a": {"limit": 2, "max_waiting": 5}, "b": {"limit": 6}}
    # a's limit edited in the file (4 -> 3): the file wins for that field only; b is gone.
    reloaded = pw.PoolConfig(8, keys={"a": pw.Weights(reserve=1, limit=3)})
    config, dropped = live.rebase(reloaded)
    assert (config.keys["a"].limit, config.keys["a"].max_waiting) == (3, 5)
    assert "b" not in config.keys
    assert live.overrides() == {"a": {"max_waiting": 5}}
    assert [sentence.split(":")[0] for sentence in dropped] == ["a.limit", "b"]
    # Live values that no longer fit the new file's totals are dropped, not an error.
    live.set(config, "a", {"reserve": 2})
    smaller = pw.PoolConfig(
        3, keys={"a": pw.Weights(reserve=1, limit=3), "c": pw.Weights(reserve=2)}
    )
    config, dropped = live.rebase(smaller)
    assert config.keys["a"].reserve == 1
    assert live.overrides() == {}
    assert "no longer fit" in dropped[0]
