"""Jobs on the board: every status and progress change reaches ``GET /jobs/{id}/events``,
which ends with the final state, at once for a follower that comes after the end."""

from __future__ import annotations

import contextlib

import pytest
import trio

import pipework as pw

from .test_board_http import follow_sse, serving
from .test_container_harness import HANG_GUARD, assert_problem, bearer


class Gate:
    def __init__(self) -> None:
        self.progressed = trio.Event()
        self.release = trio.Event()


def make_engine(gate: Gate) -> pw.Engine:
    registry = pw.Registry()
    engine = pw.Engine(registry=registry)

    @engine.pipe
    async def export(ctx: pw.Context) -> None:
        await ctx.progress(1, 4, "first batch")
        gate.progressed.set()
        await gate.release.wait()
        await ctx.progress(4, 4, "written")
        ctx.state["rows"] = 4

    @engine.pipe
    async def quick(ctx: pw.Context) -> None:
        ctx.state["ok"] = True

    engine.chain("export", export)
    engine.chain("quick", quick)
    registry.route("export", path="/export", chain="export", mode="async")
    registry.route("quick", path="/quick", chain="quick", mode="async")
    return engine


async def test_job_events_follow_progress_to_the_final_state() -> None:
    gate = Gate()
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(gate)) as served:
            accepted = (await served.client.post("/export", json={})).json()
            job_id, token = accepted["id"], accepted["token"]
            await gate.progressed.wait()
            path = f"/jobs/{job_id}/events"
            assert_problem(await served.client.get(path), 404, "job-not-found")
            async with follow_sse(served, path, bearer(token)) as (response, events):
                assert response.status_code == 200
                _, _, first = await events.next()
                assert first["data"]["status"] == "running"
                assert first["data"]["progress"]["done"] == 1
                gate.release.set()
                statuses: list[str] = []
                while not statuses or statuses[-1] != "done":
                    _, _, body = await events.next()
                    statuses.append(body["data"]["status"])
                assert body["data"]["links"]["result"] == f"/jobs/{job_id}/result"
                with contextlib.suppress(EOFError):
                    await events.next()
                    raise AssertionError("the stream went on after the final state")
            # A follower that comes after the end gets the final state at once, and the end.
            async with follow_sse(served, path, bearer(token)) as (_, events):
                _, _, body = await events.next()
                assert body["data"]["status"] == "done"
                with contextlib.suppress(EOFError):
                    await events.next()
                    raise AssertionError("the stream went on after the final state")


async def test_one_stream_follows_several_jobs_by_ticket() -> None:
    gate = Gate()
    gate.release.set()
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(gate)) as served:
            tickets = []
            for _ in range(3):
                accepted = (await served.client.post("/quick", json={})).json()
                tickets.append(f"{accepted['id']}:{accepted['token']}")
            wrong = tickets[0].split(":")[0] + ":not-the-token"
            headers = {"X-Job-Tickets": ",".join([*tickets, wrong])}
            async with follow_sse(served, "/jobs/events", headers) as (_, events):
                missing = await events.next()
                assert missing[1:] == ("missing", {"id": tickets[0].split(":")[0]})
                done: set[str] = set()
                while len(done) < 3:
                    _, _, body = await events.next()
                    if body["data"]["status"] == "done":
                        done.add(body["id"])
                assert done == {t.split(":")[0] for t in tickets}


@pytest.mark.parametrize(
    "ticket",
    [
        pytest.param("é:token".encode(), id="utf-8"),
        pytest.param("é:token".encode("latin-1"), id="latin-1"),
        pytest.param(b"job:tok\xffen", id="in-the-token"),
    ],
)
async def test_a_ticket_that_is_not_ascii_is_refused_naming_the_header(ticket: bytes) -> None:
    """Job ids and tokens are ASCII: such a ticket names no job, and its bytes would come
    back as latin-1 mojibake in a ``missing`` event. The answer says which ticket."""
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(Gate())) as served:
            response = await served.client.get(
                "/jobs/events",
                headers={
                    b"X-Job-Tickets": b"unknown:token, " + ticket,
                    b"Accept": b"text/event-stream",
                },
            )
    problem = assert_problem(response, 400, "bad-job-tickets")
    assert "X-Job-Tickets" in problem["detail"]
    assert "ticket 2" in problem["detail"]
    assert "Ã" not in response.text
    assert "é" not in response.text


async def test_more_tickets_than_one_stream_follows_are_refused() -> None:
    tickets = ",".join(f"job{n}:token" for n in range(201))
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(Gate())) as served:
            response = await served.client.get("/jobs/events", headers={"X-Job-Tickets": tickets})
    problem = assert_problem(response, 400, "bad-job-tickets")
    assert "at most 200" in problem["detail"]


async def test_the_jobs_page_is_served_with_a_strict_policy() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving() as served:
            page = await served.client.get("/ui/jobs")
            assert page.status_code == 200
            assert page.headers["content-type"] == "text/html; charset=utf-8"
            policy = page.headers["content-security-policy"]
            assert "script-src 'sha256-" in policy
            assert "default-src 'none'" in policy
            assert "<script>" in page.text
            assert "https://" not in page.text


async def test_the_board_listens_to_the_engine_only_while_it_holds_an_active_job() -> None:
    gate = Gate()
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(gate)) as served:
            engine = served.container.engine
            accepted = (await served.client.post("/export", json={})).json()
            await gate.progressed.wait()
            # Nobody follows the job: no observer, so no job view per change.
            assert engine._observers == []
            path = f"/jobs/{accepted['id']}/events"
            async with follow_sse(served, path, bearer(accepted["token"])) as (_, events):
                _, _, first = await events.next()
                assert first["data"]["status"] == "running"
                assert len(engine._observers) == 1  # the followed job is still active
                gate.release.set()
                status = ""
                while status != "done":
                    _, _, body = await events.next()
                    status = body["data"]["status"]
            # Its end was published, and the board holds no active job any more.
            assert engine._observers == []
            # A job run while nobody follows is not on the board, and reaches it whole
            # when someone follows it after its end.
            quick = (await served.client.post("/quick", json={})).json()
            await engine.wait(quick["id"])
            async with follow_sse(
                served, f"/jobs/{quick['id']}/events", bearer(quick["token"])
            ) as (
                _,
                events,
            ):
                _, _, body = await events.next()
                assert body["data"]["status"] == "done"
            assert engine._observers == []
