"""The report example (examples/report) with real worker processes and Debian's headless
Chromium: concurrency observed from the workers themselves, a real PDF checked through
``pdftoppm``, a worker killed mid-render, a render past its timeout, and a worker that
cannot start. ``scripts/ensure-tools`` installs chromium and poppler-utils; without them
these tests fail, they never skip.

Renders are held on purpose with a *gate*: a test template whose page sets
``window.reportReady = false`` and fetches a URL on a small server here, which answers only
once the test opens the gate; the worker prints the page once it is ready. Every worker
appends ``start PID ID`` / ``end PID ID`` lines to one trace file (``O_APPEND``: one write
per line, so the file's order is the order the renders really started and ended).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import trio

import pipework as pw
from examples.report.config import DEFAULT_TEMPLATES, ReportConfig
from examples.report.content import FIELDS, KINDS, prepare, validate
from examples.report.pdf import PdfWorker, WorkerSettings
from examples.report.service import Serving, serve
from examples.report.templates import load_templates

SAMPLE = Path(__file__).resolve().parent.parent / "examples" / "report" / "sample.json"
CLIENT_TIMEOUT = 90.0
T = TypeVar("T")


class Gate:
    """An HTTP server whose answers wait until the gate is open (CORS allowed, so that a
    page rendered from a string may fetch it)."""

    def __init__(self) -> None:
        self._open = trio.Event()
        self.url = ""

    def open(self) -> None:
        self._open.set()

    def close(self) -> None:
        if self._open.is_set():
            self._open = trio.Event()

    async def _handle(self, stream: trio.SocketStream) -> None:
        with contextlib.suppress(trio.BrokenResourceError):
            head = b""
            while b"\r\n\r\n" not in head:
                data = await stream.receive_some()
                if not data:
                    return
                head += data
            await self._open.wait()
            await stream.send_all(
                b"HTTP/1.1 200 OK\r\nAccess-Control-Allow-Origin: *\r\n"
                b"Content-Length: 2\r\nConnection: close\r\n\r\nok"
            )
        await stream.aclose()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, self._handle, 0, host="127.0.0.1")
            )
            self.url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}/gate"
            task_status.started()


def gated_templates(directory: Path, gate_url: str) -> Path:
    """The real templates, with the achievement report's page held at the gate."""
    directory.mkdir()
    shutil.copy(DEFAULT_TEMPLATES / "outlook.html", directory / "outlook.html")
    hold = (
        "<script>window.reportReady = false;"
        f"fetch({gate_url!r}).then(() => {{ window.reportReady = true; }});</script></head>"
    )
    text = (DEFAULT_TEMPLATES / "achievement.html").read_text(encoding="utf-8")
    (directory / "achievement.html").write_text(text.replace("</head>", hold, 1))
    return directory


@dataclass
class Running:
    serving: Serving
    client: httpx.AsyncClient
    gate: Gate
    trace: Path


@contextlib.asynccontextmanager
async def running(tmp_path: Path, **overrides: Any) -> AsyncIterator[Running]:
    gate = Gate()
    trace = tmp_path / "renders.trace"
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(gate.serve)
        workers = WorkerSettings(
            trace=str(trace), render_timeout=overrides.pop("render_timeout", 60.0)
        )
        config = ReportConfig(
            port=0,
            shutdown_grace=1.0,
            templates=gated_templates(tmp_path / "templates", gate.url),
            storage=tmp_path / "files",
            borrow_timeout=60.0,
            pdf=workers,
            **overrides,
        )
        async with trio.open_nursery() as service:
            serving: Serving = await service.start(functools.partial(serve, config, stop=stop))
            try:
                # Idle connections are dropped well before the server's keep-alive timeout
                # (5 s, as httpx's own default): a request sent on a connection the server
                # is closing at that moment would meet a reset (a browser's replacement can
                # take that long to start).
                limits = httpx.Limits(keepalive_expiry=1.0)
                async with httpx.AsyncClient(
                    base_url=serving.url, timeout=CLIENT_TIMEOUT, limits=limits
                ) as c:
                    yield Running(serving, c, gate, trace)
            finally:
                stop.set()  # serve() returns once shut down: workers closed
                gate.open()  # nothing stays held meanwhile
        nursery.cancel_scope.cancel()  # the gate server


def report(kind: str = "achievement") -> dict[str, Any]:
    body: dict[str, Any] = json.loads(SAMPLE.read_text())
    body["kind"] = kind
    return body


def trace_events(trace: Path) -> list[tuple[str, int]]:
    if not trace.exists():
        return []
    return [
        (event, int(pid))
        for event, pid, _ in (line.split() for line in trace.read_text().splitlines())
    ]


def most_at_once(events: list[tuple[str, int]]) -> int:
    now = peak = 0
    for event, _ in events:
        now += 1 if event == "start" else -1
        peak = max(peak, now)
    return peak


async def wait_for_starts(trace: Path, count: int) -> list[tuple[str, int]]:
    """The trace once it holds ``count`` render starts (the workers are other processes:
    poll the file on the real clock)."""
    while True:
        events = trace_events(trace)
        if [event for event, _ in events].count("start") >= count:
            return events
        await trio.sleep(0.05)


def read_ppm(path: Path) -> tuple[int, int, bytes]:
    """Width, height and RGB bytes of a binary PPM (P6), as pdftoppm writes it."""
    data = path.read_bytes()
    fields: list[bytes] = []
    position = 0
    while len(fields) < 4:
        while data[position : position + 1].isspace():
            position += 1
        if data[position : position + 1] == b"#":
            position = data.index(b"\n", position) + 1
            continue
        end = position
        while not data[end : end + 1].isspace():
            end += 1
        fields.append(data[position:end])
        position = end
    magic, width, height, maxval = fields
    assert magic == b"P6", fields
    assert maxval == b"255", fields
    pixels = data[position + 1 :]
    assert len(pixels) == int(width) * int(height) * 3
    return int(width), int(height), pixels


def first_page(pdf: bytes, directory: Path) -> tuple[int, int, bytes]:
    source = directory / "page.pdf"
    source.write_bytes(pdf)
    subprocess.run(
        [
            "pdftoppm",
            "-r",
            "40",
            "-f",
            "1",
            "-l",
            "1",
            "-singlefile",
            str(source),
            str(directory / "page"),
        ],
        check=True,
        capture_output=True,
    )
    return read_ppm(directory / "page.ppm")


# Four browsers start at once, each with its first page: seconds on a busy 2-core machine.
@pytest.mark.hang_guard(real_seconds=110)
async def test_a_pool_of_four_workers_end_to_end(tmp_path: Path) -> None:
    """One pool for the three checks (each worker's browser takes a second or more to
    start): at most four renders at once, a real PDF, a worker killed mid-render."""
    async with running(tmp_path, pool_size=4) as run:
        await never_more_than_four_renders_at_once(run)
        await the_pdf_is_real_and_downloadable(run, tmp_path)
        await a_worker_killed_mid_render_fails_its_request_and_is_replaced(run)


async def never_more_than_four_renders_at_once(run: Running) -> None:
    responses: list[httpx.Response] = []

    async def one() -> None:
        responses.append(await run.client.post("/reports", json=report()))

    run.gate.close()
    async with trio.open_nursery() as clients:
        for _ in range(20):
            clients.start_soon(one)
        # Every worker is now held mid-render, and 16 requests wait for one.
        held = await wait_for_starts(run.trace, 4)
        assert run.serving.pool.statistics().borrowed == 4
        run.gate.open()
    assert [r.status_code for r in responses] == [200] * 20, responses[0].text
    events = trace_events(run.trace)
    assert [e for e, _ in events].count("start") == 20
    assert [e for e, _ in events].count("end") == 20
    assert most_at_once(events) == 4  # four at once while held, never a fifth
    assert len({pid for _, pid in held}) == 4  # four workers, each its own process
    assert {pid for _, pid in events} == {pid for _, pid in held}
    assert len({r.json()["id"] for r in responses}) == 20


async def the_pdf_is_real_and_downloadable(run: Running, tmp_path: Path) -> None:
    made = await run.client.post("/reports", json=report("outlook"))
    assert made.status_code == 200, made.text
    link = made.json()["url"]
    assert link == f"/reports/{made.json()['id']}.pdf"
    pdf = await run.client.get(link)
    assert pdf.status_code == 200
    assert pdf.headers["content-type"] == "application/pdf"
    assert pdf.content.startswith(b"%PDF-")
    width, height, pixels = await trio.to_thread.run_sync(first_page, pdf.content, tmp_path)
    assert height > width > 100  # A4, portrait
    ink = sum(1 for i in range(0, len(pixels), 3) if min(pixels[i : i + 3]) < 200)
    assert ink > width * height // 100, f"only {ink} non-white pixels on page 1"
    # The chart's dark blue bars (#2171b5) are on the page: the SVG was drawn.
    bars = sum(
        1
        for i in range(0, len(pixels), 3)
        if abs(pixels[i] - 0x21) + abs(pixels[i + 1] - 0x71) + abs(pixels[i + 2] - 0xB5) < 40
    )
    assert bars > 50, f"only {bars} pixels of the chart's colour"
    missing = await run.client.get("/reports/" + "0" * 32 + ".pdf")
    assert missing.status_code == 404
    assert missing.headers["content-type"] == "application/problem+json"


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


async def a_worker_killed_mid_render_fails_its_request_and_is_replaced(run: Running) -> None:
    pool = run.serving.pool
    before = pool.statistics()
    starts = [e for e, _ in trace_events(run.trace)].count("start")
    run.gate.close()
    async with trio.open_nursery() as nursery:
        answer: list[httpx.Response] = []

        async def victim() -> None:
            answer.append(await run.client.post("/reports", json=report()))

        nursery.start_soon(victim)
        event, pid = (await wait_for_starts(run.trace, starts + 1))[-1]
        assert event == "start"
        tmpdir = worker_tmpdir(pid)
        assert processes_mentioning(tmpdir)  # its browser, with its profile in there
        os.kill(pid, signal.SIGKILL)
    run.gate.open()
    failed = answer[0]
    assert failed.status_code == 502, failed.text
    assert failed.headers["content-type"] == "application/problem+json"
    problem = failed.json()
    assert problem["type"] == "urn:pipework:problem:backend-failed"
    assert f"(pid {pid}) was killed by signal 9 (SIGKILL) while rendering" in problem["detail"]
    assert "being replaced" in problem["detail"]
    assert problem["where"] == "chain 'report' > pipe 'render_pdf'"
    # The replacement starts its browser in the pool's nursery.
    now = await eventually(
        lambda s: s.replacements > before.replacements and s.capacity == 4, pool.statistics
    )
    assert now.discarded == before.discarded + 1
    # Nothing of the killed worker is left: no process, no browser profile.
    assert not await trio.Path(tmpdir).exists()
    assert processes_mentioning(tmpdir) == []
    responses: list[httpx.Response] = []

    async def one(kind: str) -> None:
        responses.append(await run.client.post("/reports", json=report(kind)))

    async with trio.open_nursery() as clients:
        for n in range(8):
            clients.start_soon(one, KINDS[n % 2])
    assert [r.status_code for r in responses] == [200] * 8
    after = [pid for event, pid in trace_events(run.trace)[-16:] if event == "start"]
    assert pid not in after


def worker_tmpdir(pid: int) -> str:
    """The worker's own $TMPDIR, where Playwright puts its browser's profile."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(v for v in environ if v.startswith(b"TMPDIR=")).decode()[len("TMPDIR=") :]


async def eventually(check: Callable[[T], bool], read: Callable[[], T]) -> T:
    """``read()`` once ``check`` accepts it (polled on the real clock: the pool's
    replacement waits on another process)."""
    while True:
        value = read()
        if check(value):
            return value
        await trio.sleep(0.05)


async def test_a_render_past_its_timeout_fails_with_504_and_the_worker_is_replaced(
    tmp_path: Path,
) -> None:
    # The timeout must pass for the held render and be ample for the replacement's first
    # render, which starts a browser context (about 2 s on a busy 2-core machine).
    async with running(tmp_path, pool_size=1, render_timeout=10.0) as run:
        pool = run.serving.pool
        run.gate.close()  # the page never becomes ready
        stuck = await run.client.post("/reports", json=report())
        assert stuck.status_code == 504, stuck.text
        problem = stuck.json()
        assert problem["type"] == "urn:pipework:problem:deadline-exceeded"
        assert "did not render the report within render_timeout=10s" in problem["detail"]
        pid = trace_events(run.trace)[-1][1]
        await eventually(lambda s: s.replacements == 1 and s.idle == 1, pool.statistics)
        run.gate.open()
        fine = await run.client.post("/reports", json=report())
        assert fine.status_code == 200, fine.text
        assert trace_events(run.trace)[-1][1] != pid  # rendered by the replacement


async def test_a_worker_reuses_its_page_and_takes_a_fresh_one_after_a_failed_render() -> None:
    """The page made before "ready" serves every report; a render that fails (here its
    page's readiness check throws) is answered with an error, and the next report gets a
    fresh context and page, so what the broken page defined is gone."""
    worker = await PdfWorker.start(1, WorkerSettings(render_timeout=60.0))
    try:
        html = report_html("achievement")
        for _ in range(3):
            assert (await worker.render(html)).startswith(b"%PDF-")
            assert worker.pages == 1
        broken = (
            "<script>Object.defineProperty(window, 'reportReady', "
            "{get() { throw new Error('this page is broken'); }});</script><p>broken</p>"
        )
        with pytest.raises(pw.BackendError, match=r"could not render the report: .*broken"):
            await worker.render(broken)
        assert (await worker.render(html)).startswith(b"%PDF-")  # the getter is gone
        assert worker.pages == 2
        assert (await worker.render(html)).startswith(b"%PDF-")
        assert worker.pages == 2
    finally:
        await worker.aclose()


def report_html(kind: str) -> str:
    templates = load_templates(DEFAULT_TEMPLATES, KINDS, FIELDS)
    body = report(kind)
    return templates.render(kind, prepare(validate(body), dt.datetime.now(dt.UTC)))
