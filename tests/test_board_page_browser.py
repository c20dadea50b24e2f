"""The jobs page in a real browser: Debian's headless Chromium, driven by Playwright from a
worker thread (its API is sync or asyncio, never trio). A job shows as running with its
progress, then as done, without a reload. The page's screenshot is written to
docs/jobs-page.png (for the README) when that file is missing or PIPEWORK_SCREENSHOT=1 is
set, else to a temporary directory, so a test run leaves the tree clean.
``scripts/ensure-tools`` installs chromium; without it this test fails, it never skips."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import trio
from playwright.sync_api import sync_playwright

import pipework as pw

from .test_board_http import serving

CHROMIUM = "/usr/bin/chromium"
DOCS_SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "jobs-page.png"


def screenshot_path(tmp_path: Path) -> Path:
    if os.environ.get("PIPEWORK_SCREENSHOT") == "1" or not DOCS_SCREENSHOT.exists():
        return DOCS_SCREENSHOT
    return tmp_path / "jobs-page.png"


class Refused(Exception):
    """A client-side failure (4xx): its message is shown to the job's owner."""

    http_status = 422


def make_engine(release: trio.Event) -> pw.Engine:
    registry = pw.Registry()
    engine = pw.Engine(registry=registry)

    @engine.pipe
    async def export(ctx: pw.Context) -> None:
        await ctx.progress(250, 1000, "250 of 1,000 rows")
        await release.wait()
        await ctx.progress(1000, 1000, "all rows")
        ctx.state["file"] = "orders.csv"

    @engine.pipe
    async def report(ctx: pw.Context) -> None:
        ctx.state["pages"] = 3

    @engine.pipe
    async def invoice(ctx: pw.Context) -> None:
        raise Refused("the billing service refused the period")

    for name, pipe in (("export", export), ("report", report), ("invoice", invoice)):
        engine.chain(name, pipe)
        registry.route(name, path=f"/{name}", chain=name, mode="async")
    return engine


def drive(url: str, tickets: list[str], export_id: str, release: Any, shot: Path) -> dict[str, Any]:
    """In a worker thread: open the page, see the export running, let it finish, see it
    done in the same page."""
    seen: dict[str, Any] = {}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox"]
        )
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 420})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(f"{url}/ui/jobs#{','.join(tickets)}")
            row = f'[id="job-{export_id}"]'
            page.wait_for_selector(f'{row}[data-status="running"]', timeout=10_000)
            page.wait_for_function(
                f"document.querySelector('{row} progress').value === 0.25", timeout=10_000
            )
            page.wait_for_selector('tr[data-status="failed"]', timeout=10_000)
            page.wait_for_selector('tr[data-status="done"]', timeout=10_000)
            seen["running_text"] = page.inner_text(row)
            seen["error_hover"] = page.get_attribute('tr[data-status="failed"] .status', "title")
            page.evaluate("window.notReloaded = true")
            page.screenshot(path=str(shot))
            release()
            page.wait_for_selector(f'{row}[data-status="done"]', timeout=10_000)
            seen["done_text"] = page.inner_text(row)
            seen["progress"] = page.eval_on_selector(f"{row} progress", "p => p.value")
            seen["same_page"] = page.evaluate("window.notReloaded === true")
            seen["result_link"] = page.get_attribute(f"{row} .result a", "href")
            seen["errors"] = errors
        finally:
            browser.close()
    return seen


async def test_the_jobs_page_shows_a_job_go_from_running_to_done_without_a_reload(
    tmp_path: Path,
) -> None:
    shot = screenshot_path(tmp_path)
    release = trio.Event()
    token = trio.lowlevel.current_trio_token()
    with trio.fail_after(60):
        async with serving(make_engine(release)) as served:
            tickets = []
            for path in ("/report", "/invoice", "/export"):
                accepted = (await served.client.post(path, json={})).json()
                tickets.append(f"{accepted['id']}:{accepted['token']}")
            export_id = tickets[-1].split(":")[0]
            seen = await trio.to_thread.run_sync(
                drive,
                served.address.url,
                tickets,
                export_id,
                lambda: trio.from_thread.run_sync(release.set, trio_token=token),
                shot,
            )
    assert "running" in seen["running_text"]
    assert "25%" in seen["running_text"]
    assert "250 of 1,000 rows" in seen["running_text"]
    assert "the billing service refused the period" in (seen["error_hover"] or "")
    assert "done" in seen["done_text"]
    assert seen["progress"] == 1
    assert seen["same_page"]
    assert seen["result_link"] == f"/jobs/{export_id}/result"
    assert seen["errors"] == []
    assert shot.stat().st_size > 5_000
