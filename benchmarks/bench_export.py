"""The export example (seed 001) against a plain loop, in one run: peak memory and time.

Exporting every order of a SQLite database (1,000,000 rows; 100,000 with ``--quick``) to
CSV, and to xlsx (XlsxWriter in constant_memory mode, a sheet every 100,000 rows; its rows
compare it with the example's own CSV export of the same run). **pipework**: the example
(``python -m examples.export.run``) in a child process, driven over HTTP as a user would:
``POST /exports``, then ``GET /jobs/{id}/events`` to the end. **baseline**: a child that
reads the same rows with ``sqlite3`` (``fetchmany(1000)``) and writes them with ``csv`` in
a plain loop (benchmarks/_export_bare.py). Memory is each child's peak resident set during
the export over its resident set at idle (VmRSS read, VmHWM reset through
``/proc/PID/clear_refs``, the export run, VmHWM read; see benchmarks/_export.py); the worst
of the repetitions is reported. Time is from the submission to the final event (the loop's:
from its start to its end), as CPU time (the child's user + system time, which other load
on the machine does not change) and as wall time, medians of the repetitions; pipework's
includes the HTTP round trips, the job's queue and worker, a worker-thread hand-off per
5,000 rows and a progress report to the job and the record at each.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

import trio

from benchmarks import _export
from examples.export.data import make_orders

BASELINE = "plain sqlite3 + csv loop"


def run(quick: bool) -> list[dict[str, Any]]:
    rows = 100_000 if quick else 1_000_000
    repeats = 1 if quick else 3
    ours: list[_export.Measured] = []
    xlsx: list[_export.Measured] = []
    bare: list[_export.Measured] = []
    with tempfile.TemporaryDirectory(prefix="bench-export-") as name:
        data = Path(name)
        make_orders(data / "orders.sqlite3", rows)
        for _ in range(repeats):  # alternating, so load on the machine falls on both
            ours.append(trio.run(_export.pipework_export, data, rows))
            xlsx.append(trio.run(_export.pipework_export, data, rows, "xlsx"))
            bare.append(trio.run(_export.bare_export, data / "orders.sqlite3", data / "bare.csv"))
    for measured in (*ours, *xlsx, *bare):
        if measured.rows != rows:
            raise RuntimeError(f"an export wrote {measured.rows} rows, not {rows}")
    growth = max(m.growth_kb for m in ours) / 1024
    bare_growth = max(m.growth_kb for m in bare) / 1024
    seconds = statistics.median(m.seconds for m in ours)
    bare_seconds = statistics.median(m.seconds for m in bare)
    cpu = statistics.median(m.cpu_seconds for m in ours)
    bare_cpu = statistics.median(m.cpu_seconds for m in bare)
    x_growth = max(m.growth_kb for m in xlsx) / 1024
    sheets = -(-rows // 100_000)
    x_seconds = statistics.median(m.seconds for m in xlsx)
    x_cpu = statistics.median(m.cpu_seconds for m in xlsx)
    idle = max(m.idle_kb for m in ours) / 1024
    bare_idle = max(m.idle_kb for m in bare) / 1024
    return [
        {
            "scenario": f"peak RSS growth exporting {rows:,} rows",
            "subject_us": growth,
            "unit": "MB",
            "baseline": BASELINE,
            "baseline_us": bare_growth,
            "ratio": growth / bare_growth if bare_growth else float("inf"),
            "goal": "< 50 MB" if rows == 1_000_000 else "",
            "note": f"idle RSS {idle:.0f} MB (the loop: {bare_idle:.0f} MB); worst of {repeats}",
        },
        {
            "scenario": f"CPU time to export {rows:,} rows",
            "subject_us": cpu,
            "unit": "s",
            "baseline": BASELINE,
            "baseline_us": bare_cpu,
            "ratio": cpu / bare_cpu,
            "note": f"the child's user + system time; median of {repeats}",
        },
        {
            "scenario": f"wall time to export {rows:,} rows",
            "subject_us": seconds,
            "unit": "s",
            "baseline": BASELINE,
            "baseline_us": bare_seconds,
            "ratio": seconds / bare_seconds,
            "note": f"{rows / seconds:,.0f} rows/s; median of {repeats}; moves with the "
            "machine's load, CPU time does not",
        },
        {
            "scenario": f"peak RSS growth exporting {rows:,} rows to xlsx",
            "subject_us": x_growth,
            "unit": "MB",
            "baseline": "the example's CSV export",
            "baseline_us": growth,
            "ratio": x_growth / growth if growth else float("inf"),
            "goal": "≤ 50 MB" if rows == 1_000_000 else "",
            "note": f"XlsxWriter, constant_memory; sheets of 100,000 rows: {sheets}; worst "
            f"of {repeats}",
        },
        {
            "scenario": f"CPU time to export {rows:,} rows to xlsx",
            "subject_us": x_cpu,
            "unit": "s",
            "baseline": "the example's CSV export",
            "baseline_us": cpu,
            "ratio": x_cpu / cpu,
            "note": f"the child's user + system time; median of {repeats}",
        },
        {
            "scenario": f"wall time to export {rows:,} rows to xlsx",
            "subject_us": x_seconds,
            "unit": "s",
            "baseline": "the example's CSV export",
            "baseline_us": seconds,
            "ratio": x_seconds / seconds,
            "note": f"{rows / x_seconds:,.0f} rows/s; median of {repeats}",
        },
    ]
