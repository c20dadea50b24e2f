"""Reloads under traffic leak nothing: a gateway (in this process) serves a route that calls
a real backend (a small h11 server counting its open connections) while four clients keep
requesting, and ``POST /admin/reload`` runs 200 times (20 with ``--quick``). The baseline is
the same process just before the reloads, after a warm-up under the same traffic. Rows are
the process's RSS in **KB** and the backend's open connections after the reloads (traffic
stopped, idle connections of the current plan kept), against their levels before; the
goal is RSS within 10% and connections back at their level.

    .venv/bin/python -m benchmarks --only bench_reloads
"""

from __future__ import annotations

import functools
import gc
import json
import tempfile
from pathlib import Path
from typing import Any

import httpx
import trio

from pipework.container._server import BoundAddress
from pipework.registry._gateway import Gateway

TOKEN = "bench-reload-token"
CONFIG = """
[server]
admin_token = "{token}"

[services.users]
base_url = "{backend}"
timeout = 2

[pipes.get_user]
service = "users"
path = "/users/{{user_id}}"
into = "user"

[routes.user]
method = "GET"
path = "/users/{{user_id}}"
chain = ["get_user"]
result = "user"
"""


class CountingBackend:
    """A keep-alive HTTP/1.1 responder on bare trio sockets (the gateway only sends GETs
    without bodies) that counts its open connections."""

    def __init__(self) -> None:
        self.open = 0

    async def handle(self, stream: trio.SocketStream) -> None:
        self.open += 1
        buffer = b""
        try:
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = await stream.receive_some()
                    if not data:
                        return
                    buffer += data
                head, buffer = buffer.split(b"\r\n\r\n", 1)
                target = head.split(b" ", 2)[1].decode("ascii", "replace")
                body = json.dumps({"path": target}).encode()
                await stream.send_all(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
                )
        except trio.BrokenResourceError:
            return
        finally:
            self.open -= 1
            await stream.aclose()


def rss_kb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return float(line.split()[1])
    return 0.0


async def traffic(url: str, stop: trio.Event, counts: list[int]) -> None:
    async with httpx.AsyncClient(base_url=url) as client:
        n = 0
        while not stop.is_set():
            response = await client.get(f"/users/{n % 50}")
            counts[0 if response.status_code == 200 else 1] += 1
            n += 1


async def scenario(reloads: int, warmup: int) -> dict[str, Any]:
    backend = CountingBackend()
    async with trio.open_nursery() as outer:
        listeners = await outer.start(
            functools.partial(trio.serve_tcp, backend.handle, 0, host="127.0.0.1")
        )
        port = listeners[0].socket.getsockname()[1]
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "gateway.toml"
            path.write_text(CONFIG.format(token=TOKEN, backend=f"http://127.0.0.1:{port}"))
            gateway = Gateway(str(path))
            stop_gateway = trio.Event()
            async with trio.open_nursery() as nursery:
                address: BoundAddress = await nursery.start(
                    functools.partial(gateway.run, port=0, stop=stop_gateway)
                )
                auth = {"Authorization": f"Bearer {TOKEN}"}
                counts = [0, 0]
                async with httpx.AsyncClient(base_url=address.url) as admin:

                    async def reload_times(n: int) -> None:
                        for _ in range(n):
                            response = await admin.post("/admin/reload", headers=auth)
                            assert response.status_code == 200, response.text

                    stop_traffic = trio.Event()
                    async with trio.open_nursery() as clients:
                        for _ in range(4):
                            clients.start_soon(traffic, address.url, stop_traffic, counts)
                        await reload_times(warmup)
                        await trio.sleep(1.0)
                        gc.collect()
                        rss_before, conns_before = rss_kb(), backend.open
                        await reload_times(reloads)
                        await trio.sleep(1.0)
                        stop_traffic.set()
                    await trio.sleep(0.5)  # let closed connections reach the backend
                    gc.collect()
                    rss_after, conns_after = rss_kb(), backend.open
                stop_gateway.set()
        outer.cancel_scope.cancel()
    return {
        "rss_before": rss_before,
        "rss_after": rss_after,
        "conns_before": conns_before,
        "conns_after": conns_after,
        "ok": counts[0],
        "failed": counts[1],
    }


def run(quick: bool) -> list[dict[str, Any]]:
    reloads = 20 if quick else 200
    r = trio.run(scenario, reloads, 10)
    traffic_note = f"{r['ok']:,} requests ok, {r['failed']} failed during the run"
    return [
        {
            "scenario": f"gateway: RSS after {reloads} reloads under traffic (KB, not µs)",
            "subject_us": r["rss_after"],
            "baseline": "the same process before the reloads",
            "baseline_us": r["rss_before"],
            "ratio": r["rss_after"] / r["rss_before"],
            "unit": "KB",
            "goal": "≤ 1.10×",
            "note": traffic_note,
        },
        {
            "scenario": f"gateway: open backend connections after {reloads} reloads (count)",
            "subject_us": r["conns_after"],
            "baseline": "open connections before the reloads",
            "baseline_us": r["conns_before"],
            "ratio": r["conns_after"] / max(r["conns_before"], 1),
            "unit": "connections",
            "goal": "≤ 1.0×",
            "note": "4 clients keep requesting; replaced plans' clients close when idle",
        },
    ]


if __name__ == "__main__":
    for row in run(quick=False):
        print(row)
