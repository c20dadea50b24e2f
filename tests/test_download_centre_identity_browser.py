"""The jobs page when the download centre is authenticated (``[server] jobs_auth``), in
Debian's headless Chromium driven by Playwright from a worker thread: the page asks for the
credential once (the listing's 401), refuses a wrong key, lists the signed-in identity's
jobs without a single ticket (and never another identity's), downloads one with a click,
and forgets the credential on sign-out."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
from playwright.sync_api import expect

import pipework as pw

from .test_download_centre_browser import WAIT, chromium
from .test_downloads_identity import KEYS, centre, key


def sign_in_and_download(
    url: str,
    mine: list[str],
    saved: Path,
    start_held: Callable[[], str],
    release: Callable[[], None],
) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    with chromium() as (page, errors):
        page.goto(f"{url}/ui/jobs")
        page.wait_for_selector("#signin:not([hidden])", timeout=WAIT)
        seen["asked"] = page.inner_text("#note")
        page.fill("#credential", "not-a-key")
        page.press("#credential", "Enter")
        # (A locator, not wait_for_function: the page's CSP forbids evaluating strings.)
        expect(page.locator("#note")).to_have_text(re.compile("^signing in failed"), timeout=WAIT)
        seen["refused"] = page.inner_text("#note")
        page.fill("#credential", KEYS["alice"])
        page.press("#credential", "Enter")
        for job_id in mine:
            page.wait_for_selector(f'[id="job-{job_id}"][data-status="done"]', timeout=WAIT)
        seen["rows"] = page.eval_on_selector_all("#jobs tbody tr", "rows => rows.map(r => r.id)")
        seen["signin hidden"] = page.is_hidden("#signin")
        seen["stored"] = page.evaluate("sessionStorage.getItem('pipework.credential')")
        seen["tickets"] = page.evaluate("localStorage.getItem('pipework.jobs')")
        row = f'[id="job-{mine[0]}"]'
        with page.expect_download(timeout=WAIT) as download:
            page.click(f"{row} a.download")
        download.value.save_as(saved)
        page.wait_for_selector(f"{row}.downloaded", timeout=WAIT)
        # A job Alice starts elsewhere: the next listing shows it, and the page follows
        # it live (a new stream, which follows the identity's jobs as they are now).
        held = start_held()
        with page.expect_request(lambda r: r.url.endswith("/jobs/events"), timeout=WAIT):
            page.click("#search button")
            page.wait_for_selector(f'[id="job-{held}"][data-status="running"]', timeout=WAIT)
        release()
        page.wait_for_selector(f'[id="job-{held}"][data-status="done"]', timeout=WAIT)
        page.click("#signout")
        page.wait_for_selector("#signin:not([hidden])", timeout=WAIT)
        seen["after sign-out"] = page.locator("#jobs tbody tr").count()
        seen["stored after"] = page.evaluate("sessionStorage.getItem('pipework.credential')")
        seen["errors"] = errors
    return seen


async def test_the_page_signs_in_and_lists_only_the_identitys_jobs(
    tmp_path: Path,
) -> None:
    saved = tmp_path / "saved.txt"
    token = trio.lowlevel.current_trio_token()
    with trio.fail_after(120):
        async with centre(tmp_path, pw.MemoryJobStore()) as c:
            alice = [(await c.submit("/make", "alice")).split(":")[0] for _ in range(2)]
            bob = (await c.submit("/make", "bob")).split(":")[0]

            async def start_held() -> str:
                answer = await c.client.post("/hold", json={}, headers=key("alice"))
                assert answer.status_code == 202, answer.text
                job_id: str = answer.json()["id"]
                return job_id

            seen = await trio.to_thread.run_sync(
                sign_in_and_download,
                str(c.client.base_url).rstrip("/"),
                alice,
                saved,
                lambda: trio.from_thread.run(start_held, trio_token=token),
                lambda: trio.from_thread.run_sync(c.files.held.set, trio_token=token),
            )
    assert seen["asked"] == "sign in to list your jobs (an API key or a token)"
    assert "the API key is not one this route accepts" in seen["refused"]
    assert seen["rows"] == [f"job-{i}" for i in reversed(alice)]
    assert f"job-{bob}" not in seen["rows"]
    assert seen["signin hidden"]
    assert json.loads(seen["stored"]) == {"header": "x-api-key", "value": KEYS["alice"]}
    assert seen["tickets"] is None  # no ticket was needed
    assert saved.read_bytes() == f"file of {alice[0]}\n".encode()
    assert seen["after sign-out"] == 0
    assert seen["stored after"] is None
    assert seen["errors"] == []
