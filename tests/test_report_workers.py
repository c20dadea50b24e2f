"""The service's side of the PDF workers, against fake workers: small Python processes that
speak the same protocol without a browser (they answer, fail, hang or die on request), so
every failure path runs in a fraction of a second. The real workers are in
test_report_example.py."""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass

import pytest
import trio
import trio.testing

import pipework as pw
from examples.report.pdf import PdfWorker, WorkerLauncher, WorkerSettings
from examples.report.service import PdfRenderer

FAKE = """
import os, sys, time
from examples.report.protocol import FrameDecoder, encode
mode = sys.argv[1]
out = sys.stdout.buffer
if mode == "exit":
    sys.exit(3)
out.write(encode({"type": "ready", "pid": os.getpid(), "browser": "fake/1"}))
out.flush()
decoder = FrameDecoder()
while True:
    data = os.read(0, 65536)
    if not data:
        sys.exit(0)
    decoder.feed(data)
    while (m := decoder.next_message()) is not None:
        if m["type"] == "close":
            sys.exit(0)
        if mode == "die":
            os._exit(7)
        if mode == "hang":
            time.sleep(60)  # a fake worker process that hangs: no trio in it
        if mode == "error":
            reply = {"type": "error", "id": m["id"], "error": "Error", "message": "page crashed"}
        else:
            reply = {"type": "pdf", "id": m["id"], "pdf": b"%PDF-" + m["html"].encode()}
        out.write(encode(reply))
        out.flush()
"""


@dataclass(frozen=True, slots=True)
class Fake(WorkerSettings):
    mode: str = "echo"

    def command(self) -> list[str]:
        return [sys.executable, "-c", FAKE, self.mode]


async def test_a_worker_renders_in_turn_and_closes_leaving_nothing() -> None:
    worker = await PdfWorker.start(1, Fake())
    assert worker.browser == "fake/1"
    assert await worker.render("<p>one</p>") == b"%PDF-<p>one</p>"
    assert await worker.render("<p>two</p>") == b"%PDF-<p>two</p>"
    await worker.aclose()
    assert worker.process.returncode == 0  # it closed when asked
    assert not await trio.Path(worker.directory).exists()


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("error", r"PDF worker 1 \(pid \d+\) could not render the report: Error: page crashed"),
        (
            "die",
            r"PDF worker 1 \(pid \d+\) exited with status 7 while rendering; it is being "
            r"replaced, retry the request",
        ),
    ],
)
async def test_a_failed_render_says_which_worker_and_how(mode: str, message: str) -> None:
    worker = await PdfWorker.start(1, Fake(mode=mode))
    try:
        with pytest.raises(pw.BackendError, match=message) as caught:
            await worker.render("<p/>")
        assert caught.value.service == "pdf-worker"
        assert caught.value.http_status == 502
    finally:
        await worker.aclose()


async def test_a_render_past_render_timeout_is_a_deadline() -> None:
    worker = await PdfWorker.start(1, Fake(mode="hang", render_timeout=0.3))
    try:
        with pytest.raises(pw.DeadlineExceeded, match=r"within render_timeout=0\.3s"):
            await worker.render("<p/>")
    finally:
        await worker.aclose()
    assert worker.process.returncode == -signal.SIGKILL  # stuck: killed after the grace


async def test_a_worker_that_exits_while_starting_fails_start_up_and_is_cleaned_up() -> None:
    pool = pw.ResourcePool(
        WorkerLauncher(Fake(mode="exit")), 2, borrow_timeout=5, launch_timeout=10, name="pdf"
    )
    with pytest.raises(pw.ResourceStartupError, match="making resource 1 of 2") as caught:
        async with pool:
            pass
    assert isinstance(caught.value.__cause__, pw.BackendError)
    assert str(caught.value.__cause__).endswith("exited with status 3 while starting")


async def test_a_worker_found_dead_when_borrowed_is_replaced_and_another_lent() -> None:
    pool: pw.ResourcePool[PdfWorker] = pw.ResourcePool(
        WorkerLauncher(Fake()), 2, borrow_timeout=5, launch_timeout=10, name="pdf"
    )
    renderer = PdfRenderer(pool)
    async with pool:
        # Idle workers are lent in the order they came back: `second` (given back first)
        # is the next one lent, and it dies while idle.
        async with pool.borrow() as first, pool.borrow() as second:
            pass
        os.kill(second.pid, signal.SIGKILL)
        await second.process.wait()
        pdf, worker = await renderer.render("<p>after</p>")
        assert pdf == b"%PDF-<p>after</p>"
        assert worker is first
        with trio.fail_after(10):
            await replaced(pool)
        assert pool.statistics().capacity == 2
        assert pool.statistics().discarded == 1
        assert second.renders == 0  # found dead before anything was sent to it


async def replaced(pool: pw.ResourcePool[PdfWorker]) -> None:
    """Once the pool has made a replacement (it starts another process: poll)."""
    while True:
        if pool.statistics().replacements >= 1:
            return
        await trio.sleep(0.01)


async def test_a_render_cancelled_mid_way_replaces_its_worker() -> None:
    pool: pw.ResourcePool[PdfWorker] = pw.ResourcePool(
        WorkerLauncher(Fake(mode="hang")), 1, borrow_timeout=5, launch_timeout=10, name="pdf"
    )
    async with pool:
        with trio.CancelScope() as scope:  # the request's deadline, or its client gone
            async with trio.open_nursery() as nursery:
                nursery.start_soon(PdfRenderer(pool).render, "<p/>")
                await trio.testing.wait_all_tasks_blocked()  # the worker's answer is due
                scope.cancel()
        assert scope.cancelled_caught
        with trio.fail_after(10):
            await replaced(pool)
        async with pool.borrow() as worker:
            assert worker.number == 2  # never the one whose answer is still due
