"""The report service: one sync route whose chain validates, prepares the content, renders
HTML from the templates loaded at start-up, renders the PDF with a worker borrowed from a
``pipework.ResourcePool``, stores the file and answers with its link.

    POST /reports            -> 200 {"id": ..., "url": "/reports/<id>.pdf", ...}
    GET  /reports/<id>.pdf   -> the PDF

:func:`serve` composes it with pipework's Python API: templates first (a broken one stops
start-up before any browser is launched), then the pool (every worker started, or none),
then the engine and the container. Leaving it closes them in reverse order.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import logging
import re
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import trio
from quart import Response

import pipework as pw

from .config import ReportConfig
from .content import FIELDS, KINDS, prepare, validate
from .pdf import SERVICE, PdfWorker, WorkerLauncher
from .templates import Templates, load_templates

__all__ = ["PdfRenderer", "ReportService", "Serving", "Storage", "serve"]

_REPORT_ID: Final = re.compile(r"[0-9a-f]{32}\Z")
_log = logging.getLogger("examples.report")


class Storage:
    """PDF files by report id: written under a temporary name, then renamed into place."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory

    @staticmethod
    def new_id() -> str:
        return secrets.token_hex(16)  # unguessable: the link is the only way to the file

    def _staged(self, report_id: str) -> trio.Path:
        return trio.Path(self.directory / f".{report_id}.pdf.part")

    async def stage(self, report_id: str, pdf: bytes) -> None:
        await self._staged(report_id).write_bytes(pdf)

    async def publish(self, report_id: str) -> None:
        await self._staged(report_id).rename(self.directory / f"{report_id}.pdf")

    def path(self, report_id: str) -> Path | None:
        """The published file of ``report_id``, or None (unknown, or not an id at all)."""
        if _REPORT_ID.match(report_id) is None:
            return None
        path = self.directory / f"{report_id}.pdf"
        return path if path.is_file() else None


class PdfRenderer:
    """Renders with a worker borrowed from ``pool``; any failure replaces that worker."""

    def __init__(self, pool: pw.ResourcePool[PdfWorker]) -> None:
        self.pool = pool

    async def render(self, html: str) -> tuple[bytes, PdfWorker]:
        # A worker that died while idle is noticed here, replaced, and another borrowed.
        for _ in range(self.pool.size + 1):
            async with self.pool.borrow() as worker:
                if not worker.alive:
                    self.pool.report_broken(worker)
                    continue
                return await worker.render(html), worker
        raise pw.BackendError(
            f"every PDF worker lent was found dead ({self.pool.size + 1} tries); "
            "they are being replaced, retry the request",
            service=SERVICE,
        )


class ReportService:
    """The chain's pipes, over the templates, the PDF pool and the storage."""

    def __init__(self, templates: Templates, renderer: PdfRenderer, storage: Storage) -> None:
        self.templates = templates
        self.renderer = renderer
        self.storage = storage

    async def validate(self, ctx: pw.Context) -> None:
        validate(ctx.state)

    async def prepare_content(self, ctx: pw.Context) -> None:
        # The input was checked by `validate`; parsing it again into typed values costs µs.
        request = validate(ctx.state)
        ctx.state["content"] = prepare(request, dt.datetime.now(dt.UTC))

    async def render_html(self, ctx: pw.Context) -> None:
        ctx.state["html"] = self.templates.render(ctx.state["kind"], ctx.state["content"])

    async def render_pdf(self, ctx: pw.Context) -> None:
        pdf, worker = await self.renderer.render(ctx.state.pop("html"))
        report_id = self.storage.new_id()
        await self.storage.stage(report_id, pdf)
        ctx.state["pdf"] = {"id": report_id, "bytes": len(pdf), "worker": worker.number}

    async def store(self, ctx: pw.Context) -> None:
        pdf = ctx.state["pdf"]
        await self.storage.publish(pdf["id"])
        ctx.state["report"] = {
            "id": pdf["id"],
            "url": f"/reports/{pdf['id']}.pdf",
            "kind": ctx.state["kind"],
            "bytes": pdf["bytes"],
        }

    def register(self, registry: pw.Registry, *, timeout: float) -> None:
        stages = [
            registry.pipe(name=name)(getattr(self, name))
            for name in ("validate", "prepare_content", "render_html", "render_pdf", "store")
        ]
        registry.chain("report", *stages, result="report")
        registry.route("report", path="/reports", chain="report", timeout=timeout)

    async def download(self, report_id: str) -> Response:
        path = self.storage.path(report_id)
        if path is None:
            body = {
                "type": "about:blank",
                "title": "Not Found",
                "status": 404,
                "detail": f"no report {report_id!r}; POST /reports makes one",
            }
            return Response(json.dumps(body), 404, content_type="application/problem+json")
        return Response(
            await trio.Path(path).read_bytes(),
            content_type="application/pdf",
            headers={"Content-Disposition": f'inline; filename="report-{report_id}.pdf"'},
        )


@dataclass(frozen=True, slots=True)
class Serving:
    """What :func:`serve` reports once it listens."""

    url: str
    pool: pw.ResourcePool[PdfWorker]
    storage: Storage


async def serve(
    config: ReportConfig,
    *,
    stop: trio.Event,
    task_status: trio.TaskStatus[Serving] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until ``stop`` is set. Start-up fails (nothing left running) on a broken
    template (:class:`~examples.report.templates.TemplateLoadError`) or a worker that does
    not start (``pipework.ResourceStartupError``)."""
    templates = load_templates(config.templates, KINDS, FIELDS)
    with contextlib.ExitStack() as cleanup:
        directory = config.storage or Path(
            cleanup.enter_context(tempfile.TemporaryDirectory(prefix="pipework-reports-"))
        )
        storage = Storage(directory)
        registry = pw.Registry()
        engine = pw.Engine(registry=registry, default_timeout=config.timeout)
        pool: pw.ResourcePool[PdfWorker] = pw.ResourcePool(
            WorkerLauncher(config.pdf),
            config.pool_size,
            borrow_timeout=config.borrow_timeout,
            launch_timeout=config.pdf.launch_timeout,
            name="pdf",
            metrics=engine.metrics,
            # The launches mostly wait (a process, a browser, a first page): all at once,
            # start-up takes about one launch's time rather than pool_size of them.
            concurrent_start=True,
        )
        service = ReportService(templates, PdfRenderer(pool), storage)
        service.register(registry, timeout=config.timeout)
        async with pool, engine:
            _log.info(
                "PDF pool ready: pool_size=%d borrow_timeout=%gs launch_timeout=%gs "
                "render_timeout=%gs chromium=%s",
                config.pool_size,
                config.borrow_timeout,
                config.pdf.launch_timeout,
                config.pdf.render_timeout,
                config.pdf.chromium,
            )
            container = pw.Container(
                engine,
                config=pw.ContainerConfig(
                    default_timeout=config.timeout, shutdown_grace=config.shutdown_grace
                ),
            )
            container.app.add_url_rule(
                "/reports/<report_id>.pdf", "report_file", service.download, methods=["GET"]
            )
            async with trio.open_nursery() as nursery:
                address = await nursery.start(
                    functools.partial(
                        container.serve,
                        host=config.host,
                        port=config.port,
                        shutdown_trigger=stop,
                    )
                )
                task_status.started(Serving(address.url, pool, storage))
