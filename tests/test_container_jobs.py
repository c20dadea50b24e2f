"""The job API over HTTP: status, progress, result, cancel, signals, signed callbacks,
owner tokens (a wrong one reveals nothing), idempotent resubmission and retention."""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from typing import Any
from urllib.parse import parse_qs, urlsplit

import h11
import pytest
import trio
import trio.testing

import pipework as pw
from pipework.dispatcher._store import JobStore
from pipework.redis import RedisJobStore
from pipework.redis._wire import ReplyError

from ._redis import RedisServer
from .test_container_harness import (
    HANG_GUARD,
    assert_no_content,
    assert_problem,
    assert_raw_problem,
    bearer,
    raw_client,
    serving,
)


class Backend:
    """Where the test pipes leave what they hand out."""

    def __init__(self) -> None:
        self.callback_urls: list[str] = []
        self.progressed = trio.Event()
        self.release = trio.Event()


def make_engine(backend: Backend, **kwargs: Any) -> pw.Engine:
    registry = pw.Registry()
    engine = pw.Engine(registry=registry, **kwargs)

    @engine.pipe
    async def export(ctx: pw.Context) -> None:
        await ctx.progress(1, 4, "first batch")
        backend.progressed.set()
        await backend.release.wait()
        ctx.state["rows"] = 4

    @engine.pipe
    async def wait_paid(ctx: pw.Context) -> None:
        await ctx.suspend("paid", into="payment")

    @engine.pipe
    async def ask_backend(ctx: pw.Context) -> None:
        backend.callback_urls.append(ctx.callback_url("done", ttl=60))
        await ctx.suspend("done", into="answer")

    @engine.pipe
    async def held(ctx: pw.Context) -> None:
        await backend.release.wait()

    @engine.pipe
    async def quick(ctx: pw.Context) -> None:
        ctx.state["ok"] = True

    @engine.pipe
    async def crash(ctx: pw.Context) -> None:
        raise KeyError("internal")

    engine.chain("export", export)
    engine.chain("order", wait_paid)
    engine.chain("callback", ask_backend, result="answer")
    # Active after the signal until the test releases it: refusals say why, not "ended".
    engine.chain("callback_held", ask_backend, held, result="answer")
    engine.chain("order_held", wait_paid, held, result="payment")
    engine.chain("quick", quick)
    engine.chain("crash", crash)
    for name in ("export", "order", "callback", "callback_held", "order_held", "quick", "crash"):
        registry.route(name, path=f"/{name}", chain=name, mode="async")
    registry.route("quick_sync", path="/quick-sync", chain="quick")
    return engine


async def submit(served: Any, path: str, **kwargs: Any) -> tuple[str, str]:
    response = await served.client.post(path, **kwargs)
    assert response.status_code == 202, response.text
    return response.json()["id"], response.json()["token"]


async def test_status_shows_progress_then_links_to_the_result() -> None:
    backend = Backend()
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(backend)) as served:
            job_id, token = await submit(served, "/export")
            await backend.progressed.wait()
            running = (await served.client.get(f"/jobs/{job_id}", headers=bearer(token))).json()
            early = await served.client.get(
                f"/jobs/{job_id}/result", headers={"X-Job-Token": token}
            )
            backend.release.set()
            await served.engine.wait(job_id)
            done = (await served.client.get(f"/jobs/{job_id}", headers=bearer(token))).json()
            result = await served.client.get(f"/jobs/{job_id}/result", headers=bearer(token))
    assert running["status"] == "running"
    assert running["progress"] == {"done": 1, "total": 4, "message": "first batch"}
    assert running["expires_at"].endswith("Z")
    assert running["retain_until"] is None
    assert "result" not in running["links"]
    body = assert_problem(early, 409, "job-not-finished")
    assert body["job_status"] == "running"
    assert done["status"] == "done"
    assert done["finished_at"] is not None
    assert done["retain_until"].endswith("Z")
    assert done["links"]["result"] == f"/jobs/{job_id}/result"
    assert result.json() == {"rows": 4}


async def test_failed_job_reports_its_error_without_internals() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(Backend())) as served:
            job_id, token = await submit(served, "/crash")
            with pytest.raises(KeyError):
                await served.engine.wait(job_id)
            status = (await served.client.get(f"/jobs/{job_id}", headers=bearer(token))).json()
            result = await served.client.get(f"/jobs/{job_id}/result", headers=bearer(token))
    assert status["status"] == "failed"
    assert status["error"]["error_type"] == "KeyError"
    assert status["error"]["status"] == 500
    assert "internal" not in str(status)
    body = assert_problem(result, 500, "pipe-failed")
    assert body["job_status"] == "failed"


@pytest.mark.parametrize(
    ("method", "suffix"),
    [
        pytest.param("GET", "", id="status"),
        pytest.param("GET", "/result", id="result"),
        pytest.param("DELETE", "", id="cancel"),
        pytest.param("POST", "/signals/paid", id="signal"),
    ],
)
async def test_wrong_or_missing_token_is_404_like_an_unknown_id(method: str, suffix: str) -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(Backend())) as served:
            job_id, token = await submit(served, "/order")
            answers = [
                await served.client.request(method, f"/jobs/{job_id}{suffix}", headers=headers)
                for headers in (bearer("wrong"), {"X-Job-Token": token[:-1]}, {})
            ]
            unknown = await served.client.request(
                method, f"/jobs/{'x' * 22}{suffix}", headers=bearer(token)
            )
            # None of those touched the job.
            assert (await served.engine.status(job_id)).status is pw.Status.SUSPENDED
    bodies = [assert_problem(r, 404, "job-not-found") for r in (*answers, unknown)]
    assert len({(b["title"], b["detail"]) for b in bodies}) == 1


async def test_a_malformed_job_token_is_404_like_a_wrong_one() -> None:
    """A job token of raw bytes outside ASCII, in either header, is a wrong token: the same
    404 as an unknown id, never a 500."""
    answers = []
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(Backend())) as served:
            job_id, token = await submit(served, "/order", json={})
            for name, value in [
                ("Authorization", b"Bearer \xc3\xa9"),
                ("Authorization", b"Bearer " + token.encode() + b"\xff"),
                ("X-Job-Token", b"\xff"),
                ("X-Job-Token", b"\xc3\xa9"),
            ]:
                async with raw_client(served.address) as raw:
                    await raw.send("GET", f"/jobs/{job_id}", headers=[(name, value)])
                    answers.append(await raw.receive())
            owner = await served.client.get(f"/jobs/{job_id}", headers=bearer(token))
            await served.engine.cancel(job_id)
    for answer in answers:
        assert_raw_problem(answer, 404, "job-not-found")
    assert owner.status_code == 200


async def test_cancel_with_delete() -> None:
    backend = Backend()
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(backend)) as served:
            job_id, token = await submit(served, "/export")
            await backend.progressed.wait()
            first = await served.client.delete(f"/jobs/{job_id}", headers=bearer(token))
            again = await served.client.delete(f"/jobs/{job_id}", headers=bearer(token))
            result = await served.client.get(f"/jobs/{job_id}/result", headers=bearer(token))
    assert first.status_code == 200
    assert first.json()["status"] == "cancelled"
    assert again.status_code == 200
    assert again.json()["status"] == "cancelled"
    assert assert_problem(result, 409, "job-cancelled")["job_status"] == "cancelled"


async def test_signal_resumes_a_suspended_job() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(Backend())) as served:
            job_id, token = await submit(served, "/order", json={"item": "book"})
            await trio.testing.wait_all_tasks_blocked()
            status = (await served.client.get(f"/jobs/{job_id}", headers=bearer(token))).json()
            wrong = await served.client.post(
                f"/jobs/{job_id}/signals/shipped", headers=bearer(token), json={}
            )
            resumed = await served.client.post(
                status["links"]["signal"], headers=bearer(token), json={"amount": 12}
            )
            result = await served.engine.wait(job_id)
    assert status["status"] == "suspended"
    assert status["waiting_for"] == "paid"
    assert assert_problem(wrong, 409, "signal-refused")["detail"].startswith(f"job {job_id} is")
    assert resumed.status_code == 202
    assert result == {"item": "book", "payment": {"amount": 12}}


async def test_signed_callback_resumes_the_job_and_refuses_tampering() -> None:
    backend = Backend()
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(backend)) as served:
            job_id, _ = await submit(served, "/callback")
            await trio.testing.wait_all_tasks_blocked()
            url = backend.callback_urls[0]
            parts = urlsplit(url)
            query = parse_qs(parts.query)
            sig, exp = query["sig"][0], query["exp"][0]
            signer = served.container.signer
            tampered = [
                f"{parts.path}?exp={exp}&sig={'A' * len(sig)}",  # forged signature
                f"{parts.path}?exp={int(exp) + 1}&sig={sig}",  # extended expiry
                f"/callbacks/{job_id}/other?exp={exp}&sig={sig}",  # another signal
                f"{parts.path}?exp={exp}",  # no signature
                signer.url_expiring_at(job_id, "done", int(time.time()) - 1),  # expired
            ]
            refused = [await served.client.post(u, json="no") for u in tampered]
            assert (await served.engine.status(job_id)).status is pw.Status.SUSPENDED
            accepted = await served.client.post(url, json={"answer": 42})
            result = await served.engine.wait(job_id)
            replayed = await served.client.post(url, json={"answer": 43})
    assert url.startswith(f"{served.address.url}/callbacks/{job_id}/done?")
    for response in refused:
        assert_problem(response, 403, "callback-refused")
    assert "expired" in refused[-1].json()["detail"]
    assert accepted.status_code == 204
    assert_no_content(accepted)
    assert result == {"answer": 42}
    # The job is finished: a replay of the URL cannot reach it.
    assert_problem(replayed, 409, "signal-refused")


@pytest.fixture(params=["memory", "redis"])
def job_store(request: pytest.FixtureRequest) -> JobStore:
    """The memory store, and the Redis store on the session's server (a prefix of its own)."""
    if request.param == "memory":
        return pw.MemoryJobStore()
    server: RedisServer = request.getfixturevalue("redis_server")
    return RedisJobStore(server.url, prefix=f"t{secrets.token_hex(6)}")


async def post_at_once(
    served: Any, target: str, bodies: list[bytes], headers: list[tuple[str, str]]
) -> list[tuple[h11.Response, bytes]]:
    """POST each body to ``target`` on a connection of its own: every request is sent
    whole before any answer is read; the answers, in the order of ``bodies``."""
    headers = [("Content-Type", "application/json"), *headers]
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(raw_client(served.address)) for _ in bodies]
        for client, body in zip(clients, bodies, strict=True):
            await client.send("POST", target, body=body, headers=headers)
        return [await client.receive() for client in clients]


async def until_suspended(engine: pw.Engine, job_id: str) -> None:
    while (await engine.status(job_id)).status is not pw.Status.SUSPENDED:
        await trio.testing.wait_all_tasks_blocked()


async def test_one_callback_url_posted_eight_times_at_once_delivers_once(
    job_store: JobStore,
) -> None:
    """Eight backends (or one retrying) POST one signed callback URL at once: exactly one
    is told 204 and its payload is the one the job resumes with; every other is 409, the
    signal already delivered. None is told "delivered" and dropped."""
    backend = Backend()
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(backend, store=job_store)) as served:
            job_id, _ = await submit(served, "/callback_held")
            await until_suspended(served.engine, job_id)
            parts = urlsplit(backend.callback_urls[0])
            bodies = [json.dumps({"n": n}).encode() for n in range(8)]
            answers = await post_at_once(served, f"{parts.path}?{parts.query}", bodies, [])
            backend.release.set()
            result = await served.engine.wait(job_id)
    delivered = [n for n, (response, _) in enumerate(answers) if response.status_code == 204]
    assert len(delivered) == 1, [response.status_code for response, _ in answers]
    for n, answer in enumerate(answers):
        if n not in delivered:
            body, _ = assert_raw_problem(answer, 409, "signal-refused")
            assert "'done' was already delivered" in body["detail"]
    assert result == {"n": delivered[0]}


async def test_one_signal_posted_eight_times_at_once_with_the_token_delivers_once(
    job_store: JobStore,
) -> None:
    """The token-authenticated signal API, eight times at once: one 202, seven 409."""
    with trio.fail_after(HANG_GUARD):
        backend = Backend()
        async with serving(make_engine(backend, store=job_store)) as served:
            job_id, token = await submit(served, "/order_held")
            await until_suspended(served.engine, job_id)
            bodies = [json.dumps({"n": n}).encode() for n in range(8)]
            answers = await post_at_once(
                served,
                f"/jobs/{job_id}/signals/paid",
                bodies,
                [("Authorization", f"Bearer {token}")],
            )
            backend.release.set()
            result = await served.engine.wait(job_id)
    delivered = [n for n, (response, _) in enumerate(answers) if response.status_code == 202]
    assert len(delivered) == 1, [response.status_code for response, _ in answers]
    for n, answer in enumerate(answers):
        if n not in delivered:
            body, _ = assert_raw_problem(answer, 409, "signal-refused")
            assert "'paid' was already delivered" in body["detail"]
    assert result == {"n": delivered[0]}


async def test_idempotency_key_returns_the_same_job() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(Backend())) as served:
            key = {"Idempotency-Key": "order-7f3a"}
            first = await served.client.post("/order", headers=key, json={"item": "book"})
            again = await served.client.post("/order", headers=key, json={"item": "book"})
            other_body = await served.client.post("/order", headers=key, json={"item": "pen"})
            other_route = await served.client.post("/export", headers=key)
            no_key = await served.client.post("/order", json={"item": "book"})
            # A key whose job was cancelled starts a new job.
            job_id, token = first.json()["id"], first.json()["token"]
            await served.client.delete(f"/jobs/{job_id}", headers=bearer(token))
            after_cancel = await served.client.post("/order", headers=key, json={"item": "book"})
            # Sync routes replay the finished job's answer.
            sync = [
                await served.client.post("/quick-sync", headers={"Idempotency-Key": "q1"})
                for _ in range(2)
            ]
    assert (again.json()["id"], again.json()["token"]) == (job_id, token)
    assert again.headers["location"] == first.headers["location"]
    assert_problem(other_body, 422, "idempotency-key-reused")
    assert other_route.json()["id"] != job_id
    assert no_key.json()["id"] != job_id
    assert after_cancel.json()["id"] != job_id
    assert sync[0].json() == sync[1].json() == {"ok": True}
    assert sync[0].headers["x-job-id"] == sync[1].headers["x-job-id"]


async def test_concurrent_requests_with_one_key_start_one_job() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(Backend())) as served:
            ids: list[str] = []

            async def post() -> None:
                response = await served.client.post("/order", headers={"Idempotency-Key": "k"})
                ids.append(response.json()["id"])

            async with trio.open_nursery() as nursery:
                for _ in range(5):
                    nursery.start_soon(post)
            jobs = await served.engine.store.list()
    assert len(set(ids)) == 1
    assert [job.id for job in jobs if job.chain == "order"] == ids[:1]


async def test_job_past_retention_is_410_gone() -> None:
    # Real time (a served engine): the retention is long enough for the first read to come
    # well within it on a busy machine.
    engine = make_engine(Backend(), store=pw.MemoryJobStore(retain_seconds=1.0))
    with trio.fail_after(HANG_GUARD):
        async with serving(engine) as served:
            job_id, token = await submit(served, "/quick")
            await served.engine.wait(job_id)
            retained = await served.client.get(f"/jobs/{job_id}", headers=bearer(token))
            retain_until = (await served.engine.status(job_id)).retain_until
            assert retain_until is not None
            await trio.sleep_until(retain_until + 0.01)
            gone = await served.client.get(f"/jobs/{job_id}", headers=bearer(token))
            gone_result = await served.client.get(f"/jobs/{job_id}/result", headers=bearer(token))
            stranger = await served.client.get(f"/jobs/{job_id}", headers=bearer("wrong"))
            anonymous = await served.client.get(f"/jobs/{job_id}")
    assert retained.status_code == 200
    assert_problem(gone, 410, "job-gone")
    assert_problem(gone_result, 410, "job-gone")
    # Only the owner learns the job existed: anyone else gets the unknown-job answer.
    assert stranger.status_code == 404
    assert anonymous.status_code == 404


class _LoadingAfterDelivery(RedisJobStore):
    """A Redis store that answers every call ``LOADING`` (a restarted server reading its
    AOF) from the moment a signal's delivery is written until ``back`` is called."""

    def __init__(self, url: str, prefix: str) -> None:
        super().__init__(url, prefix=prefix, resend_seconds=0.2)
        self.loading = False

    async def update_unless_changed(self, job: Any, **kwargs: Any) -> bool:
        written = await super().update_unless_changed(job, **kwargs)
        self.loading = written and job.status is pw.Status.QUEUED
        return written

    async def _call(self, call: Any) -> Any:
        if self.loading:
            raise self._refused(ReplyError("LOADING Redis is loading the dataset in memory"))
        return await super()._call(call)


async def test_a_delivered_signal_whose_later_store_calls_are_refused_is_never_nothing_done(
    redis_server: RedisServer,
) -> None:
    """The delivery is written, then Redis answers LOADING (restarted, reading its file) to
    the same request's later calls (the lock's release, the status read): the signal's
    answer is its 202, or a 503 naming the job (its Location), never "nothing was done",
    which would send its client's retry to a 409."""
    store = _LoadingAfterDelivery(redis_server.url, f"t{secrets.token_hex(6)}")
    with trio.fail_after(HANG_GUARD):
        async with serving(make_engine(Backend(), store=store)) as served:
            job_id, token = await submit(served, "/order")
            await until_suspended(served.engine, job_id)
            answer = await served.client.post(
                f"/jobs/{job_id}/signals/paid", headers=bearer(token), json={"amount": 3}
            )
            store.loading = False
            record = await store.get(job_id)
    assert record.state["payment"] == {"amount": 3}  # delivered
    assert "paid" in record.delivered
    assert "nothing was done" not in answer.text, answer.text
    if answer.status_code != 202:
        body = assert_problem(answer, 503, "store-unavailable")
        assert answer.headers["Location"] == f"/jobs/{job_id}"
        assert job_id in body["detail"]
