"""A rate limit shared by two gateway processes on one Redis: ``pipework serve FILE`` twice,
``[rate_limits] store = "redis"``, concurrent clients on both. The limit refills once an
hour, so the count is exact in real time: the burst passes across both processes, and no
more."""

from __future__ import annotations

import secrets
from pathlib import Path

import httpx
import pytest
import trio

from ._proxy_backend import running_backend
from ._proxy_gateway import gateway_file
from ._redis import RedisServer
from .test_rate_limits_gateway import statuses
from .test_serve_workers import serving

# Starting a gateway is a new interpreter importing pipework: seconds on a busy machine.
pytestmark = pytest.mark.hang_guard(real_seconds=150)


async def test_two_processes_share_one_limit(tmp_path: Path, redis_server: RedisServer) -> None:
    async with running_backend() as backend:
        text = gateway_file(
            backend,
            f"""
[rate_limits]
store = "redis"
url = "{redis_server.url}"
prefix = "{secrets.token_hex(6)}"

[rate_limits.shared]
rate = 1
period = 3600
burst = 6

[routes.api]
proxy = "echo"
prefix = "/api"
strip_prefix = true
rate_limits = "shared"
""",
        )
        path = tmp_path / "gateway.toml"
        path.write_text(text)
        async with serving(str(path)) as one, serving(str(path)) as two:
            answers: list[httpx.Response] = []

            async def client(url: str) -> None:
                async with httpx.AsyncClient(base_url=url) as fresh:
                    answers.append(await fresh.get("/api/echo/x"))

            async with trio.open_nursery() as nursery:
                for i in range(20):
                    nursery.start_soon(client, one.url if i % 2 else two.url)
            assert statuses(answers) == {200: 6, 429: 14}
            assert len(backend.requests) == 6
            refused = next(a for a in answers if a.status_code == 429)
            assert refused.headers["RateLimit-Policy"] == '"shared";q=6;w=21600'
            # Each process counted its own decisions; together, every request.
            counted = 0
            for served in (one, two):
                async with httpx.AsyncClient(base_url=served.url) as fresh:
                    metrics = (await fresh.get("/metrics")).text
                for line in metrics.splitlines():
                    if line.startswith("pipework_rate_limit_decisions_total{"):
                        counted += int(float(line.rsplit(" ", 1)[1]))
            assert counted == 20
