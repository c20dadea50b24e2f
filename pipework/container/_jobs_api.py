"""The job API: status, result, cancel and signals for a job, and the signed callbacks.

Every ``/jobs/{id}`` endpoint needs the job's token (``Authorization: Bearer <token>`` or
``X-Job-Token``). A wrong or missing token is answered exactly like an unknown id, 404, so
the API never confirms that an id exists to someone without its token. A job dropped after
its retention answers 410 Gone. ``/callbacks/...`` needs no token: its signature is the
authority, and it answers nothing about the job.
"""

from __future__ import annotations

import contextlib
import time
from datetime import UTC, datetime
from typing import Any

import trio
from quart import Response, request

from .._errors import JobNotFound
from ..dispatcher._engine import Engine
from ..dispatcher._job import JobView, Progress
from ..dispatcher._status import TERMINAL, Status
from ..dispatcher._store import JobGone
from ._bodies import choose_media_type, decode, encode, read_body
from ._callbacks import CallbackSigner
from ._credentials import bearer_token
from ._problems import Problem, problem_for_error

__all__ = ["JobsApi", "job_document", "job_links"]


def _iso(unix: float | None) -> str | None:
    if unix is None:
        return None
    return (
        datetime.fromtimestamp(unix, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )


def _wall(trio_time: float | None) -> str | None:
    """A time on trio's clock (deadlines, retention) as a UTC timestamp."""
    if trio_time is None or trio_time == float("inf"):
        return None
    return _iso(time.time() + (trio_time - trio.current_time()))


def job_links(view: JobView) -> dict[str, str]:
    base = f"/jobs/{view.id}"
    links = {"self": base}
    if view.status in TERMINAL:
        links["result"] = f"{base}/result"
    else:
        links["cancel"] = base
    if view.status is Status.SUSPENDED and view.waiting_for is not None:
        links["signal"] = f"{base}/signals/{view.waiting_for}"
    return links


def _progress_document(progress: Progress) -> dict[str, Any]:
    document: dict[str, Any] = {
        "done": progress.done,
        "total": progress.total,
        "message": progress.message,
    }
    if progress.branch is not None:  # reported from inside a parallel branch
        document["branch"] = progress.branch
    return document


def job_document(view: JobView, *, expose: bool = False) -> dict[str, Any]:
    """What ``GET /jobs/{id}`` answers: the job's status, without its result."""
    progress = view.progress
    error = None
    if view.error is not None:
        problem = problem_for_error(view.error, expose=expose)
        error = {
            "type": problem.type,
            "title": problem.title,
            "status": problem.status,
            "detail": problem.detail,
            "error_type": view.error.type,
            "where": view.error.where or None,
        }
    finished = view.status in TERMINAL
    return {
        "id": view.id,
        "chain": view.chain,
        "status": view.status.value,
        "correlation_id": view.correlation_id,
        "progress": None if progress is None else _progress_document(progress),
        "waiting_for": view.waiting_for,
        "error": error,
        "created_at": _iso(view.created_at),
        "updated_at": _iso(view.updated_at),
        "finished_at": _iso(view.finished_at),
        "expires_at": None if finished else _wall(view.deadline),
        "retain_until": _wall(view.retain_until) if finished else None,
        "links": job_links(view),
    }


def _not_found() -> Problem:
    # One answer for an unknown id and a wrong token: nothing to tell them apart by.
    return Problem(
        404,
        "Job not found",
        "no job with this id, or the token does not match",
        slug="job-not-found",
    )


def job_token() -> str | None:
    headers = request.headers
    token = bearer_token(headers.get("Authorization"))
    return token if token is not None else headers.get("X-Job-Token")


class JobsApi:
    """The handlers behind ``/jobs`` and ``/callbacks``."""

    def __init__(
        self,
        engine: Engine,
        signer: CallbackSigner,
        *,
        max_body: int,
        body_time_limit: float,
        cancel_wait: float,
        expose_errors: bool,
    ) -> None:
        self.engine = engine
        self.signer = signer
        self.max_body = max_body
        self.body_time_limit = body_time_limit
        self.cancel_wait = cancel_wait
        self.expose_errors = expose_errors

    async def authorize(self, job_id: str) -> JobView:
        try:
            return await self.engine.authorize(job_id, job_token())
        except JobGone:
            raise
        except JobNotFound:
            raise _not_found() from None

    def _answer(self, value: Any, status: int = 200) -> Response:
        media_type = choose_media_type(request)
        return Response(encode(value, media_type), status=status, content_type=media_type)

    async def status(self, job_id: str) -> Response:
        view = await self.authorize(job_id)
        return self._answer(job_document(view, expose=self.expose_errors))

    async def result(self, job_id: str) -> Response:
        view = await self.authorize(job_id)
        if view.status is Status.DONE:
            return self._answer(view.result)
        if view.status not in TERMINAL:
            raise Problem(
                409,
                "Job not finished",
                f"job {job_id} is {view.status.value}; its result is not there yet",
                slug="job-not-finished",
                headers={"Retry-After": "1", "Link": f'</jobs/{job_id}>; rel="status"'},
                job_status=view.status.value,
            )
        assert view.error is not None
        problem = problem_for_error(view.error, expose=self.expose_errors, job_id=job_id)
        problem.extensions["job_status"] = view.status.value
        raise problem

    async def cancel(self, job_id: str) -> Response:
        view = await self.authorize(job_id)
        if view.status not in TERMINAL:
            await self.engine.cancel(job_id)
            # A running pipe's cleanup runs first; answer with its end if it comes soon.
            with trio.move_on_after(self.cancel_wait):
                await _quietly_wait(self.engine, job_id)
            view = await self.engine.status(job_id)
        status = 200 if view.status in TERMINAL else 202
        return self._answer(job_document(view, expose=self.expose_errors), status)

    async def signal(self, job_id: str, name: str) -> Response:
        await self.authorize(job_id)
        payload = await self._payload()
        await self.engine.signal(job_id, name, payload)
        view = await self.engine.status(job_id)
        return self._answer(job_document(view, expose=self.expose_errors), 202)

    async def callback(self, job_id: str, name: str) -> Response:
        self.signer.verify(job_id, name, request.args.get("exp"), request.args.get("sig"))
        payload = await self._payload()
        await self.engine.signal(job_id, name, payload)
        return Response(b"", status=204)

    async def _payload(self) -> Any:
        data = await read_body(request, limit=self.max_body, time_limit=self.body_time_limit)
        return decode(data, request.headers.get("Content-Type"), what="signal payload")


async def _quietly_wait(engine: Engine, job_id: str) -> None:
    # The job's end is what is awaited here, not its outcome: its error is its record's.
    with contextlib.suppress(Exception):
        await engine.wait(job_id)
