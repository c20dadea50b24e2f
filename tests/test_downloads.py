"""The download centre over real HTTP: the listing (``GET /jobs``) by the tickets a client
holds, with its filters and the jobs a route's records outlive the store with; the signed
download links (a good one, tampered ones, an expired one); the zip of several files, whole
and streamed in bounded memory; the downloaded mark."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import secrets
import time
import tracemalloc
import zipfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import trio

import pipework as pw
from pipework.container import BoundAddress, Container, ContainerConfig
from pipework.redis import RedisJobStore

from ._redis import RedisServer
from .test_container_harness import HANG_GUARD, SECRET, assert_problem

TTL = 300


class Files:
    """A route's records of the files its jobs made, as a test keeps them."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.files: dict[str, pw.ResultFile] = {}
        self.marks: dict[str, float] = {}
        self.started = trio.Event()  # a running job's record is in

    async def result_file(self, job_id: str) -> pw.ResultFile | None:
        file = self.files.get(job_id)
        if file is None:
            return None
        return dataclasses.replace(file, downloaded=self.marks.get(job_id))

    async def mark_downloaded(self, job_id: str, when: float) -> None:
        self.marks[job_id] = when

    def expire(self, job_id: str) -> None:
        file = self.files[job_id]
        assert file.path is not None
        file.path.unlink()
        self.files[job_id] = dataclasses.replace(file, state="expired", path=None)


@dataclass
class Centre:
    client: httpx.AsyncClient
    engine: pw.Engine
    files: Files
    clock: list[float]
    held: trio.Event

    async def submit(self, path: str, body: dict[str, Any] | None = None) -> str:
        response = await self.client.post(path, json=body or {})
        assert response.status_code == 202, response.text
        job_id, token = response.json()["id"], response.json()["token"]
        with contextlib.suppress(Exception):  # read over HTTP
            if path != "/hold":
                await self.engine.wait(job_id)
        return f"{job_id}:{token}"

    async def listing(self, tickets: list[str], **params: str) -> httpx.Response:
        return await self.client.get(
            "/jobs", params=params, headers={"X-Job-Tickets": ",".join(tickets)}
        )

    async def entries(self, tickets: list[str], **params: str) -> dict[str, Any]:
        response = await self.listing(tickets, **params)
        assert response.status_code == 200, response.text
        assert response.headers["cache-control"] == "no-store"
        body: dict[str, Any] = response.json()
        return body


def make_engine(files: Files, held: trio.Event, store: Any = None) -> pw.Engine:
    registry = pw.Registry()
    engine = pw.Engine(registry=registry, store=store)

    async def write(ctx: pw.Context, content: bytes) -> None:
        job = await engine.store.get(ctx.job_id)
        path = files.directory / f"{ctx.job_id}.txt"
        path.write_bytes(content)
        files.files[ctx.job_id] = pw.ResultFile(
            job_id=ctx.job_id,
            name=ctx.state.get("name", "report.txt"),
            owner=job.token_hash,
            state="done",
            path=path,
            chain=ctx.chain,
            media_type="text/plain",
            rows=content.count(b"\n"),
            size=len(content),
            created=time.time(),
            finished=time.time(),
        )

    @engine.pipe
    async def make(ctx: pw.Context) -> None:
        await write(ctx, f"file of {ctx.job_id}\n".encode() * int(ctx.state.get("lines", 3)))

    @engine.pipe
    async def hold(ctx: pw.Context) -> None:
        job = await engine.store.get(ctx.job_id)
        files.files[ctx.job_id] = pw.ResultFile(
            ctx.job_id, "later.txt", job.token_hash, "running", chain=ctx.chain, rows=5
        )
        await ctx.progress(5, 10, "half")
        files.started.set()
        await held.wait()

    @engine.pipe
    async def plain(ctx: pw.Context) -> None:
        ctx.state["answer"] = 42

    for name, pipe in (("make", make), ("hold", hold), ("plain", plain)):
        engine.chain(name, pipe)
        registry.route(name, path=f"/{name}", chain=name, mode="async")
    return engine


@contextlib.asynccontextmanager
async def centre(tmp_path: Path, store: Any = None) -> AsyncIterator[Centre]:
    files = Files(tmp_path)
    held = trio.Event()
    clock = [time.time()]
    engine = make_engine(files, held, store)
    signer = pw.CallbackSigner(SECRET, clock=lambda: clock[0])
    stop = trio.Event()
    async with engine:
        container = Container(engine, None, ContainerConfig(shutdown_grace=0.5), signer=signer)
        container.add_file_results(files)
        async with trio.open_nursery() as nursery:
            address: BoundAddress = await nursery.start(
                functools.partial(container.serve, shutdown_trigger=stop)
            )
            try:
                async with httpx.AsyncClient(base_url=address.url, timeout=HANG_GUARD) as client:
                    yield Centre(client, engine, files, clock, held)
            finally:
                held.set()
                stop.set()


def with_query(href: str, **changes: str) -> str:
    parts = urlsplit(href)
    query = {k: v[0] for k, v in parse_qs(parts.query).items()}
    query.update(changes)
    return parts.path + "?" + "&".join(f"{k}={v}" for k, v in query.items())


async def test_the_listing_shows_the_callers_jobs_newest_first_with_their_files(
    tmp_path: Path,
) -> None:
    async with centre(tmp_path) as c:
        first = await c.submit("/make", {"name": "orders.csv"})
        second = await c.submit("/make", {"name": "invoices.csv", "lines": 10})
        plain = await c.submit("/plain")
        running = await c.submit("/hold")
        await c.files.started.wait()
        wrong = first.split(":")[0] + ":not-the-token"
        body = await c.entries([first, second, plain, running, wrong, "nobody:x"])
    ids = [entry["id"] for entry in body["jobs"]]
    assert ids == [t.split(":")[0] for t in (running, plain, second, first)]
    assert body["missing"] == ["nobody"]  # the wrong token's job: listed once, by its ticket
    by_id = {entry["id"]: entry for entry in body["jobs"]}
    done = by_id[second.split(":")[0]]
    assert done["state"] == "done"
    assert done["chain"] == "make"
    assert done["file"]["name"] == "invoices.csv"
    assert done["file"]["rows"] == 10
    assert done["file"]["size"] == len(f"file of {done['id']}\n") * 10
    assert done["file"]["href"].startswith(f"/jobs/{done['id']}/file?exp=")
    assert done["file"]["downloaded_at"] is None
    assert by_id[plain.split(":")[0]]["file"] is None
    later = by_id[running.split(":")[0]]
    assert later["state"] == "running"
    assert later["progress"]["done"] == 5
    assert later["file"]["href"] is None  # nothing to download yet


async def test_a_ticket_with_the_wrong_token_lists_nothing(tmp_path: Path) -> None:
    async with centre(tmp_path) as c:
        ticket = await c.submit("/make")
        job_id = ticket.split(":")[0]
        body = await c.entries([f"{job_id}:someone-else"])
    assert body == {"jobs": [], "missing": [job_id]}


async def test_the_listing_filters_by_name_state_and_date(tmp_path: Path) -> None:
    async with centre(tmp_path) as c:
        orders = await c.submit("/make", {"name": "orders.csv"})
        invoices = await c.submit("/make", {"name": "invoices.csv"})
        running = await c.submit("/hold")
        await c.files.started.wait()
        c.files.expire(invoices.split(":")[0])
        tickets = [orders, invoices, running]
        today = datetime.now(UTC).date()
        found = {}
        for name, params in {
            "name": {"q": "ORDERS"},
            "id": {"q": orders.split(":")[0][:8]},
            "expired": {"status": "expired"},
            "active": {"status": "running,queued"},
            "today": {"from": today.isoformat(), "to": today.isoformat()},
            "yesterday": {"to": (today - timedelta(days=1)).isoformat()},
            "after now": {"from": (datetime.now(UTC) + timedelta(hours=1)).isoformat()},
        }.items():
            body = await c.entries(tickets, **params)
            found[name] = {entry["id"] for entry in body["jobs"]}
        bad_state = await c.listing(tickets, status="lost")
        bad_date = await c.listing(tickets, to="tomorrow")
        bad_ticket = await c.client.get("/jobs", headers={"X-Job-Tickets": "no-colon"})
    ids = {name: t.split(":")[0] for name, t in (("o", orders), ("i", invoices), ("r", running))}
    assert found["name"] == {ids["o"]}
    assert found["id"] == {ids["o"]}
    assert found["expired"] == {ids["i"]}
    assert found["active"] == {ids["r"]}
    assert found["today"] == set(ids.values())
    assert found["yesterday"] == set()
    assert found["after now"] == set()
    assert "status='lost'" in assert_problem(bad_state, 400, "bad-filter")["detail"]
    assert "to='tomorrow'" in assert_problem(bad_date, 400, "bad-filter")["detail"]
    assert "ticket 1" in assert_problem(bad_ticket, 400, "bad-job-tickets")["detail"]


async def test_a_job_the_store_forgot_is_listed_from_its_files_records(tmp_path: Path) -> None:
    async with centre(tmp_path) as c:
        ticket = await c.submit("/make", {"name": "kept.csv"})
        job_id, token = ticket.split(":")
        await c.engine.store.delete(job_id)  # as a restart forgets a memory store's jobs
        gone = await c.client.get(f"/jobs/{job_id}", headers={"X-Job-Token": token})
        body = await c.entries([ticket])
        other = await c.entries([f"{job_id}:another-token"])
        download = await c.client.get(body["jobs"][0]["file"]["href"])
    assert gone.status_code == 404
    (entry,) = body["jobs"]
    assert (entry["id"], entry["state"], entry["chain"]) == (job_id, "done", "make")
    assert entry["file"]["name"] == "kept.csv"
    assert other == {"jobs": [], "missing": [job_id]}
    assert download.status_code == 200
    assert download.content == (tmp_path / f"{job_id}.txt").read_bytes()


async def test_a_signed_link_downloads_the_file_and_sets_the_mark(tmp_path: Path) -> None:
    async with centre(tmp_path) as c:
        ticket = await c.submit("/make", {"name": "Zoë's orders.csv"})
        job_id, token = ticket.split(":")
        (entry,) = (await c.entries([ticket]))["jobs"]
        href = entry["file"]["href"]
        response = await c.client.get(href)
        after = (await c.entries([ticket]))["jobs"][0]
        by_token = await c.client.get(f"/jobs/{job_id}/file", headers={"X-Job-Token": token})
        by_other = await c.client.get(f"/jobs/{job_id}/file", headers={"X-Job-Token": "x"})
    assert token not in href
    assert response.status_code == 200, response.text
    assert response.content == (tmp_path / f"{job_id}.txt").read_bytes()
    assert response.headers["content-type"].startswith("text/plain")
    assert response.headers["content-length"] == str(len(response.content))
    disposition = response.headers["content-disposition"]
    assert disposition.startswith('attachment; filename="Zo_')
    assert "filename*=UTF-8''Zo%C3%AB%27s%20orders.csv" in disposition
    assert after["file"]["downloaded_at"] is not None
    assert by_token.content == response.content
    assert_problem(by_other, 404, "job-not-found")


async def test_a_tampered_or_expired_link_is_refused(tmp_path: Path) -> None:
    async with centre(tmp_path) as c:
        first = await c.submit("/make")
        second = await c.submit("/make")
        body = await c.entries([first, second])
        href = body["jobs"][0]["file"]["href"]
        other_id = body["jobs"][1]["id"]
        sig = parse_qs(urlsplit(href).query)["sig"][0]
        exp = parse_qs(urlsplit(href).query)["exp"][0]
        flipped = ("A" if sig[0] != "A" else "B") + sig[1:]
        answers = {
            "signature": await c.client.get(with_query(href, sig=flipped)),
            "later exp": await c.client.get(with_query(href, exp=str(int(exp) + 3600))),
            "other job": await c.client.get(f"/jobs/{other_id}/file?exp={exp}&sig={sig}"),
            "no sig": await c.client.get(urlsplit(href).path + f"?exp={exp}"),
            "bad exp": await c.client.get(with_query(href, exp="1e9")),
        }
        good = await c.client.get(href)
        c.clock[0] += TTL + 1
        expired = await c.client.get(href)
    assert good.status_code == 200
    for why, response in answers.items():
        problem = assert_problem(response, 403, "download-refused")
        assert "download link" in problem["detail"], why
    assert "signature does not match" in answers["signature"].json()["detail"]
    assert "expired" in assert_problem(expired, 403, "download-refused")["detail"]


async def test_files_not_ready_are_not_offered(tmp_path: Path) -> None:
    async with centre(tmp_path) as c:
        done = await c.submit("/make")
        running = await c.submit("/hold")
        await c.files.started.wait()
        body = await c.entries([done])
        href = body["jobs"][0]["file"]["href"]
        c.files.expire(done.split(":")[0])
        gone = await c.client.get(href)
        expired = (await c.entries([done]))["jobs"][0]
        tickets = {"X-Job-Tickets": f"{done},{running}"}
        batch_expired = await c.client.post(
            "/jobs/downloads", json={"ids": [done.split(":")[0]]}, headers=tickets
        )
        batch_running = await c.client.post(
            "/jobs/downloads", json={"ids": [running.split(":")[0]]}, headers=tickets
        )
        batch_bad = await c.client.post("/jobs/downloads", json={"ids": []}, headers=tickets)
    assert_problem(gone, 410, "file-gone")
    assert expired["state"] == "expired"
    assert expired["file"]["href"] is None
    assert_problem(batch_expired, 410, "file-gone")
    assert_problem(batch_running, 409, "file-not-ready")
    assert_problem(batch_bad, 422, "bad-download-request")


async def test_several_files_download_as_one_zip_by_a_signed_link(tmp_path: Path) -> None:
    async with centre(tmp_path) as c:
        tickets = [await c.submit("/make", {"name": "same.csv", "lines": n}) for n in (2, 5)]
        ids = [t.split(":")[0] for t in tickets]
        headers = {"X-Job-Tickets": ",".join(tickets)}
        link = await c.client.post("/jobs/downloads", json={"ids": ids}, headers=headers)
        href = link.json()["href"]
        response = await c.client.get(href)
        marks = dict(c.files.marks)
        not_mine = await c.client.post(
            "/jobs/downloads", json={"ids": ids}, headers={"X-Job-Tickets": tickets[0]}
        )
        tampered = await c.client.get(href.replace(ids[1], ids[0]))
    assert link.status_code == 200, link.text
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/zip"
    with zipfile.ZipFile(io.BytesIO(response.content)) as archive:
        assert archive.testzip() is None
        assert archive.namelist() == ["same.csv", "same (2).csv"]
        for name, job_id in zip(archive.namelist(), ids, strict=True):
            assert archive.read(name) == (tmp_path / f"{job_id}.txt").read_bytes()
    assert set(marks) == set(ids)
    assert_problem(not_mine, 404, "job-not-found")
    assert_problem(tampered, 403, "download-refused")


async def test_a_zip_of_large_files_streams_in_bounded_memory(tmp_path: Path) -> None:
    """Two 64 MiB files (sparse: no disk is used) through the zip while tracemalloc
    watches: the peak held is a few chunks, not the files."""
    size = 64 * 1024 * 1024
    async with centre(tmp_path) as c:
        tickets = [await c.submit("/make") for _ in range(2)]
        ids = [t.split(":")[0] for t in tickets]
        for job_id in ids:
            path = tmp_path / f"big-{job_id}"
            with path.open("wb") as f:
                f.truncate(size)
            c.files.files[job_id] = dataclasses.replace(
                c.files.files[job_id], path=path, name=f"{job_id}.bin", size=size
            )
        headers = {"X-Job-Tickets": ",".join(tickets)}
        href = (await c.client.post("/jobs/downloads", json={"ids": ids}, headers=headers)).json()[
            "href"
        ]
        saved = tmp_path / "all.zip"
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            async with c.client.stream("GET", href) as response:
                assert response.status_code == 200
                with saved.open("wb") as out:
                    async for chunk in response.aiter_raw():
                        out.write(chunk)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 8 * 1024 * 1024, peak
    with zipfile.ZipFile(saved) as archive:
        infos = archive.infolist()
        assert [i.file_size for i in infos] == [size, size]
        with archive.open(infos[1]) as member:
            assert member.read(1024) == b"\0" * 1024


async def test_jobs_a_shared_store_keeps_are_listed_after_a_restart(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """On the Redis store a restart forgets nothing: the listing after it has every job,
    those without a route's file record too."""
    prefix = f"d{secrets.token_hex(6)}"
    async with centre(tmp_path, RedisJobStore(redis_server.url, prefix=prefix)) as first:
        made = await first.submit("/make")
        plain = await first.submit("/plain")
        before = await first.entries([made, plain])
    # Another process on the same Redis, with none of the first one's memory.
    async with centre(tmp_path, RedisJobStore(redis_server.url, prefix=prefix)) as second:
        after = await second.entries([made, plain])
    assert [e["id"] for e in before["jobs"]] == [e["id"] for e in after["jobs"]]
    assert [e["state"] for e in after["jobs"]] == ["done", "done"]
    assert after["missing"] == []
