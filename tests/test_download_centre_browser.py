"""The download centre (the jobs page) with the export example, in Debian's headless
Chromium driven by Playwright from a worker thread (its API is sync or asyncio, never
trio), as a user tries it: an export's progress live, then done, downloaded with a click
(the saved file's bytes checked) and marked; a desktop notification when it ends while the
page is in the background; two exports as one zip; a failed export's reason on hover; an
expired one grey and not downloadable; and after a restart of the server, the exports
still listed and downloadable (the example's records outlive the memory job store)."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import zipfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from playwright.sync_api import Page, expect, sync_playwright

import pipework as pw
from examples.export.data import make_orders
from examples.export.exporter import Blocking, ExportConfig, Exporter, in_thread
from pipework.container import BoundAddress, Container, ContainerConfig

from .test_export import EVERY, ROWS, HoldAtProgress, config

DOCS_SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "download-centre.png"

CHROMIUM = "/usr/bin/chromium"
WAIT = 20_000  # ms: a bound for a busy machine, never a wait
BLUE, GREEN, RED, GREY = (
    "rgb(11, 98, 196)",
    "rgb(19, 122, 46)",
    "rgb(179, 38, 30)",
    "rgb(136, 136, 136)",
)

#: Before any of the page's scripts: notifications are recorded (and still shown), and the
#: test says whether the page is in the background (headless Chromium's always is not).
INIT = """
window.__notes = [];
window.__hidden = false;
const Real = window.Notification;
function Recorded(title, options) {
  window.__notes.push({ title, body: (options || {}).body });
  document.documentElement.dataset.notes = String(window.__notes.length);
  return new Real(title, options);
}
Object.defineProperty(Recorded, "permission", { get: () => Real.permission });
Recorded.requestPermission = (...args) => Real.requestPermission(...args);
window.Notification = Recorded;
Object.defineProperty(document, "visibilityState", {
  get: () => (window.__hidden ? "hidden" : "visible"),
});
Object.defineProperty(document, "hidden", { get: () => window.__hidden });
"""


@pytest.fixture(scope="module")
def orders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("source") / "orders.sqlite3"
    make_orders(path, ROWS)
    return path


@dataclass
class Running:
    url: str
    port: int
    client: httpx.AsyncClient
    engine: pw.Engine
    exporter: Exporter

    async def submit(self, body: dict[str, Any] | None = None) -> tuple[str, str]:
        response = await self.client.post("/exports", json=body or {})
        assert response.status_code == 202, response.text
        return response.json()["id"], response.json()["token"]

    async def finish(self, body: dict[str, Any] | None = None) -> tuple[str, str]:
        job_id, token = await self.submit(body)
        with contextlib.suppress(Exception):  # its outcome is the page's to show
            await self.engine.wait(job_id)
        return job_id, token


@contextlib.asynccontextmanager
async def example(
    cfg: ExportConfig, *, port: int = 0, blocking: Blocking = in_thread
) -> AsyncIterator[Running]:
    """The export example as examples/export/run.py serves it (memory job store), on
    ``port``: a restart serves again on the same one, so the page keeps its origin."""
    registry = pw.Registry()
    engine = pw.Engine(registry=registry, store=pw.MemoryJobStore(retain_seconds=cfg.retention))
    exporter = Exporter(engine, cfg, blocking=blocking)
    stop = trio.Event()
    async with trio.open_nursery() as tasks:
        await tasks.start(exporter.run)
        async with engine:
            container = Container(engine, config=ContainerConfig(shutdown_grace=1.0))
            exporter.add_routes(container)
            async with trio.open_nursery() as server:
                address: BoundAddress = await server.start(
                    functools.partial(container.serve, port=port, shutdown_trigger=stop)
                )
                try:
                    async with httpx.AsyncClient(base_url=address.url, timeout=30) as client:
                        yield Running(address.url, address.port, client, engine, exporter)
                finally:
                    stop.set()
        tasks.cancel_scope.cancel()


@contextlib.contextmanager
def chromium() -> Any:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox"]
        )
        try:
            context = browser.new_context(accept_downloads=True, permissions=["notifications"])
            context.add_init_script(INIT)
            page = context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            yield page, errors
        finally:
            browser.close()


def tickets_of(stored: str) -> set[str]:
    return set(json.loads(stored))


def screenshot_path(tmp_path: Path) -> Path:
    """docs/download-centre.png when it is missing or PIPEWORK_SCREENSHOT=1 is set, else a
    temporary file: a test run leaves the tree clean."""
    if os.environ.get("PIPEWORK_SCREENSHOT") == "1" or not DOCS_SCREENSHOT.exists():
        return DOCS_SCREENSHOT
    return tmp_path / "download-centre.png"


def colour(page: Page, row: str) -> str:
    return str(page.eval_on_selector(f"{row} .status", "e => getComputedStyle(e).color"))


def follow_one_export(
    url: str, ticket: str, job_id: str, release: Callable[[], None], saved: Path
) -> dict[str, Any]:
    """Open the empty page, add the ticket to the address's fragment (no reload), see the
    export running at 25% in blue, put the page in the background and let the export
    finish: done in green, a notification; then download it with a click."""
    seen: dict[str, Any] = {}
    with chromium() as (page, errors):
        page.goto(f"{url}/ui/jobs")
        page.wait_for_selector("#empty:not([hidden])", timeout=WAIT)
        page.evaluate("window.notReloaded = true")
        page.evaluate(f"location.hash = {ticket!r}")
        row = f'[id="job-{job_id}"]'
        page.wait_for_selector(f'{row}[data-status="running"]', timeout=WAIT)
        expect(page.locator(f"{row} progress")).to_have_js_property("value", 0.25, timeout=WAIT)
        seen["running"] = page.inner_text(row)
        seen["running colour"] = colour(page, row)
        seen["same page"] = page.evaluate("window.notReloaded === true")
        seen["fragment"] = page.evaluate("location.hash")
        page.evaluate("window.__hidden = true")
        release()
        page.wait_for_selector(f'{row}[data-status="done"] a.download', timeout=WAIT)
        page.wait_for_selector("html[data-notes]", state="attached", timeout=WAIT)
        seen["notes"] = page.evaluate("window.__notes")
        page.evaluate("window.__hidden = false")
        seen["done"] = page.inner_text(row)
        seen["done colour"] = colour(page, row)
        seen["href"] = page.get_attribute(f"{row} a.download", "href")
        with page.expect_download(timeout=WAIT) as download:
            page.click(f"{row} a.download")
        download.value.save_as(saved)
        seen["suggested"] = download.value.suggested_filename
        page.wait_for_selector(f"{row}.downloaded", timeout=WAIT)
        seen["mark"] = page.inner_text(f"{row} .mark")
        seen["errors"] = errors
    return seen


async def test_an_export_is_followed_live_notified_and_downloaded_from_the_page(
    orders: Path, tmp_path: Path
) -> None:
    hold = HoldAtProgress()
    token = trio.lowlevel.current_trio_token()
    saved = tmp_path / "saved.csv"
    with trio.fail_after(120):
        async with example(config(orders, tmp_path / "exports"), blocking=hold) as running:
            job_id, job_token = await running.submit()
            async for rows, go in hold.held:
                if rows == EVERY:
                    break  # held at 5,000 of 20,000 rows while the page looks
                go.set()
            released = trio.Event()

            async def go_on() -> None:
                await released.wait()
                go.set()
                async for _, more in hold.held:
                    more.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(go_on)
                seen = await trio.to_thread.run_sync(
                    follow_one_export,
                    running.url,
                    f"{job_id}:{job_token}",
                    job_id,
                    lambda: trio.from_thread.run_sync(released.set, trio_token=token),
                    saved,
                )
                nursery.cancel_scope.cancel()
            record = (
                await running.client.get(f"/exports/{job_id}", headers={"X-Job-Token": job_token})
            ).json()
    assert "25% 5,000 of 20,000 rows" in seen["running"]
    assert f"orders-{job_id}.csv" in seen["running"]
    assert seen["running colour"] == BLUE
    assert seen["same page"]
    assert seen["fragment"] == ""  # taken out of the address, into the page's storage
    assert seen["notes"] == [
        {"title": f"orders-{job_id}.csv: done", "body": "Ready in the download centre."}
    ]
    assert "done" in seen["done"]
    assert "20,000" in seen["done"]
    assert seen["done colour"] == GREEN
    assert job_token not in seen["href"]
    assert seen["suggested"] == f"orders-{job_id}.csv"
    assert saved.read_bytes() == (tmp_path / "exports" / f"{job_id}.csv").read_bytes()
    assert saved.read_bytes().count(b"\n") > ROWS
    assert "downloaded" in seen["mark"]
    assert record["status"] == "done"
    assert seen["errors"] == []


def batch_failure_expiry_restart(
    url: str,
    tickets: dict[str, str],
    zipped: Path,
    restart: Callable[[], None],
    saved: Path,
    shot: Path,
) -> dict[str, Any]:
    """Two exports ticked and downloaded as one zip; the failed one's reason on hover; the
    expired one grey with no download; then the server restarts and the page, reloaded,
    still lists the exports and downloads one."""
    seen: dict[str, Any] = {}
    rows = {name: f'[id="job-{ticket.split(":")[0]}"]' for name, ticket in tickets.items()}
    with chromium() as (page, errors):
        page.goto(f"{url}/ui/jobs#{','.join(tickets.values())}")
        for name, state in (("a", "done"), ("b", "done"), ("bad", "failed"), ("old", "expired")):
            page.wait_for_selector(f'{rows[name]}[data-status="{state}"]', timeout=WAIT)
        page.wait_for_selector(f"{rows['b']} a.download", timeout=WAIT)
        seen["reason"] = page.get_attribute(f"{rows['bad']} .status", "title")
        seen["failed colour"] = colour(page, rows["bad"])
        seen["expired colour"] = colour(page, rows["old"])
        seen["expired links"] = page.locator(f"{rows['old']} a").count()
        seen["expired pick"] = page.is_disabled(f"{rows['old']} .pick")
        seen["expired text"] = page.inner_text(rows["old"])
        page.check(f"{rows['a']} .pick")
        page.check(f"{rows['b']} .pick")
        page.set_viewport_size({"width": 1600, "height": 400})
        page.screenshot(path=str(shot))
        with page.expect_download(timeout=WAIT) as download:
            page.click("#batch")
        download.value.save_as(zipped)
        # Search: by name, then by state.
        page.fill("#q", tickets["a"].split(":")[0])
        page.wait_for_selector(rows["b"], state="detached", timeout=WAIT)
        expect(page.locator("#jobs tbody tr")).to_have_count(1, timeout=WAIT)
        page.fill("#q", "")
        page.select_option("#state", "expired")
        # The row the name search left must go (a count of one alone holds before too).
        page.wait_for_selector(rows["a"], state="detached", timeout=WAIT)
        page.wait_for_selector(rows["old"], timeout=WAIT)
        expect(page.locator("#jobs tbody tr")).to_have_count(1, timeout=WAIT)
        seen["expired only"] = page.inner_text("#jobs tbody")
        page.select_option("#state", "")
        page.wait_for_selector(rows["b"], timeout=WAIT)

        restart()
        page.reload()
        for name, state in (("a", "done"), ("b", "done"), ("old", "expired")):
            page.wait_for_selector(f'{rows[name]}[data-status="{state}"]', timeout=WAIT)
        page.wait_for_selector(f'{rows["bad"]}[data-status="unknown"]', timeout=WAIT)
        seen["after restart"] = page.inner_text(rows["a"])
        seen["kept"] = page.evaluate("localStorage.getItem('pipework.jobs')")
        with page.expect_download(timeout=WAIT) as download:
            page.click(f"{rows['b']} a.download")
        download.value.save_as(saved)
        seen["errors"] = errors
    return seen


async def test_a_batch_zip_a_failure_an_expiry_and_a_restart_on_the_page(
    orders: Path, tmp_path: Path
) -> None:
    cfg = config(orders, tmp_path / "exports")
    token = trio.lowlevel.current_trio_token()
    zipped, saved = tmp_path / "both.zip", tmp_path / "b.csv"
    shot = screenshot_path(tmp_path)
    want_restart, restarted, finished = trio.Event(), trio.Event(), trio.Event()
    seen: dict[str, Any] = {}

    def restart() -> None:  # in the browser's thread
        trio.from_thread.run_sync(want_restart.set, trio_token=token)
        trio.from_thread.run(restarted.wait, trio_token=token)

    async def drive(url: str, tickets: dict[str, str]) -> None:
        seen.update(
            await trio.to_thread.run_sync(
                batch_failure_expiry_restart, url, tickets, zipped, restart, saved, shot
            )
        )
        finished.set()

    with trio.fail_after(180):
        async with trio.open_nursery() as nursery:
            async with example(cfg) as first:
                old = await first.finish()
                old_record = await trio.to_thread.run_sync(first.exporter.records.get, old[0])
                assert old_record is not None
                assert old_record.finished is not None
                # Its retention passed (the cutoff is its own end): the only export expired.
                expired = await first.exporter.cleanup(now=old_record.finished + cfg.retention)
                assert [r.id for r in expired] == [old[0]]
                a, b = await first.finish({"status": "paid"}), await first.finish()
                bad = await first.finish({"status": "lost"})
                jobs = {"a": a, "b": b, "bad": bad, "old": old}
                tickets = {name: f"{i}:{t}" for name, (i, t) in jobs.items()}
                nursery.start_soon(drive, first.url, tickets)
                await want_restart.wait()
            # The server stopped (its memory job store is gone) and starts again.
            async with example(cfg, port=first.port) as second:
                assert second.url == first.url
                restarted.set()
                await finished.wait()
    files = cfg.directory
    assert "'status' must be one of" in (seen["reason"] or "")
    assert seen["failed colour"] == RED
    assert seen["expired colour"] == GREY
    assert seen["expired links"] == 0
    assert seen["expired pick"]
    assert "file deleted" in seen["expired text"]
    assert f"orders-{old[0]}.csv" in seen["expired only"]
    with zipfile.ZipFile(io.BytesIO(zipped.read_bytes())) as archive:
        assert archive.testzip() is None
        contents = {name: archive.read(name) for name in archive.namelist()}
    assert contents == {
        f"orders-{a[0]}.csv": (files / f"{a[0]}.csv").read_bytes(),
        f"orders-{b[0]}.csv": (files / f"{b[0]}.csv").read_bytes(),
    }
    assert "done" in seen["after restart"]
    # The job the server forgot (a failure leaves no export record) is shown as unknown,
    # and its ticket kept: the page drops none on its own.
    assert tickets_of(seen["kept"]) == set(tickets.values())
    assert saved.read_bytes() == (files / f"{b[0]}.csv").read_bytes()
    assert seen["errors"] == []
    assert shot.stat().st_size > 5_000
