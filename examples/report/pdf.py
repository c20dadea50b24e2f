"""The service's side of the PDF workers: start one, render with it, close it.

A :class:`PdfWorker` is one worker process (``examples/report/worker.py``) holding one
browser; a ``pipework.ResourcePool`` of them is the PDF stage's capacity. Every failure
surfaces as an exception from :meth:`PdfWorker.render`, inside the pool's ``borrow()``
block, so the pool closes that worker and makes a replacement in the background:

- the worker's output ends (it exited, was killed, crashed): :class:`pipework.BackendError`
  naming the worker, its pid and how it ended (HTTP 502);
- no answer within ``render_timeout``: :class:`pipework.DeadlineExceeded` (HTTP 504); the
  worker may be stuck, so it is replaced like a dead one;
- the worker answers with an error (the page failed to load or print): ``BackendError``.

Closing a worker asks it to close its browser and exit; past a short grace, or when it is
already gone, its process group is killed, and so is what is left of its browser. Each
worker runs with its own ``$TMPDIR``, where Playwright makes the browser's fresh profile,
and that directory is removed on close.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import trio

import pipework as pw

from .protocol import FrameDecoder, ProtocolError, encode

__all__ = ["ROOT", "PdfWorker", "WorkerLauncher", "WorkerSettings"]

ROOT: Final = Path(__file__).resolve().parents[2]
#: How long a closing worker gets to close its browser before it is killed.
CLOSE_GRACE: Final = 5.0
#: How long to wait for a worker whose output ended to be reaped (to say how it ended).
EXIT_WAIT: Final = 2.0
SERVICE: Final = "pdf-worker"

_log = logging.getLogger("examples.report.pdf")


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """How workers are started: the browser, the timeouts, and an optional trace file."""

    chromium: str = "/usr/bin/chromium"
    launch_timeout: float = 30.0
    render_timeout: float = 30.0
    trace: str | None = None

    def __post_init__(self) -> None:
        for name in ("launch_timeout", "render_timeout"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"pdf.{name} must be a number of seconds above 0, not {value!r}")

    def command(self) -> list[str]:
        command = [
            sys.executable,
            "-m",
            "examples.report.worker",
            "--chromium",
            self.chromium,
            "--launch-timeout",
            str(self.launch_timeout),
        ]
        return command if self.trace is None else [*command, "--trace", self.trace]


class PdfWorker:
    """One running worker process. Use :class:`WorkerLauncher` to make them."""

    def __init__(
        self, number: int, process: trio.Process, directory: Path, settings: WorkerSettings
    ) -> None:
        self.number = number
        self.process = process
        self.directory = directory
        self.settings = settings
        self.pid: int = process.pid
        self.browser = ""
        self.renders = 0
        #: Pages the worker's browser has made, as of its last PDF: one while every render
        #: succeeds (the page is reused), one more after each that failed.
        self.pages = 0
        self._decoder = FrameDecoder()
        self._closed = False

    def __repr__(self) -> str:
        return f"<PdfWorker {self.number} pid={self.pid} renders={self.renders}>"

    @property
    def name(self) -> str:
        return f"PDF worker {self.number} (pid {self.pid})"

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    @classmethod
    async def start(cls, number: int, settings: WorkerSettings) -> PdfWorker:
        """Start a worker and wait until its browser is up (bound it from outside: the
        pool's ``launch_timeout``). A worker that fails to start is closed before raising."""
        directory = Path(tempfile.mkdtemp(prefix=f"pipework-pdf-{number}-"))
        try:
            process = await trio.lowlevel.open_process(
                settings.command(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                cwd=ROOT,  # `-m examples.report.worker` resolves from the repository root
                env={**os.environ, "TMPDIR": str(directory)},
                # Its own session: Ctrl-C in a terminal reaches the service only, which
                # closes the workers itself; and the worker's group can be killed as one.
                start_new_session=True,
            )
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        worker = cls(number, process, directory, settings)
        try:
            await worker._hello()
        except BaseException:
            with trio.CancelScope(shield=True):
                await worker.aclose()
            raise
        return worker

    async def _hello(self) -> None:
        hello = await self._receive("starting")
        if hello["type"] == "failed":
            raise RuntimeError(
                f"{self.name} could not launch {self.settings.chromium}: "
                f"{hello.get('error')}: {hello.get('message')}"
            )
        if hello["type"] != "ready":
            raise ProtocolError(f"{self.name} said {hello['type']!r} instead of 'ready'")
        self.browser = str(hello.get("browser", ""))

    async def render(self, html: str) -> bytes:
        """The PDF of ``html``. Any exception means this worker should be replaced."""
        self.renders += 1
        request = self.renders
        timeout = self.settings.render_timeout
        with trio.move_on_after(timeout) as scope:
            # The worker's own timeout is a backstop a little later: this deadline decides.
            message = {"type": "render", "id": request, "html": html, "timeout": timeout + 1}
            await self._send(message)
            reply = await self._receive("rendering")
        if scope.cancelled_caught:
            raise pw.DeadlineExceeded(
                f"{self.name} did not render the report within render_timeout={timeout:g}s; "
                "the worker is being replaced",
                scope="pipe",
            )
        if reply.get("id") != request:
            raise ProtocolError(f"{self.name} answered request {reply.get('id')}, not {request}")
        if reply["type"] == "error":
            raise pw.BackendError(
                f"{self.name} could not render the report: {reply.get('error')}: "
                f"{reply.get('message')}",
                service=SERVICE,
            )
        pdf = reply.get("pdf")
        if reply["type"] != "pdf" or not isinstance(pdf, bytes):
            raise ProtocolError(f"{self.name} answered a {reply['type']!r} frame without a PDF")
        self.pages = int(reply.get("pages", 0))
        return pdf

    async def _send(self, message: dict[str, Any]) -> None:
        stdin = self.process.stdin
        assert stdin is not None
        try:
            await stdin.send_all(encode(message))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
            raise await self._died("rendering") from error

    async def _receive(self, doing: str) -> dict[str, Any]:
        stdout = self.process.stdout
        assert stdout is not None
        while (message := self._decoder.next_message()) is None:
            try:
                data = await stdout.receive_some(1 << 16)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
                raise await self._died(doing) from error
            if not data:
                raise await self._died(doing)
            self._decoder.feed(data)
        return message

    async def _died(self, doing: str) -> pw.BackendError:
        """The error for a worker whose pipe ended: how it ended, once it is reaped."""
        with trio.move_on_after(EXIT_WAIT):
            await self.process.wait()
        code = self.process.returncode
        if code is None:
            how = "closed its output but is still running"
        elif code < 0:
            try:
                how = f"was killed by signal {-code} ({signal.Signals(-code).name})"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with status {code}"
        then = "; it is being replaced, retry the request" if doing == "rendering" else ""
        return pw.BackendError(f"{self.name} {how} while {doing}{then}", service=SERVICE)

    async def aclose(self) -> None:
        """Close the browser and end the process (killed past a short grace); idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.alive:
                with trio.move_on_after(CLOSE_GRACE):
                    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                        assert self.process.stdin is not None
                        await self.process.stdin.send_all(encode({"type": "close"}))
                        await self.process.stdin.aclose()
                    await self.process.wait()
        finally:
            # Whatever is left of its group (its Playwright driver) goes with it.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            with trio.CancelScope(shield=True):
                await self.process.wait()
                for stream in (self.process.stdin, self.process.stdout):
                    if stream is not None:
                        await stream.aclose()
                await self._end_browser()
                await trio.to_thread.run_sync(
                    lambda: shutil.rmtree(self.directory, ignore_errors=True)
                )

    async def _end_browser(self) -> None:
        """Kill what is left of the browser and wait until it is gone (bounded), so that
        nothing writes into its profile while the directory is removed.

        Chromium runs in a process group of its own (Playwright starts it so) and exits
        once its pipe to the driver closes, but not at once: after a kill it may outlive
        the worker by a moment. Its processes name the profile, under this worker's
        directory, on their command lines: that is how they are found."""
        with trio.move_on_after(EXIT_WAIT):
            while pids := await trio.to_thread.run_sync(_processes_naming, str(self.directory)):
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                await trio.sleep(0.02)


def _processes_naming(text: str) -> list[int]:
    """The live processes whose command line holds ``text`` (Linux's /proc; none elsewhere)."""
    needle = text.encode()
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as file:
                    if needle in file.read():
                        found.append(int(name))
            except OSError:
                continue  # gone meanwhile, or not ours to read
    return found


class WorkerLauncher:
    """The pool's factory: each call starts the next numbered worker."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self._numbers = itertools.count(1)

    async def __call__(self) -> PdfWorker:
        worker = await PdfWorker.start(next(self._numbers), self.settings)
        _log.info("%s started: %s", worker.name, worker.browser)
        return worker
