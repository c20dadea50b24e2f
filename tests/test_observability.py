"""Metrics and structured logs after a scripted workload, read the way Prometheus and an
operator read them."""

from __future__ import annotations

import logging
import shutil
from typing import Any

import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

import pipework as pw


def scrape(engine: pw.Engine) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition, parsed by prometheus-client's own parser."""
    samples = {}
    for family in text_string_to_metric_families(engine.metrics.exposition().decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def build_engine() -> pw.Engine:
    pool = pw.WeightedPool(
        8,
        keys={
            "api": pw.Weights(reserve=1),
            "paused": pw.Weights(limit=0),
            "narrow": pw.Weights(limit=1, max_waiting=1, wait_timeout=3),
            "slow": pw.Weights(limit=1),
        },
    )
    engine = pw.Engine(pool=pool)

    @engine.pipe(key="api")
    async def ok(ctx: pw.Context) -> None:
        await trio.sleep(0.5)
        ctx.state["ok"] = True

    @engine.pipe(key="api")
    async def broken(ctx: pw.Context) -> None:
        raise RuntimeError("backend said 500")

    @engine.pipe(key="paused")
    async def paused(ctx: pw.Context) -> None:
        return None

    @engine.pipe(key="narrow")
    async def hog(ctx: pw.Context) -> None:
        await trio.sleep(100)

    @engine.pipe(key="slow")
    async def slow_hog(ctx: pw.Context) -> None:
        await trio.sleep(100)

    @engine.pipe(key="api")
    async def wait_signal(ctx: pw.Context) -> None:
        await ctx.suspend("go")

    engine.chain("ok", ok)
    engine.chain("broken", broken)
    engine.chain("paused", paused)
    engine.chain("narrow", hog)
    engine.chain("slow", slow_hog)
    engine.chain("suspend", wait_signal, ok)
    return engine


async def outcome(engine: pw.Engine, job_id: str) -> str:
    try:
        await engine.wait(job_id)
    except pw.Rejected as exc:
        return exc.reason
    except Exception as exc:
        return type(exc).__name__
    return "ok"


async def test_scraped_values_after_a_scripted_workload(autojump_clock: trio.abc.Clock) -> None:
    engine = build_engine()
    async with engine:
        ids = [await engine.submit("ok") for _ in range(3)]
        ids.append(await engine.submit("broken"))
        ids.append(await engine.submit("paused"))  # rejected: paused
        hog = await engine.submit("narrow")  # holds narrow's one slot for 100 s
        slow_hog = await engine.submit("slow")  # holds slow's one slot for 100 s
        await trio.testing.wait_all_tasks_blocked()
        waiter = await engine.submit("narrow")  # waits: rejected at its 3 s wait timeout
        await trio.testing.wait_all_tasks_blocked()
        overflow = await engine.submit("narrow")  # narrow's queue (1) is full
        short = await engine.submit("slow", timeout=1)  # its deadline comes first
        suspended = await engine.submit("suspend")
        await trio.testing.wait_all_tasks_blocked()
        await engine.signal(suspended, "go", 1)
        results = {job_id: await outcome(engine, job_id) for job_id in ids}
        assert sorted(results.values()) == ["RuntimeError", "ok", "ok", "ok", "paused"]
        assert await outcome(engine, overflow) == "queue_full"
        assert await outcome(engine, short) == "deadline"
        assert await outcome(engine, waiter) == "wait_timeout"
        assert await outcome(engine, suspended) == "ok"
        for job_id in (hog, slow_hog):
            await engine.cancel(job_id)
            assert await outcome(engine, job_id) == "JobCancelled"

        samples = scrape(engine)
        for reason, key, count in [
            ("paused", "paused", 1),
            ("queue_full", "narrow", 1),
            ("deadline", "slow", 1),
            ("wait_timeout", "narrow", 1),
        ]:
            assert value(samples, "pipework_pool_rejected_total", key=key, reason=reason) == count
        # ok: 3 + the resumed job's first step and its second; broken: 1; narrow: the hog.
        assert value(samples, "pipework_pool_admitted_total", key="api") == 6
        assert value(samples, "pipework_pool_admitted_total", key="narrow") == 1
        done = value(samples, "pipework_job_duration_seconds_count", route="ok", outcome="done")
        assert done == 3
        failed = "pipework_job_duration_seconds_count"
        assert value(samples, failed, route="broken", outcome="failed") == 1
        assert value(samples, failed, route="narrow", outcome="failed") == 2
        assert value(samples, failed, route="slow", outcome="failed") == 1
        assert value(samples, failed, route="narrow", outcome="cancelled") == 1
        assert value(samples, failed, route="suspend", outcome="done") == 1
        assert (
            value(
                samples,
                "pipework_pipe_duration_seconds_count",
                pipe="wait_signal",
                outcome="suspended",
            )
            == 1
        )
        assert (
            value(samples, "pipework_pipe_duration_seconds_count", pipe="broken", outcome="error")
            == 1
        )
        assert value(samples, "pipework_event_queue_depth") == 0
        assert value(samples, "pipework_pool_in_use", key="narrow", kind="shared") == 0
        assert value(samples, "pipework_pool_waiting", key="narrow") == 0
        assert value(samples, "pipework_jobs", status="done") == 4
        assert value(samples, "pipework_jobs", status="running") == 0
        assert value(samples, "pipework_jobs", status="queued") == 0


async def test_exposition_passes_promtool() -> None:
    promtool = shutil.which("promtool")
    assert promtool is not None, (
        "promtool is missing: install Debian's 'prometheus' package (scripts/ensure-tools)"
    )
    engine = build_engine()
    async with engine:
        await engine.run("ok")
        with pytest.raises(RuntimeError):
            await engine.run("broken")
        text = engine.metrics.exposition()
    result = await trio.run_process(
        [promtool, "check", "metrics"],
        stdin=text,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    problems = (result.stdout + result.stderr).decode()
    assert result.returncode == 0, problems
    assert problems.strip() == ""


async def test_one_correlation_id_finds_every_stage_of_a_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = pw.Engine()

    @engine.pipe
    async def load_user(ctx: pw.Context) -> None:
        ctx.state["user"] = 1

    @engine.pipe
    async def load_quote(ctx: pw.Context) -> None:
        ctx.state["quote"] = 2

    @engine.pipe
    async def wait_paid(ctx: pw.Context) -> None:
        await ctx.suspend("paid")

    @engine.pipe
    async def confirm(ctx: pw.Context) -> None:
        ctx.state["done"] = True

    engine.chain("order", pw.all_of(load_user, load_quote), wait_paid, confirm)
    # A job's life is logged at DEBUG (at INFO a request that succeeds is its access line).
    caplog.set_level(logging.DEBUG, logger="pipework.job")
    async with engine:
        other = await engine.submit("order", correlation_id="someone-else")
        job_id = await engine.submit("order", correlation_id="req-42")
        await trio.testing.wait_all_tasks_blocked()
        await engine.signal(job_id, "paid", {"amount": 3})
        await engine.signal(other, "paid", {"amount": 4})
        await engine.wait(job_id)
        await engine.wait(other)

    mine = [r for r in caplog.records if getattr(r, "correlation_id", None) == "req-42"]
    events = [
        (getattr(r, "event", None), getattr(r, "pipe", None), getattr(r, "outcome", None))
        for r in mine
    ]
    assert ("job accepted", None, None) in events
    for pipe in ("load_user", "load_quote", "confirm"):
        assert ("pipe ended", pipe, "ok") in events
    assert ("pipe ended", "wait_paid", "suspended") in events
    assert events.count(("branch finished", None, "done")) == 2
    assert ("job suspended", None, None) in events
    assert ("job resumed", None, None) in events
    assert events[-1] == ("job finished", None, "done")
    # Every line names the job (the parent, or a branch of it) and the route.
    assert all(getattr(r, "route", None) == "order" for r in mine)
    formatter = pw.JsonFormatter()
    import json

    line = json.loads(formatter.format(mine[-1]))
    assert line["correlation_id"] == "req-42"
    assert line["event"] == "job finished"
    assert line["job_id"] == job_id


async def test_each_series_counts_its_own_jobs_when_observers_are_kept() -> None:
    # The engine keeps the observer of each pipe's, route's and key's series after the first
    # observation: later jobs must still land in their own series, sums included.
    engine = pw.Engine(pool=pw.WeightedPool(4, keys={"api": pw.Weights(reserve=1)}))

    @engine.pipe(key="api")
    async def first(ctx: pw.Context) -> None:
        await trio.lowlevel.checkpoint()

    @engine.pipe
    async def second(ctx: pw.Context) -> None:
        await trio.lowlevel.checkpoint()

    engine.chain("one", first)
    engine.chain("both", first, second)
    async with engine:
        for _ in range(3):
            await engine.run("one")
        for _ in range(2):
            await engine.run("both")
    samples = scrape(engine)
    pipe = "pipework_pipe_duration_seconds_count"
    assert value(samples, pipe, pipe="first", outcome="ok") == 5
    assert value(samples, pipe, pipe="second", outcome="ok") == 2
    job = "pipework_job_duration_seconds_count"
    assert value(samples, job, route="one", outcome="done") == 3
    assert value(samples, job, route="both", outcome="done") == 2
    wait = "pipework_pool_wait_seconds_count"
    assert value(samples, wait, key="api") == 5  # every job's first step
    assert value(samples, wait, key="default") == 2  # the hand-off of each "both" job
