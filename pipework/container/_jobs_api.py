"""The job API: status, result, cancel and signals for a job, and the signed callbacks.

Every ``/jobs/{id}`` endpoint needs the job's token, checked as ``pipework._http._jobs``
says (a wrong or missing token is a 404, as an unknown id; a dropped job 410). With
``[server] jobs_auth``, a job's status and result are also read by the credential of the
identity that started it (the one the listing shows it to): without its token, a request
bringing that auth's credential is authenticated (401 if it does not hold) and answered if
its identity owns the job (404 otherwise). Cancelling and signalling take the token alone.
``/callbacks/...`` needs no token: its signature is the authority, and it answers nothing
about the job.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Protocol

import trio
from quart import Response, request

from .._errors import JobNotFound, StoreUnavailable
from .._http._auth import RouteAuth
from .._http._bodies import choose_media_type, decode, encode, raw_answer, read_body
from .._http._jobs import authorize, job_document, job_token
from .._http._problems import Problem, problem_for_error
from ..dispatcher._engine import Engine
from ..dispatcher._job import JobView
from ..dispatcher._status import TERMINAL, Status
from ._callbacks import CallbackSigner

__all__ = ["Identities", "JobsApi", "signal_unsure"]

_log = logging.getLogger("pipework.container")


class Identities(Protocol):
    """Who may read their own jobs (the download centre's ``jobs_auth``)."""

    #: The authentication (None: tokens alone); a reload may change it.
    auth: RouteAuth | None

    async def caller(self) -> str | None:
        """The request's owner string; a 401 or 403 :class:`Problem` without a good
        credential."""
        ...


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
        #: Whose identity reads its own jobs' status and result (set by the container).
        self.identities: Identities | None = None

    async def authorize(self, job_id: str) -> JobView:
        return await authorize(self.engine, job_id, job_token(request.headers))

    async def _read(self, job_id: str) -> JobView:
        """The job, to read: by its token, or else by the caller's identity if it owns it."""
        try:
            return await self.authorize(job_id)
        except Problem as not_found:
            if not_found.status != 404:
                raise
            owner = await self._owner()
            if owner is None:
                raise
            try:
                return await self.engine.authorize_owner(job_id, owner)
            except JobNotFound:
                raise not_found from None

    async def _owner(self) -> str | None:
        """The owner string of the request's identity, when ``jobs_auth`` is set and the
        request brings one of its credentials (else None, and the token's answer stands)."""
        identities = self.identities
        auth = None if identities is None else identities.auth
        if identities is None or auth is None:
            return None
        headers = {name.lower(): value for name, value in request.headers.items()}
        if not any(method.present(headers) for method in auth.methods):
            return None
        return await identities.caller()

    def _answer(self, value: Any, status: int = 200) -> Response:
        media_type = choose_media_type(request)
        return Response(encode(value, media_type), status=status, content_type=media_type)

    async def status(self, job_id: str) -> Response:
        view = await self._read(job_id)
        return self._answer(job_document(view, expose=self.expose_errors))

    async def result(self, job_id: str) -> Response:
        view = await self._read(job_id)
        if view.status is Status.DONE:
            raw = raw_answer(view.result)
            if raw is not None:  # bytes with their content type, as the route answers them
                return Response(raw[0], content_type=raw[1])
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
        await self._signal(job_id, name, payload)
        try:
            view = await self.engine.status(job_id)
        except StoreUnavailable as exc:  # delivered, its status unread: named all the same
            _log.warning("pipework: the status of job %s cannot be read: %s", job_id, exc)
            raise signal_unsure(job_id, name, delivered=True) from None
        return self._answer(job_document(view, expose=self.expose_errors), 202)

    async def callback(self, job_id: str, name: str) -> Response:
        self.signer.verify(job_id, name, request.args.get("exp"), request.args.get("sig"))
        payload = await self._payload()
        await self._signal(job_id, name, payload)
        return Response(b"", status=204)

    async def _signal(self, job_id: str, name: str, payload: Any) -> None:
        try:
            await self.engine.signal(job_id, name, payload)
        except StoreUnavailable as exc:
            if not exc.maybe_done:  # nothing reached the store: nothing was done
                raise
            _log.warning(
                "pipework: signal %r to job %s may have been delivered: %s", name, job_id, exc
            )
            raise signal_unsure(job_id, name, delivered=exc.job_id is not None) from None

    async def _payload(self) -> Any:
        data = await read_body(request, limit=self.max_body, time_limit=self.body_time_limit)
        return decode(data, request.headers.get("Content-Type"), what="signal payload")


def signal_unsure(job_id: str, name: str, *, delivered: bool) -> Problem:
    """The job store went away while a signal was written (``delivered``: after it was):
    the answer names the job — its status's ``Location`` — so that its client looks at the
    job rather than sends the signal again (a repeat of a delivered signal is refused 409);
    never "nothing was done". No Retry-After: the request is not to be sent again as it is."""
    what = "was delivered" if delivered else "may or may not have been delivered"
    detail = (
        f"signal {name!r} to job {job_id} {what}, but the server cannot reach its job store "
        "now: follow the job's status at Location (with its token) rather than sending the "
        "signal again"
    )
    return Problem(
        503,
        "Job store unavailable",
        detail,
        slug="store-unavailable",
        headers={"Location": f"/jobs/{job_id}", "X-Job-Id": job_id},
        job_id=job_id,
        reason="store_unavailable",
    )


async def _quietly_wait(engine: Engine, job_id: str) -> None:
    # The job's end is what is awaited here, not its outcome: its error is its record's.
    with contextlib.suppress(Exception):
        await engine.wait(job_id)
