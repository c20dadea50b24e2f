"""How a route's request waits for its job: sync, async, stream or auto.

A request becomes a job at once (its input is the job's state); what differs is how the
answer comes. A parked request holds no worker: it waits on the job's end, bounded by the
job's deadline, and a server that is shutting down cuts every such wait to its grace
period (see :class:`Parking`). A client that hangs up while parked cancels its job unless
the route says ``on_disconnect = "continue"`` or another request waits on the same job.

This module reads the request and the clock and does the waiting; what to answer is
decided from values in ``_modes_core`` (the route's mode, ``Prefer``, ``Idempotency-Key``,
the time).
"""

from __future__ import annotations

import heapq
import logging
import math
import secrets
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

import trio
from prometheus_client import Gauge
from quart import Request, Response, g, request
from werkzeug.datastructures import MultiDict

from .._errors import JobNotFound, PipeworkError, StoreUnavailable
from .._http._auth import Identity, RouteAuth, put_identity
from .._http._bodies import (
    JSON,
    choose_media_type,
    decode_object,
    dumps_json,
    encode,
    raw_answer,
    read_body,
)
from .._http._identity import pool_key_of
from .._http._jobs import DEGRADED_HEADER, degraded_header, job_document
from .._http._problems import Problem, problem_for_exception
from .._http._ratelimit import RateLimits
from .._logging import outage
from ..dispatcher._engine import Engine
from ..dispatcher._wake import Waiting, Wake
from ..pipes._state import check_state, raw_value
from ._idempotency import IdempotencyTable, fingerprint
from ._modes_core import (
    NO_PREFERENCES,
    SLACK,
    KeyStep,
    Preferences,
    RanOut,
    add_identity,
    add_request,
    admits_now,
    build_state,
    check_unencoded,
    deadline_passed,
    frees_key,
    idempotency_key,
    job_timeout,
    key_busy,
    key_step,
    needs_token,
    outcome_unknown,
    owner_of,
    parse_prefer,
    preference_applied,
    ran_out,
    request_record,
    shutting_down,
    stream_taken,
    wait_terms,
)
from ._request import Incoming, current_g, current_request, incoming
from ._routes import Route

__all__ = ["EventStream", "Parking", "Submissions", "sse_event"]

_log = logging.getLogger("pipework.container")

# How long a retry waits for a concurrent submission with its Idempotency-Key.
_CLAIM_WAIT: Final = 5.0


class Parking:
    """The parked requests' waits, so that a shutdown can cut them all short at once.

    A sync request on an in-process store parks on its job's wake (:meth:`park`): its
    deadline is an entry in one heap, served by one task (:meth:`run`), instead of a
    cancel scope per request (a scope's cancel status takes two sets, ~0.7 KB a request
    held for as long as it is parked). Other waits (streams, shared stores, or before
    :meth:`run` has started) take a cancel scope (:meth:`scope`, :meth:`open`).
    """

    def __init__(self, gauge: Gauge | None = None) -> None:
        self._scopes: set[trio.CancelScope] = set()
        self._watchers: dict[str, int] = {}
        self.drain_deadline = math.inf
        self._gauge = gauge  # pipework_parked_requests
        # Ordered by deadline; a request that leaves clears its waiting's task.
        self._heap: list[Waiting] = []
        self._lean = 0  # parked in the heap
        self._timer: trio.CancelScope | None = None  # set while run() serves the heap

    @property
    def draining(self) -> bool:
        return self.drain_deadline < math.inf

    @property
    def drained(self) -> bool:
        """The grace period is over: what still waits is answered 503."""
        return trio.current_time() >= self.drain_deadline

    @property
    def parked(self) -> int:
        return len(self._scopes) + self._lean

    @property
    def serving(self) -> bool:
        """Whether :meth:`run` serves the heap's deadlines (else :meth:`park` must not be used)."""
        return self._timer is not None

    @contextmanager
    def scope(self, deadline: float) -> Iterator[trio.CancelScope]:
        """A wait that ends at ``deadline`` or at the end of a shutdown's grace period."""
        scope = trio.CancelScope(deadline=min(deadline, self.drain_deadline))
        self._scopes.add(scope)
        if self._gauge is not None:
            self._gauge.inc()
        try:
            with scope:
                yield scope
        finally:
            self._scopes.discard(scope)
            if self._gauge is not None:
                self._gauge.dec()

    def drain(self, grace: float) -> None:
        """Start a shutdown: every wait, present or future, ends within ``grace`` seconds."""
        self.drain_deadline = min(self.drain_deadline, trio.current_time() + grace)
        for scope in self._scopes:
            scope.deadline = min(scope.deadline, self.drain_deadline)
        if self._timer is not None and self._heap:
            self._timer.deadline = min(self._timer.deadline, self.drain_deadline)

    def open(self, deadline: float, job_id: str) -> trio.CancelScope:
        """A parked request's wait on ``job_id``, as :meth:`scope` but without a context
        manager (the request's own frame holds it); end it with :meth:`close`."""
        scope = trio.CancelScope(deadline=min(deadline, self.drain_deadline))
        self._scopes.add(scope)
        self._watch(job_id)
        return scope

    def close(self, scope: trio.CancelScope, job_id: str) -> None:
        self._scopes.discard(scope)
        self._unwatch(job_id)

    def park(self, deadline: float, job_id: str, wake: Wake) -> Waiting:
        """The current task's wait on ``job_id``'s unset ``wake``, cut at ``deadline`` or
        at the end of a shutdown's grace period (the wake stays unset then); only while
        :attr:`serving`. Await ``trio.lowlevel.wait_task_rescheduled(waiting)``, then
        :meth:`unpark`, whatever happened."""
        waiting = wake.join(trio.lowlevel.current_task(), deadline)
        heapq.heappush(self._heap, waiting)
        self._lean += 1
        timer = self._timer
        if timer is not None:
            earlier = min(deadline, self.drain_deadline)
            if earlier < timer.deadline:  # (setting it costs, even to the same value)
                timer.deadline = earlier
        self._watch(job_id)
        return waiting

    def unpark(self, waiting: Waiting, job_id: str) -> None:
        waiting.task = None  # its heap entry is dropped when it comes up, or compacted
        self._lean -= 1
        self._unwatch(job_id)
        heap = self._heap
        if len(heap) > 64 and len(heap) > 2 * self._lean:  # mostly left: compact it
            heap[:] = [waiting for waiting in heap if waiting.task is not None]
            heapq.heapify(heap)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the parked requests' deadlines until cancelled (then cut what still waits)."""
        heap = self._heap
        started = False
        try:
            while True:
                while heap and heap[0].task is None:
                    heapq.heappop(heap)
                # Nothing parked: nothing to wake for (a drain's deadline included).
                first = min(heap[0].deadline, self.drain_deadline) if heap else math.inf
                with trio.CancelScope(deadline=first) as timer:
                    self._timer = timer
                    if not started:
                        started = True
                        task_status.started()
                    await trio.sleep_forever()
                self._timer = None
                now = trio.current_time()
                everything = now >= self.drain_deadline
                while heap and (everything or heap[0].deadline <= now):
                    heapq.heappop(heap).cut()
        finally:
            self._timer = None
            for waiting in heap:
                waiting.cut()
            heap.clear()

    def _watch(self, job_id: str) -> None:
        self._watchers[job_id] = self._watchers.get(job_id, 0) + 1
        if self._gauge is not None:
            self._gauge.inc()

    def _unwatch(self, job_id: str) -> None:
        left = self._watchers[job_id] - 1
        if left:
            self._watchers[job_id] = left
        else:
            del self._watchers[job_id]
        if self._gauge is not None:
            self._gauge.dec()

    def watchers(self, job_id: str) -> int:
        """How many parked requests wait on ``job_id``."""
        return self._watchers.get(job_id, 0)


@dataclass(frozen=True, slots=True)
class _Ticket:
    job_id: str
    token: str | None  # None: the route's answers never hand it out (sync, stream)
    replayed: bool
    deadline: float  # the job's (trio time)


class _MaybeAccepted(Exception):
    """A submission whose create was sent to a shared store and not answered: job
    ``job_id`` may exist, with this ``deadline`` (answered by :func:`outcome_unknown`)."""

    def __init__(self, job_id: str, deadline: float) -> None:
        super().__init__(job_id)
        self.job_id = job_id
        self.deadline = deadline


_NO_HEADERS: Final[Mapping[str, str]] = MappingProxyType({})
_NO_QUERY: Final[MultiDict[str, str]] = MultiDict()


def _unset(request: Request) -> tuple[Route, Mapping[str, str]] | Response:
    raise RuntimeError("Submissions.match is not set: the container sets it")


class Submissions:
    """Turns a route's request into a job and answers it as the route's mode says."""

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
        self, route: Route, prefs: Preferences, ticket: _Ticket
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
            ctx.headers = _NO_HEADERS  # read: a parked request keeps none of them
        return limit, deadline, media_type, applied

    async def _hung_up(self, route: Route, job_id: str) -> None:
        if route.on_disconnect == "cancel" and self.parking.watchers(job_id) == 1:
            await self.cancel_quietly(job_id)

    async def _wait_scoped(
        self,
        route: Route,
        ticket: _Ticket,
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
        ticket: _Ticket,
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

    async def _authenticate(self, auth: RouteAuth) -> Identity:
        ctx = incoming()
        headers = _NO_HEADERS if ctx is None else ctx.headers
        identity = await auth.authenticate(headers)
        scope: Any = current_request().scope  # the ASGI scope, a dict (typed as a TypedDict)
        put_identity(scope, identity)
        return identity

    async def _accept(
        self, route: Route, params: Mapping[str, str], identity: Identity | None
    ) -> tuple[_Ticket, Preferences]:
        # Everything the request says is read and checked before a job exists: a request
        # answered 4xx has started nothing.
        req = current_request()
        ctx = incoming()
        headers = _NO_HEADERS if ctx is None else ctx.headers
        prefs = NO_PREFERENCES
        if "prefer" in headers:
            prefs = parse_prefer(req.headers.getlist("Prefer"))
        key = idempotency_key(route.name, headers.get("idempotency-key"))
        limit = self.max_body if route.max_body is None else route.max_body
        raw = route.body == "raw"
        if raw:
            check_unencoded(headers.get("content-encoding"))  # before the body is read
        data = await read_body(req, limit=limit, time_limit=self.body_time_limit, headers=headers)
        if ctx is not None:
            ctx.body_bytes = len(data)
        if raw:  # kept as it came, its members no part of the state
            kept: dict[str, Any] | None = raw_value(headers.get("content-type"), data)
            body = None
        else:
            kept, body = None, decode_object(data, headers.get("content-type"))
        query = req.args if req.scope.get("query_string") else _NO_QUERY
        state = build_state(body, query, params)
        if identity is not None:
            add_identity(state, identity.state())
        use = self.engine.registry.get_chain(route.chain).request_use
        if use is not None or kept is not None:
            add_request(state, request_record(use, req.scope["headers"], kept))
        state = check_state(state)
        # An async answer promises the job will run: its admission is decided now (503 +
        # Retry-After if the pool would refuse it), and it then waits for its slot.
        owner = None if identity is None else owner_of(route.mode, identity.owner)
        ticket = await self._submit(route, state, key, admit=admits_now(route.mode), owner=owner)
        return ticket, prefs

    # -- submitting ----------------------------------------------------------------------

    async def _submit(
        self,
        route: Route,
        state: dict[str, Any],
        key: str | None,
        *,
        admit: bool,
        owner: str | None = None,
    ) -> _Ticket:
        if key is None:
            shared = self.engine.shares_store
            token = secrets.token_urlsafe(32) if needs_token(route.mode, shared) else None
            try:
                deadline, job_id = await self._new_job(
                    route, state, token, admit=admit, owner=owner
                )
            except _MaybeAccepted as maybe:
                raise outcome_unknown(maybe.job_id, token) from None
            return _Ticket(job_id, token, replayed=False, deadline=deadline)
        digest = fingerprint(route.method, request.path, state)
        with trio.move_on_after(_CLAIM_WAIT):
            while True:
                claim = self.idempotency.get(key)
                step = key_step(claim, digest)
                if step is KeyStep.SUBMIT:
                    return await self._first_with_key(
                        route, state, key, digest, admit=admit, owner=owner
                    )
                assert claim is not None
                if step is KeyStep.WAIT:
                    await claim.settled.wait()
                    continue
                claimed = claim.job_id
                assert claimed is not None
                try:
                    view = await self.engine.status(claimed)
                except JobNotFound:
                    view = None
                except StoreUnavailable:  # the key's job exists: named, never said undone
                    raise outcome_unknown(claimed, claim.token) from None
                if view is None or frees_key(view.status):
                    self.idempotency.forget(key, claim)
                    continue
                return _Ticket(claimed, claim.token, replayed=True, deadline=view.deadline)
        raise key_busy()

    async def _first_with_key(
        self,
        route: Route,
        state: dict[str, Any],
        key: str,
        digest: str,
        *,
        admit: bool,
        owner: str | None,
    ) -> _Ticket:
        token = secrets.token_urlsafe(32)
        claim = self.idempotency.claim(key, digest, token)
        try:
            deadline, job_id = await self._new_job(route, state, token, admit=admit, owner=owner)
        except _MaybeAccepted as maybe:
            # The key keeps the job that may exist: a retry with it follows that job (or,
            # not found, submits anew) rather than running it twice.
            self.idempotency.bind(key, claim, maybe.job_id, maybe.deadline + self.retain_seconds)
            raise outcome_unknown(maybe.job_id, token) from None
        except BaseException:
            self.idempotency.forget(key, claim)
            raise
        self.idempotency.bind(key, claim, job_id, deadline + self.retain_seconds)
        return _Ticket(job_id, token, replayed=False, deadline=deadline)

    async def _new_job(
        self,
        route: Route,
        state: dict[str, Any],
        token: str | None,
        *,
        admit: bool,
        owner: str | None = None,
    ) -> tuple[float, str]:
        """The new job's deadline and id."""
        engine = self.engine
        # The chain is looked up only when the route sets no time limit of its own.
        chain = None if route.timeout is not None else engine.registry.get_chain(route.chain)
        timeout = job_timeout(
            route.timeout,
            None if chain is None else chain.timeout,
            engine.default_timeout,
            self.default_timeout,
        )
        namespace = current_g()
        ctx: Incoming | None = namespace.get("pipework")
        # The engine sets the same deadline: it reads the clock before its first await.
        deadline = trio.current_time() + timeout
        # Chosen once, here: the job keeps it (through hand-offs and the store).
        pool_key = None
        if route.pool_key is not None:
            pool_key = pool_key_of(current_request().scope, route.pool_key)
        try:
            job_id = await self.engine.submit(
                route.chain,
                state,
                timeout=timeout,
                correlation_id=namespace.correlation_id,
                token=token,
                traceparent=None if ctx is None else ctx.traceparent,
                tracestate=None if ctx is None else ctx.tracestate,
                baggage=None if ctx is None else ctx.baggage,
                stream=route.mode == "stream",
                admit=admit,
                pool_key=pool_key,
                owner=owner,
            )
        except StoreUnavailable as exc:
            if exc.job_id is None:  # nothing reached the store: nothing was done
                raise
            # Its record may have been written (the connection was lost after it was sent):
            # the job may run. Its client follows it rather than submitting it again. While
            # the store's outage is on, its own two lines say it, with the count of these.
            dependency = exc.dependency
            out = dependency is not None and outage(dependency).count("submissions in doubt")
            _log.log(
                logging.DEBUG if out else logging.WARNING,
                "pipework: job %s may or may not have been accepted: %s",
                exc.job_id,
                exc,
            )
            raise _MaybeAccepted(exc.job_id, deadline) from None
        return deadline, job_id

    # -- answering -----------------------------------------------------------------------

    async def _accepted(
        self, ticket: _Ticket, *, respond_async: bool, applied: Iterable[str] = ()
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

    async def _stream(self, ticket: _Ticket) -> Response:
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


class EventStream:
    """A streamed job as server-sent events: ``chunk`` per emitted chunk, then ``end``
    (status and result) or ``error`` (a problem document). Closing it early (the client
    went away) cancels the job."""

    def __init__(
        self,
        submissions: Submissions,
        job_id: str,
        deadline: float,
        correlation_id: str,
        instance: str,
    ) -> None:
        self._submissions = submissions
        self._engine = submissions.engine
        self._parking = submissions.parking
        self._job_id = job_id
        self._deadline = deadline
        self._correlation_id = correlation_id
        self._instance = instance
        self._chunks = self._engine.stream(job_id)
        self._first: bytes | None = None
        self._done = False
        self._settled = False
        self._sent = 0

    async def start(self) -> None:
        """Wait for the first event; a job that fails before any chunk raises its problem,
        so the client gets a plain error response instead of a stream."""
        self._first = await self._pull(first=True)

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> bytes:
        if self._first is not None:
            event, self._first = self._first, None
            return event
        if self._done:
            raise StopAsyncIteration
        return await self._pull(first=False)

    async def _pull(self, *, first: bool) -> bytes:
        with self._parking.scope(self._deadline):
            try:
                chunk = await anext(self._chunks)
            except StopAsyncIteration:
                return await self._end(first)
            except Exception as exc:
                return await self._failed(exc, first)
            else:
                return await self._chunk(chunk, first)
        # The scope ran out: the job's deadline passed, or the shutdown's grace did.
        self._done = True
        await self._submissions.cancel_quietly(self._job_id)
        drained = self._parking.drained
        return self._error(shutting_down() if drained else deadline_passed(self._job_id), first)

    async def _chunk(self, chunk: Any, first: bool) -> bytes:
        try:
            data = dumps_json(chunk)
        except Problem as problem:
            self._done = True
            await self._submissions.cancel_quietly(self._job_id)
            return self._error(problem, first)
        self._sent += 1
        return sse_event("chunk", data, event_id=self._sent)

    async def _end(self, first: bool) -> bytes:
        self._done = self._settled = True
        view = await self._engine.status(self._job_id)
        end: dict[str, Any] = {"status": view.status, "result": view.result}
        if view.degraded:  # the headers are long gone: the end says what was degraded
            end["degraded"] = dict(view.degraded)
        try:
            return sse_event("end", dumps_json(end))
        except Problem as problem:
            return self._error(problem, first)

    async def _failed(self, exc: Exception, first: bool) -> bytes:
        self._done = self._settled = True
        return self._error(await self._submissions.failure(self._job_id, exc), first)

    def _error(self, problem: Problem, first: bool) -> bytes:
        if first:
            raise problem
        document = problem.document(correlation_id=self._correlation_id, instance=self._instance)
        return sse_event("error", dumps_json(document))

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            if not self._settled:
                await self._submissions.cancel_quietly(self._job_id)
            aclose = getattr(self._chunks, "aclose", None)  # an async generator's
            if aclose is not None:
                await aclose()


def sse_event(event: str, json_text: str, *, event_id: int | None = None) -> bytes:
    """One server-sent event; ``json_text`` is one line (compact JSON never breaks lines)."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {json_text}\n\n".encode()
