"""A Redis outage in the log: one ERROR when it starts, one INFO when it ends with a count
of what failed meanwhile (requests refused 503 among them), and nothing else at WARNING or
above -- with a real redis-server, stopped and started again, under a served gateway."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import httpx
import pytest
import trio

from pipework import Gateway
from pipework.container import BoundAddress

from ._redis import start_redis

#: Real time: a real Redis goes away and comes back.
HANG_GUARD = 60.0
REFUSED = 3

GATEWAY = """
[store]
backend = "redis"
url = "{url}"
prefix = "outage"

[pipes.hello]
python = "tests.test_config_corpus:enrich"

[routes.hello]
method = "POST"
path = "/hello"
chain = ["hello"]
"""


async def test_a_redis_outage_is_one_error_then_one_info(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pipework")
    server = start_redis(tmp_path)
    try:
        path = tmp_path / "gateway.toml"
        path.write_text(GATEWAY.format(url=server.url))
        gateway = Gateway(str(path))
        stop = trio.Event()
        with trio.fail_after(HANG_GUARD):
            async with trio.open_nursery() as nursery:
                address: BoundAddress = await nursery.start(
                    functools.partial(gateway.run, port=0, stop=stop)
                )
                async with httpx.AsyncClient(base_url=address.url, timeout=HANG_GUARD) as http:
                    assert (await http.post("/hello", json={})).status_code == 200
                    start = len(caplog.records)
                    await trio.to_thread.run_sync(server.stop)
                    for _ in range(REFUSED):
                        assert (await http.post("/hello", json={})).status_code == 503
                    await trio.to_thread.run_sync(server.restart)
                    # The store connects again for it; its job waits for the event reader.
                    assert (await http.post("/hello", json={})).status_code == 200
                    during = caplog.records[start:]
                stop.set()
    finally:
        server.stop()
    said = [r for r in during if r.name != "pipework.access"]
    assert [
        (r.levelname, getattr(r, "event", None)) for r in said if r.levelno >= logging.INFO
    ] == [
        ("ERROR", "outage started"),
        ("INFO", "outage ended"),
        # Redis came back empty (no persistence): what was in the stream is gone.
        ("WARNING", None),
    ]
    started, ended, lost = said
    name = f"Redis at {server.url}"
    assert started.getMessage().startswith(f"{name} cannot be reached (")
    assert started.exc_info is None
    assert ended.getMessage().startswith(f"{name} is reachable again after ")
    failed = ended.failed  # type: ignore[attr-defined]  # set through `extra`
    # Each request answered 503: refused, or its submission in doubt (sent as the
    # connection went: it may have been written; its client is told to follow it).
    assert failed.get("requests refused", 0) + failed.get("submissions in doubt", 0) == REFUSED
    assert "event stream" in lost.getMessage()
    accessed = [r.status for r in during if r.name == "pipework.access"]  # type: ignore[attr-defined]  # set through `extra`
    assert accessed.count(503) >= REFUSED
