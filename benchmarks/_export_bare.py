"""The baseline export: ``python -m benchmarks._export_bare SOURCE OUT``.

Prints ``ready`` and waits for a line on stdin; then reads every order of SOURCE with
``sqlite3`` (``fetchmany(1000)``, in primary-key order) and writes them to OUT with
``csv``, prints ``done ROWS``, and waits for stdin to close. No trio, no HTTP, no
pipework: what the export's memory and time would be without them.
"""

from __future__ import annotations

import contextlib
import csv
import sqlite3
import sys
from pathlib import Path

BATCH = 1_000


def export(source: Path, out: Path) -> int:
    rows = 0
    with (
        contextlib.closing(sqlite3.connect(source)) as db,
        open(out, "w", newline="", encoding="utf-8") as file,
    ):
        cursor = db.execute("SELECT * FROM orders ORDER BY id")
        writer = csv.writer(file)
        writer.writerow([column[0] for column in cursor.description])
        while batch := cursor.fetchmany(BATCH):
            writer.writerows(batch)
            rows += len(batch)
    return rows


def main() -> None:
    source, out = Path(sys.argv[1]), Path(sys.argv[2])
    print("ready", flush=True)
    sys.stdin.readline()
    print(f"done {export(source, out)}", flush=True)
    sys.stdin.read()  # until the parent closes it: measured while still alive


if __name__ == "__main__":
    main()
