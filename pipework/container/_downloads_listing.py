"""The download centre's listing, ``GET /jobs``: the caller's jobs (its tickets', and its
identity's with ``jobs_auth``, from the job store's owner index and the routes' records),
newest first, filtered by ``q``, ``status``, ``from`` and ``to``, each with its file and,
when it can be downloaded, a signed link to it.

A part of :class:`~._downloads.DownloadsApi` (a base it is made of), in a module of its
own so the download centre reads in one sitting.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final
from urllib.parse import quote

from quart import Response, request

from .._errors import JobNotFound
from .._http._bodies import JSON, dumps_json
from .._http._jobs import job_document
from .._http._problems import Problem
from ..dispatcher._job import JobView
from ._downloads_access import MAX_TICKETS, FileAccess, claims
from ._result_files import OwnedFiles, ResultFile, owned_file

__all__ = ["MAX_LOOKED_AT", "STATES", "JobListing", "iso"]

#: The most of an identity's jobs one listing looks at (newest first, a page of
#: :data:`MAX_TICKETS` at a time) for those its filters take; older ones are reached by
#: narrowing ``to``.
MAX_LOOKED_AT: Final = 10 * MAX_TICKETS
#: What the listing's ``state`` may be: the job's status, or ``expired`` for a done job
#: whose file was deleted.
STATES: Final = frozenset(
    {"queued", "running", "suspended", "done", "failed", "cancelled", "expired"}
)
_DATE: Final = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}\Z")


@dataclass(frozen=True, slots=True)
class _Filters:
    text: str
    states: frozenset[str]
    since: float | None
    until: float | None

    @classmethod
    def parse(cls, args: Any) -> _Filters:
        states = frozenset(s.strip() for s in args.get("status", "").split(",") if s.strip())
        unknown = sorted(states - STATES)
        if unknown:
            raise Problem(
                400,
                "Bad listing filter",
                f"status={unknown[0]!r} is not a state; use one or more of "
                f"{', '.join(sorted(STATES))}, comma-separated",
                slug="bad-filter",
            )
        return cls(
            args.get("q", "").strip().casefold(),
            states,
            _instant(args.get("from"), "from", end_of_day=False),
            _instant(args.get("to"), "to", end_of_day=True),
        )

    def match(self, entry: dict[str, Any], created: float | None, name: str) -> bool:
        if self.states and entry["state"] not in self.states:
            return False
        if self.text and not any(
            self.text in str(v).casefold() for v in (entry["id"], entry["chain"], name)
        ):
            return False
        if self.since is not None and (created is None or created < self.since):
            return False
        return not (self.until is not None and (created is None or created > self.until))


def _instant(text: str | None, name: str, *, end_of_day: bool) -> float | None:
    """``from``/``to``: a date (``2026-12-02``, the whole day) or an RFC 3339 time."""
    if not text:
        return None
    try:
        if _DATE.match(text):
            day = datetime.fromisoformat(text).replace(tzinfo=UTC)
            return day.timestamp() + (86_400 - 0.001 if end_of_day else 0)
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        moment = None
    if moment is None:
        raise Problem(
            400,
            "Bad listing filter",
            f"{name}={text!r} is neither a date (2026-12-02) nor a time (2026-12-02T10:00:00Z)",
            slug="bad-filter",
        )
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def iso(unix: float | None) -> str | None:
    if unix is None:
        return None
    return datetime.fromtimestamp(unix, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _document_of(file: ResultFile) -> dict[str, Any]:
    """A job the store no longer knows, as its file's records tell it: the fields of
    ``GET /jobs/{id}`` they can fill."""
    failed = file.state == "failed"
    return {
        "id": file.job_id,
        "chain": file.chain,
        "status": "done" if file.state == "expired" else file.state,
        "correlation_id": None,
        "progress": None if file.rows is None else {"done": file.rows, "total": None},
        "waiting_for": None,
        "error": {"title": "Failed", "detail": file.error} if failed else None,
        "created_at": iso(file.created),
        "updated_at": iso(file.finished or file.created),
        "finished_at": iso(file.finished),
        "expires_at": None,
        "retain_until": None,
        "degraded": {},
        "links": {},
    }


class JobListing(FileAccess):
    """The handler behind ``GET /jobs`` (see the module)."""

    def _entry(self, job_id: str, view: JobView | None, file: ResultFile | None) -> dict[str, Any]:
        if view is not None:
            entry = job_document(view, expose=self.expose_errors)
            state = view.status.value
        else:
            assert file is not None
            entry = _document_of(file)
            state = file.state
        if file is not None and (
            file.state == "expired" or (state == "done" and file.state == "done" and not file.ready)
        ):
            state = "expired"
        entry["state"] = state
        entry["file"] = None if file is None else self._file_document(file, state)
        return entry

    def _file_document(self, file: ResultFile, state: str) -> dict[str, Any]:
        document: dict[str, Any] = {
            "name": file.name,
            "state": file.state,
            "media_type": file.media_type,
            "rows": file.rows,
            "size": file.size,
            "keep_until": iso(file.keep_until),
            "downloaded_at": iso(file.downloaded),
            "href": None,
            "href_expires_at": None,
        }
        if file.ready and state == "done":
            href, expires = self._link(f"/jobs/{quote(file.job_id, safe='')}/file", "?")
            document["href"], document["href_expires_at"] = href, iso(expires)
        return document

    async def list_jobs(self) -> Response:
        """``GET /jobs``: the caller's jobs, newest first, those the filters take: its
        identity's (with ``jobs_auth``), and those of the tickets it sends."""
        owner = await self.caller()
        filters = _Filters.parse(request.args)
        tickets = claims(request.headers)
        listed: list[tuple[float, dict[str, Any]]] = []
        missing: list[str] = []
        seen: set[str] = set()
        more = False
        if owner is not None:
            more = await self._list_owned(owner, filters, seen, listed)
        for job_id, token in tickets:
            if job_id in seen:
                continue
            view, file = await self._owned(job_id, token)
            if view is None and file is None:
                missing.append(job_id)
                continue
            seen.add(job_id)
            self._add(listed, filters, job_id, view, file)
        listed.sort(key=lambda pair: pair[0], reverse=True)
        if len(listed) > MAX_TICKETS:
            listed, more = listed[:MAX_TICKETS], True
        # A job named by a good ticket and a bad one is listed, not missing.
        missing = list(dict.fromkeys(i for i in missing if i not in seen))
        body: dict[str, Any] = {"jobs": [entry for _, entry in listed], "missing": missing}
        if owner is not None:
            body["more"] = more
        response = Response(dumps_json(body), content_type=JSON)
        response.headers["Cache-Control"] = "no-store"  # it holds signed links
        return response

    def _add(
        self,
        listed: list[tuple[float, dict[str, Any]]],
        filters: _Filters,
        job_id: str,
        view: JobView | None,
        file: ResultFile | None,
    ) -> None:
        """The job's entry in ``listed``, if the filters take it."""
        entry = self._entry(job_id, view, file)
        created = view.created_at if view is not None else file.created if file else None
        name = file.name if file is not None else ""
        if filters.match(entry, created, name):
            listed.append((created or 0.0, entry))

    async def _list_owned(
        self,
        owner: str,
        filters: _Filters,
        seen: set[str],
        listed: list[tuple[float, dict[str, Any]]],
    ) -> bool:
        """``owner``'s jobs into ``listed``, those the filters take: the job store's index,
        newest first, a page at a time, from ``to`` on back to ``from``, until
        :data:`MAX_TICKETS` are listed or :data:`MAX_LOOKED_AT` were looked at; then the
        files the routes' records say are its (:class:`OwnedFiles`) whose jobs the store no
        longer knows. True if older jobs are left unlooked at."""
        until = filters.until
        before = None if until is None else math.nextafter(until, math.inf)
        looked = 0
        more = False
        while True:
            views, older = await self.engine.owned(owner, limit=MAX_TICKETS, before=before)
            for view in views:
                if filters.since is not None and view.created_at < filters.since:
                    older = None  # every other one is older still
                    break
                looked += 1
                seen.add(view.id)
                file = owned_file(await self.file_of(view.id), owner, True)
                self._add(listed, filters, view.id, view, file)
            if older is None:
                break
            if looked >= MAX_LOOKED_AT or len(listed) >= MAX_TICKETS:
                more = True
                break
            before = older
        for provider in self.providers:
            if not isinstance(provider, OwnedFiles):
                continue
            for file in await provider.files_of(owner, limit=MAX_TICKETS):
                if file.job_id in seen or owned_file(file, owner, False) is None:
                    continue
                seen.add(file.job_id)
                known: JobView | None = None
                with contextlib.suppress(JobNotFound):
                    known = await self.engine.authorize_owner(file.job_id, owner)
                self._add(listed, filters, file.job_id, known, file)
        return more
