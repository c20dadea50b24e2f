"""The download centre: one record per export, in a SQLite table.

    id        the export's job id: the same id names its log lines and its file
    owner     the hash of the job's owner token (the only one who may download it)
    status    running -> done | failed;  done -> expired  (TRANSITIONS)
    rows      rows written so far, then in all
    file      the file's name in the export directory, while it exists
    created   when the export started (Unix seconds)
    finished  when it ended
    error     why it failed
    downloaded  when its file was last downloaded whole (the download centre's mark)
    format    the file's format, ``csv`` or ``xlsx``, known from the start
    identity  the owner identity of the authenticated caller who started it (pipework's
              ``AUTH:SUBJECT``), or none: the download centre lists it for that identity

Every write is a transaction of its own, committed at once, so a reader sees an export's
progress while it runs, not when it ends. Every update names the status it expects
(``WHERE id = ? AND status = ?``), and one that changes no row raises
:class:`RecordError`: an UPDATE of 0 rows is a failure, and a silent one unless someone
checks. Each method blocks: call it in a worker thread.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

__all__ = ["TRANSITIONS", "Record", "RecordError", "RecordStatus", "Records"]

RecordStatus = Literal["running", "done", "failed", "expired"]

#: Which status may follow which; every other change is refused.
TRANSITIONS: Final[Mapping[RecordStatus, frozenset[RecordStatus]]] = {
    "running": frozenset({"done", "failed"}),
    "done": frozenset({"expired"}),
    "failed": frozenset(),
    "expired": frozenset(),
}

#: Errors are cut to this many characters: enough to read, never a whole traceback.
MAX_ERROR: Final = 500

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS exports (
    id TEXT PRIMARY KEY,
    owner TEXT,
    status TEXT NOT NULL CHECK (status IN ('running', 'done', 'failed', 'expired')),
    rows INTEGER NOT NULL DEFAULT 0,
    file TEXT,
    created REAL NOT NULL,
    finished REAL,
    error TEXT,
    downloaded REAL,
    format TEXT NOT NULL DEFAULT 'csv',
    identity TEXT
)
"""
#: An identity's exports, newest first (Records.owned_by).
_IDENTITY_INDEX: Final = (
    "CREATE INDEX IF NOT EXISTS exports_by_identity ON exports (identity, created)"
)
_COLUMNS: Final = (
    "id, owner, status, rows, file, created, finished, error, downloaded, format, identity"
)


class RecordError(Exception):
    """A record is not where the caller expected it to be (a write changed no row)."""


@dataclass(frozen=True, slots=True)
class Record:
    id: str
    owner: str | None
    status: RecordStatus
    rows: int
    file: str | None
    created: float
    finished: float | None
    error: str | None
    downloaded: float | None = None
    format: str = "csv"
    identity: str | None = None


def check_transition(old: RecordStatus, new: RecordStatus) -> None:
    if new not in TRANSITIONS[old]:
        allowed = ", ".join(sorted(TRANSITIONS[old])) or "nothing"
        raise RecordError(f"an export cannot go from {old} to {new} (from {old}: {allowed})")


class Records:
    """The ``exports`` table in the SQLite database at ``path``: :meth:`open` it first,
    :meth:`close` it at the end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._db: sqlite3.Connection | None = None
        # One connection, used from whichever worker thread runs a call, one call at a
        # time. (A connection per call would cost a WAL checkpoint at every close.)
        self._lock = threading.Lock()

    def open(self) -> None:
        """Open the database and create the table if it is not there (WAL: a reader never
        waits for a writer)."""
        with self._lock:
            if self._db is not None:
                return
            db = sqlite3.connect(
                self.path, isolation_level=None, timeout=5.0, check_same_thread=False
            )
            try:
                db.execute("PRAGMA journal_mode = WAL")
                db.execute("PRAGMA synchronous = FULL")  # every commit is on disk
                db.execute(_SCHEMA)
                columns = {row[1] for row in db.execute("PRAGMA table_info(exports)")}
                if "downloaded" not in columns:  # a table an older version made
                    db.execute("ALTER TABLE exports ADD COLUMN downloaded REAL")
                if "format" not in columns:  # made before xlsx: every export was CSV
                    db.execute("ALTER TABLE exports ADD COLUMN format TEXT NOT NULL DEFAULT 'csv'")
                if "identity" not in columns:  # made before exports knew their identity
                    db.execute("ALTER TABLE exports ADD COLUMN identity TEXT")
                db.execute(_IDENTITY_INDEX)
            except BaseException:
                db.close()
                raise
            self._db = db

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    @contextlib.contextmanager
    def _connect(self, *, durable: bool = True) -> Iterator[sqlite3.Connection]:
        # Autocommit: each statement is its own transaction, visible to readers at once.
        with self._lock:
            db = self._db
            if db is None:
                raise RecordError(f"{self.path}: the download centre is not open")
            if durable:
                yield db
                return
            # Visible at once all the same; only a power cut could lose it (the database
            # stays sound), which costs a progress figure, not an export.
            db.execute("PRAGMA synchronous = NORMAL")
            try:
                yield db
            finally:
                db.execute("PRAGMA synchronous = FULL")

    def create(
        self,
        export_id: str,
        owner: str | None,
        now: float,
        form: str = "csv",
        identity: str | None = None,
    ) -> None:
        with self._connect() as db:
            db.execute(
                "INSERT INTO exports (id, owner, status, created, format, identity) "
                "VALUES (?, ?, 'running', ?, ?, ?)",
                (export_id, owner, now, form, identity),
            )

    def progress(self, export_id: str, rows: int) -> None:
        self._update(export_id, "running", "running", durable=False, rows=rows)

    def finish(self, export_id: str, rows: int, file: str, now: float) -> None:
        self._update(export_id, "running", "done", rows=rows, file=file, finished=now)

    def fail(self, export_id: str, rows: int, error: str, now: float) -> None:
        self._update(
            export_id, "running", "failed", rows=rows, error=error[:MAX_ERROR], finished=now
        )

    def expire(self, export_id: str) -> None:
        """The file was deleted after its retention: say so, and forget its name."""
        self._update(export_id, "done", "expired", file=None)

    def mark_downloaded(self, export_id: str, when: float) -> None:
        """Its file was downloaded whole: the mark, set by the export's id. Not a change of
        state, so any finished record takes it (an expiry may come between)."""
        with self._connect() as db:
            changed = db.execute(
                "UPDATE exports SET downloaded = ? WHERE id = ? AND status IN ('done', 'expired')",
                (when, export_id),
            ).rowcount
        if changed != 1:
            raise RecordError(
                f"export {export_id}: expected a finished record to mark downloaded, "
                f"but the update changed {changed} rows"
            )

    def _update(
        self,
        export_id: str,
        old: RecordStatus,
        new: RecordStatus,
        *,
        durable: bool = True,
        **fields: Any,
    ) -> None:
        if new != old:
            check_transition(old, new)
        # Column names come from this module, never from a request; values are parameters.
        sets = ", ".join(["status = ?", *(f"{name} = ?" for name in fields)])
        with self._connect(durable=durable) as db:
            changed = db.execute(
                f"UPDATE exports SET {sets} WHERE id = ? AND status = ?",
                (new, *fields.values(), export_id, old),
            ).rowcount
        if changed != 1:
            raise RecordError(
                f"export {export_id}: expected a {old} record to set {new}, "
                f"but the update changed {changed} rows"
            )

    def fail_running(self, error: str, now: float) -> list[Record]:
        """Mark every export still ``running`` failed, with ``error``: at start-up, those
        are exports a previous process left behind. Returns them as they were."""
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")  # nothing starts between the read and the write
            try:
                stale = self._select(db, "WHERE status = 'running'")
                db.execute(
                    "UPDATE exports SET status = 'failed', error = ?, finished = ? "
                    "WHERE status = 'running'",
                    (error[:MAX_ERROR], now),
                )
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        return stale

    def due(self, cutoff: float) -> list[Record]:
        """Finished exports whose files have been kept since ``cutoff`` or longer."""
        with self._connect() as db:
            return self._select(
                db, "WHERE status = 'done' AND finished <= ? ORDER BY finished", (cutoff,)
            )

    def owned_by(self, identity: str, limit: int) -> list[Record]:
        """The newest ``limit`` exports ``identity`` started."""
        with self._connect() as db:
            return self._select(
                db, "WHERE identity = ? ORDER BY created DESC LIMIT ?", (identity, limit)
            )

    def get(self, export_id: str) -> Record | None:
        with self._connect() as db:
            found = self._select(db, "WHERE id = ?", (export_id,))
        return found[0] if found else None

    @staticmethod
    def _select(db: sqlite3.Connection, where: str, args: tuple[Any, ...] = ()) -> list[Record]:
        cursor = db.execute(f"SELECT {_COLUMNS} FROM exports {where}", args)
        return [Record(*row) for row in cursor]
