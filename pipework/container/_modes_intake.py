"""How a route's request becomes a job: the request read and checked (its identity, its
body, its query and path parameters, ``Prefer``, ``Idempotency-Key``), then the job
submitted, once per key, and the job's id, token and deadline handed back as a ticket.

A part of :class:`~._modes.Submissions` (a base it is made of), in a module of its own so
the routes' view reads in one sitting; what is decided from values is ``_modes_core``'s.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

import trio
from quart import request
from werkzeug.datastructures import MultiDict

from .._errors import JobNotFound, StoreUnavailable
from .._http._auth import Identity, RouteAuth, put_identity
from .._http._bodies import decode_object, read_body
from .._http._identity import pool_key_of
from .._logging import outage
from ..dispatcher._engine import Engine
from ..pipes._state import check_state, raw_value
from ._idempotency import IdempotencyTable, fingerprint
from ._modes_core import (
    NO_PREFERENCES,
    KeyStep,
    Preferences,
    add_identity,
    add_request,
    admits_now,
    build_state,
    check_unencoded,
    frees_key,
    idempotency_key,
    job_timeout,
    key_busy,
    key_step,
    needs_token,
    outcome_unknown,
    owner_of,
    parse_prefer,
    request_record,
)
from ._request import Incoming, current_g, current_request, incoming
from ._routes import Route

__all__ = ["NO_HEADERS", "Intake", "Ticket"]

_log = logging.getLogger("pipework.container")

# How long a retry waits for a concurrent submission with its Idempotency-Key.
_CLAIM_WAIT: Final = 5.0


@dataclass(frozen=True, slots=True)
class Ticket:
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


NO_HEADERS: Final[Mapping[str, str]] = MappingProxyType({})
_NO_QUERY: Final[MultiDict[str, str]] = MultiDict()


class Intake:
    """The routes' view's reading of a request and submitting of its job:
    :meth:`_authenticate`, then :meth:`_accept` (see the module)."""

    # Made by Submissions.__init__.
    engine: Engine
    idempotency: IdempotencyTable
    default_timeout: float
    max_body: int
    body_time_limit: float
    retain_seconds: float

    async def _authenticate(self, auth: RouteAuth) -> Identity:
        ctx = incoming()
        headers = NO_HEADERS if ctx is None else ctx.headers
        identity = await auth.authenticate(headers)
        scope: Any = current_request().scope  # the ASGI scope, a dict (typed as a TypedDict)
        put_identity(scope, identity)
        return identity

    async def _accept(
        self, route: Route, params: Mapping[str, str], identity: Identity | None
    ) -> tuple[Ticket, Preferences]:
        # Everything the request says is read and checked before a job exists: a request
        # answered 4xx has started nothing.
        req = current_request()
        ctx = incoming()
        headers = NO_HEADERS if ctx is None else ctx.headers
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
    ) -> Ticket:
        if key is None:
            shared = self.engine.shares_store
            token = secrets.token_urlsafe(32) if needs_token(route.mode, shared) else None
            try:
                deadline, job_id = await self._new_job(
                    route, state, token, admit=admit, owner=owner
                )
            except _MaybeAccepted as maybe:
                raise outcome_unknown(maybe.job_id, token) from None
            return Ticket(job_id, token, replayed=False, deadline=deadline)
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
                return Ticket(claimed, claim.token, replayed=True, deadline=view.deadline)
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
    ) -> Ticket:
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
        return Ticket(job_id, token, replayed=False, deadline=deadline)

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
