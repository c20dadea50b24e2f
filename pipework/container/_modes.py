"""How a route's request waits for its job: sync, async, stream or auto.

A request becomes a job at once (its input is the job's state); what differs is how the
answer comes. A parked request holds no worker: it waits on the job's end, bounded by the
job's deadline, and a server that is shutting down cuts every such wait to its grace
period (see :class:`~._parking.Parking`). A client that hangs up while parked cancels its job unless
the route says ``on_disconnect = "continue"`` or another request waits on the same job.

This module reads the request and the clock and does the waiting; what to answer is
decided from values in ``_modes_core`` (the route's mode, ``Prefer``, ``Idempotency-Key``,
the time). How the request becomes a job is :mod:`._modes_intake`'s, the parked requests'
deadlines :mod:`._parking`'s, a stream's events :mod:`._event_stream`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import trio
from quart import Request, Response, g, request

from .._errors import JobNotFound, PipeworkError, StoreUnavailable
from .._http._bodies import JSON, choose_media_type, encode, raw_answer
from .._http._jobs import DEGRADED_HEADER, degraded_header, job_document
from .._http._problems import Problem, problem_for_exception
from .._http._ratelimit import RateLimits
from ..dispatcher._engine import Engine
from ._event_stream import EventStream
from ._idempotency import IdempotencyTable
from ._modes_core import (
    SLACK,
    Preferences,
    RanOut,
    deadline_passed,
    outcome_unknown,
    preference_applied,
    ran_out,
    shutting_down,
    stream_taken,
    wait_terms,
)
from ._modes_intake import NO_HEADERS, Intake, Ticket
from ._parking import Parking
from ._request import current_request, incoming
from ._routes import Route

__all__ = ["Submissions"]

_log = logging.getLogger("pipework.container")


def _unset(request: Request) -> tuple[Route, Mapping[str, str]] | Response:
    raise RuntimeError("Submissions.match is not set: the container sets it")


class Submissions(Intake):
    """Turns a route's request into a job (:class:`~._modes_intake.Intake`) and answers it
    as the route's mode says."""

    def __init__(
        self,
        engine: Engine,
        parking: Parking,
        idempotency: IdempotencyTable,
        *,
        default_timeout: float,
        max_body: int,
        body_time_limit: float,
        retain_seconds: float,
        expose_errors: bool,
    ) -> None:
        self.engine = engine
        self.parking = parking
        self.idempotency = idempotency
        self.default_timeout = default_timeout
        self.max_body = max_body
        self.body_time_limit = body_time_limit
        self.retain_seconds = retain_seconds
        self.expose_errors = expose_errors
        #: The request's route and path parameters (raises werkzeug's NotFound or
        #: MethodNotAllowed), or the answer itself.
        self.match: Callable[[Request], tuple[Route, Mapping[str, str]] | Response] = _unset
        #: The rate limits in force (set by the container; None: none).
        self.rate_limits: RateLimits | None = None

    async def serve(self, _rest: str = "") -> Response:
        """The routes' view: the route :attr:`match` finds for the request (set by the
        container; it may answer itself, as to OPTIONS), its job submitted and answered as
        the route's mode says. A sync or auto request parks in this one frame: no frame of
        a dispatching view above it."""
        found = self.match(current_request())
        if isinstance(found, Response):
            return found
        route, params = found
        del found  # the pair would stay for as long as the request is parked
        # 401/403 before anything else is decided, read or started; the identity then keys
        # the rate limits.
        identity = None if route.auth is None else await self._authenticate(route.auth)
        limits = self.rate_limits
        if limits is not None:
            # Before the body is read and any job exists: a refusal costs one decision.
            met = limits.routes.get(route.name)
            if met:
                too_many = await limits.check(met, current_request().scope)
                if too_many is not None:
                    raise too_many
        if self.parking.draining:
            raise shutting_down()
        # The request's body and its decoded forms live only in _accept's frame: a parked
        # request keeps none of them (its job's state is the engine's).
        ticket, prefs = await self._accept(route, params, identity)
        del identity
        if route.mode == "async":
            return await self._accepted(ticket, respond_async=prefs.respond_async)
        if route.mode == "stream":
            return await self._stream(ticket)
        # Few locals: this frame is what a parked request keeps.
        limit, deadline, media_type, applied = self._terms(route, prefs, ticket)
        wake = self.engine.wake(ticket.job_id) if self.parking.serving else None
        if wake is None:
            return await self._wait_scoped(route, ticket, prefs, limit, media_type, applied)
        # The wait, flat: this frame on the job's wake, its deadline in the heap.
        waiting = None if wake.is_set() else self.parking.park(limit, ticket.job_id, wake)
        try:
            if waiting is not None:
                await trio.lowlevel.wait_task_rescheduled(waiting)
        except trio.Cancelled:
            # The client hung up (or the server is stopping hard).
            await self._hung_up(route, ticket.job_id)
            raise
        finally:
            if waiting is not None:
                self.parking.unpark(waiting, ticket.job_id)
        if wake.is_set():  # the job has ended: its outcome is read at once
            try:
                result, degraded = await self.engine.wait_answer(ticket.job_id)
            except Exception as exc:  # the job's own error, whatever a pipe raised
                raise await self.failure(ticket.job_id, exc) from None
            return self._answer(result, media_type, ticket.job_id, applied, degraded)
        return await self._ran_out(ticket, prefs, limit, deadline, applied)

    def _terms(
        self, route: Route, prefs: Preferences, ticket: Ticket
    ) -> tuple[float, float, str, tuple[str, ...]]:
        """How a sync or auto request waits (:func:`wait_terms`: until when, the job's
        deadline with the slack, the preferences applied) and the answer's media type."""
        limit, deadline, applied = wait_terms(
            route.mode, route.sync_wait, prefs, ticket.deadline, trio.current_time()
        )
        media_type = JSON
        ctx = incoming()
        if ctx is not None:
            if "accept" in ctx.headers:
                media_type = choose_media_type(current_request())
            ctx.headers = NO_HEADERS  # read: a parked request keeps none of them
        return limit, deadline, media_type, applied

    async def _hung_up(self, route: Route, job_id: str) -> None:
        if route.on_disconnect == "cancel" and self.parking.watchers(job_id) == 1:
            await self.cancel_quietly(job_id)

    async def _wait_scoped(
        self,
        route: Route,
        ticket: Ticket,
        prefs: Preferences,
        limit: float,
        media_type: str,
        applied: tuple[str, ...],
    ) -> Response:
        """A shared store's wait: the engine's, in one cancel scope."""
        job_id = ticket.job_id
        parking = self.parking
        scope = parking.open(limit, job_id)
        try:
            with scope:
                try:
                    result, degraded = await self.engine.wait_answer(job_id)
                except StoreUnavailable as exc:
                    # Its record could not be read (the store sent the read again on a new
                    # connection first): the job goes on, its outcome unknown here.
                    _log.warning("pipework: the outcome of job %s cannot be read: %s", job_id, exc)
                    raise outcome_unknown(job_id, ticket.token) from None
                except Exception as exc:  # the job's own error, whatever a pipe raised
                    raise await self.failure(job_id, exc) from None
                return self._answer(result, media_type, job_id, applied, degraded)
        except trio.Cancelled:
            # Our own scope swallows its timeout, so this is from outside: the client hung
            # up (or the server is stopping hard).
            await self._hung_up(route, job_id)
            raise
        finally:
            parking.close(scope, job_id)
        return await self._ran_out(ticket, prefs, limit, ticket.deadline + SLACK, applied)

    @staticmethod
    def _answer(
        result: Any,
        media_type: str,
        job_id: str,
        applied: tuple[str, ...],
        degraded: Mapping[str, str],
    ) -> Response:
        raw = raw_answer(result)
        if raw is None:
            response = Response(encode(result, media_type), content_type=media_type)
        else:  # bytes with their content type: answered as they are
            response = Response(raw[0], content_type=raw[1])
        response.headers["X-Job-Id"] = job_id
        if applied:
            response.headers["Preference-Applied"] = ", ".join(applied)
        if degraded:  # an answer made without some of its pipes says which, and why
            response.headers[DEGRADED_HEADER] = degraded_header(degraded)
        return response

    async def _ran_out(
        self,
        ticket: Ticket,
        prefs: Preferences,
        limit: float,
        deadline: float,
        applied: tuple[str, ...],
    ) -> Response:
        """A parked wait ran out: the job's deadline, the shutdown's grace, or the auto wait."""
        job_id = ticket.job_id
        outcome = ran_out(limit, deadline, drained=self.parking.drained)
        if outcome is RanOut.ACCEPTED:
            return await self._accepted(ticket, respond_async=prefs.respond_async, applied=applied)
        await self.cancel_quietly(job_id)
        if outcome is RanOut.SHUTTING_DOWN:
            raise shutting_down()
        raise deadline_passed(job_id)

    # -- answering -----------------------------------------------------------------------

    async def _accepted(
        self, ticket: Ticket, *, respond_async: bool, applied: Iterable[str] = ()
    ) -> Response:
        try:
            view = await self.engine.status(ticket.job_id)
        except StoreUnavailable as exc:  # accepted, its status unread: named all the same
            _log.warning("pipework: the status of job %s cannot be read: %s", ticket.job_id, exc)
            raise outcome_unknown(ticket.job_id, ticket.token) from None
        document = job_document(view, expose=self.expose_errors)
        document["token"] = ticket.token
        media_type = choose_media_type(request)
        response = Response(encode(document, media_type), status=202, content_type=media_type)
        response.headers["Location"] = f"/jobs/{ticket.job_id}"
        response.headers["X-Job-Id"] = ticket.job_id
        if ticket.token is not None:  # always, for the modes that answer 202
            response.headers["X-Job-Token"] = ticket.token
        preferences = preference_applied(respond_async, applied)
        if preferences is not None:
            response.headers["Preference-Applied"] = preferences
        return response

    async def cancel_quietly(self, job_id: str) -> None:
        with trio.CancelScope(shield=True):
            try:
                await self.engine.cancel(job_id)
            except PipeworkError as exc:
                _log.debug("could not cancel job %s: %s", job_id, exc)

    async def failure(self, job_id: str, error: BaseException) -> Problem:
        """The problem for a job that ended with ``error`` (its stage path from its record)."""
        where = ""
        try:
            recorded = (await self.engine.status(job_id)).error
        except (JobNotFound, StoreUnavailable):  # (its stage path is then not said)
            recorded = None
        if recorded is not None:
            where = recorded.where
        problem = problem_for_exception(
            error, expose=self.expose_errors, job_id=job_id, where=where
        )
        problem.headers["X-Job-Id"] = job_id
        return problem

    async def _stream(self, ticket: Ticket) -> Response:
        if ticket.replayed:
            raise stream_taken(ticket.job_id)
        deadline = ticket.deadline + SLACK
        events = EventStream(self, ticket.job_id, deadline, g.correlation_id, request.path)
        try:
            await events.start()
        except BaseException:
            await events.aclose()
            raise
        response = Response(events, content_type="text/event-stream")
        response.timeout = None  # Quart would cut a stream at RESPONSE_TIMEOUT otherwise
        response.headers["Cache-Control"] = "no-cache"
        response.headers["X-Accel-Buffering"] = "no"  # proxies: flush each event
        response.headers["X-Job-Id"] = ticket.job_id
        return response
