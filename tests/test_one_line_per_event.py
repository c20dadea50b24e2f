"""One line per event at the default level (INFO): a request that succeeds writes its
access line and nothing else; one failed backend call is one WARNING naming the job, the
service, the host and the cause (the pipe's end, the branch's and the job's are DEBUG); a
Redis outage is one ERROR when it starts and one INFO when it ends, with what failed
between (tests/test_redis_outage_log.py)."""

from __future__ import annotations

import logging
import socket

import pytest
import trio

import pipework as pw
from pipework import Backends, HttpCall, Service, http_pipe
from pipework._logging import Outage

from .test_container_harness import HANG_GUARD, serving


def closed_port() -> int:
    """A loopback port nothing listens on: a connection to it is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def engine_with(backends: Backends) -> pw.Engine:
    registry = pw.Registry()
    engine = pw.Engine(registry=registry)
    backends.metrics = engine.metrics
    registry.add_pipe(http_pipe("down", HttpCall.of("users", "/down", into="x"), backends))

    @registry.pipe
    async def fine(ctx: pw.Context) -> None:
        ctx.state["fine"] = True

    @registry.pipe
    async def also(ctx: pw.Context) -> None:
        ctx.state["also"] = True

    engine.chain("ok", pw.all_of(fine, also), result="fine")
    engine.chain("fails", pw.all_of("down", fine))
    registry.route("ok", path="/ok", chain="ok", method="GET")
    registry.route("fails", path="/fails", chain="fails", method="GET")
    return engine


def lines(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("pipework") and r.levelno >= level]


async def test_a_request_that_succeeds_is_its_access_line_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="pipework")
    backends = Backends([Service("users", f"http://127.0.0.1:{closed_port()}")])
    with trio.fail_after(HANG_GUARD):
        async with backends, serving(engine_with(backends)) as served:
            caplog.clear()  # the server's own start
            answer = await served.client.get("/ok", headers={"X-Request-ID": "req-ok"})
            assert answer.status_code == 200
            mine = lines(caplog, logging.INFO)
    assert [(r.name, r.levelname, getattr(r, "event", None)) for r in mine] == [
        ("pipework.access", "INFO", "request")
    ]
    assert mine[0].correlation_id == "req-ok"  # type: ignore[attr-defined]  # set through `extra`


@pytest.mark.parametrize("level", [logging.INFO, logging.DEBUG])
async def test_a_failed_backend_call_is_one_warning_line(
    caplog: pytest.LogCaptureFixture, level: int
) -> None:
    caplog.set_level(level, logger="pipework")
    port = closed_port()
    backends = Backends([Service("users", f"http://127.0.0.1:{port}")])
    with trio.fail_after(HANG_GUARD):
        async with backends, serving(engine_with(backends)) as served:
            caplog.clear()
            answer = await served.client.get("/fails", headers={"X-Request-ID": "req-down"})
            assert answer.status_code == 502
            mine = [r for r in caplog.records if r.name.startswith("pipework")]
    above = [r for r in mine if r.levelno >= logging.INFO]
    assert [(r.name, r.levelname, getattr(r, "event", None)) for r in above] == [
        ("pipework.job", "WARNING", "backend call failed"),
        ("pipework.access", "INFO", "request"),
    ]
    failed = above[0]
    assert failed.service == "users"  # type: ignore[attr-defined]  # set through `extra`
    assert failed.host == f"127.0.0.1:{port}"  # type: ignore[attr-defined]  # set through `extra`
    assert failed.job_id  # type: ignore[attr-defined]  # set through `extra`
    assert failed.correlation_id == "req-down"  # type: ignore[attr-defined]  # set through `extra`
    assert failed.cause.startswith("ConnectFailed: ")  # type: ignore[attr-defined]  # set through `extra`
    assert failed.retries == 1  # type: ignore[attr-defined]  # a refused connection: once more
    assert f"host=127.0.0.1:{port}" in failed.getMessage()
    if level == logging.DEBUG:
        # The rest of the job's life is there, below INFO: the failed pipe's end, its
        # branch's, the other branch's and the job's own.
        events = [getattr(r, "event", None) for r in mine if r.levelno == logging.DEBUG]
        assert {"job accepted", "pipe ended", "branch finished", "job finished"} <= set(events)
        assert all(r.exc_info is None for r in mine if r is not failed)


async def test_a_pipes_own_bug_is_one_warning_line_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="pipework")
    engine = pw.Engine()

    @engine.pipe
    async def broken(ctx: pw.Context) -> None:
        raise KeyError("nope")

    @engine.pipe
    async def fine(ctx: pw.Context) -> None:
        ctx.state["fine"] = True

    engine.chain("bug", pw.all_of(broken, fine))
    routes = [pw.Route("bug", "GET", "/bug", "bug")]
    with trio.fail_after(HANG_GUARD):
        async with serving(engine, routes=routes) as served:
            caplog.clear()
            answer = await served.client.get("/bug")
            assert answer.status_code == 500
            mine = lines(caplog, logging.INFO)
    assert [(r.name, r.levelname, getattr(r, "event", None)) for r in mine] == [
        ("pipework.job", "WARNING", "pipe ended"),
        ("pipework.access", "INFO", "request"),
    ]
    assert mine[0].exc_info is not None  # a bug's traceback is what to read


async def test_a_job_that_runs_out_of_time_says_so_once(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    caplog.set_level(logging.INFO, logger="pipework.job")
    engine = pw.Engine()

    @engine.pipe
    async def slow(ctx: pw.Context) -> None:
        await trio.sleep_forever()

    @engine.pipe
    async def fine(ctx: pw.Context) -> None:
        ctx.state["fine"] = True

    engine.chain("slow", pw.all_of(slow, fine))
    async with engine:
        late = await engine.submit("slow", timeout=1.0)
        with pytest.raises(pw.DeadlineExceeded):
            await engine.wait(late)
    warned = [(r.levelname, getattr(r, "event", None)) for r in caplog.records]
    # The job's end says it; the pipe's and the branch's ends, cut by it, are DEBUG.
    assert warned == [("WARNING", "job finished")]


def test_an_outage_is_two_lines_with_what_failed_between(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="pipework.tests")
    outage = Outage("Redis at redis://db:6379/0", logging.getLogger("pipework.tests"))
    # Never reached: a failure is the start-up's to report, not an outage.
    assert outage.failed("refused", "connections") is False
    assert not outage.on
    assert outage.count("requests refused") is False
    outage.recovered()  # reached
    assert caplog.records == []
    assert outage.failed(ConnectionError("reset"), "reading events") is True
    assert outage.failed("refused", "connections") is True
    assert outage.count("requests refused") is True
    assert outage.count("requests refused") is True
    outage.recovered()
    outage.recovered()  # nothing more: it was over
    started, ended = caplog.records
    assert (started.levelname, ended.levelname) == ("ERROR", "INFO")
    assert started.getMessage().startswith("Redis at redis://db:6379/0 cannot be reached (")
    assert ended.getMessage().startswith("Redis at redis://db:6379/0 is reachable again after ")
    assert "(reset)" in started.getMessage()
    assert ended.failed == {"requests refused": 2, "reading events": 1, "connections": 1}  # type: ignore[attr-defined]  # set through `extra`
    assert ended.getMessage().endswith(
        "failed meanwhile: requests refused 2, reading events 1, connections 1"
    )
    # A failure after it is a new outage, with its own count.
    assert outage.failed("refused", "connections") is True
    assert outage.failures == {"connections": 1}
