"""Degradation through a served gateway, over real sockets with a real client: a route whose
``all_of`` has an optional branch on a service held at its limit answers at once, without
that branch, and says so (``Pipework-Degraded``, the job's document, the metrics)."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import trio
from quart import Response
from quart_trio import QuartTrio

from pipework import Gateway
from pipework.container import BoundAddress, serve

HANG_GUARD = 60.0


class Recommender:
    """The backend: a catalog that answers at once, and a recommender whose ``/recs/hold``
    holds its caller until ``release`` is set."""

    def __init__(self) -> None:
        self.holding = trio.Event()
        self.release = trio.Event()
        self.asked: list[str] = []

    def app(self) -> QuartTrio:
        app = QuartTrio("backend")

        @app.route("/products/<sku>")
        async def product(sku: str) -> dict[str, str]:
            return {"sku": sku, "name": "lamp"}

        @app.route("/recs/hold")
        async def hold() -> dict[str, bool]:
            self.holding.set()
            await self.release.wait()
            return {"held": True}

        @app.route("/recs/<sku>")
        async def recs(sku: str) -> Response:
            self.asked.append(sku)
            return Response('["shade"]', content_type="application/json")

        return app


def gateway_file(backend: str) -> str:
    return f"""
[services.catalog]
base_url = "{backend}"
timeout = 5

[services.recommender]
base_url = "{backend}"
timeout = 5
limit = 1

[pipes.product]
service = "catalog"
path = "/products/{{sku}}"

[pipes.recommend]
service = "recommender"
path = "/recs/{{sku}}"
optional = true

[pipes.hold]
service = "recommender"
path = "/recs/hold"

[routes.hold]
method = "GET"
path = "/hold"
chain = ["hold"]

[routes.page]
method = "GET"
path = "/page/{{sku}}"
mode = "auto"
chain = [{{ all_of = ["product", "recommend"] }}]
"""


@asynccontextmanager
async def served(path: Path) -> AsyncIterator[httpx.AsyncClient]:
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        address: BoundAddress = await nursery.start(
            functools.partial(Gateway(str(path)).run, port=0, stop=stop)
        )
        async with httpx.AsyncClient(base_url=address.url) as client:
            yield client
        stop.set()


@asynccontextmanager
async def backend(recommender: Recommender) -> AsyncIterator[BoundAddress]:
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        address: BoundAddress = await nursery.start(
            functools.partial(serve, recommender.app(), port=0, shutdown_trigger=stop)
        )
        yield address
        stop.set()


async def followed_to_its_end(client: httpx.AsyncClient, job: str, token: dict[str, str]) -> None:
    """Follow the job's events: the stream ends after its final state."""
    async with client.stream("GET", f"{job}/events", headers=token) as events:
        assert events.status_code == 200
        async for _ in events.aiter_lines():
            pass


async def test_a_saturated_services_optional_branch_is_done_without_and_the_answer_says_so(
    tmp_path: Path,
) -> None:
    recommender = Recommender()
    path = tmp_path / "gateway.toml"
    with trio.fail_after(HANG_GUARD):
        async with backend(recommender) as address, trio.open_nursery() as nursery:
            path.write_text(gateway_file(address.url))
            async with served(path) as client:
                held: list[httpx.Response] = []
                answered = trio.Event()

                async def hold() -> None:
                    held.append(await client.get("/hold"))
                    answered.set()

                nursery.start_soon(hold)
                await recommender.holding.wait()  # the recommender's one slot is taken

                degraded = await client.get("/page/7")
                assert degraded.status_code == 200, degraded.text
                assert degraded.headers["Pipework-Degraded"] == "recommend;reason=no_slot"
                assert degraded.json() == {
                    "sku": "7",
                    "product": {"sku": "7", "name": "lamp"},
                    "degraded": {"recommend": "no_slot"},
                }
                assert recommender.asked == []

                later = await client.get("/page/8", headers={"Prefer": "respond-async"})
                assert later.status_code == 202, later.text
                job = later.headers["Location"]
                token = {"X-Job-Token": later.headers["X-Job-Token"]}
                await followed_to_its_end(client, job, token)
                document = (await client.get(job, headers=token)).json()
                assert document["status"] == "done"
                assert document["degraded"] == {"recommend": "no_slot"}

                recommender.release.set()
                await answered.wait()
                assert held[0].status_code == 200

                served_in_full = await client.get("/page/9")
                assert served_in_full.status_code == 200
                assert "Pipework-Degraded" not in served_in_full.headers
                assert served_in_full.json()["recommend"] == ["shade"]
                assert recommender.asked == ["9"]

                metrics = (await client.get("/metrics")).text
    counted = 'pipework_degraded_total{pipe="recommend",reason="no_slot",route="page"} 2.0'
    assert counted in metrics


def breaker_file(backend: str) -> str:
    return f"""
[services.catalog]
base_url = "{backend}"
timeout = 5

[services.flaky]
base_url = "{backend}"
timeout = 5

[services.flaky.breaker]
minimum_calls = 2
failure_percent = 50
window = 600
wait = 600

[pipes.product]
service = "catalog"
path = "/products/{{sku}}"

[pipes.recommend]
service = "flaky"
path = "/flaky/{{sku}}"
optional = true

[routes.page]
method = "GET"
path = "/page/{{sku}}"
chain = [{{ all_of = ["product", "recommend"] }}]
"""


async def test_an_optional_pipe_whose_service_breaker_is_open_is_not_even_tried(
    tmp_path: Path,
) -> None:
    asked: list[str] = []
    app = QuartTrio("flaky")

    @app.route("/products/<sku>")
    async def product(sku: str) -> dict[str, str]:
        return {"sku": sku, "name": "lamp"}

    @app.route("/flaky/<sku>")
    async def flaky(sku: str) -> Response:
        asked.append(sku)
        return Response("down", status=503)

    path = tmp_path / "gateway.toml"
    stop = trio.Event()
    with trio.fail_after(HANG_GUARD):
        async with trio.open_nursery() as nursery:
            address: BoundAddress = await nursery.start(
                functools.partial(serve, app, port=0, shutdown_trigger=stop)
            )
            path.write_text(breaker_file(address.url))
            async with served(path) as client:
                # Two failed calls: the page still answers, the pipe degraded for its error;
                # and the breaker opens (two calls, all failed).
                for sku in ("1", "2"):
                    failed = await client.get(f"/page/{sku}")
                    assert failed.status_code == 200, failed.text
                    assert failed.headers["Pipework-Degraded"] == "recommend;reason=error"
                assert asked == ["1", "2"]
                # Now the service refuses: the pipe is degraded before any call is made.
                refused = await client.get("/page/3")
                assert refused.status_code == 200, refused.text
                assert refused.headers["Pipework-Degraded"] == "recommend;reason=refused"
                assert refused.json()["degraded"] == {"recommend": "refused"}
                assert asked == ["1", "2"]
            stop.set()


def branch_file(backend: str) -> str:
    """A route whose ``all_of`` has a branch of two calls to the recommender, with a
    fallback as a whole."""
    return f"""
[services.catalog]
base_url = "{backend}"
timeout = 5

[services.recommender]
base_url = "{backend}"
timeout = 5
limit = 1

[pipes.product]
service = "catalog"
path = "/products/{{sku}}"

[pipes.recommend]
service = "recommender"
path = "/recs/{{sku}}"

[pipes.more]
service = "recommender"
path = "/recs/more-{{sku}}"

[pipes.hold]
service = "recommender"
path = "/recs/hold"

[routes.hold]
method = "GET"
path = "/hold"
chain = ["hold"]

[routes.page]
method = "GET"
path = "/page/{{sku}}"
chain = [{{ all_of = [
  "product",
  {{ serial = ["recommend", "more"], name = "recs", fallback = {{ recs_hidden = true }} }},
] }}]
"""


async def test_a_saturated_services_branch_of_two_calls_is_answered_by_its_fallback(
    tmp_path: Path,
) -> None:
    recommender = Recommender()
    path = tmp_path / "gateway.toml"
    with trio.fail_after(HANG_GUARD):
        async with backend(recommender) as address, trio.open_nursery() as nursery:
            path.write_text(branch_file(address.url))
            async with served(path) as client:
                held: list[httpx.Response] = []
                answered = trio.Event()

                async def hold() -> None:
                    held.append(await client.get("/hold"))
                    answered.set()

                nursery.start_soon(hold)
                await recommender.holding.wait()  # the recommender's one slot is taken

                degraded = await client.get("/page/7")
                assert degraded.status_code == 200, degraded.text
                assert degraded.headers["Pipework-Degraded"] == "recs;reason=no_slot"
                assert degraded.json() == {
                    "sku": "7",
                    "product": {"sku": "7", "name": "lamp"},
                    "recs_hidden": True,
                    "degraded": {"recs": "no_slot"},
                }
                assert recommender.asked == []

                recommender.release.set()
                await answered.wait()
                assert held[0].status_code == 200

                served_in_full = await client.get("/page/9")
                assert served_in_full.status_code == 200
                assert "Pipework-Degraded" not in served_in_full.headers
                assert served_in_full.json()["more"] == ["shade"]
                assert recommender.asked == ["9", "more-9"]

                metrics = (await client.get("/metrics")).text
    assert 'pipework_degraded_total{pipe="recs",reason="no_slot",route="page"} 1.0' in metrics
