"""One PDF worker: a process that holds one headless Chromium and renders HTML to PDF.

The report service starts N of these (``python -m examples.report.worker ...``) and talks
to each over its stdin and stdout with the frames of :mod:`examples.report.protocol`.
Playwright's API is synchronous or asyncio, never trio, which is why it lives here, behind
a process boundary: one browser per process, one render at a time, nothing shared.

Everything the worker prints goes to stderr (the service's log); stdout carries frames only.
With ``--trace FILE`` it appends ``start PID ID`` and ``end PID ID`` around every render,
each line one ``write()`` to a file opened with ``O_APPEND``, so the lines of all workers
land in the order the renders really started and ended (how the tests observe concurrency).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Mapping
from typing import Any, BinaryIO, Final

from playwright.sync_api import Browser, BrowserContext, Page, sync_playwright

from examples.report.protocol import FrameDecoder, ProtocolError, encode

__all__ = ["CHROMIUM_ARGS", "main"]

#: Flags for a browser that only prints: no GPU, no background traffic, no first-run UI.
#: (Playwright gives each launch a fresh --user-data-dir of its own, under $TMPDIR.)
CHROMIUM_ARGS: Final = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)
#: A template that draws after load sets ``window.reportReady = false``, then ``true``.
_READY: Final = "() => window.reportReady !== false"
_WARM_UP: Final = "<!doctype html><title>warm-up</title><p>warm-up</p>"


class _Trace:
    def __init__(self, path: str | None) -> None:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
        self._fd = None if path is None else os.open(path, flags, 0o644)

    def write(self, event: str, request: int) -> None:
        if self._fd is not None:
            os.write(self._fd, f"{event} {os.getpid()} {request}\n".encode())


class _Renderer:
    """One browser context and page, kept from one report to the next: a new page costs
    a renderer process (most of a second on a busy machine), reusing it a document swap.
    Each report replaces the page's document; the templates are the service's own and run
    no third-party script. A render that fails discards both, and the next one starts
    from a fresh context: nothing a broken page left behind reaches another report."""

    def __init__(self, browser: Browser) -> None:
        self.browser = browser
        self.context: BrowserContext | None = None
        self.page: Page | None = None
        self.pages = 0  # pages made so far: 1 while every render succeeds

    def render(self, html: str, timeout: float) -> bytes:
        try:
            page = self._page()
            page.set_default_timeout(timeout * 1000)
            page.set_content(html, wait_until="load")
            page.wait_for_function(_READY)
            return page.pdf(format="A4", print_background=True, prefer_css_page_size=True)
        except BaseException:
            self.discard()
            raise

    def _page(self) -> Page:
        if self.page is None:
            self.context = self.browser.new_context()
            self.page = self.context.new_page()
            self.pages += 1
        return self.page

    def discard(self) -> None:
        context, self.context, self.page = self.context, None, None
        if context is not None:
            with contextlib.suppress(Exception):  # a context whose page crashed may not close
                context.close()


def _serve(renderer: _Renderer, frames_in: BinaryIO, frames_out: BinaryIO, trace: _Trace) -> int:
    decoder = FrameDecoder()

    def send(message: Mapping[str, Any]) -> None:
        frames_out.write(encode(message))
        frames_out.flush()

    while True:
        message = decoder.next_message()
        if message is None:
            data = os.read(frames_in.fileno(), 1 << 16)
            if not data:
                return 0  # the service closed our input: it is gone, or wants us gone
            decoder.feed(data)
            continue
        kind = message["type"]
        if kind == "close":
            return 0
        if kind != "render":
            raise ProtocolError(f"unexpected {kind!r} frame")
        request = int(message["id"])
        trace.write("start", request)
        try:
            pdf = renderer.render(str(message["html"]), float(message["timeout"]))
        except Exception as error:
            trace.write("end", request)
            text = str(error).strip().splitlines()
            send(
                {
                    "type": "error",
                    "id": request,
                    "error": type(error).__name__,
                    "message": text[0][:300] if text else "",
                }
            )
            continue
        trace.write("end", request)
        send({"type": "pdf", "id": request, "pdf": pdf, "pages": renderer.pages})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.report.worker")
    parser.add_argument("--chromium", required=True, help="the browser's executable")
    parser.add_argument("--launch-timeout", type=float, default=30.0, help="seconds")
    parser.add_argument("--trace", default=None, help="append render start/end lines here")
    args = parser.parse_args(argv)
    # fd 1 carries frames only: keep a handle on it, and send any other output to stderr.
    frames_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    trace = _Trace(args.trace)
    with sync_playwright() as playwright:
        try:
            browser = playwright.chromium.launch(
                executable_path=args.chromium,
                headless=True,
                args=list(CHROMIUM_ARGS),
                timeout=args.launch_timeout * 1000,
            )
        except Exception as error:
            frames_out.write(
                encode({"type": "failed", "error": type(error).__name__, "message": str(error)})
            )
            frames_out.flush()
            return 1
        renderer = _Renderer(browser)
        try:
            # One render before "ready": the page, its renderer and the PDF machinery are
            # up before the first report comes, so that one is as fast as the next.
            with contextlib.suppress(Exception):  # then the first report makes them
                renderer.render(_WARM_UP, args.launch_timeout)
            frames_out.write(
                encode({"type": "ready", "pid": os.getpid(), "browser": browser.version})
            )
            frames_out.flush()
            return _serve(renderer, sys.stdin.buffer, frames_out, trace)
        finally:
            renderer.discard()
            browser.close()


if __name__ == "__main__":
    sys.exit(main())
