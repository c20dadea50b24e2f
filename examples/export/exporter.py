"""Exports orders from a SQLite database to CSV files or xlsx workbooks, as async jobs
(seed 001).

``POST /exports`` answers 202 at once with the job's id and token (the container's async
mode). The job then:

1. records the export as ``running`` in the download centre (records.py), committed at once;
2. opens one read transaction on the source, counts the rows it will write, and reads them
   through a cursor, ``batch`` rows at a time, writing each batch to the file as it comes
   (CSV, or xlsx when the request says ``"format": "xlsx"``: :class:`_XlsxSink`): memory
   holds one batch, however many rows there are;
3. every ``progress_every`` rows, reports progress on the job (``GET /jobs/{id}``, the jobs
   board and the jobs page show it at once) and in its record;
4. renames the finished file into place and records the export ``done``; on any failure
   (an error, a cancel, the job's deadline) it deletes the partial file and records the
   export ``failed`` with the reason.

SQLite and the file block, so their work runs in worker threads, one call per progress
interval (``progress_every`` rows, a batch at a time): a cancel waits for that one call to
return, and no thread is abandoned while it holds the cursor or the file.

Only the owner (whoever holds the job's token) reads the record, ``GET /exports/{id}``, and
the file, ``GET /exports/{id}/file``; anyone else gets the container's 404 for jobs. Files
are kept ``retention`` seconds after their export finished: :meth:`Exporter.run`, started in
the caller's nursery, deletes those past it every ``cleanup_interval`` and marks their
records ``expired``. At start-up it marks failed every record still ``running``: an export
a previous process left behind.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import hashlib
import hmac
import json
import logging
import os
import shutil
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, BinaryIO, Final, Protocol, TypeVar

import trio
import xlsxwriter
from quart import Response, g, request

import pipework as pw

from .data import DATETIME_COLUMNS, STATUSES
from .records import Record, Records

__all__ = ["CHAIN", "FORMATS", "Blocking", "ExportConfig", "Exporter", "Refused", "in_thread"]

_log = logging.getLogger("examples.export")

T = TypeVar("T")

#: The chain, and the route that starts it: ``POST /exports``.
CHAIN: Final = "export"
RECORDS_FILE: Final = "exports.sqlite3"
#: What the container answers for a job that is unknown or not the caller's: the same here.
NOT_FOUND: Final = "no job with this id, or the token does not match"
_CHUNK: Final = 64 * 1024
#: The rows a sheet holds below its header row (Excel's limit is 1,048,576 in all).
_SHEET_ROWS: Final = 1_048_575
#: The formats an export writes, and how its file is served.
FORMATS: Final = ("csv", "xlsx")
_MEDIA_TYPES: Final = {
    "csv": "text/csv; charset=utf-8",
    "xlsx": "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet",
}
_BEARER: Final = "bearer "


class Blocking(Protocol):
    """How blocking work runs: ``await blocking(fn)`` returns what ``fn()`` returns."""

    def __call__(self, fn: Callable[[], T], /) -> Awaitable[T]: ...


async def in_thread(fn: Callable[[], T], /) -> T:
    """Run ``fn`` in a worker thread. A cancel waits for it to return (one batch at most)
    rather than abandon a thread that holds a cursor or a file."""
    return await trio.to_thread.run_sync(fn)


class Refused(Exception):
    """The request asked for an export this example does not make (a 422 to the owner)."""

    http_status = 422


@dataclass(frozen=True, slots=True)
class ExportConfig:
    """Where the data comes from and goes, and the export's numbers.

    - ``source``: the SQLite database with the ``orders`` table (data.py makes one);
    - ``directory``: where the files and the download centre (``exports.sqlite3``) live;
    - ``retention``: seconds a finished export's file is kept;
    - ``cleanup_interval``: seconds between two looks for files past their retention;
    - ``batch``: rows fetched and written together (all memory holds of the rows);
    - ``progress_every``: rows between two progress reports;
    - ``timeout``: the export job's time limit;
    - ``cleanup_timeout``: how long a failed export may take to clean up after itself;
    - ``key``: the export jobs' admission key (give it a ``limit`` in the engine's pool);
    - ``rows_per_sheet``: an xlsx export starts a new sheet after this many rows (seed 001:
      100,000; a sheet holds 1,048,575 rows below its header at most).
    """

    source: Path
    directory: Path
    retention: float = 7 * 86_400.0
    cleanup_interval: float = 3_600.0
    batch: int = 1_000
    progress_every: int = 5_000
    timeout: float = 3_600.0
    cleanup_timeout: float = 10.0
    key: str = "exports"
    rows_per_sheet: int = 100_000

    def __post_init__(self) -> None:
        for name in ("retention", "cleanup_interval", "timeout", "cleanup_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"ExportConfig.{name} must be a positive number of seconds")
        for name in ("batch", "progress_every", "rows_per_sheet"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"ExportConfig.{name} must be a whole number of rows, 1 or more")
        if self.rows_per_sheet > _SHEET_ROWS:
            raise ValueError(
                f"ExportConfig.rows_per_sheet must be at most {_SHEET_ROWS:,} (a sheet's rows "
                f"below its header), not {self.rows_per_sheet:,}"
            )


class Exporter:
    """The export example on ``engine``: registers the pipe, its chain and the route
    ``POST /exports`` on the engine's registry (a :class:`pipework.Registry`).

    Start :meth:`run` in a nursery around the engine (it opens the download centre and
    applies the restart rule, then deletes expired files until cancelled), and call
    :meth:`add_routes` on the container that serves the engine. ``blocking`` runs the
    SQLite and file work (default: worker threads).
    """

    def __init__(
        self, engine: pw.Engine, config: ExportConfig, *, blocking: Blocking = in_thread
    ) -> None:
        registry = engine.registry
        if not isinstance(registry, pw.Registry):
            raise TypeError(
                "the exporter adds the route POST /exports: build the engine with "
                "registry=pw.Registry()"
            )
        self.engine = engine
        self.config = config
        self.records = Records(config.directory / RECORDS_FILE)
        self._blocking = blocking
        self._epoch: float | None = None
        registry.add_pipe(pw.Pipe(self.export, "export_orders"))
        registry.chain(CHAIN, "export_orders", key=config.key, result="export")
        registry.route(
            CHAIN, method="POST", path="/exports", chain=CHAIN, mode="async", timeout=config.timeout
        )

    def now(self) -> float:
        """Unix time, advanced by trio's clock (a test's virtual time moves it too)."""
        if self._epoch is None:
            self._epoch = time.time() - trio.current_time()
        return self._epoch + trio.current_time()

    def add_routes(self, container: pw.Container) -> None:
        """Serve ``GET /exports/{id}`` (the record) and ``GET /exports/{id}/file``, and put
        the exports in the container's download centre (the jobs page)."""
        container.add_file_results(self)
        app = container.app
        app.add_url_rule("/exports/<export_id>", "export_record", self.record, methods=["GET"])
        app.add_url_rule("/exports/<export_id>/file", "export_file", self.download, methods=["GET"])

    # -- start-up and retention ------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the download centre, mark exports a previous process left ``running``
        failed, then delete files past their retention every ``cleanup_interval``
        seconds (first at once), until cancelled; then close the download centre.

        Start it in a nursery around the engine (``async with engine:`` inside it): the
        exports the engine ends at shutdown still record how they ended."""
        await self._blocking(self._open)
        try:
            await self.recover()
            task_status.started()
            while True:
                try:
                    await self.cleanup()
                except Exception:  # a locked database, a full disk: the next round tries again
                    _log.exception(
                        "export cleanup failed; next attempt in %gs", self.config.cleanup_interval
                    )
                await trio.sleep(self.config.cleanup_interval)
        finally:
            with trio.CancelScope(shield=True):
                await self._blocking(self.records.close)

    def _open(self) -> None:
        self.config.directory.mkdir(parents=True, exist_ok=True)
        self.records.open()

    async def recover(self) -> list[Record]:
        """The restart rule: every export still ``running`` was left by a process that
        stopped (this one has started none yet); mark it failed, saying so."""
        now = self.now()
        reason = (
            "the server stopped while this export ran; it was marked failed when the "
            f"server started again at {_iso(now)}: start a new export"
        )
        stale = await self._blocking(functools.partial(self._recover, reason, now))
        for record in stale:
            _log.warning(
                "export %s: left running by a previous process after %d rows; marked failed",
                record.id,
                record.rows,
            )
        return stale

    def _recover(self, reason: str, now: float) -> list[Record]:
        stale = self.records.fail_running(reason, now)
        for record in stale:
            partial = self._partial(record.id, record.format)
            partial.unlink(missing_ok=True)
            shutil.rmtree(scratch_directory(partial), ignore_errors=True)
        return stale

    async def cleanup(self, now: float | None = None) -> list[Record]:
        """Delete the files kept ``retention`` seconds or longer (as of ``now``, default
        the current time); their records become ``expired``. Returns them."""
        cutoff = (self.now() if now is None else now) - self.config.retention
        expired = await self._blocking(functools.partial(self._expire, cutoff))
        for record in expired:
            _log.info("export %s: file deleted after its retention", record.id)
        return expired

    def _expire(self, cutoff: float) -> list[Record]:
        due = self.records.due(cutoff)
        for record in due:
            if record.file is not None:
                (self.config.directory / record.file).unlink(missing_ok=True)
            self.records.expire(record.id)
        return due

    # -- the export job --------------------------------------------------------------------

    async def export(self, ctx: pw.Context) -> None:
        """The pipe: stream the orders to ``{job id}.csv`` or ``.xlsx`` (see the module's
        docstring)."""
        status, form = _request(ctx.state)
        export_id = ctx.job_id
        job = await self.engine.store.get(export_id)
        owner, identity = job.token_hash, job.owner
        every = self.config.progress_every
        copy: _Copy | None = None
        rows = 0
        try:
            create = functools.partial(
                self.records.create, export_id, owner, self.now(), form, identity
            )
            await self._blocking(create)
            _log.info("export %s started (correlation id %s)", export_id, ctx.correlation_id)
            copy = await self._blocking(
                functools.partial(
                    _Copy,
                    self.config.source,
                    status,
                    _sink(form, self._partial(export_id, form), self.config),
                    self.config.batch,
                )
            )
            total = copy.total
            await self._report(ctx, 0, total)
            # One worker-thread call per progress interval, a batch at a time inside it:
            # fewer hand-offs between threads, and a cancel still waits for one call only.
            while count := await self._blocking(functools.partial(copy.copy, every)):
                rows += count
                if rows % every == 0:
                    await self._report(ctx, rows, total)
            target = self._file(export_id, form)
            size = await self._blocking(functools.partial(copy.commit, target))
            copy = None
            finish = functools.partial(
                self.records.finish, export_id, rows, target.name, self.now()
            )
            await self._blocking(finish)
        except BaseException as exc:
            await self._failed(ctx, copy, rows, exc, form)
            raise
        await ctx.progress(rows, total, f"done: {rows:,} rows")
        _log.info(
            "export %s done: %d rows, %d bytes (correlation id %s)",
            export_id,
            rows,
            size,
            ctx.correlation_id,
        )
        ctx.state["export"] = {
            "id": export_id,
            "rows": rows,
            "bytes": size,
            "file": f"/exports/{export_id}/file",
            "format": form,
            "record": f"/exports/{export_id}",
            "keep_until": _iso(self.now() + self.config.retention),
        }

    async def _report(self, ctx: pw.Context, rows: int, total: int) -> None:
        # The job first (GET /jobs/{id}, the board), then the record (GET /exports/{id}):
        # each is written and visible at once, not when the export ends.
        await ctx.progress(rows, total, f"{rows:,} of {total:,} rows")
        await self._blocking(functools.partial(self.records.progress, ctx.job_id, rows))

    async def _failed(
        self, ctx: pw.Context, copy: _Copy | None, rows: int, exc: BaseException, form: str
    ) -> None:
        """Delete what the export wrote and record why it failed: shielded, because a
        cancel is one of the reasons, and bounded by ``cleanup_timeout``."""
        reason = _reason(ctx, rows, exc)
        _log.warning(
            "export %s failed (correlation id %s): %s", ctx.job_id, ctx.correlation_id, reason
        )
        export_id = ctx.job_id
        with trio.move_on_after(self.config.cleanup_timeout, shield=True) as scope:
            try:
                if copy is not None:
                    await self._blocking(copy.discard)
                unlink = functools.partial(self._file(export_id, form).unlink, missing_ok=True)
                await self._blocking(unlink)
                fail = functools.partial(self.records.fail, export_id, rows, reason, self.now())
                await self._blocking(fail)
            except Exception as error:
                _log.exception("export %s: recording its failure failed", export_id)
                exc.add_note(f"recording the export's failure failed too: {error!r}")
        if scope.cancelled_caught:
            _log.error(
                "export %s: cleaning up took longer than %gs; its record may still say running",
                export_id,
                self.config.cleanup_timeout,
            )

    def _file(self, export_id: str, form: str) -> Path:
        return self.config.directory / f"{export_id}.{form}"

    def _partial(self, export_id: str, form: str) -> Path:
        return self.config.directory / f"{export_id}.{form}.part"

    # -- the download centre: pipework's jobs page lists and serves the files ----------------

    async def result_file(self, job_id: str) -> pw.ResultFile | None:
        """The export's file as pipework's download centre lists it, from its record: the
        record outlives the process (and the job store's memory), so the list does too."""
        record = await self._blocking(functools.partial(self.records.get, job_id))
        return None if record is None else await self._result_file(record)

    async def files_of(self, identity: str, *, limit: int) -> list[pw.ResultFile]:
        """The newest exports ``identity`` started (an authenticated caller: pipework's
        ``[server] jobs_auth``), as the download centre lists them: from the records, so a
        job store that forgot the jobs forgets none of them."""
        records = await self._blocking(functools.partial(self.records.owned_by, identity, limit))
        return [await self._result_file(record) for record in records]

    async def _result_file(self, record: Record) -> pw.ResultFile:
        path = None if record.file is None else self.config.directory / record.file
        size = None
        if path is not None and record.status == "done":
            size = await self._blocking(functools.partial(_size, path))
            path = None if size is None else path
        kept = None if record.finished is None else record.finished + self.config.retention
        return pw.ResultFile(
            job_id=record.id,
            name=f"orders-{record.id}.{record.format}",
            owner=record.owner,
            state=record.status,
            path=path,
            chain=CHAIN,
            media_type=_MEDIA_TYPES.get(record.format, _MEDIA_TYPES["csv"]),
            rows=record.rows,
            size=size,
            created=record.created,
            finished=record.finished,
            keep_until=kept if record.status == "done" else None,
            error=record.error,
            downloaded=record.downloaded,
            identity=record.identity,
        )

    async def mark_downloaded(self, job_id: str, when: float) -> None:
        await self._blocking(functools.partial(self.records.mark_downloaded, job_id, when))

    # -- the download centre over HTTP ----------------------------------------------------------

    async def _owned(self, export_id: str) -> Record | Response:
        """The export's record if the request carries its job's token; else the
        container's own 404 for jobs (an unknown id and a wrong token look the same)."""
        token = _job_token()
        record = await self._blocking(functools.partial(self.records.get, export_id))
        given = "" if token is None else _token_hash(token)
        if record is None or record.owner is None or not hmac.compare_digest(record.owner, given):
            return _problem(404, "job-not-found", "Job not found", NOT_FOUND)
        return record

    async def record(self, export_id: str) -> Response:
        """``GET /exports/{id}``: the export's record, for its owner."""
        found = await self._owned(export_id)
        if isinstance(found, Response):
            return found
        return Response(json.dumps(self._document(found)), content_type="application/json")

    def _document(self, record: Record) -> dict[str, Any]:
        done = record.status == "done"
        kept = None if record.finished is None else record.finished + self.config.retention
        return {
            "id": record.id,
            "status": record.status,
            "rows": record.rows,
            "created": _iso(record.created),
            "finished": None if record.finished is None else _iso(record.finished),
            "error": record.error,
            "file": f"/exports/{record.id}/file" if done else None,
            "keep_until": _iso(kept) if done and kept is not None else None,
        }

    async def download(self, export_id: str) -> Response:
        """``GET /exports/{id}/file``: the CSV or xlsx file, streamed from disk, for its
        owner."""
        found = await self._owned(export_id)
        if isinstance(found, Response):
            return found
        if found.status == "running":
            return _problem(
                409,
                "export-running",
                "Export still running",
                f"export {export_id} has written {found.rows:,} rows so far; its file is "
                "offered once it is done",
                headers={"Retry-After": "5"},
            )
        if found.status == "failed":
            return _problem(
                409, "export-failed", "Export failed", f"export {export_id} failed: {found.error}"
            )
        gone = _problem(
            410,
            "job-gone",
            "Job gone",
            f"export {export_id}'s file was deleted after its retention time "
            f"({self.config.retention:g}s); start a new export",
        )
        if found.file is None:
            return gone
        path = self.config.directory / found.file
        try:
            file = await self._blocking(functools.partial(_open, path))
        except FileNotFoundError:
            return gone
        # Opened before answering: a cleanup that deletes the file now cannot cut the
        # download short (the open file lives on until it is closed).
        size = os.fstat(file.fileno()).st_size
        form = found.format
        response = Response(self._chunks(file), content_type=_MEDIA_TYPES[form])
        response.headers["Content-Length"] = str(size)
        response.headers["Content-Disposition"] = (
            f'attachment; filename="orders-{export_id}.{form}"'
        )
        response.timeout = None  # a large file may take longer than Quart's response timeout
        return response

    async def _chunks(self, file: BinaryIO) -> AsyncIterator[bytes]:
        try:
            while chunk := await self._blocking(functools.partial(file.read, _CHUNK)):
                yield chunk
        finally:
            file.close()


class _Copy:
    """One export's blocking half: a read transaction and a cursor on the source, and the
    file being written (a :class:`_Sink`). Each method is one short blocking call; the pipe
    runs them in worker threads, one after another, never two at once."""

    def __init__(self, source: Path, status: str | None, sink: _Sink, batch: int) -> None:
        self.batch = batch
        self.sink = sink
        self.cursor: sqlite3.Cursor | None = None
        self.copied = 0
        where, args = ("WHERE status = ?", (status,)) if status else ("", ())
        # Read-only: an export never changes what it exports. Used from one worker thread
        # after another (never two at once), hence check_same_thread=False.
        self.db = sqlite3.connect(
            source.resolve().as_uri() + "?mode=ro",
            uri=True,
            isolation_level=None,
            check_same_thread=False,
        )
        try:
            self.db.execute("BEGIN")  # one snapshot for the count and the rows
            (self.total,) = self.db.execute(f"SELECT count(*) FROM orders {where}", args).fetchone()
            # In primary-key order, which SQLite reads as stored: no sort, no temporary table.
            self.cursor = self.db.execute(f"SELECT * FROM orders {where} ORDER BY id", args)
            sink.open([column[0] for column in self.cursor.description])
        except BaseException:
            self.discard()
            raise

    def copy(self, rows: int) -> int:
        """Copy up to ``rows`` more rows, one batch in memory at a time, stopping at a
        multiple of ``rows`` in all; how many it copied (0: there are no more)."""
        assert self.cursor is not None
        wanted = rows - self.copied % rows
        copied = 0
        while copied < wanted:
            batch = self.cursor.fetchmany(min(self.batch, wanted - copied))
            if not batch:
                break
            self.sink.write(batch)
            copied += len(batch)
        self.copied += copied
        return copied

    def commit(self, target: Path) -> int:
        """End the read, make the file durable and put it in place; its size in bytes."""
        assert self.cursor is not None
        self.cursor.close()
        self.db.execute("COMMIT")
        self.db.close()
        self.sink.finish()
        os.replace(self.sink.partial, target)
        return target.stat().st_size

    def discard(self) -> None:
        """Close everything (the read rolls back) and delete the partial file."""
        for close in (getattr(self.cursor, "close", None), self.db.close, self.sink.abandon):
            if close is not None:
                with contextlib.suppress(Exception):  # closing what may be half-open
                    close()
        self.sink.partial.unlink(missing_ok=True)


class _Sink(Protocol):
    """Where an export's rows go: a file at ``partial``, opened with the header, written a
    batch at a time, then finished (complete and on disk) or abandoned."""

    partial: Path

    def open(self, header: list[str]) -> None: ...

    def write(self, batch: list[tuple[Any, ...]]) -> None: ...

    def finish(self) -> None: ...

    def abandon(self) -> None: ...


def _sink(form: str, partial: Path, config: ExportConfig) -> _Sink:
    if form == "xlsx":
        return _XlsxSink(partial, config.rows_per_sheet)
    return _CsvSink(partial)


class _CsvSink:
    """CSV through ``csv.writer``: every value as ``str()``."""

    def __init__(self, partial: Path) -> None:
        self.partial = partial
        self.file: IO[str] | None = None

    def open(self, header: list[str]) -> None:
        self.file = open(self.partial, "w", newline="", encoding="utf-8")  # noqa: SIM115 - closed in finish/abandon
        self.writer = csv.writer(self.file)
        self.writer.writerow(header)

    def write(self, batch: list[tuple[Any, ...]]) -> None:
        self.writer.writerows(batch)

    def finish(self) -> None:
        assert self.file is not None
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()

    def abandon(self) -> None:
        if self.file is not None:
            self.file.close()


class _XlsxSink:
    """An xlsx workbook through XlsxWriter in ``constant_memory`` mode: each row goes to a
    temporary file as soon as the next one starts, and strings are written inline (no
    shared-string table), so memory holds one row whatever the export's size; the sheets
    are zipped into the workbook when it is finished.

    The seed's formats (001, §3.6): numbers are numeric cells, each formatted with as many
    decimals as its value has (``0``, ``0.0``, ``0.00``...), so that a spreadsheet sorts and
    sums them; the datetime columns (``DATETIME_COLUMNS``) are date cells
    (``yyyy-mm-dd hh:mm:ss``, in UTC); every column is 30 wide; a new sheet, with the
    header again, every ``rows_per_sheet`` rows. One format object per number of decimals:
    formats are shared by every cell that needs them, never made per cell."""

    def __init__(self, partial: Path, rows_per_sheet: int) -> None:
        self.partial = partial
        self.scratch = scratch_directory(partial)
        self.rows_per_sheet = rows_per_sheet
        self.workbook: Any = None
        self.sheet: Any = None
        self.sheets = 0
        self.row = 0  # the last row written in the current sheet (0: its header)
        self.header: list[str] = []
        self.dates: frozenset[int] = frozenset()
        self._decimals: dict[int | None, Any] = {None: None}

    def open(self, header: list[str]) -> None:
        self.header = header
        self.dates = frozenset(i for i, name in enumerate(header) if name in DATETIME_COLUMNS)
        self.scratch.mkdir(exist_ok=True)
        self.workbook = xlsxwriter.Workbook(
            str(self.partial),
            {
                "constant_memory": True,
                # Its row files, one per sheet, in a directory of this export's own: removed
                # when it ends however it ends, and by the restart rule after a crash.
                "tmpdir": str(self.scratch),
                # Only write_number/write_string/write_datetime are called: no cell is
                # guessed from its text (a note "=1+1" stays text, never a formula).
                "strings_to_formulas": False,
                "strings_to_urls": False,
                "nan_inf_to_errors": True,
                "remove_timezone": True,
            },
        )
        self.bold = self.workbook.add_format({"bold": True})
        self.when = self.workbook.add_format({"num_format": "yyyy-mm-dd hh:mm:ss"})
        self._new_sheet()

    def _new_sheet(self) -> None:
        self.sheets += 1
        self.sheet = self.workbook.add_worksheet(f"orders {self.sheets}")
        self.sheet.set_column(0, len(self.header) - 1, 30)
        for column, name in enumerate(self.header):
            self.sheet.write_string(0, column, name, self.bold)
        self.row = 0

    def write(self, batch: list[tuple[Any, ...]]) -> None:
        sheet, dates = self.sheet, self.dates
        for values in batch:
            if self.row == self.rows_per_sheet:
                self._new_sheet()
                sheet = self.sheet
            self.row += 1
            row = self.row
            for column, value in enumerate(values):
                if value is None:
                    continue  # an empty cell
                kind = type(value)
                if kind is int:
                    sheet.write_number(row, column, value, self._format(0))
                elif kind is float:
                    sheet.write_number(row, column, value, self._format(_decimals(value)))
                elif column in dates and (when := _datetime(value)) is not None:
                    sheet.write_datetime(row, column, when, self.when)
                else:
                    sheet.write_string(row, column, str(value))

    def _format(self, decimals: int | None) -> Any:
        if decimals in self._decimals:
            return self._decimals[decimals]
        assert decimals is not None  # None (General) is there from the start
        pattern = "0" if decimals == 0 else "0." + "0" * decimals
        made = self._decimals[decimals] = self.workbook.add_format({"num_format": pattern})
        return made

    def finish(self) -> None:
        self.workbook.close()  # the sheets zipped into the file
        fd = os.open(self.partial, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        shutil.rmtree(self.scratch, ignore_errors=True)

    def abandon(self) -> None:
        # Not closed (that would zip a workbook nobody wants): its row files' handles are
        # closed, and the files go with the scratch directory.
        try:
            if self.workbook is not None:
                for sheet in self.workbook.worksheets():
                    handle = getattr(sheet, "row_data_fh", None)
                    if handle is not None:
                        handle.close()
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)


def scratch_directory(partial: Path) -> Path:
    """Where an xlsx export keeps its row files while it runs: ``{id}.xlsx.tmp``."""
    return partial.with_name(partial.name.removesuffix(".part") + ".tmp")


def _decimals(value: float) -> int | None:
    """How many decimals ``value`` shows (``12.5``: 1, ``3.0``: 0), up to 15; None for
    what has no plain decimal form (an exponent, ``nan``, ``inf``: Excel's General)."""
    text = repr(value)
    point = text.find(".")
    if point < 0 or "e" in text:
        return None
    return 0 if text.endswith(".0") else min(len(text) - point - 1, 15)


def _datetime(value: object) -> datetime | None:
    """``value`` as a datetime, if it is an ISO 8601 text; else None (written as text)."""
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def _open(path: Path) -> BinaryIO:
    return open(path, "rb")


def _request(state: Mapping[str, Any]) -> tuple[str | None, str]:
    """The export asked for: which orders (a ``status``, or all) and the file's ``format``
    (``csv``, the default, or ``xlsx``)."""
    # "identity": who an authenticated route's caller is, put there by pipework (a body
    # cannot set it), not a field of the request.
    unknown = sorted(set(state) - {"status", "format", "identity"})
    if unknown:
        raise Refused(
            f"unknown field {unknown[0]!r}: an export takes only 'status', "
            f"one of {', '.join(STATUSES)} (or none, for every order), and 'format', "
            f"one of {', '.join(FORMATS)} (or none, for csv)"
        )
    status = state.get("status")
    if status is not None and status not in STATUSES:
        raise Refused(f"'status' must be one of {', '.join(STATUSES)}, got {status!r}")
    form = state.get("format", "csv")
    if form not in FORMATS:
        raise Refused(f"'format' must be one of {', '.join(FORMATS)}, got {form!r}")
    return status, str(form)


def _reason(ctx: pw.Context, rows: int, exc: BaseException) -> str:
    after = f"after {rows:,} rows"
    if _cancelled(exc):
        if ctx.remaining <= 0:
            return f"the export ran past its time limit, {after}"
        return f"the export was cancelled {after} (by its owner, or the server is stopping)"
    return f"{type(exc).__name__}: {exc} ({after})"


def _cancelled(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return exc.split((trio.Cancelled, KeyboardInterrupt))[1] is None
    return isinstance(exc, trio.Cancelled | KeyboardInterrupt)


def _job_token() -> str | None:
    """The job token as the container takes it: ``Authorization: Bearer`` or
    ``X-Job-Token``."""
    auth = request.headers.get("Authorization", "")
    if auth[: len(_BEARER)].lower() == _BEARER:
        return auth[len(_BEARER) :].strip()
    return request.headers.get("X-Job-Token")


def _token_hash(token: str) -> str:
    # What pipework keeps of a job's owner token (its SHA-256, in hex), which is what the
    # record's owner holds; tests/test_export.py checks the owner's token matches it.
    return hashlib.sha256(token.encode()).hexdigest()


def _problem(
    status: int, slug: str, title: str, detail: str, *, headers: Mapping[str, str] | None = None
) -> Response:
    """A problem document in the container's own shape (RFC 9457)."""
    body: dict[str, Any] = {
        "type": f"urn:pipework:problem:{slug}",
        "title": title,
        "status": status,
        "detail": detail,
        "instance": request.path,
    }
    correlation_id = g.get("correlation_id")
    if correlation_id is not None:
        body["correlation_id"] = correlation_id
    response = Response(json.dumps(body), status=status, content_type="application/problem+json")
    response.headers["Cache-Control"] = "no-store"
    for name, value in (headers or {}).items():
        response.headers[name] = value
    return response


def _iso(unix: float) -> str:
    return datetime.fromtimestamp(unix, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
