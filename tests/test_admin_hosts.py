"""The admin API's hand on the backend hosts: list them, drain one, restore it -- for HTTP
pipes and proxy routes, through a gateway served from its file on a real socket, with a
real client, in front of several real trio HTTP servers (one per host). Real time (the
gateway reads its file in a thread): every wait is on a condition, bounded by the guard."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing

import pipework as pw
from pipework import Gateway
from pipework.container import BoundAddress, ContainerConfig

from .test_backend_pool import RawBackend, Seen, echo
from .test_container_harness import SECRET, assert_problem, bearer, serving
from .test_gateway import TOKEN, gateway_file
from .test_proxy_resilience import proxying
from .test_resilience_io import hosts

HANG_GUARD = 30.0
AUTH = bearer(TOKEN)


async def held_when_slow(backend: RawBackend, seen: Seen, index: int) -> tuple[bytes, bool] | None:
    """Echo, but hold a call to a path ending in ``/slow`` until the backend's ``release``."""
    if seen.target.endswith("/slow"):
        await backend.release.wait()
    return await echo(backend, seen, index)


def address(url: str) -> str:
    return url.removeprefix("http://")


def calls(backend: RawBackend) -> int:
    return len(backend.seen)


async def until(condition: Callable[[], bool]) -> None:
    """Wait for ``condition``; the test's guard bounds it."""
    while not condition():  # noqa: ASYNC110 - the servers have no event to wait on
        await trio.sleep(0.01)


def file_for(urls: list[str], extra: str = "") -> str:
    """The test gateway's file: route ``GET /users/{id}`` calls service ``users`` over
    ``urls``, round robin (so which host takes a call is known), with time to hold one."""
    text = gateway_file(urls[0]).replace(
        f'base_url = "{urls[0]}"',
        "hosts = [" + ", ".join(f'"{u}"' for u in urls) + ']\nbalance = "round_robin"',
    )
    return text.replace("timeout = 2\n", "timeout = 20\n") + extra


@dataclass
class Running:
    gateway: Gateway
    http: httpx.AsyncClient
    path: Path

    async def admin(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return await self.http.request(method, path, headers=AUTH, **kwargs)

    async def services(self) -> dict[str, Any]:
        answer = await self.admin("GET", "/admin/services")
        assert answer.status_code == 200, answer.text
        found: dict[str, Any] = answer.json()["services"]
        return found

    async def host(self, service: str, url: str) -> dict[str, Any]:
        hosts: list[dict[str, Any]] = (await self.services())[service]["hosts"]
        (host,) = [h for h in hosts if h["url"] == url]
        return host


@asynccontextmanager
async def running(tmp_path: Path, text: str) -> AsyncIterator[Running]:
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    gateway = Gateway(str(path))
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        address: BoundAddress = await nursery.start(
            functools.partial(gateway.run, port=0, stop=stop)
        )
        try:
            async with httpx.AsyncClient(base_url=address.url, timeout=HANG_GUARD) as http:
                yield Running(gateway, http, path)
        finally:
            stop.set()


async def test_a_drained_host_takes_no_new_call_and_finishes_the_one_it_has(
    tmp_path: Path,
) -> None:
    with trio.fail_after(HANG_GUARD):
        async with hosts(held_when_slow, echo, echo) as found:
            backends = [b for b, _ in found]
            urls = [u for _, u in found]
            async with running(tmp_path, file_for(urls)) as gw, trio.open_nursery() as nursery:
                listed = await gw.services()
                assert [h["host"] for h in listed["users"]["hosts"]] == [address(u) for u in urls]
                assert {h["state"] for h in listed["users"]["hosts"]} == {"available"}
                assert listed["users"]["balance"] == "round_robin"
                assert listed["users"]["breaker"]["state"] == "closed"

                slow: list[httpx.Response] = []

                async def call_slow() -> None:
                    slow.append(await gw.http.get("/users/slow"))

                nursery.start_soon(call_slow)  # round robin: the first call goes to host 0
                await until(lambda: calls(backends[0]) == 1)

                drained = await gw.admin(
                    "POST", f"/admin/services/users/hosts/{address(urls[0])}/drain"
                )
                assert drained.status_code == 200, drained.text
                body = drained.json()
                assert body["changed"] is True
                assert body["host"]["state"] == "draining"
                assert body["host"]["outstanding"] == 1  # the call in flight goes on
                assert body["available"] == 2

                before = [calls(b) for b in backends]
                for n in range(6):
                    answer = await gw.http.get(f"/users/{n}")
                    assert answer.status_code == 200, answer.text
                after = [calls(b) for b in backends]
                assert after[0] == before[0]  # nothing new went to the drained host
                assert after[1] - before[1] == after[2] - before[2] == 3

                again = await gw.admin(
                    "POST", f"/admin/services/users/hosts/{address(urls[0])}/drain"
                )
                assert again.status_code == 200
                assert again.json()["changed"] is False

                backends[0].release.set()
                await until(lambda: bool(slow))
                assert slow[0].status_code == 200, slow[0].text  # it finished on its host
                host = await gw.host("users", urls[0])
                assert (host["state"], host["outstanding"]) == ("draining", 0)

                restored = await gw.admin(
                    "POST", f"/admin/services/users/hosts/{address(urls[0])}/restore"
                )
                assert restored.status_code == 200, restored.text
                assert restored.json()["changed"] is True
                assert restored.json()["host"]["state"] == "available"
                before = [calls(b) for b in backends]
                for n in range(3):
                    assert (await gw.http.get(f"/users/{n}")).status_code == 200
                assert [calls(b) - n for b, n in zip(backends, before, strict=True)] == [1, 1, 1]


async def test_a_drained_host_takes_no_new_proxied_request_and_relays_the_one_it_has(
    tmp_path: Path,
) -> None:
    with trio.fail_after(HANG_GUARD):
        async with hosts(held_when_slow, echo) as found:
            backends = [b for b, _ in found]
            urls = [u for _, u in found]
            async with proxying(tmp_path, urls) as (_, http, _), trio.open_nursery() as nursery:
                auth = bearer("proxy-admin")
                slow: list[httpx.Response] = []

                async def call_slow() -> None:
                    slow.append(await http.get("/api/slow"))

                nursery.start_soon(call_slow)  # round robin: the first request goes to host 0
                await until(lambda: calls(backends[0]) == 1)
                path = f"/admin/services/api/hosts/{address(urls[0])}/drain"
                drained = await http.post(path, headers=auth)
                assert drained.status_code == 200, drained.text
                assert drained.json()["host"]["outstanding"] == 1
                for n in range(4):
                    answer = await http.get(f"/api/{n}")
                    assert answer.status_code == 200, answer.text
                assert [calls(b) for b in backends] == [1, 4]
                backends[0].release.set()
                await until(lambda: bool(slow))
                assert slow[0].status_code == 200, slow[0].text
                listed = (await http.get("/admin/services/api", headers=auth)).json()
                assert [(h["state"], h["outstanding"]) for h in listed["hosts"]] == [
                    ("draining", 0),
                    ("available", 0),
                ]


async def test_a_drain_lasts_across_a_reload_that_keeps_the_host(tmp_path: Path) -> None:
    with trio.fail_after(HANG_GUARD):
        async with hosts(echo, echo, echo) as found:
            backends = [b for b, _ in found]
            urls = [u for _, u in found]
            async with running(tmp_path, file_for(urls[:2])) as gw:
                path = f"/admin/services/users/hosts/{address(urls[1])}/drain"
                assert (await gw.admin("POST", path)).status_code == 200
                # The file gains a host: the one drained stays so, the new one serves.
                gw.path.write_text(file_for(urls))
                reloaded = await gw.admin("POST", "/admin/reload")
                assert reloaded.status_code == 200, reloaded.text
                states = [h["state"] for h in (await gw.services())["users"]["hosts"]]
                assert states == ["available", "draining", "available"]
                for n in range(4):
                    assert (await gw.http.get(f"/users/{n}")).status_code == 200
                assert [calls(b) for b in backends] == [2, 0, 2]
                # The admin API drives the new plan's hosts: restoring reaches the calls.
                restore = f"/admin/services/users/hosts/{address(urls[1])}/restore"
                assert (await gw.admin("POST", restore)).json()["changed"] is True
                for n in range(3):
                    assert (await gw.http.get(f"/users/{n}")).status_code == 200
                assert calls(backends[1]) == 1


async def test_with_every_host_drained_calls_are_refused_until_one_is_restored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "pipework.backends")
    with trio.fail_after(HANG_GUARD):
        async with hosts(echo, echo) as found:
            urls = [u for _, u in found]
            async with running(tmp_path, file_for(urls)) as gw:
                for url in urls:
                    path = f"/admin/services/users/hosts/{address(url)}/drain"
                    assert (await gw.admin("POST", path)).status_code == 200
                refused = await gw.http.get("/users/1")
                problem = assert_problem(refused, 503, "overloaded")
                assert problem["reason"] == "no_host"
                assert refused.headers["retry-after"] == "30"
                one = await gw.admin("GET", "/admin/services/users")
                assert one.status_code == 200
                assert (one.json()["service"], one.json()["available"]) == ("users", 0)
                path = f"/admin/services/users/hosts/{address(urls[0])}/restore"
                assert (await gw.admin("POST", path)).status_code == 200
                assert (await gw.http.get("/users/1")).status_code == 200
            assert [len(b.seen) for b, _ in found] == [1, 0]
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "pipework.backends"]
    assert (logging.INFO, f"service 'users': host {urls[0]} drained; 0 tries out finish") in said
    assert (
        logging.WARNING,
        "service 'users': every host is drained; its calls are refused until one is restored",
    ) in said
    assert (logging.INFO, f"service 'users': host {urls[0]} restored") in said


async def test_hosts_answers_need_the_token_and_name_what_is_unknown(tmp_path: Path) -> None:
    # An https:// service goes through its core as an http:// one: its host drains.
    extra = '\n[services.vault]\nbase_url = "https://vault.invalid"\n'
    with trio.fail_after(HANG_GUARD):
        async with hosts(echo, echo) as found:
            urls = [u for _, u in found]
            async with running(tmp_path, file_for(urls, extra)) as gw:
                base = "/admin/services/users/hosts"
                drain = f"{base}/{address(urls[0])}/drain"
                assert_problem(await gw.http.get("/admin/services"), 401, "admin-unauthorized")
                assert_problem(await gw.http.post(drain), 401, "admin-unauthorized")
                wrong = await gw.http.post(drain, headers=bearer("nope"))
                assert_problem(wrong, 401, "admin-unauthorized")

                listed = await gw.services()
                assert listed["vault"]["balanced"] is True
                assert [h["url"] for h in listed["vault"]["hosts"]] == ["https://vault.invalid"]
                unknown = await gw.admin(
                    "POST", f"/admin/services/user/hosts/{address(urls[0])}/drain"
                )
                problem = assert_problem(unknown, 404, "admin-unknown-service")
                assert "did you mean 'users'" in problem["detail"]
                assert_problem(
                    await gw.admin("GET", "/admin/services/nope"), 404, "admin-unknown-service"
                )

                port = address(urls[0]).rsplit(":", 1)[1]
                typo = await gw.admin("POST", f"{base}/127.0.0.2:{port}/drain")
                problem = assert_problem(typo, 404, "admin-unknown-host")
                for url in urls:
                    assert address(url) in problem["detail"]  # the hosts it has

                vault = await gw.admin("POST", "/admin/services/vault/hosts/vault.invalid/drain")
                assert vault.status_code == 200, vault.text
                assert (await gw.admin("GET", drain)).status_code == 404  # a drain is a POST
                # Nothing was drained by any of these.
                assert {h["state"] for h in (await gw.services())["users"]["hosts"]} == {
                    "available"
                }


async def test_a_container_without_backends_has_no_services(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = pw.Engine()
    config = ContainerConfig(callback_secret=SECRET, shutdown_grace=1.0, admin_token=TOKEN)
    with trio.fail_after(HANG_GUARD):
        async with serving(engine, config=config) as served:
            listed = await served.client.get("/admin/services", headers=AUTH)
            drain = await served.client.post("/admin/services/users/hosts/a:1/drain", headers=AUTH)
    assert listed.status_code == 200
    assert listed.json() == {"services": {}}
    problem = assert_problem(drain, 404, "admin-unknown-service")
    assert "declared: none" in problem["detail"]
