"""CORS from a real browser: a page served on one origin (a small trio server) calls the
gateway on another with a custom header, so Debian's headless Chromium (driven by
Playwright from a worker thread, as in tests/test_board_page_browser.py) sends a preflight
first. Allowed: the call goes through and the page reads the answer and an exposed header.
Refused (a header the policy does not list, an origin it does not list, a route without a
policy): the browser refuses the call after the preflight, and no job ran.
``scripts/ensure-tools`` installs chromium; without it this test fails, it never skips."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio
from playwright.sync_api import sync_playwright

import pipework as pw

from ._proxy_gateway import gateway

CHROMIUM = "/usr/bin/chromium"
KEY = "browser-test-key"
PAGE = b"<!doctype html><html><head><title>origin A</title></head><body>A</body></html>"

#: Every state a pipe of these routes saw.
SEEN: list[dict[str, Any]] = []


async def note(ctx: pw.Context) -> None:
    SEEN.append(dict(ctx.state))
    ctx.state["ok"] = "called"


@asynccontextmanager
async def page_origin() -> AsyncIterator[str]:
    """Origin A: one page, for the browser to run the calls from."""

    async def handle(stream: trio.SocketStream) -> None:
        request = b""
        while b"\r\n\r\n" not in request:
            chunk = await stream.receive_some(4096)
            if not chunk:
                return
            request += chunk
        head = (
            "HTTP/1.1 200 OK\r\nContent-Type: text/html\r\n"
            f"Content-Length: {len(PAGE)}\r\nConnection: close\r\n\r\n"
        ).encode()
        await stream.send_all(head + PAGE)
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        serve = functools.partial(trio.serve_tcp, handle, 0, host="127.0.0.1")
        listeners = await nursery.start(serve)
        yield f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        nursery.cancel_scope.cancel()


def gateway_text(origin: str) -> str:
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    return f"""
[pool]
max_workers = 4

[cors.page]
origins = ["{origin}"]
methods = ["POST"]
headers = ["X-Trace", "X-API-Key", "Content-Type"]
expose = ["X-Request-ID"]
max_age = 0

[cors.elsewhere]
origins = ["https://app.example"]
methods = ["POST"]
headers = ["X-Trace", "X-API-Key", "Content-Type"]

[auth.keys]
type = "api_key"
[auth.keys.keys.page]
sha256 = "{digest}"

[pipes.note]
python = "tests.test_edge_cors_browser:note"

[routes.orders]
path = "/orders"
chain = ["note"]
result = "ok"
cors = "page"
auth = "keys"

[routes.others]
path = "/others"
chain = ["note"]
result = "ok"
cors = "elsewhere"

[routes.plain]
path = "/plain"
chain = ["note"]
result = "ok"
"""


CALL = """
async ([url, headers]) => {
    try {
        const answer = await fetch(url, {method: "POST", headers, body: "{}"});
        return {status: answer.status, body: await answer.text(),
                request_id: answer.headers.get("X-Request-ID")};
    } catch (error) {
        return {error: String(error)};
    }
}
"""


def drive(page_url: str, gateway_url: str) -> dict[str, Any]:
    """In a worker thread: from origin A's page, call the gateway on origin B."""
    seen: dict[str, Any] = {}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox"]
        )
        try:
            page = browser.new_page()
            page.goto(page_url)
            json_headers = {"Content-Type": "application/json", "X-Trace": "t-1"}
            calls = {
                "allowed": ("/orders", {**json_headers, "X-API-Key": KEY}),
                "header_refused": ("/orders", {**json_headers, "X-API-Key": KEY, "X-Secret": "s"}),
                "origin_refused": ("/others", json_headers),
                "no_policy": ("/plain", json_headers),
            }
            for name, (path, headers) in calls.items():
                seen[name] = page.evaluate(CALL, [gateway_url + path, headers])
            seen["origin"] = page.evaluate("window.location.origin")
        finally:
            browser.close()
    return seen


async def test_a_page_on_another_origin_calls_a_route_only_as_its_policy_allows(
    tmp_path: Path,
) -> None:
    SEEN.clear()
    with trio.fail_after(60):
        async with (
            page_origin() as origin,
            gateway(tmp_path, gateway_text(origin)) as (_, address),
        ):
            seen = await trio.to_thread.run_sync(drive, origin + "/", address.url)
            # The gateway answers the same preflight from this process too.
            async with httpx.AsyncClient(base_url=address.url) as client:
                refused = await client.options(
                    "/orders",
                    headers={
                        "Origin": origin,
                        "Access-Control-Request-Method": "POST",
                        "Access-Control-Request-Headers": "x-secret",
                    },
                )
    assert seen["origin"] == origin
    assert seen["origin"] != address.url.rstrip("/")
    allowed = seen["allowed"]
    assert allowed.get("status") == 200, allowed
    assert json.loads(allowed["body"]) == "called"
    assert allowed["request_id"]  # exposed to the page by the policy
    for name in ("header_refused", "origin_refused", "no_policy"):
        assert "TypeError" in seen[name].get("error", ""), (name, seen[name])
    assert refused.status_code == 403
    # Only the allowed call reached a pipe; the refused ones stopped at their preflight.
    assert len(SEEN) == 1
