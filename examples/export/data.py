"""The database the example exports from: one ``orders`` table, made up but realistic.

:func:`make_orders` writes ``rows`` orders to a new SQLite file, the same rows for the same
``seed``, in batches and in one transaction, so making a million rows takes a few seconds
and little memory. Some values need CSV quoting (a comma, a double quote, a line break) and
some are not ASCII, so an export that mishandles either shows it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Final

__all__ = ["COLUMNS", "DATETIME_COLUMNS", "STATUSES", "count_orders", "make_orders"]

COLUMNS: Final = ("id", "created", "customer", "sku", "qty", "amount", "status", "note")
#: The columns that hold a time (ISO 8601 text, UTC): an xlsx export writes them as dates.
DATETIME_COLUMNS: Final = ("created",)
STATUSES: Final = ("placed", "paid", "shipped", "delivered", "returned")

_CUSTOMERS: Final = (
    "Ada Lovelace",
    "Lovelace, Ada",
    'Grace "Amazing" Hopper',
    "Linus Torvalds",
    "张伟",
    "Zoë Ångström",
    "Edsger Dijkstra",
    "Barbara Liskov",
)
_SKUS: Final = ("tea", "coffee", "cocoa", "tea pot", "grinder", "mug")
_NOTES: Final = ("", "", "", "leave at the door", "gift, wrapped", "call first\nring twice")
_BATCH: Final = 10_000

_SCHEMA: Final = """
CREATE TABLE orders (
    id INTEGER PRIMARY KEY,
    created TEXT NOT NULL,
    customer TEXT NOT NULL,
    sku TEXT NOT NULL,
    qty INTEGER NOT NULL,
    amount REAL NOT NULL,
    status TEXT NOT NULL,
    note TEXT NOT NULL
)
"""

Row = tuple[int, str, str, str, int, float, str, str]


def _orders(rows: int, seed: int) -> Iterator[Row]:
    draw = random.Random(seed)
    for n in range(1, rows + 1):
        qty = draw.randint(1, 20)
        yield (
            n,
            f"2026-{draw.randint(1, 12):02d}-{draw.randint(1, 28):02d}T"
            f"{draw.randint(0, 23):02d}:{draw.randint(0, 59):02d}:00Z",
            draw.choice(_CUSTOMERS),
            draw.choice(_SKUS),
            qty,
            round(qty * draw.uniform(1.0, 40.0), 2),
            draw.choice(STATUSES),
            draw.choice(_NOTES),
        )


def make_orders(path: Path, rows: int, *, seed: int = 1) -> None:
    """Write a new database of ``rows`` orders at ``path`` (replacing any file there).

    It is made under a temporary name and renamed into place, so a half-made database
    is never exported from."""
    if rows < 0:
        raise ValueError(f"rows must not be negative, got {rows}")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".part")
    partial.unlink(missing_ok=True)
    with contextlib.closing(sqlite3.connect(partial)) as db:
        db.execute(_SCHEMA)
        orders = _orders(rows, seed)
        while batch := list(itertools.islice(orders, _BATCH)):
            db.executemany("INSERT INTO orders VALUES (?, ?, ?, ?, ?, ?, ?, ?)", batch)
        db.commit()
    os.replace(partial, path)


def count_orders(path: Path) -> int | None:
    """How many orders the database at ``path`` holds; None if there is none to read."""
    if not path.exists():
        return None
    try:
        with contextlib.closing(sqlite3.connect(path)) as db:
            (count,) = db.execute("SELECT count(*) FROM orders").fetchone()
    except sqlite3.DatabaseError:
        return None
    return int(count)
