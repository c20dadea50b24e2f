"""The export example (examples/export, seed 001) over real sockets: progress seen while
it runs (job status, record, the jobs page's stream, the jobs page in Chromium), the file
whole, only the owner downloads it, failures recorded with their reason, the restart rule,
retention on virtual time, and memory bounded by the batch."""

from __future__ import annotations

import contextlib
import csv
import functools
import hashlib
import io
import sqlite3
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openpyxl
import pytest
import trio
from playwright.sync_api import sync_playwright

import pipework as pw
from benchmarks import _export
from examples.export.data import COLUMNS, make_orders
from examples.export.exporter import Blocking, ExportConfig, Exporter, in_thread
from examples.export.records import TRANSITIONS, RecordError, Records, check_transition
from pipework.container import BoundAddress, Container, ContainerConfig

from .test_board_http import follow_sse
from .test_container_harness import HANG_GUARD, Served, assert_problem, bearer

T = TypeVar("T")

ROWS = 20_000
EVERY = 5_000


@pytest.fixture(scope="module")
def orders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A source database shared by the tests that only read it."""
    path = tmp_path_factory.mktemp("source") / "orders.sqlite3"
    make_orders(path, ROWS)
    return path


def config(source: Path, directory: Path, **overrides: Any) -> ExportConfig:
    return ExportConfig(
        source=source, directory=directory, batch=1_000, progress_every=EVERY, **overrides
    )


@dataclass
class Example:
    served: Served
    exporter: Exporter

    @property
    def client(self) -> httpx.AsyncClient:
        return self.served.client

    async def submit(self, body: dict[str, Any] | None = None) -> tuple[str, str]:
        response = await self.client.post("/exports", json=body or {})
        assert response.status_code == 202, response.text
        return response.json()["id"], response.json()["token"]

    async def wait(self, job_id: str) -> None:
        with contextlib.suppress(Exception):  # its outcome is read over HTTP
            await self.served.engine.wait(job_id)


@contextlib.asynccontextmanager
async def serving(cfg: ExportConfig, *, blocking: Blocking = in_thread) -> AsyncIterator[Example]:
    """The example as examples/export/run.py serves it, on a free port."""
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
                    functools.partial(container.serve, shutdown_trigger=stop)
                )
                try:
                    async with httpx.AsyncClient(base_url=address.url, timeout=HANG_GUARD) as c:
                        yield Example(Served(container, address, c, stop), exporter)
                finally:
                    stop.set()
        tasks.cancel_scope.cancel()


def db_rows(source: Path, where: str = "", args: tuple[Any, ...] = ()) -> list[list[str]]:
    """The rows as csv writes them: every value as str()."""
    with contextlib.closing(sqlite3.connect(source)) as db:
        query = f"SELECT * FROM orders {where} ORDER BY id"
        return [[str(value) for value in row] for row in db.execute(query, args)]


def leftovers(directory: Path) -> list[str]:
    suffixes = (".csv", ".xlsx", ".part", ".tmp")  # .tmp: an xlsx export's row files
    return sorted(p.name for p in directory.iterdir() if p.suffix in suffixes)


def is_progress_write(fn: Callable[[], Any]) -> bool:
    func = getattr(fn, "func", None)
    return getattr(func, "__func__", None) is Records.progress


class HoldAtProgress:
    """Runs the example's blocking work in threads, as it does; after every progress write
    to the record, holds the export until the test says go."""

    def __init__(self) -> None:
        self.send, self.held = trio.open_memory_channel[tuple[int, trio.Event]](0)

    async def __call__(self, fn: Callable[[], T], /) -> T:
        result = await in_thread(fn)
        if is_progress_write(fn):
            go = trio.Event()
            await self.send.send((fn.args[1], go))  # type: ignore[attr-defined]  # a partial
            await go.wait()
        return result


class Follower:
    """The jobs page's stream (``GET /jobs/events`` with the job's ticket): every progress
    value it delivers, in order."""

    def __init__(self) -> None:
        self.progress: list[float] = []
        self.arrived = trio.Event()

    async def run(self, example: Example, ticket: str) -> None:
        headers = {"X-Job-Tickets": ticket}
        async with follow_sse(example.served, "/jobs/events", headers) as (response, events):
            assert response.status_code == 200
            while True:
                _, kind, body = await events.next()
                assert kind == "update", (kind, body)
                progress = body["data"]["progress"]
                if progress is not None and progress["done"] not in self.progress[-1:]:
                    self.progress.append(progress["done"])
                    self.arrived.set()
                    self.arrived = trio.Event()

    async def wait_for(self, done: int) -> None:
        while done not in self.progress:
            await self.arrived.wait()


async def test_progress_increases_while_the_export_runs(orders: Path, tmp_path: Path) -> None:
    hold = HoldAtProgress()
    seen_in_status: list[float] = []
    with trio.fail_after(HANG_GUARD):
        async with serving(config(orders, tmp_path), blocking=hold) as example:
            job_id, token = await example.submit()
            follower = Follower()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(follower.run, example, f"{job_id}:{token}")
                async for rows, go in hold.held:
                    # Held just after reporting `rows`: every reader sees it now.
                    status = await example.client.get(f"/jobs/{job_id}", headers=bearer(token))
                    assert status.json()["status"] == "running"
                    progress = status.json()["progress"]
                    assert progress["total"] == ROWS
                    seen_in_status.append(progress["done"])
                    record = await example.client.get(f"/exports/{job_id}", headers=bearer(token))
                    assert (record.json()["status"], record.json()["rows"]) == ("running", rows)
                    await follower.wait_for(rows)
                    go.set()
                    if rows == ROWS:
                        break
                await example.wait(job_id)
                await follower.wait_for(ROWS)
                nursery.cancel_scope.cancel()
            done = (await example.client.get(f"/jobs/{job_id}", headers=bearer(token))).json()
    assert seen_in_status == [0, 5_000, 10_000, 15_000, 20_000]
    assert follower.progress == seen_in_status
    assert done["status"] == "done"
    assert done["progress"]["done"] == ROWS


async def test_the_file_has_the_header_and_every_row(orders: Path, tmp_path: Path) -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(config(orders, tmp_path)) as example:
            job_id, token = await example.submit()
            await example.wait(job_id)
            result = await example.client.get(f"/jobs/{job_id}/result", headers=bearer(token))
            assert result.status_code == 200, result.text
            download = await example.client.get(result.json()["file"], headers=bearer(token))
            shipped_id, shipped_token = await example.submit({"status": "shipped"})
            await example.wait(shipped_id)
            shipped = await example.client.get(
                f"/exports/{shipped_id}/file", headers=bearer(shipped_token)
            )
    assert result.json()["rows"] == ROWS
    assert download.status_code == 200
    assert download.headers["content-type"] == "text/csv; charset=utf-8"
    assert int(download.headers["content-length"]) == len(download.content)
    assert f"orders-{job_id}.csv" in download.headers["content-disposition"]
    header, *rows = csv.reader(io.StringIO(download.content.decode("utf-8"), newline=""))
    assert header == list(COLUMNS)
    assert rows == db_rows(orders)  # every row, in order, quoting and non-ASCII intact
    _, *shipped_rows = csv.reader(io.StringIO(shipped.content.decode("utf-8"), newline=""))
    assert shipped_rows == db_rows(orders, "WHERE status = ?", ("shipped",))
    assert 0 < len(shipped_rows) < ROWS
    assert leftovers(tmp_path) == sorted([f"{job_id}.csv", f"{shipped_id}.csv"])


async def test_only_the_owner_gets_the_file(orders: Path, tmp_path: Path) -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(config(orders, tmp_path)) as example:
            job_id, token = await example.submit()
            other_id, other_token = await example.submit()
            await example.wait(job_id)
            await example.wait(other_id)
            client = example.client
            owner = await client.get(f"/exports/{job_id}/file", headers={"X-Job-Token": token})
            answers = {
                "wrong token": await client.get(
                    f"/exports/{job_id}/file", headers=bearer("not-the-token")
                ),
                "another job's token": await client.get(
                    f"/exports/{job_id}/file", headers=bearer(other_token)
                ),
                "no token": await client.get(f"/exports/{job_id}/file"),
                "unknown id": await client.get(
                    "/exports/no-such-export/file", headers=bearer(token)
                ),
                "record, wrong token": await client.get(
                    f"/exports/{job_id}", headers=bearer("not-the-token")
                ),
            }
            container_says = await client.get(f"/jobs/{job_id}", headers=bearer("not-the-token"))
    assert owner.status_code == 200
    assert owner.content.startswith(",".join(COLUMNS).encode())
    expected = assert_problem(container_says, 404, "job-not-found")
    for what, answer in answers.items():
        body = assert_problem(answer, 404, "job-not-found")
        # Nothing tells an unknown id from a wrong token, here or in the job API.
        assert (body["title"], body["detail"]) == (expected["title"], expected["detail"]), what
        assert set(body) == set(expected), what


async def test_a_record_left_running_is_failed_at_start_up(orders: Path, tmp_path: Path) -> None:
    """What a process killed mid-export leaves: a record still running and a partial file.
    The next start marks it failed, saying why, and deletes the partial file."""
    token = "owner-token-of-the-killed-export"
    owner = hashlib.sha256(token.encode()).hexdigest()
    records = Records(tmp_path / "exports.sqlite3")
    records.open()
    now = time.time()
    records.create("killed", owner, now - 60.0)
    records.progress("killed", 15_000)
    records.create("finished", owner, now - 60.0)
    (tmp_path / "finished.csv").write_text("id\n")
    records.finish("finished", 0, "finished.csv", now - 50.0)
    records.close()
    (tmp_path / "killed.csv.part").write_text("id\n1\n")
    records = Records(tmp_path / "exports.sqlite3")
    records.open()
    records.create("killed-xlsx", owner, now - 60.0, "xlsx")
    records.close()
    (tmp_path / "killed-xlsx.xlsx.part").write_bytes(b"PK")
    (tmp_path / "killed-xlsx.xlsx.tmp").mkdir()
    (tmp_path / "killed-xlsx.xlsx.tmp" / "tmpsheet1").write_text("<row/>")
    with trio.fail_after(HANG_GUARD):
        async with serving(config(orders, tmp_path)) as example:
            record = await example.client.get("/exports/killed", headers=bearer(token))
            file = await example.client.get("/exports/killed/file", headers=bearer(token))
            kept = await example.client.get("/exports/finished", headers=bearer(token))
            # The download centre outlives the process: the file is still the owner's.
            kept_file = await example.client.get("/exports/finished/file", headers=bearer(token))
    body = record.json()
    assert (body["status"], body["rows"]) == ("failed", 15_000)
    assert body["error"].startswith("the server stopped while this export ran;")
    assert "start a new export" in body["error"]
    assert body["finished"] is not None
    refused = assert_problem(file, 409, "export-failed")
    assert "the server stopped while this export ran" in refused["detail"]
    assert kept.json()["status"] == "done"  # only running records are touched
    assert (kept_file.status_code, kept_file.text) == (200, "id\n")
    assert leftovers(tmp_path) == ["finished.csv"]


async def test_a_failure_is_recorded_with_its_message(orders: Path, tmp_path: Path) -> None:
    source = tmp_path / "broken.sqlite3"
    make_orders(source, 10)
    with contextlib.closing(sqlite3.connect(source)) as db:
        db.execute("ALTER TABLE orders RENAME TO old_orders")
    with trio.fail_after(HANG_GUARD):
        async with serving(config(source, tmp_path / "out")) as example:
            job_id, token = await example.submit()
            await example.wait(job_id)
            status = await example.client.get(f"/jobs/{job_id}", headers=bearer(token))
            record = await example.client.get(f"/exports/{job_id}", headers=bearer(token))
            file = await example.client.get(f"/exports/{job_id}/file", headers=bearer(token))
    assert status.json()["status"] == "failed"
    assert status.json()["error"]["error_type"] == "OperationalError"
    assert record.json()["status"] == "failed"
    assert record.json()["error"] == "OperationalError: no such table: orders (after 0 rows)"
    assert record.json()["file"] is None
    assert "no such table: orders" in assert_problem(file, 409, "export-failed")["detail"]
    assert leftovers(tmp_path / "out") == []


@pytest.mark.parametrize("form", ["csv", "xlsx"])
async def test_a_failure_midway_deletes_the_partial_file(
    orders: Path, tmp_path: Path, form: str
) -> None:
    copies = 0

    async def disk_fills_up(fn: Callable[[], T], /) -> T:
        nonlocal copies
        if getattr(getattr(fn, "func", None), "__name__", "") == "copy":
            copies += 1
            if copies == 3:
                raise OSError(28, "No space left on device")
        return await in_thread(fn)

    with trio.fail_after(HANG_GUARD):
        async with serving(config(orders, tmp_path), blocking=disk_fills_up) as example:
            job_id, token = await example.submit({"format": form})
            await example.wait(job_id)
            record = (await example.client.get(f"/exports/{job_id}", headers=bearer(token))).json()
    assert record["status"] == "failed"
    assert record["rows"] == 10_000
    assert record["error"] == "OSError: [Errno 28] No space left on device (after 10,000 rows)"
    assert leftovers(tmp_path) == []


async def test_a_cancelled_export_is_recorded_failed(orders: Path, tmp_path: Path) -> None:
    hold = HoldAtProgress()
    with trio.fail_after(HANG_GUARD):
        async with serving(config(orders, tmp_path), blocking=hold) as example:
            job_id, token = await example.submit()
            async for rows, go in hold.held:
                if rows == EVERY:
                    break  # held after 5,000 rows; cancelled while held
                go.set()
            cancelled = await example.client.delete(f"/jobs/{job_id}", headers=bearer(token))
            assert cancelled.status_code == 200, cancelled.text
            await example.wait(job_id)
            status = (await example.client.get(f"/jobs/{job_id}", headers=bearer(token))).json()
            record = (await example.client.get(f"/exports/{job_id}", headers=bearer(token))).json()
    assert status["status"] == "cancelled"
    assert record["status"] == "failed"
    assert record["error"].startswith("the export was cancelled after 5,000 rows")
    assert leftovers(tmp_path) == []


async def test_input_the_export_does_not_take_is_refused(orders: Path, tmp_path: Path) -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(config(orders, tmp_path)) as example:
            job_id, token = await example.submit({"status": "lost"})
            await example.wait(job_id)
            result = await example.client.get(f"/jobs/{job_id}/result", headers=bearer(token))
            record = await example.client.get(f"/exports/{job_id}", headers=bearer(token))
    body = assert_problem(result, 422, "pipe-refused")
    assert "'status' must be one of placed, paid, shipped" in body["detail"]
    assert record.status_code == 404  # refused before it started: no record, no file


async def test_a_format_the_export_does_not_write_is_refused(orders: Path, tmp_path: Path) -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(config(orders, tmp_path)) as example:
            job_id, token = await example.submit({"format": "pdf"})
            await example.wait(job_id)
            result = await example.client.get(f"/jobs/{job_id}/result", headers=bearer(token))
    body = assert_problem(result, 422, "pipe-refused")
    assert body["detail"] == "'format' must be one of csv, xlsx, got 'pdf'"
    assert leftovers(tmp_path) == []


def test_rows_per_sheet_is_bounded_by_a_sheets_rows(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="rows_per_sheet must be at most 1,048,575"):
        config(tmp_path / "orders.sqlite3", tmp_path, rows_per_sheet=1_048_576)
    with pytest.raises(ValueError, match="rows_per_sheet must be a whole number of rows"):
        config(tmp_path / "orders.sqlite3", tmp_path, rows_per_sheet=0)


async def test_a_file_past_its_retention_is_gone(orders: Path, tmp_path: Path) -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(config(orders, tmp_path, retention=3_600.0)) as example:
            job_id, token = await example.submit()
            await example.wait(job_id)
            exporter = example.exporter
            done = await trio.to_thread.run_sync(exporter.records.get, job_id)
            assert done is not None
            assert done.finished is not None
            assert await exporter.cleanup(done.finished + 3_599.0) == []
            expired = await exporter.cleanup(done.finished + 3_600.0)
            file = await example.client.get(f"/exports/{job_id}/file", headers=bearer(token))
            record = await example.client.get(f"/exports/{job_id}", headers=bearer(token))
            stranger = await example.client.get(f"/exports/{job_id}/file")
    assert [r.id for r in expired] == [job_id]
    assert "deleted after its retention time" in assert_problem(file, 410, "job-gone")["detail"]
    assert (record.json()["status"], record.json()["file"]) == ("expired", None)
    assert_problem(stranger, 404, "job-not-found")  # "gone" is news only for the owner
    assert leftovers(tmp_path) == []


async def _inline(fn: Callable[[], T], /) -> T:
    """Blocking work run in the trio thread: under autojump, time moves only on sleeps."""
    await trio.lowlevel.checkpoint()
    return fn()


async def test_cleanup_deletes_files_at_their_retention(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    registry = pw.Registry()
    cfg = config(tmp_path / "unused.sqlite3", tmp_path, retention=3_600.0, cleanup_interval=600.0)
    exporter = Exporter(pw.Engine(registry=registry), cfg, blocking=_inline)

    def finished(export_id: str) -> None:
        (tmp_path / f"{export_id}.csv").write_text("id\n")
        exporter.records.create(export_id, None, exporter.now())
        exporter.records.finish(export_id, 0, f"{export_id}.csv", exporter.now())

    def status(export_id: str) -> str:
        record = exporter.records.get(export_id)
        assert record is not None
        return record.status

    async with trio.open_nursery() as nursery:
        await nursery.start(exporter.run)
        finished("early")  # at 0 s
        await trio.sleep(1_800.0)
        finished("later")  # at 1,800 s
        await trio.sleep(3_599.0 - 1_800.0)
        assert leftovers(tmp_path) == ["early.csv", "later.csv"]
        await trio.sleep(2.0)  # 3,601 s: the round at 3,600 s has run
        assert leftovers(tmp_path) == ["later.csv"]
        assert (status("early"), status("later")) == ("expired", "done")
        await trio.sleep(5_399.0 - 3_601.0)
        assert leftovers(tmp_path) == ["later.csv"]
        await trio.sleep(2.0)  # 5,401 s: the round at 5,400 s
        assert leftovers(tmp_path) == []
        assert status("later") == "expired"
        nursery.cancel_scope.cancel()


def test_records_refuse_a_transition_the_table_does_not_allow(tmp_path: Path) -> None:
    records = Records(tmp_path / "exports.sqlite3")
    records.open()
    records.create("e", None, 0.0)
    records.fail("e", 0, "broken", 1.0)
    with pytest.raises(RecordError, match="changed 0 rows"):
        records.finish("e", 0, "e.csv", 2.0)  # an UPDATE of 0 rows is an error, not a no-op
    with pytest.raises(RecordError, match="from failed to done"):
        check_transition("failed", "done")
    record = records.get("e")
    records.close()
    assert record is not None
    assert (record.status, record.error) == ("failed", "broken")


def see_on_the_jobs_page(url: str, ticket: str, job_id: str, release: Callable[[], None]) -> str:
    """In a worker thread (Playwright's API is not trio's): open the jobs page in Debian's
    Chromium, wait for the export's row at 5,000 of 20,000 rows, let the export go on, and
    wait for the same row to say done. The row's text while running."""
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path="/usr/bin/chromium", headless=True, args=["--no-sandbox"]
        )
        try:
            page = browser.new_page()
            page.goto(f"{url}/ui/jobs#{ticket}")
            row = f'[id="job-{job_id}"]'
            page.wait_for_selector(f'{row}[data-status="running"]', timeout=10_000)
            page.wait_for_function(
                f"document.querySelector('{row} progress').value === 0.25", timeout=10_000
            )
            running = page.inner_text(row)
            release()
            page.wait_for_selector(f'{row}[data-status="done"]', timeout=10_000)
        finally:
            browser.close()
    return running


async def test_the_jobs_page_lists_the_export_with_its_progress(
    orders: Path, tmp_path: Path
) -> None:
    hold = HoldAtProgress()
    token = trio.lowlevel.current_trio_token()
    with trio.fail_after(60):
        async with serving(config(orders, tmp_path), blocking=hold) as example:
            job_id, job_token = await example.submit()
            async for rows, go in hold.held:
                if rows == EVERY:
                    break  # held at 5,000 rows while the page looks
                go.set()
            released = trio.Event()

            async def go_on() -> None:
                await released.wait()
                go.set()
                async for _, more in hold.held:
                    more.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(go_on)
                running = await trio.to_thread.run_sync(
                    see_on_the_jobs_page,
                    example.served.address.url,
                    f"{job_id}:{job_token}",
                    job_id,
                    lambda: trio.from_thread.run_sync(released.set, trio_token=token),
                )
                nursery.cancel_scope.cancel()
    assert "running" in running
    assert "25% 5,000 of 20,000 rows" in running


def test_the_readme_draws_the_record_transitions_as_the_table_has_them() -> None:
    readme = Path(__file__).parent.parent / "examples" / "export" / "README.md"
    drawn = set()
    for line in readme.read_text(encoding="utf-8").splitlines():
        parts = line.strip().split(":")[0].split(" --> ")
        if len(parts) == 2 and "[*]" not in parts:
            drawn.add((parts[0].strip(), parts[1].strip()))
    assert drawn == {(old, new) for old, targets in TRANSITIONS.items() for new in targets}


async def test_memory_is_bounded_by_the_batch_not_the_rows(tmp_path: Path) -> None:
    """The example as its README starts it, in a child process: exporting 100,000 rows
    grows its peak resident set far less than holding those rows would. (The benchmark
    bench_export measures a million, against a plain loop.)"""
    rows = 100_000
    source = tmp_path / "orders.sqlite3"
    make_orders(source, rows)
    with contextlib.closing(sqlite3.connect(source)) as db:
        sample = db.execute("SELECT * FROM orders LIMIT 1000").fetchall()
    # What holding every row at once would take: the row objects sqlite3 hands out.
    per_row = sum(sys.getsizeof(r) + sum(sys.getsizeof(v) for v in r) for r in sample) / 1000
    held_kb = per_row * rows / 1024
    measured = await _export.pipework_export(tmp_path, rows)
    assert measured.rows == rows
    assert measured.growth_kb < held_kb / 4, (measured, held_kb)
    assert measured.growth_kb < 20 * 1024, measured


async def test_an_xlsx_exports_memory_does_not_grow_with_its_cells(tmp_path: Path) -> None:
    """The same for xlsx, in a child process: 30,000 rows (240,000 cells) grow the peak
    resident set by a few MB in constant_memory mode, where a workbook that kept its cells
    would grow by some 30 MB (and by a GB for a million rows)."""
    rows = 30_000
    make_orders(tmp_path / "orders.sqlite3", rows)
    measured = await _export.pipework_export(tmp_path, rows, "xlsx")
    assert measured.rows == rows
    assert measured.growth_kb < 15 * 1024, measured


def xlsx_sheets(content: bytes) -> dict[str, list[list[tuple[Any, str]]]]:
    """Every sheet of a workbook: its rows, each cell as (value, number format)."""
    workbook = openpyxl.load_workbook(io.BytesIO(content), read_only=True)
    try:
        return {
            sheet.title: [[(c.value, c.number_format) for c in row] for row in sheet.iter_rows()]
            for sheet in workbook.worksheets
        }
    finally:
        workbook.close()


def typed_rows(source: Path, where: str = "", args: tuple[Any, ...] = ()) -> list[list[Any]]:
    """The rows as an xlsx export writes them: numbers as numbers, times as datetimes."""
    with contextlib.closing(sqlite3.connect(source)) as db:
        rows = db.execute(f"SELECT * FROM orders {where} ORDER BY id", args).fetchall()
    created = COLUMNS.index("created")
    return [
        [
            datetime.fromisoformat(v).replace(tzinfo=None) if i == created else v
            for i, v in enumerate(row)
        ]
        for row in rows
    ]


async def test_an_xlsx_export_has_typed_cells_and_a_sheet_every_rows_per_sheet(
    orders: Path, tmp_path: Path
) -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving(config(orders, tmp_path, rows_per_sheet=1_500)) as example:
            job_id, token = await example.submit({"status": "shipped", "format": "xlsx"})
            await example.wait(job_id)
            result = await example.client.get(f"/jobs/{job_id}/result", headers=bearer(token))
            assert result.status_code == 200, result.text
            download = await example.client.get(result.json()["file"], headers=bearer(token))
            # The download centre (pipework's) names and serves it as an xlsx file too.
            centre = await example.client.get(f"/jobs/{job_id}/file", headers=bearer(token))
    expected = typed_rows(orders, "WHERE status = ?", ("shipped",))
    assert 3_000 < len(expected) < 4_500  # so three sheets: 1,500, 1,500 and the rest
    assert result.json()["format"] == "xlsx"
    assert result.json()["rows"] == len(expected)
    assert download.status_code == 200
    assert download.headers["content-type"] == (
        "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet"
    )
    assert int(download.headers["content-length"]) == len(download.content)
    assert f"orders-{job_id}.xlsx" in download.headers["content-disposition"]
    assert centre.status_code == 200, centre.text
    assert centre.headers["content-type"] == download.headers["content-type"]
    assert f"orders-{job_id}.xlsx" in centre.headers["content-disposition"]
    assert centre.content == download.content
    sheets = await trio.to_thread.run_sync(xlsx_sheets, download.content)
    assert list(sheets) == ["orders 1", "orders 2", "orders 3"]
    assert [len(rows) - 1 for rows in sheets.values()] == [1_500, 1_500, len(expected) - 3_000]
    cells = []
    for rows in sheets.values():
        assert [value for value, _ in rows[0]] == list(COLUMNS)  # each sheet has the header
        cells += rows[1:]
    assert [[value for value, _ in row] for row in cells] == expected
    at = {name: COLUMNS.index(name) for name in ("id", "created", "qty", "amount", "note")}
    for row in cells:
        # Typed cells with the seed's formats: whole numbers "0", an amount with as many
        # decimals as it has, the time a date cell; text stays text.
        for name in ("id", "qty"):
            assert type(row[at[name]][0]) is int
            assert row[at[name]][1] == "0"
        amount, shown = row[at["amount"]]
        assert type(amount) in (int, float)  # a number cell (198.0 reads back as 198)
        decimals = 0 if amount == int(amount) else len(repr(amount).split(".")[1])
        assert shown == ("0" if decimals == 0 else "0." + "0" * decimals)
        assert isinstance(row[at["created"]][0], datetime)
        assert row[at["created"]][1] == "yyyy-mm-dd hh:mm:ss"
        assert row[at["note"]][1] == "General"
    assert {row[at["amount"]][1] for row in cells} >= {"0.0", "0.00"}
    assert leftovers(tmp_path) == [f"{job_id}.xlsx"]  # no partial file, no row files


async def test_an_xlsx_export_starts_its_second_sheet_after_100_000_rows(tmp_path: Path) -> None:
    """The real boundary, with the default rows_per_sheet: a one-column table keeps
    100,001 rows quick to write and read."""
    source = tmp_path / "ids.sqlite3"
    with contextlib.closing(sqlite3.connect(source)) as db:
        db.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
        db.executemany("INSERT INTO orders VALUES (?)", ((n,) for n in range(1, 100_002)))
        db.commit()
    out = tmp_path / "out"
    with trio.fail_after(HANG_GUARD):
        async with serving(
            ExportConfig(source=source, directory=out, progress_every=50_000)
        ) as example:
            # The format as a query parameter: the container puts it in the job's state.
            accepted = await example.client.post("/exports?format=xlsx", json={})
            assert accepted.status_code == 202, accepted.text
            job_id, token = accepted.json()["id"], accepted.json()["token"]
            await example.wait(job_id)
            download = await example.client.get(f"/exports/{job_id}/file", headers=bearer(token))
    assert download.status_code == 200, download.text
    sheets = await trio.to_thread.run_sync(xlsx_sheets, download.content)
    assert list(sheets) == ["orders 1", "orders 2"]
    first, second = sheets.values()
    assert len(first) == 1 + 100_000
    assert first[0] == [("id", "General")]
    assert first[-1] == [(100_000, "0")]
    assert second == [[("id", "General")], [(100_001, "0")]]
