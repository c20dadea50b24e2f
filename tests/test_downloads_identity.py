"""The download centre by identity, over real HTTP, on every job store: with ``jobs_auth``
``GET /jobs`` lists the jobs the caller's identity started on authenticated async routes
(their owner recorded and indexed by the store), with the tickets it sends besides; another
identity's job is never listed nor downloadable; a request without the credential is a 401.
The owner index is bounded by the store's retention (virtual time), and a ``pipework serve``
on Redis lists an identity's jobs again after a restart."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

import pipework as pw
from examples.export.data import make_orders
from examples.export.exporter import CHAIN as EXPORT_CHAIN
from examples.export.exporter import ExportConfig, Exporter
from pipework._http._auth import ApiKey, ApiKeys, RouteAuth
from pipework.container import BoundAddress, Container, ContainerConfig
from pipework.container._routes import Route
from pipework.redis import RedisJobStore

from ._redis import RedisServer
from .test_board_http import SseReader
from .test_container_harness import HANG_GUARD, SECRET, assert_problem
from .test_downloads import Files
from .test_serve_workers import serving

KEYS = {name: secrets.token_urlsafe(24) for name in ("alice", "bob", "zoë")}
AUTH = RouteAuth(
    (
        ApiKeys(
            "team",
            tuple(ApiKey(n, hashlib.sha256(k.encode()).digest()) for n, k in KEYS.items()),
        ),
    )
)


def key(name: str) -> dict[str, str]:
    return {"X-API-Key": KEYS[name]}


@dataclass
class Centre:
    client: httpx.AsyncClient
    engine: pw.Engine
    files: HeldFiles

    async def submit(self, path: str, who: str | None, body: dict[str, Any] | None = None) -> str:
        headers = {} if who is None else key(who)
        answer = await self.client.post(path, json=body or {}, headers=headers)
        assert answer.status_code == 202, answer.text
        job_id: str = answer.json()["id"]
        await self.engine.wait(job_id)
        return f"{job_id}:{answer.json()['token']}"

    async def listing(
        self, who: str | None, tickets: tuple[str, ...] = (), params: dict[str, str] | None = None
    ) -> httpx.Response:
        headers = {} if who is None else key(who)
        if tickets:
            headers["X-Job-Tickets"] = ",".join(tickets)
        return await self.client.get("/jobs", params=params, headers=headers)

    async def ids(
        self, who: str | None, tickets: tuple[str, ...] = (), params: dict[str, str] | None = None
    ) -> list[str]:
        answer = await self.listing(who, tickets, params)
        assert answer.status_code == 200, answer.text
        return [entry["id"] for entry in answer.json()["jobs"]]


class HeldFiles(Files):
    """The test's file records, and what holds the ``hold`` route's jobs."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.held = trio.Event()


def make_engine(files: HeldFiles, store: Any) -> pw.Engine:
    registry = pw.Registry()
    engine = pw.Engine(registry=registry, store=store)

    @engine.pipe
    async def make(ctx: pw.Context) -> None:
        job = await engine.store.get(ctx.job_id)
        path = files.directory / f"{ctx.job_id}.txt"
        path.write_bytes(f"file of {ctx.job_id}\n".encode())
        files.files[ctx.job_id] = pw.ResultFile(
            job_id=ctx.job_id,
            name=ctx.state.get("name", "report.txt"),
            owner=job.token_hash,
            state="done",
            path=path,
            chain=ctx.chain,
            media_type="text/plain",
            size=path.stat().st_size,
            created=job.created_at,
            finished=time.time(),
            identity=job.owner,
        )

    @engine.pipe
    async def plain(ctx: pw.Context) -> None:
        ctx.state["answer"] = 42

    @engine.pipe
    async def hold(ctx: pw.Context) -> None:
        await ctx.progress(1, 2, "held")
        await files.held.wait()

    engine.chain("make", make)
    engine.chain("plain", plain)
    engine.chain("hold", hold)
    for name, auth in (("make", AUTH), ("plain", AUTH), ("hold", AUTH), ("open", None)):
        chain = "plain" if name == "open" else name
        registry.add_route(Route(name, "POST", f"/{name}", chain, "async", auth=auth))
    return engine


@contextlib.asynccontextmanager
async def centre(tmp_path: Path, store: Any, *, jobs_auth: bool = True) -> AsyncIterator[Centre]:
    files = HeldFiles(tmp_path)
    engine = make_engine(files, store)
    stop = trio.Event()
    config = ContainerConfig(
        callback_secret=SECRET, shutdown_grace=0.5, jobs_auth=AUTH if jobs_auth else None
    )
    async with engine:
        container = Container(engine, None, config)
        container.add_file_results(files)
        async with trio.open_nursery() as nursery:
            address: BoundAddress = await nursery.start(
                functools.partial(container.serve, shutdown_trigger=stop)
            )
            try:
                async with httpx.AsyncClient(base_url=address.url, timeout=HANG_GUARD) as client:
                    yield Centre(client, engine, files)
            finally:
                files.held.set()
                stop.set()


async def test_each_identity_lists_and_downloads_only_its_own_jobs(
    tmp_path: Path, each_store: type[Any]
) -> None:
    async with centre(tmp_path, each_store()) as c:
        alice = [await c.submit("/make", "alice", {"name": f"a{i}.txt"}) for i in range(2)]
        alice.append(await c.submit("/plain", "alice"))
        bob = await c.submit("/make", "bob", {"name": "b.txt"})
        anonymous = await c.submit("/open", None)
        listed = {who: await c.ids(who) for who in ("alice", "bob")}
        answer = await c.listing("alice")
        body = answer.json()
        # Alice's file, by the listing's signed link, by her credential, and in a zip.
        made = body["jobs"][1]
        assert made["file"]["name"] == "a1.txt"
        by_link = await c.client.get(made["file"]["href"])
        by_key = await c.client.get(f"/jobs/{made['id']}/file", headers=key("alice"))
        zipped = await c.client.post(
            "/jobs/downloads",
            json={"ids": [t.split(":")[0] for t in alice[:2]]},
            headers=key("alice"),
        )
        # Bob's job is not Alice's: not listed, not downloadable, not zipped.
        bob_id = bob.split(":")[0]
        refused = await c.client.get(f"/jobs/{bob_id}/file", headers=key("alice"))
        not_zipped = await c.client.post(
            "/jobs/downloads", json={"ids": [bob_id]}, headers=key("alice")
        )
        # A ticket is listed beside the identity's jobs: Bob holding the anonymous job's.
        with_ticket = await c.ids("bob", (anonymous,))
    assert listed["alice"] == [t.split(":")[0] for t in reversed(alice)]
    assert listed["bob"] == [bob_id]
    assert body["missing"] == []
    assert body["more"] is False
    assert [e["state"] for e in body["jobs"]] == ["done", "done", "done"]
    assert body["jobs"][0]["file"] is None  # the plain job makes no file
    assert by_link.status_code == 200
    assert by_link.content == f"file of {made['id']}\n".encode()
    assert by_key.status_code == 200
    assert by_key.content == by_link.content
    assert zipped.status_code == 200, zipped.text
    assert zipped.json()["href"].startswith("/jobs/files.zip?ids=")
    assert_problem(refused, 404, "job-not-found")
    assert_problem(not_zipped, 404, "job-not-found")
    assert with_ticket == [anonymous.split(":")[0], bob_id]


async def test_a_subject_beyond_ascii_lists_and_downloads_its_jobs(
    tmp_path: Path, each_store: type[Any]
) -> None:
    """A key's name (a JWT's ``sub``) may be any text: ``team:zoë`` owns her jobs."""
    async with centre(tmp_path, each_store()) as c:
        ticket = await c.submit("/make", "zoë")
        job_id = ticket.split(":")[0]
        listed = await c.ids("zoë")
        by_key = await c.client.get(f"/jobs/{job_id}/file", headers=key("zoë"))
        others = await c.ids("alice")
    assert listed == [job_id]
    assert by_key.status_code == 200, by_key.text
    assert others == []


async def test_without_the_credential_the_listing_is_a_401(
    tmp_path: Path, each_store: type[Any]
) -> None:
    async with centre(tmp_path, each_store()) as c:
        ticket = await c.submit("/make", "alice")
        job_id = ticket.split(":")[0]
        bare = await c.listing(None, (ticket,))
        wrong = await c.client.get("/jobs", headers={"X-API-Key": "not-a-key"})
        batch = await c.client.post("/jobs/downloads", json={"ids": [job_id]})
        file = await c.client.get(f"/jobs/{job_id}/file")
        events = await c.client.get("/jobs/events", headers={"X-Job-Tickets": ticket})
        # The job's own token and a signed link need no credential.
        token = ticket.split(":")[1]
        by_token = await c.client.get(f"/jobs/{job_id}/file", headers={"X-Job-Token": token})
    for answer in (bare, batch, file, events):
        body = assert_problem(answer, 401, "unauthorized")
        assert "an API key in x-api-key" in body["detail"]
        assert answer.headers["WWW-Authenticate"].startswith("ApiKey ")
    assert_problem(wrong, 401, "unauthorized")
    assert 'error="invalid_token"' in wrong.headers["WWW-Authenticate"]
    assert by_token.status_code == 200


async def test_without_jobs_auth_the_listing_is_by_tickets_alone(
    tmp_path: Path, each_store: type[Any]
) -> None:
    async with centre(tmp_path, each_store(), jobs_auth=False) as c:
        ticket = await c.submit("/make", "alice")
        other = await c.submit("/make", "alice")
        by_key = await c.listing("alice")
        by_ticket = await c.listing(None, (ticket,))
    assert by_key.json() == {"jobs": [], "missing": []}
    assert [e["id"] for e in by_ticket.json()["jobs"]] == [ticket.split(":")[0]]
    assert other.split(":")[0] not in by_ticket.text


async def test_the_filters_apply_to_an_identitys_jobs(
    tmp_path: Path, each_store: type[Any]
) -> None:
    async with centre(tmp_path, each_store()) as c:
        orders = (await c.submit("/make", "alice", {"name": "orders.csv"})).split(":")[0]
        invoices = (await c.submit("/make", "alice", {"name": "invoices.csv"})).split(":")[0]
        plain = (await c.submit("/plain", "alice")).split(":")[0]
        c.files.expire(invoices)
        today = datetime.now(UTC).date()
        found = {
            name: set(await c.ids("alice", (), params))
            for name, params in {
                "name": {"q": "ORDERS"},
                "id": {"q": plain[:10]},
                "expired": {"status": "expired"},
                "done": {"status": "done"},
                "today": {"from": today.isoformat(), "to": today.isoformat()},
                "yesterday": {"to": (today - timedelta(days=1)).isoformat()},
                "after now": {"from": (datetime.now(UTC) + timedelta(hours=1)).isoformat()},
            }.items()
        }
        bad = await c.listing("alice", (), {"status": "lost"})
    assert found["name"] == {orders}
    assert plain in found["id"]
    assert found["expired"] == {invoices}
    assert found["done"] == {orders, plain}
    assert found["today"] == {orders, invoices, plain}
    assert found["yesterday"] == set()
    assert found["after now"] == set()
    assert_problem(bad, 400, "bad-filter")


async def events_until(c: Centre, who: str, job_id: str) -> set[str]:
    """The jobs ``GET /jobs/events`` with ``who``'s credential streams events of, until
    ``job_id``'s final state (read off a bare socket, event by event)."""
    url = c.client.base_url
    assert url.host
    assert url.port
    seen: set[str] = set()
    async with await trio.open_tcp_stream(url.host, url.port) as stream:
        reader = SseReader(stream)
        headers = {"Accept": "text/event-stream", **key(who)}
        response = await reader.open("/jobs/events", headers)
        assert response.status_code == 200
        while True:
            _, _, body = await reader.next()
            seen.add(body["id"])
            if body["id"] == job_id and body["data"]["status"] == "done":
                return seen


async def test_the_live_stream_follows_the_identitys_jobs(
    tmp_path: Path, each_store: type[Any]
) -> None:
    async with centre(tmp_path, each_store()) as c:
        alice = (await c.submit("/make", "alice")).split(":")[0]
        bob = (await c.submit("/make", "bob")).split(":")[0]
        alices = await events_until(c, "alice", alice)
        bobs = await events_until(c, "bob", bob)
    assert alices == {alice}
    assert bobs == {bob}


def test_jobs_auth_names_a_declared_auth() -> None:
    base = """
[auth.team]
type = "api_key"
[auth.team.keys.alice]
sha256 = "{digest}"
""".format(digest="0" * 64)
    config = pw.loads_config('[server]\njobs_auth = "team"\n' + base)
    assert config.edge.jobs_auth is not None
    assert [m.name for m in config.edge.jobs_auth.methods] == ["team"]
    assert pw.loads_config(base).edge.jobs_auth is None
    with pytest.raises(pw.ConfigError) as info:
        pw.loads_config('[server]\njobs_auth = "tema"\n' + base)
    said = [f"{p.path}: {p.message}" for p in info.value.problems if p.severity == "error"]
    assert said == ["server.jobs_auth: unknown auth 'tema'; did you mean 'team'?"]


async def test_the_owner_index_is_bounded_by_retention(
    autojump_clock: trio.abc.Clock, each_store: type[Any]
) -> None:
    """Jobs leave their owner's index with their records: beyond ``retain_count`` at once,
    past ``retain_seconds`` (virtual time) at the next read; a deleted one at once."""
    store = each_store(retain_seconds=60.0, retain_count=3)
    registry = pw.Registry()
    async with pw.Engine(registry=registry, store=store) as engine:

        @engine.pipe
        async def noop(ctx: pw.Context) -> None:
            pass

        engine.chain("noop", noop)
        ids = []
        for _ in range(5):
            job_id = await engine.submit("noop", owner="team:alice")
            await engine.wait(job_id)
            ids.append(job_id)
            await trio.sleep(1)  # their retention ends one after another, in this order
        other = await engine.submit("noop", owner="team:bob")
        await engine.wait(other)
        kept, more = await engine.owned("team:alice", limit=10)
        assert [v.id for v in kept] == [ids[4], ids[3]]  # retain_count 3: Bob's is the third
        assert more is None
        assert await index_size(store, "team:alice") == 2
        paged, older = await engine.owned("team:alice", limit=1)
        assert [v.id for v in paged] == [ids[4]]
        assert older is not None
        rest, none = await engine.owned("team:alice", limit=5, before=older)
        assert [v.id for v in rest] == [ids[3]]
        assert none is None
        await engine.store.delete(ids[4])
        assert await index_size(store, "team:alice") == 1
        await trio.sleep(61)
        assert await engine.owned("team:alice", limit=10) == ([], None)
        assert await engine.owned("team:bob", limit=10) == ([], None)
        assert await index_size(store, "team:alice") == 0
        assert await index_size(store, "team:bob") == 0


async def index_size(store: Any, owner: str) -> int:
    """How many ids the store's owner index holds for ``owner``."""
    if isinstance(store, RedisJobStore):
        (count,) = await store.pipeline([["ZCARD", f"{store.prefix}:owner:{owner}"]])
        return int(count)
    return len(store._owners.get(owner, ()))


async def note(ctx: pw.Context) -> None:
    """The serve test's pipe."""
    ctx.state["noted"] = True


@pytest.mark.hang_guard(real_seconds=150)
async def test_a_restarted_gateway_on_redis_lists_an_identitys_jobs(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """``pipework serve`` with ``[server] jobs_auth`` on the Redis store: the jobs Alice
    started are listed for her again by a new process, and never for Bob."""
    path = tmp_path / "gateway.toml"
    path.write_text(identity_file(jobs_auth=True, redis=redis_server.url))
    started: list[str] = []
    async with (
        serving(str(path)) as first,
        httpx.AsyncClient(base_url=first.url, timeout=HANG_GUARD) as client,
    ):
        for who in ("alice", "alice", "bob"):
            answer = await client.post("/note", json={}, headers=key(who))
            assert answer.status_code == 202, answer.text
            started.append(answer.json()["id"])
        before = (await client.get("/jobs", headers=key("alice"))).json()
    async with (
        serving(str(path)) as second,
        httpx.AsyncClient(base_url=second.url, timeout=HANG_GUARD) as client,
    ):
        after = (await client.get("/jobs", headers=key("alice"))).json()
        bobs = (await client.get("/jobs", headers=key("bob"))).json()
    assert {e["id"] for e in before["jobs"]} == set(started[:2])
    assert [e["id"] for e in after["jobs"]] == [started[1], started[0]]
    assert [e["id"] for e in bobs["jobs"]] == [started[2]]


@contextlib.asynccontextmanager
async def exporting(cfg: ExportConfig) -> AsyncIterator[tuple[httpx.AsyncClient, pw.Engine]]:
    """The export example on a memory job store, its exports also on an authenticated
    route (``POST /mine``), with ``jobs_auth``: each call is a fresh process's memory."""
    registry = pw.Registry()
    engine = pw.Engine(registry=registry, store=pw.MemoryJobStore())
    exporter = Exporter(engine, cfg)
    registry.add_route(Route("mine", "POST", "/mine", EXPORT_CHAIN, "async", auth=AUTH))
    stop = trio.Event()
    config = ContainerConfig(callback_secret=SECRET, shutdown_grace=1.0, jobs_auth=AUTH)
    async with trio.open_nursery() as tasks:
        await tasks.start(exporter.run)
        async with engine:
            container = Container(engine, config=config)
            exporter.add_routes(container)
            async with trio.open_nursery() as server:
                address: BoundAddress = await server.start(
                    functools.partial(container.serve, shutdown_trigger=stop)
                )
                try:
                    async with httpx.AsyncClient(base_url=address.url, timeout=30) as client:
                        yield client, engine
                finally:
                    stop.set()
        tasks.cancel_scope.cancel()


async def test_an_identitys_exports_outlive_the_memory_store(tmp_path: Path) -> None:
    """The export example's records carry the identity (``ResultFile.identity``, listed by
    its ``files_of``): a new process, its memory store empty, lists Alice's exports for her
    again, downloadable, and never for Bob."""
    source = tmp_path / "orders.sqlite3"
    make_orders(source, 50)
    cfg = ExportConfig(source=source, directory=tmp_path / "exports", batch=10, progress_every=10)
    with trio.fail_after(60):
        async with exporting(cfg) as (client, engine):
            started = []
            for who in ("alice", "alice", "bob"):
                answer = await client.post("/mine", json={}, headers=key(who))
                assert answer.status_code == 202, answer.text
                started.append(answer.json()["id"])
                await engine.wait(started[-1])  # its record is done before its job ends
        async with exporting(cfg) as (client, _):
            after = (await client.get("/jobs", headers=key("alice"))).json()
            bobs = (await client.get("/jobs", headers=key("bob"))).json()
            file = await client.get(after["jobs"][0]["file"]["href"])
            other = await client.get(f"/jobs/{started[2]}/file", headers=key("alice"))
    assert [e["id"] for e in after["jobs"]] == [started[1], started[0]]
    assert [e["state"] for e in after["jobs"]] == ["done", "done"]
    assert [e["id"] for e in bobs["jobs"]] == [started[2]]
    assert file.status_code == 200
    assert file.content == (cfg.directory / f"{started[1]}.csv").read_bytes()
    assert_problem(other, 404, "job-not-found")


def identity_file(*, jobs_auth: bool, redis: str = "") -> str:
    """A gateway file: the team's keys, an authenticated async route, ``jobs_auth`` or
    not, and the Redis store when ``redis`` names a server."""
    store = f'\n[store]\nbackend = "redis"\nurl = "{redis}"\nprefix = "o{secrets.token_hex(6)}"\n'
    return f"""
[server]
admin_token = "{ADMIN}"
{'jobs_auth = "team"' if jobs_auth else ""}
{store if redis else ""}
[auth.team]
type = "api_key"

[auth.team.keys.alice]
sha256 = "{hashlib.sha256(KEYS["alice"].encode()).hexdigest()}"

[auth.team.keys.bob]
sha256 = "{hashlib.sha256(KEYS["bob"].encode()).hexdigest()}"

[pipes.note]
python = "tests.test_downloads_identity:note"

[routes.note]
path = "/note"
mode = "async"
chain = ["note"]
auth = "team"
"""


ADMIN = "identity-admin-token"


async def test_a_reload_turns_the_listing_by_identity_on(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(identity_file(jobs_auth=False))
    gateway = pw.Gateway(str(path))
    stop = trio.Event()
    with trio.fail_after(HANG_GUARD):
        async with trio.open_nursery() as nursery:
            address: BoundAddress = await nursery.start(
                functools.partial(gateway.run, port=0, stop=stop)
            )
            async with httpx.AsyncClient(base_url=address.url) as client:
                accepted = await client.post("/note", json={}, headers=key("alice"))
                assert accepted.status_code == 202, accepted.text
                before = await client.get("/jobs", headers=key("alice"))
                path.write_text(identity_file(jobs_auth=True))
                admin = {"Authorization": f"Bearer {ADMIN}"}
                reloaded = await client.post("/admin/reload", headers=admin)
                assert reloaded.status_code == 200, reloaded.text
                bare = await client.get("/jobs")
                after = await client.get("/jobs", headers=key("alice"))
            stop.set()
    assert before.json() == {"jobs": [], "missing": []}
    assert_problem(bare, 401, "unauthorized")
    assert [e["id"] for e in after.json()["jobs"]] == [accepted.json()["id"]]


async def test_an_identity_reads_its_jobs_status_and_result_without_their_tokens(
    tmp_path: Path, each_store: type[Any]
) -> None:
    """A job the listing shows opens by the same credential, file or not; reading only:
    cancelling and signalling still take the job's token."""
    async with centre(tmp_path, each_store()) as c:
        ticket = await c.submit("/plain", "alice")
        job_id, token = ticket.split(":")
        status = await c.client.get(f"/jobs/{job_id}", headers=key("alice"))
        result = await c.client.get(f"/jobs/{job_id}/result", headers=key("alice"))
        by_bob = await c.client.get(f"/jobs/{job_id}/result", headers=key("bob"))
        bare = await c.client.get(f"/jobs/{job_id}/result")
        wrong = await c.client.get(f"/jobs/{job_id}/result", headers={"X-API-Key": "nope"})
        by_token = await c.client.get(f"/jobs/{job_id}/result", headers={"X-Job-Token": token})
        cancel = await c.client.delete(f"/jobs/{job_id}", headers=key("alice"))
        unknown = await c.client.get("/jobs/no-such-job", headers=key("alice"))
    assert status.status_code == 200, status.text
    assert status.json()["status"] == "done"
    assert result.status_code == 200, result.text
    assert result.json()["answer"] == 42
    assert_problem(by_bob, 404, "job-not-found")
    assert_problem(bare, 404, "job-not-found")  # no credential: as before, a token's 404
    assert wrong.status_code == 401, wrong.text
    assert by_token.json() == result.json()
    assert_problem(cancel, 404, "job-not-found")
    assert_problem(unknown, 404, "job-not-found")


async def test_without_jobs_auth_a_job_opens_by_its_token_alone(tmp_path: Path) -> None:
    async with centre(tmp_path, pw.MemoryJobStore(), jobs_auth=False) as c:
        job_id, _ = (await c.submit("/plain", "alice")).split(":")
        by_key = await c.client.get(f"/jobs/{job_id}/result", headers=key("alice"))
    assert_problem(by_key, 404, "job-not-found")
