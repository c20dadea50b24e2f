"""Accepting jobs: :meth:`Engine.submit` and the probe's own submission, from the new
record (its plan, deadline, first key, trace context and admission check) to the record
stored and its first event queued, in one step with no await when the store and the queue
are in-process, or through a shared queue that writes both at once (Redis), claiming the
first step when a slot is free.

A part of :class:`~._engine.Engine` (a base it is made of), in a module of its own so the
engine reads in one sitting: the engine keeps the lifecycle, the plans (on which the
intake counts each job it accepts) and waiting for a job's end.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import trio

from .. import _tracing
from .._errors import Overloaded, StoreUnavailable
from .._logging import job_logger, log_job
from ..pipes._state import check_state
from ._abilities import Abilities, CheckedAdmission, SharedQueue
from ._cursor import start_frames
from ._dispatcher import Dispatcher
from ._engine_observers import JobObservers
from ._events import RunJob
from ._job import Job, hash_token, new_ids
from ._queue import EventQueue
from ._store import JobStore

__all__ = ["JobIntake"]


class JobIntake(JobObservers):
    """How the engine accepts a job: :meth:`submit`, and what it shares with the probe."""

    # Made by Engine.__init__: what a job is accepted into.
    store: JobStore
    queue: EventQueue
    default_timeout: float | None
    _abilities: Abilities
    _dispatcher: Dispatcher
    _checked: CheckedAdmission | None
    _nursery: trio.Nursery | None
    _stream_buffer: int
    _receivers: dict[str, trio.MemoryReceiveChannel[Any]]
    _relayed: set[str]
    # The plans' bookkeeping, the engine's: a job is counted on its plan when accepted.
    _generation: int
    _plan_jobs: dict[int, set[str]]
    _retire_if_idle: Callable[[int], None]

    async def submit(
        self,
        chain: str,
        state: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the job's time limit, not this call's
        correlation_id: str | None = None,
        token: str | None = None,
        stream: bool = False,
        admit: bool = False,
        traceparent: str | None = None,
        tracestate: str | None = None,
        baggage: str | None = None,
        pool_key: str | None = None,
        owner: str | None = None,
    ) -> str:
        """Accept a job and return its id, or raise Overloaded at once if the queue is full.

        ``timeout`` overrides the chain's; ``token`` is the owner secret (only its hash is
        kept); ``stream=True`` keeps emitted chunks for :meth:`stream` instead of the record.
        ``admit=True`` decides the job's admission now: :class:`~pipework.Rejected` if the
        pool would refuse its first step (a pool without ``check_admission`` never does);
        once accepted, its steps wait for their slots up to its deadline and are never
        refused for load. For work promised before it runs, as an async route's 202.
        ``traceparent``, ``tracestate`` and ``baggage`` (the W3C trace context of the
        request behind the job) go with every backend call its pipes make. ``pool_key``
        replaces the chain's key as the admission key of every step that would run under
        it (a pipe with a key of its own keeps it), for the whole job and its branches: a
        route's tenant (docs/edge-policy.md). ``owner``: who the job belongs to (an
        authenticated caller's ``Identity.owner``): the store indexes the job by it, and
        :meth:`owned` lists it for that owner.
        """
        if pool_key is not None and not (isinstance(pool_key, str) and pool_key):
            raise ValueError(f"pool_key must be a non-empty string or None, got {pool_key!r}")
        if owner is not None and not (isinstance(owner, str) and owner):
            raise ValueError(f"owner must be a non-empty string or None, got {owner!r}")
        job = self._new_job(
            self._generation,
            chain,
            state,
            timeout,
            correlation_id,
            token,
            admit,
            traceparent,
            tracestate,
            baggage,
            pool_key,
            owner,
        )
        nowait = self._dispatcher.nowait
        if stream or not nowait or self._abilities.shared_queue is not None:
            return await self._enqueue(job, stream)
        # An in-process store and queue: the common case awaits nothing, so it runs here
        # rather than in a coroutine of its own.
        try:
            nowait[2](job)
            try:
                self.queue.submit_nowait(RunJob(job.id))
            except Overloaded:
                await self.store.delete(job.id)
                raise
        except BaseException:
            self._not_accepted(job)
            raise
        self._accepted(job)
        return job.id

    async def _accept(
        self,
        generation: int,
        chain: str,
        state: dict[str, Any] | None,
        *,
        timeout: float | None,  # noqa: ASYNC109 - the job's time limit, not this call's
    ) -> str:
        job = self._new_job(
            generation, chain, state, timeout, None, None, False, None, None, None, None, None
        )
        return await self._enqueue(job, False)

    def _new_job(
        self,
        generation: int,
        chain: str,
        state: dict[str, Any] | None,
        timeout: float | None,
        correlation_id: str | None,
        token: str | None,
        admit: bool,
        traceparent: str | None,
        tracestate: str | None,
        baggage: str | None,
        pool_key: str | None,
        owner: str | None,
    ) -> Job:
        """The record of a job about to be accepted, counted on its plan."""
        if self._nursery is None:
            raise RuntimeError("the engine is not running; use `async with engine:` first")
        plan = self._dispatcher.plans[generation].get_chain(chain)
        state = check_state({} if state is None else state)
        limit = timeout if timeout is not None else plan.timeout or self.default_timeout
        now = self._dispatcher.flight.clock()
        deadline = math.inf if limit is None else now + limit
        wall = time.time()
        job_id, new_correlation = new_ids()
        tracing = _tracing.ACTIVE
        if tracing.on:
            # The job carries the span it was submitted under (a request's server span):
            # its steps, run by the engine's tasks or another process, are its children.
            current, current_state = tracing.headers()
            if current is not None:
                traceparent, tracestate = current, current_state
        job = Job.accepted(
            job_id,
            chain,
            state,
            correlation_id or new_correlation,
            deadline,
            None if token is None else hash_token(token),
            traceparent,
            generation,
            now,
            admit,
            wall,
            tracestate,
            baggage,
            pool_key,
            owner,
        )
        start_frames(job, plan, now)  # its first key: the pool key's, when it uses it
        if tracing.on:
            tracing.annotate("pipework.job_id", job_id)
            tracing.event("job queued", {"pipework.job_id": job_id, "pipework.key": job.key})
        if admit and self._checked is not None:
            self._checked.check_admission(job.key, deadline=deadline)
        # Counted on its plan before the first await, so a swap cannot retire it meanwhile.
        jobs = self._plan_jobs.get(generation)
        if jobs is not None:
            jobs.add(job.id)
        return job

    async def _enqueue(self, job: Job, stream: bool) -> str:
        """Store the new job and queue its first step."""
        relayed = stream and self._relay is not None
        try:
            if relayed:  # its steps may run anywhere: marked before its first event
                await self._relay.open_stream(job.id)
            nowait = self._dispatcher.nowait
            # A shared queue that writes the record and the first event together (Redis).
            shared_queue = self._abilities.shared_queue
            handled = shared_queue is not None and await self._create_claiming(job, shared_queue)
            if not handled and (
                shared_queue is None
                or not await shared_queue.create_and_submit(self.store, job, RunJob(job.id))
            ):
                if nowait:
                    nowait[2](job)
                else:
                    await self.store.create(job)
                try:
                    self.queue.submit_nowait(RunJob(job.id))
                except Overloaded:
                    await self.store.delete(job.id)
                    raise
                await self._abilities.flush()  # a shared queue: the first event is there first
        except BaseException as exc:
            if isinstance(exc, StoreUnavailable) and exc.maybe_done:
                exc.job_id = job.id  # it may exist and run: its client is told to follow it
            if relayed:
                self._relay.close_stream(job.id)
            self._not_accepted(job)
            raise
        if relayed:
            self._relayed.add(job.id)
        elif stream:
            self._receivers[job.id] = self._dispatcher.ends.open_stream(job.id, self._stream_buffer)
        self._accepted(job)
        return job.id

    async def _create_claiming(self, job: Job, shared_queue: SharedQueue) -> bool:
        """Write a new job's record and first event with the event claimed by this process,
        its first step started at once on a slot held meanwhile, when a slot is free now
        (``Dispatcher.hold_first``); False, with nothing written, when that cannot be."""
        if self._dispatcher.steps.hold_first(job) is None:
            return False
        event = RunJob(job.id)
        try:
            claimed = await shared_queue.create_and_claim(self.store, job, event)
        except BaseException:
            self._dispatcher.steps.let_go_first(job.id)
            raise
        if claimed:
            self._dispatcher.steps.start_claimed(event)
        else:  # not written (None), or its event left on the stream for the next read
            self._dispatcher.steps.let_go_first(job.id)
        return claimed is not None

    def _not_accepted(self, job: Job) -> None:
        jobs = self._plan_jobs.get(job.plan)
        if jobs is not None:
            jobs.discard(job.id)
            self._retire_if_idle(job.plan)

    def _accepted(self, job: Job) -> None:
        if self._observers:
            self._changed(job)
        if job_logger.isEnabledFor(logging.DEBUG):  # a job's life: DEBUG (docs/operations.md)
            log_job(
                "job accepted",
                logging.DEBUG,
                correlation_id=job.correlation_id,
                job_id=job.id,
                route=job.chain,
                key=job.key,
                status=job.status.value,
            )
