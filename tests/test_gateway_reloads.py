"""Reloads leak nothing: a replaced plan is retired once its last job ends, and a gateway
then closes that plan's HTTP clients (counted as open connections at a real backend)."""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import h11
import httpx
import trio
import trio.testing

import pipework as pw
from pipework import Gateway
from pipework.container import BoundAddress

from .test_gateway import TOKEN, gateway_file

HANG_GUARD = 20.0


class CountingBackend:
    """An HTTP/1.1 backend on a bare trio socket that counts its open connections and
    answers every request with a small JSON body (keep-alive, as httpx expects)."""

    def __init__(self) -> None:
        self.open = 0
        self.accepted = 0

    async def handle(self, stream: trio.SocketStream) -> None:
        self.open += 1
        self.accepted += 1
        conn = h11.Connection(our_role=h11.SERVER)
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some()
                    if not data:
                        return
                    conn.receive_data(data)
                elif isinstance(event, h11.Request):
                    user = event.target.decode().rsplit("/", 1)[-1]
                    body = json.dumps({"id": user}).encode()
                    headers = [
                        ("Content-Type", "application/json"),
                        ("Content-Length", str(len(body))),
                    ]
                    out = conn.send(h11.Response(status_code=200, headers=headers))
                    out += conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
                    await stream.send_all(out)
                elif isinstance(event, h11.EndOfMessage):
                    conn.start_next_cycle()
                else:
                    return
        except (trio.BrokenResourceError, h11.RemoteProtocolError):
            return
        finally:
            self.open -= 1
            await stream.aclose()


@asynccontextmanager
async def counting_backend() -> AsyncIterator[tuple[CountingBackend, str]]:
    backend = CountingBackend()
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, backend.handle, 0, host="127.0.0.1")
        )
        port = listeners[0].socket.getsockname()[1]
        try:
            yield backend, f"http://127.0.0.1:{port}"
        finally:
            nursery.cancel_scope.cancel()


async def test_reloads_close_the_replaced_plans_http_clients(tmp_path: Path) -> None:
    reloads = 12
    with trio.fail_after(HANG_GUARD):
        async with counting_backend() as (backend, url):
            path = tmp_path / "gateway.toml"
            path.write_text(gateway_file(url))
            gateway = Gateway(str(path))
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                address: BoundAddress = await nursery.start(
                    functools.partial(gateway.run, port=0, stop=stop)
                )
                auth = {"Authorization": f"Bearer {TOKEN}"}
                async with httpx.AsyncClient(base_url=address.url) as client:
                    for n in range(reloads):
                        answer = await client.get(f"/users/{n}")
                        assert answer.json() == {"id": str(n)}, answer.text
                        reloaded = await client.post("/admin/reload", headers=auth)
                        assert reloaded.status_code == 200, reloaded.text
                    assert (await client.get("/users/last")).json() == {"id": "last"}
                    # Each plan opened a connection of its own; the replaced ones are closed.
                    await trio.testing.wait_all_tasks_blocked(cushion=0.1)
                    assert backend.open == 1
                    assert backend.accepted >= reloads
                    assert gateway.engine is not None
                    assert len(gateway.engine._dispatcher.plans) == 2  # plan 0 and the current
                stop.set()
    assert backend.open == 0


async def test_a_replaced_plan_retires_when_its_last_job_ends() -> None:
    release = trio.Event()
    engine = pw.Engine(registry=pw.Registry())

    @engine.pipe
    async def hold(ctx: pw.Context) -> None:
        await release.wait()

    engine.chain("hold", hold)
    async with engine:
        job = await engine.submit("hold")
        await trio.testing.wait_all_tasks_blocked()
        assert engine.swap_registry(pw.Registry()) == 2
        retired = trio.Event()

        async def watch() -> None:
            await engine.wait_plan_retired(1)
            retired.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            await trio.testing.wait_all_tasks_blocked()
            assert not retired.is_set()  # its job still runs on it
            release.set()
            await engine.wait(job)
        assert retired.is_set()
        engine.swap_registry(pw.Registry())  # plan 2 had no jobs: retired at once
        await engine.wait_plan_retired(2)
        assert sorted(engine._dispatcher.plans) == [0, 3]
