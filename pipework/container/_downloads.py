"""The download centre: the owner's jobs listed from the server, their files downloaded by
short-lived signed links, one at a time or several as one streamed zip.

A route whose jobs leave a file registers a :class:`FileResults` on the container
(:meth:`Container.add_file_results`): it says what it knows of a job's file (a
:class:`ResultFile`: name, where it is, rows, size, its own state, its owner) and keeps the
"downloaded" mark. Its records are the source of truth for the file: a job the job store
no longer knows (the memory store after a restart, or past its retention) is still listed
from them, for the owner whose token hashes to the record's ``owner``.

- ``GET /jobs`` lists the caller's jobs: those of the tickets the client holds
  (``X-Job-Tickets: ID:TOKEN, ...``, as ``GET /jobs/events``: :func:`claims`) and, when
  the endpoints have an authentication (``[server] jobs_auth``, :attr:`DownloadsApi.auth`),
  those its identity owns (``JobRecord.owner``, recorded when an authenticated route
  started them): the job store's owner index, and the files the routes' records say the
  identity owns (:class:`OwnedFiles`: a listing that outlives a store that forgets).
  Then a request without the credential is a 401. ``q``, ``status``, ``from`` and ``to``
  filter it.
- Each listed file that can be downloaded carries ``href``, ``/jobs/{id}/file?exp=&sig=``:
  HMAC-SHA256 with the deployment's secret (the callback secret) over ``GET``, the path
  and ``exp``, good for :data:`LINK_TTL` seconds. The token never goes in a URL.
- ``POST /jobs/downloads`` (the tickets, and ``{"ids": [...]}``) answers one signed link
  to ``/jobs/files.zip?ids=...``: every file in one zip, streamed as it is read, in
  memory one chunk at a time however large the files are.
- A download that reached its last byte sets the file's "downloaded" mark, through its
  :class:`FileResults`.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import math
import os
import re
import time
import zipfile
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Literal, Protocol, runtime_checkable
from urllib.parse import quote, urlencode

import trio
from quart import Response, request

from .._errors import JobNotFound
from .._http._auth import RouteAuth, put_identity
from .._http._bodies import JSON, decode, dumps_json, read_body
from .._http._jobs import job_document, job_token
from .._http._problems import Problem
from ..dispatcher._engine import Engine
from ..dispatcher._job import JobView, hash_token
from ._callbacks import CallbackSigner

__all__ = [
    "LINK_TTL",
    "MAX_LOOKED_AT",
    "MAX_TICKETS",
    "DownloadsApi",
    "FileResults",
    "OwnedFiles",
    "ResultFile",
    "claims",
]

_log = logging.getLogger("pipework.downloads")

#: How long a signed download link works, in seconds: long enough to click, short enough
#: that a link copied out of the page (or a proxy's log) soon opens nothing.
LINK_TTL: Final = 300
#: The most jobs one listing, one stream or one zip may name.
MAX_TICKETS: Final = 200
#: The most of an identity's jobs one listing looks at (newest first, a page of
#: :data:`MAX_TICKETS` at a time) for those its filters take; older ones are reached by
#: narrowing ``to``.
MAX_LOOKED_AT: Final = 10 * MAX_TICKETS
#: Bytes read (and, in a zip, held) at a time.
CHUNK: Final = 256 * 1024

FileState = Literal["running", "done", "failed", "expired"]
#: What the listing's ``state`` may be: the job's status, or ``expired`` for a done job
#: whose file was deleted.
STATES: Final = frozenset(
    {"queued", "running", "suspended", "done", "failed", "cancelled", "expired"}
)
_VISIBLE_ASCII: Final = re.compile(r"[\x21-\x7e]+\Z")
_EXPIRES: Final = re.compile(r"[0-9]{1,12}\Z")
_SIGNATURE: Final = re.compile(r"[A-Za-z0-9_-]{1,128}\Z")
_DATE: Final = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}\Z")


@dataclass(frozen=True, slots=True)
class ResultFile:
    """A job's file, as the download centre lists and serves it.

    ``owner`` is the hash of the job's owner token (what the job store keeps:
    SHA-256, hex); ``identity``, the owner string of the authenticated caller who started
    the job (``JobRecord.owner``, ``AUTH:SUBJECT``), when one did; ``state`` is the file's
    own (``expired`` once it was deleted); ``path`` is where it is while it can be
    downloaded. Times are Unix seconds."""

    job_id: str
    name: str
    owner: str | None
    state: FileState
    path: Path | None = None
    chain: str = ""
    media_type: str = "application/octet-stream"
    rows: int | None = None
    size: int | None = None
    created: float | None = None
    finished: float | None = None
    keep_until: float | None = None
    error: str | None = None
    downloaded: float | None = None
    identity: str | None = None

    @property
    def ready(self) -> bool:
        return self.state == "done" and self.path is not None


class FileResults(Protocol):
    """What a route whose jobs leave files tells the download centre."""

    async def result_file(self, job_id: str) -> ResultFile | None:
        """The job's file, if this route made one for it (running, done, failed or
        expired); None for a job it knows nothing of."""
        ...

    async def mark_downloaded(self, job_id: str, when: float) -> None:
        """Its file was downloaded whole at ``when`` (Unix seconds): keep the mark."""
        ...


@runtime_checkable
class OwnedFiles(Protocol):
    """A :class:`FileResults` whose records also list an identity's files: the download
    centre then lists them for that identity even when the job store no longer knows
    their jobs (the memory store after a restart)."""

    async def files_of(self, identity: str, *, limit: int) -> list[ResultFile]:
        """At most ``limit`` of the files whose ``identity`` is this one, newest first."""
        ...


def claims(headers: Any) -> list[tuple[str, str]]:
    """The jobs a request names by ticket: ``(job id, token)`` pairs from
    ``X-Job-Tickets`` (an authenticated identity names its own besides: see
    :meth:`DownloadsApi.caller`)."""
    tickets = [t.strip() for t in headers.get("X-Job-Tickets", "").split(",")]
    tickets = [t for t in tickets if t]
    if len(tickets) > MAX_TICKETS:
        raise _bad_tickets(f"it names {len(tickets)} jobs; at most {MAX_TICKETS}")
    pairs: list[tuple[str, str]] = []
    for number, ticket in enumerate(tickets, 1):
        job_id, colon, token = ticket.partition(":")
        if not _VISIBLE_ASCII.match(ticket) or not colon or not job_id or not token:
            raise _bad_tickets(
                f"ticket {number} is not ID:TOKEN in visible ASCII (the job's X-Job-Id "
                "and X-Job-Token)"
            )
        pairs.append((job_id, token))
    return list(dict.fromkeys(pairs))


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


def _iso(unix: float | None) -> str | None:
    if unix is None:
        return None
    return datetime.fromtimestamp(unix, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _bad_tickets(why: str) -> Problem:
    return Problem(
        400, "Bad job tickets", f"X-Job-Tickets cannot be read: {why}", slug="bad-job-tickets"
    )


def _refused(detail: str) -> Problem:
    return Problem(403, "Download refused", detail, slug="download-refused")


def _no_file(job_id: str) -> Problem:
    # The same for an unknown job and one that is not the caller's: nothing to tell apart.
    return Problem(
        404,
        "Job not found",
        f"no job {job_id} with a file for this caller (unknown id, wrong token, or a job "
        "that makes no file)",
        slug="job-not-found",
    )


def _not_ready(file: ResultFile) -> Problem:
    if file.state == "expired" or (file.state == "done" and file.path is None):
        return Problem(
            410,
            "File gone",
            f"job {file.job_id}'s file was deleted after its retention time; start a new job",
            slug="file-gone",
        )
    if file.state == "failed":
        return Problem(
            409,
            "No file",
            f"job {file.job_id} failed and left no file: {file.error or 'no reason recorded'}",
            slug="file-failed",
        )
    return Problem(
        409,
        "File not ready",
        f"job {file.job_id} is still writing its file ({file.rows or 0:,} rows so far); "
        "it can be downloaded once the job is done",
        slug="file-not-ready",
        headers={"Retry-After": "5"},
    )


def _disposition(name: str) -> str:
    """``attachment`` with the name as ASCII and, for any other name, RFC 6266's
    ``filename*`` in UTF-8 too."""
    plain = "".join(c if " " <= c <= "~" and c not in '"\\' else "_" for c in name)
    value = f'attachment; filename="{plain}"'
    if plain != name:
        value += f"; filename*=UTF-8''{quote(name, safe='')}"
    return value


class _Sink:
    """What zipfile writes to: held until taken, one chunk and a header or two at most."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: bytes, /) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.parts.clear()

    def take(self) -> bytes:
        data = b"".join(self.parts)
        self.parts.clear()
        return data


def _zip_name(name: str, taken: set[str]) -> str:
    """``name``, or ``name (2)`` and so on: two jobs' files may share a name."""
    stem, dot, suffix = name.rpartition(".")
    if not dot:
        stem, suffix = name, ""
    candidate, n = name, 1
    while candidate in taken:
        n += 1
        candidate = f"{stem} ({n}).{suffix}" if dot else f"{stem} ({n})"
    taken.add(candidate)
    return candidate


async def zip_chunks(
    entries: Iterable[tuple[str, Any, int, float | None]],
) -> AsyncIterator[bytes]:
    """One zip of ``(name, trio file open for reading, size, time)`` entries, as chunks:
    each file is read :data:`CHUNK` bytes at a time and its bytes given on at once (stored,
    not compressed: no CPU on the event loop; a data descriptor after each file, since its
    CRC is known only at its end; ZIP64 for a file of 2 GiB or more)."""
    sink = _Sink()
    taken: set[str] = set()
    with zipfile.ZipFile(sink, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, file, size, when in entries:
            stamp = datetime.fromtimestamp(when or time.time(), UTC)
            info = zipfile.ZipInfo(_zip_name(name, taken), stamp.timetuple()[:6])
            info.compress_type = zipfile.ZIP_STORED
            with archive.open(info, "w", force_zip64=size >= 2**31) as entry:
                while chunk := await file.read(CHUNK):
                    entry.write(chunk)
                    yield sink.take()
            yield sink.take()
    yield sink.take()  # the central directory


class DownloadsApi:
    """The handlers behind ``GET /jobs``, ``POST /jobs/downloads``, ``GET /jobs/{id}/file``
    and ``GET /jobs/files.zip``."""

    def __init__(
        self,
        engine: Engine,
        signer: CallbackSigner,
        *,
        expose_errors: bool,
        max_body: int,
        body_time_limit: float,
        link_ttl: int = LINK_TTL,
        auth: RouteAuth | None = None,
    ) -> None:
        self.engine = engine
        #: Who may call ``GET /jobs``, ``POST /jobs/downloads`` and ``GET /jobs/events``
        #: (``[server] jobs_auth``): they then list and serve the identity's jobs, and
        #: answer 401 without its credential. None: tickets alone.
        self.auth = auth
        self.signer = signer
        self.expose_errors = expose_errors
        self.max_body = max_body
        self.body_time_limit = body_time_limit
        self.link_ttl = link_ttl
        self.providers: list[FileResults] = []

    # -- what is known of a job ----------------------------------------------------------

    async def file_of(self, job_id: str) -> ResultFile | None:
        found = await self._lookup(job_id)
        return None if found is None else found[1]

    async def _lookup(self, job_id: str) -> tuple[FileResults, ResultFile] | None:
        """The job's file and the route that made it, if one did."""
        for provider in self.providers:
            file = await provider.result_file(job_id)
            if file is not None:
                return provider, file
        return None

    async def _owned(self, job_id: str, token: str) -> tuple[JobView | None, ResultFile | None]:
        """The job (if the store knows it) and its file (if a route made one), each only
        if ``token`` is its owner's."""
        view: JobView | None
        try:
            view = await self.engine.authorize(job_id, token)
        except JobNotFound:  # unknown, not the caller's, or dropped: the file may say more
            view = None
        file = await self.file_of(job_id)
        if file is not None and (
            file.owner is None or not hmac.compare_digest(file.owner, hash_token(token))
        ):
            file = None
        return view, file

    async def caller(self) -> str | None:
        """The owner string of the request's identity (``Identity.owner``) when the
        endpoints have an authentication: a 401 (or 403) :class:`Problem` without a good
        credential. None when they have none."""
        auth = self.auth
        if auth is None:
            return None
        headers = {name.lower(): value for name, value in request.headers.items()}
        identity = await auth.authenticate(headers)
        scope: Any = request.scope  # the ASGI scope, a dict (typed as a TypedDict)
        put_identity(scope, identity)
        return identity.owner

    async def owned_views(self, owner: str) -> list[JobView]:
        """The newest :data:`MAX_TICKETS` jobs of ``owner`` the job store knows (what
        ``GET /jobs/events`` follows for an identity)."""
        return (await self.engine.owned(owner, limit=MAX_TICKETS))[0]

    async def _owned_by(self, job_id: str, owner: str) -> tuple[JobView | None, ResultFile | None]:
        """The job (if the store knows it) and its file (if a route made one), each only
        if ``owner`` owns it: the job by its record's owner, the file by its record's
        identity, or, with none recorded, by being the file of a job ``owner`` owns."""
        view: JobView | None
        try:
            view = await self.engine.authorize_owner(job_id, owner)
        except JobNotFound:
            view = None
        return view, _owned_file(await self.file_of(job_id), owner, view is not None)

    # -- signed links --------------------------------------------------------------------

    def _link(self, target: str, joiner: str) -> tuple[str, int]:
        expires = math.ceil(self.signer.now() + self.link_ttl)
        signature = self.signer.signature("GET", target, expires)
        return f"{target}{joiner}{urlencode({'exp': expires, 'sig': signature})}", expires

    def _verify(self, target: str) -> None:
        exp, sig = request.args.get("exp"), request.args.get("sig")
        if exp is None or sig is None or not _EXPIRES.match(exp) or not _SIGNATURE.match(sig):
            raise _refused(
                "the download link lacks its exp and sig parameters, or one is malformed; "
                "take a new link from the download centre (or send the job's token)"
            )
        expected = self.signer.signature("GET", target, int(exp))
        if not hmac.compare_digest(expected.encode(), sig.encode("ascii")):
            raise _refused("the download link's signature does not match what it names")
        if int(exp) <= self.signer.now():
            raise _refused(
                "the download link has expired; the download centre gives a new one "
                f"(links last {self.link_ttl}s)"
            )

    # -- the listing ---------------------------------------------------------------------

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
            "keep_until": _iso(file.keep_until),
            "downloaded_at": _iso(file.downloaded),
            "href": None,
            "href_expires_at": None,
        }
        if file.ready and state == "done":
            href, expires = self._link(f"/jobs/{quote(file.job_id, safe='')}/file", "?")
            document["href"], document["href_expires_at"] = href, _iso(expires)
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
                file = _owned_file(await self.file_of(view.id), owner, True)
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
                if file.job_id in seen or _owned_file(file, owner, False) is None:
                    continue
                seen.add(file.job_id)
                known: JobView | None = None
                with contextlib.suppress(JobNotFound):
                    known = await self.engine.authorize_owner(file.job_id, owner)
                self._add(listed, filters, file.job_id, known, file)
        return more

    # -- downloads -----------------------------------------------------------------------

    async def batch_link(self) -> Response:
        """``POST /jobs/downloads`` with ``{"ids": [...]}``: a signed link to their zip, for
        jobs the caller's tickets or identity own."""
        owner = await self.caller()
        owned: dict[str, list[str]] = {}
        for job_id, token in claims(request.headers):
            owned.setdefault(job_id, []).append(token)
        data = await read_body(request, limit=self.max_body, time_limit=self.body_time_limit)
        body = decode(data, request.mimetype or None, what="download request")
        ids = body.get("ids") if isinstance(body, dict) else None
        if (
            not isinstance(ids, list)
            or not ids
            or len(ids) > MAX_TICKETS
            or not all(isinstance(i, str) and _VISIBLE_ASCII.match(i) for i in ids)
        ):
            raise Problem(
                422,
                "Bad download request",
                f'the body must be {{"ids": [...]}} with 1 to {MAX_TICKETS} job ids',
                slug="bad-download-request",
            )
        ids = list(dict.fromkeys(ids))
        for job_id in ids:
            file = None
            for token in owned.get(job_id, ()):
                file = file or (await self._owned(job_id, token))[1]
            if file is None and owner is not None:
                file = (await self._owned_by(job_id, owner))[1]
            if file is None:
                raise _no_file(job_id)
            if not file.ready:
                raise _not_ready(file)
        href, expires = self._link(f"/jobs/files.zip?{urlencode({'ids': ','.join(ids)})}", "&")
        response = Response(
            dumps_json({"href": href, "expires_at": _iso(expires)}), content_type=JSON
        )
        response.headers["Cache-Control"] = "no-store"
        return response

    async def download(self, job_id: str) -> Response:
        """``GET /jobs/{id}/file``: the file, by a signed link, with the job's token, or
        (with ``jobs_auth``) with the credential of the identity that owns it."""
        token = job_token(request.headers)
        if token is not None and "sig" not in request.args:
            file = (await self._owned(job_id, token))[1]
        elif self.auth is not None and "sig" not in request.args:
            owner = await self.caller()
            assert owner is not None
            file = (await self._owned_by(job_id, owner))[1]
        else:
            self._verify(f"/jobs/{quote(job_id, safe='')}/file")
            file = await self.file_of(job_id)
        if file is None:
            raise _no_file(job_id)
        opened = await self._open(file)
        size = os.fstat(opened.wrapped.fileno()).st_size
        response = Response(
            self._chunks(file, opened), content_type=file.media_type or "application/octet-stream"
        )
        response.headers["Content-Length"] = str(size)
        response.headers["Content-Disposition"] = _disposition(file.name)
        response.headers["Cache-Control"] = "no-store"
        response.timeout = None  # a large file may take longer than Quart's response timeout
        return response

    async def download_zip(self) -> Response:
        """``GET /jobs/files.zip?ids=...``: the files of ``ids`` in one zip, by a signed
        link (``POST /jobs/downloads`` hands them out)."""
        ids_text = request.args.get("ids", "")
        self._verify(f"/jobs/files.zip?{urlencode({'ids': ids_text})}")
        files: list[ResultFile] = []
        for job_id in ids_text.split(","):
            file = await self.file_of(job_id)
            if file is None:
                raise _no_file(job_id)
            files.append(file)
        opened: list[tuple[ResultFile, Any]] = []
        try:
            for file in files:
                opened.append((file, await self._open(file)))
        except BaseException:
            for _, handle in opened:
                _close(handle)
            raise
        response = Response(self._zip(opened), content_type="application/zip")
        response.headers["Content-Disposition"] = _disposition(
            f"downloads-{datetime.now(UTC):%Y%m%d-%H%M%S}.zip"
        )
        response.headers["Cache-Control"] = "no-store"
        response.timeout = None
        return response

    @staticmethod
    async def _open(file: ResultFile) -> Any:
        """The file, opened before answering: a retention cleanup that deletes it now
        cannot cut the download short (an open file lives on until it is closed)."""
        if not file.ready:
            raise _not_ready(file)
        assert file.path is not None
        try:
            return await trio.open_file(file.path, "rb")
        except FileNotFoundError:
            raise _not_ready(
                ResultFile(file.job_id, file.name, file.owner, "expired", None)
            ) from None

    async def _chunks(self, file: ResultFile, opened: Any) -> AsyncIterator[bytes]:
        try:
            while chunk := await opened.read(CHUNK):
                yield chunk
        finally:
            _close(opened)
        await self._mark([file])

    async def _zip(self, opened: list[tuple[ResultFile, Any]]) -> AsyncIterator[bytes]:
        try:
            entries = [
                (f.name, h, os.fstat(h.wrapped.fileno()).st_size, f.finished) for f, h in opened
            ]
            async for chunk in zip_chunks(entries):
                if chunk:
                    yield chunk
        finally:
            for _, handle in opened:
                _close(handle)
        await self._mark([f for f, _ in opened])

    async def _mark(self, files: list[ResultFile]) -> None:
        """The whole file went out: its mark. One that cannot be kept is logged; the
        download itself succeeded."""
        when = self.signer.now()
        for file in files:
            try:
                found = await self._lookup(file.job_id)
                if found is not None:
                    await found[0].mark_downloaded(file.job_id, when)
            except Exception:
                _log.exception("job %s: its downloaded mark could not be kept", file.job_id)


def _owned_file(file: ResultFile | None, owner: str, job_owned: bool) -> ResultFile | None:
    """``file`` if ``owner`` may have it: its record names that identity, or names none and
    its job is ``owner``'s (``job_owned``)."""
    if file is None:
        return None
    if file.identity is None:
        return file if job_owned else None
    # As bytes: an identity is any text, and compare_digest takes str only in ASCII.
    return file if hmac.compare_digest(_utf8(file.identity), _utf8(owner)) else None


def _utf8(text: str) -> bytes:
    # surrogatepass: any text encodes (as hash_token's).
    return text.encode("utf-8", "surrogatepass")


def _close(opened: Any) -> None:
    """Close a file opened for reading, at once: closing a read-only file does not block
    (nothing to flush), and a response body closed by a client that left, or collected,
    may not await."""
    opened.wrapped.close()


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
        "created_at": _iso(file.created),
        "updated_at": _iso(file.finished or file.created),
        "finished_at": _iso(file.finished),
        "expires_at": None,
        "retain_until": None,
        "degraded": {},
        "links": {},
    }


def add_download_rules(app: Any, api: DownloadsApi) -> None:
    app.add_url_rule("/jobs", "jobs_list", api.list_jobs, methods=["GET"])
    app.add_url_rule("/jobs/downloads", "jobs_batch_link", api.batch_link, methods=["POST"])
    app.add_url_rule("/jobs/files.zip", "jobs_zip", api.download_zip, methods=["GET"])
    app.add_url_rule("/jobs/<job_id>/file", "job_file", api.download, methods=["GET"])
