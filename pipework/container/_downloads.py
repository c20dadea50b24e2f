"""The download centre: the owner's jobs listed from the server, their files downloaded by
short-lived signed links, one at a time or several as one streamed zip.

A route whose jobs leave a file registers a :class:`~._result_files.FileResults` on the
container (:meth:`Container.add_file_results`): it says what it knows of a job's file (a
:class:`~._result_files.ResultFile`: name, where it is, rows, size, its own state, its
owner) and keeps the "downloaded" mark. Its records are the source of truth for the file:
a job the job store no longer knows (the memory store after a restart, or past its
retention) is still listed from them, for the owner whose token hashes to the record's
``owner``.

- ``GET /jobs`` lists the caller's jobs: those of the tickets the client holds
  (``X-Job-Tickets: ID:TOKEN, ...``, as ``GET /jobs/events``:
  :func:`~._downloads_access.claims`) and, when the endpoints have an authentication
  (``[server] jobs_auth``, :attr:`DownloadsApi.auth`), those its identity owns
  (``JobRecord.owner``, recorded when an authenticated route started them): the job
  store's owner index, and the files the routes' records say the identity owns
  (:class:`~._result_files.OwnedFiles`: a listing that outlives a store that forgets).
  Then a request without the credential is a 401. ``q``, ``status``, ``from`` and ``to``
  filter it.
- Each listed file that can be downloaded carries ``href``, ``/jobs/{id}/file?exp=&sig=``:
  HMAC-SHA256 with the deployment's secret (the callback secret) over ``GET``, the path
  and ``exp``, good for :data:`~._downloads_access.LINK_TTL` seconds. The token never goes
  in a URL.
- ``POST /jobs/downloads`` (the tickets, and ``{"ids": [...]}``) answers one signed link
  to ``/jobs/files.zip?ids=...``: every file in one zip, streamed as it is read, in
  memory one chunk at a time however large the files are.
- A download that reached its last byte sets the file's "downloaded" mark, through its
  :class:`~._result_files.FileResults`.

Its parts: the files' records (:mod:`._result_files`), who may have them and the signed
links (:mod:`._downloads_access`), the listing (:mod:`._downloads_listing`), and the zips
(:mod:`._downloads_zip`); this module serves the downloads.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote, urlencode

import trio
from quart import Response, request

from .._http._bodies import JSON, decode, dumps_json, read_body
from .._http._jobs import job_token
from .._http._problems import Problem
from ._downloads_access import MAX_TICKETS, VISIBLE_ASCII, claims
from ._downloads_listing import JobListing, iso
from ._downloads_zip import CHUNK, zip_chunks
from ._result_files import ResultFile

__all__ = ["DownloadsApi", "add_download_rules"]

_log = logging.getLogger("pipework.downloads")


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


class DownloadsApi(JobListing):
    """The handlers behind ``GET /jobs`` (:class:`~._downloads_listing.JobListing`),
    ``POST /jobs/downloads``, ``GET /jobs/{id}/file`` and ``GET /jobs/files.zip``."""

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
            or not all(isinstance(i, str) and VISIBLE_ASCII.match(i) for i in ids)
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
            dumps_json({"href": href, "expires_at": iso(expires)}), content_type=JSON
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


def _close(opened: Any) -> None:
    """Close a file opened for reading, at once: closing a read-only file does not block
    (nothing to flush), and a response body closed by a client that left, or collected,
    may not await."""
    opened.wrapped.close()


def add_download_rules(app: Any, api: DownloadsApi) -> None:
    app.add_url_rule("/jobs", "jobs_list", api.list_jobs, methods=["GET"])
    app.add_url_rule("/jobs/downloads", "jobs_batch_link", api.batch_link, methods=["POST"])
    app.add_url_rule("/jobs/files.zip", "jobs_zip", api.download_zip, methods=["GET"])
    app.add_url_rule("/jobs/<job_id>/file", "job_file", api.download, methods=["GET"])
