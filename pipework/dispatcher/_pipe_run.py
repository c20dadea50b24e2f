"""Running one pipe: its context, its deadline, and what its end means for its job.

Every pipe a worker runs, in a job's step or in a branch running in its parent's step,
runs through :meth:`PipeRunner.run`: the pipe gets a :class:`~pipework.Context` on the
job's state (a copy, for a blocking pipe, adopted only if it ends in time), runs within the
earliest of its own timeout, its stages' and the job's deadline — carried by the step's own
cancel scope, not a scope per pipe — and its end is measured, logged and fed to the key's
adaptive limit. What it raised is sorted out (:mod:`._outcomes`): a suspension parks the
job, a timeout or an error ends it, the step's cancellation travels on.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Protocol

import trio

from .. import _tracing
from .._errors import BackendError, DeadlineExceeded, StateError
from .._logging import job_logger, log_job, mark_reported, reported
from .._metrics import Metrics
from ..pipes._merge import snapshot
from ..pipes._pipe import Context, JobOps, Pipe, Suspend
from ..pipes._stages import Chain
from ..pipes._state import check_state, storable_part
from ._admission import Admission
from ._cursor import path_of
from ._ends import INTERNAL_PLAN, Ends
from ._flight import Flight
from ._job import Frame, Job
from ._outcomes import (
    PipeTimeout,
    backend_trouble,
    cancellation_in,
    invoke,
    is_job_timeout,
    note,
    pipe_error,
    refused_by_service,
    timeout_of,
)
from ._status import Status
from ._suspend import Suspensions

__all__ = ["DegradingRunner", "PipeRunner"]


class DegradingRunner(Protocol):
    """What runs the pipes a job can do without (``_degrade.py``): :meth:`PipeRunner.run`
    hands such a pipe to it."""

    async def run(
        self, job: Job, chain: Chain, pipe: Pipe, now: float, top: Frame
    ) -> float | None: ...


class PipeRunner:
    def __init__(
        self,
        flight: Flight,
        ends: Ends,
        suspensions: Suspensions,
        pool: Admission,
        metrics: Metrics,
        ops: JobOps,
    ) -> None:
        self._flight = flight
        self._ends = ends
        self._suspensions = suspensions
        self._pool = pool
        self._metrics = metrics
        self._ops = ops
        # The observers of the duration of pipes that ended ok, by pipe: no label tuples
        # built and hashed per pipe (label values are bounded by registration).
        self._ok: dict[str, Callable[[float], None]] = {}
        #: What runs the pipes a job can do without (set once it is made: it runs their
        #: fallbacks through this runner).
        self.degrader: DegradingRunner | None = None
        #: With tracing on, the span of the pipe each job runs now (from :meth:`context`
        #: to :meth:`ended`, which every run passes through), by job id.
        self._spans: dict[str, _tracing.Span] = {}

    async def run(
        self, job: Job, chain: Chain, pipe: Pipe, now: float, top: Frame, *, learn: bool = True
    ) -> float | None:
        """Run ``pipe`` for ``job`` from ``now`` (the clock at its start); ``top`` is the
        cursor's frame it sits in (moved past it when it ends well). Returns the clock at
        its end to go on from, or None when the job's step ended here (the pipe failed,
        timed out or suspended the job). The step's cancellation travels on. ``learn``:
        its end feeds its key's adaptive limit (not a fallback's, run in a pipe's place).

        The step's own loop (:meth:`Steps.run_held`) runs the same three parts in its own
        frame: a coroutine per pipe is one object and one frame more on the hot path."""
        if pipe.degradable:
            assert self.degrader is not None, "the degrader is wired in with the runner"
            return await self.degrader.run(job, chain, pipe, now, top)
        ctx = self.context(job, chain, pipe, now, top)
        try:
            await self.call(pipe, ctx, job)
        except BaseException as raised:  # sorted out there; a cancellation travels on
            return await self.raised(job, chain, pipe, now, raised, ctx, top, learn)
        return self.ok(job, pipe, now, ctx, top, learn)

    def context(self, job: Job, chain: Chain, pipe: Pipe, now: float, top: Frame) -> Context:
        """The pipe's context: its deadline the earlier of its own and its frame's."""
        pipe_deadline = math.inf if pipe.timeout is None else now + pipe.timeout
        deadline = top.deadline if pipe_deadline > top.deadline else pipe_deadline
        if _tracing.ACTIVE.on and job.plan != INTERNAL_PLAN:
            self._start_span(job, chain, pipe)
        # A thread cannot be stopped: a blocking pipe works on a copy of the state that is
        # adopted only if it ends in time and uncancelled. Positional arguments: no keyword
        # matching per pipe.
        return Context(
            snapshot(job.state) if pipe.blocking else job.state,
            job.id,
            job.correlation_id,
            chain.name,
            pipe,
            chain,
            job.root if len(job.frames) == 1 else path_of(job),  # path_of's flat case
            job.key,
            deadline,
            self._ops,
            job.traceparent,
            job.tracestate,
            job.baggage,
        )

    async def call(self, pipe: Pipe, ctx: Context, job: Job) -> None:
        if ctx.deadline == math.inf:
            await invoke(pipe, ctx)  # no limit anywhere: nothing to arm
            # A pipe that swallowed the step's cancellation (or a thread that could not
            # see it) must not carry on as if it had not come.
            await trio.lowlevel.checkpoint_if_cancelled()
        else:
            await self._within(pipe, ctx, job)
        check_state(ctx.state)

    def ok(
        self, job: Job, pipe: Pipe, now: float, ctx: Context, top: Frame, learn: bool = True
    ) -> float:
        """A pipe ended well: its state adopted, the cursor moved on; the clock at its end."""
        if pipe.blocking:
            job.state = ctx.state
        top.index += 1
        return self.ended(job, pipe, now, "ok", None, learn)

    async def _within(self, pipe: Pipe, ctx: Context, job: Job) -> None:
        """Run the pipe within ``ctx.deadline``; raise PipeTimeout if that limit ran out."""
        # The step's own scope carries the pipe's limit: one scope per step, not one more
        # per pipe. A cancel marks the record first, which is how the two are told apart.
        scope = self._flight.scopes[job.id]
        scope.deadline = ctx.deadline
        try:
            await invoke(pipe, ctx)
            await trio.lowlevel.checkpoint_if_cancelled()
        except BaseException as exc:
            if (
                scope.cancel_called
                and not job.cancel_requested
                and trio.current_time() >= ctx.deadline
                and cancellation_in(exc, lambda: ctx.path) is not None
            ):
                raise PipeTimeout from None
            raise
        finally:
            if not scope.cancel_called:
                scope.deadline = math.inf  # the bookkeeping that follows is not the pipe's

    async def raised(
        self,
        job: Job,
        chain: Chain,
        pipe: Pipe,
        started: float,
        raised: BaseException,
        ctx: Context,
        top: Frame,
        learn: bool = True,
    ) -> float | None:
        """What a pipe raised, sorted out: the clock to go on at (a suspension whose signal
        had come), None when the step ended (failure, timeout, suspension). Cancellation of
        the step travels on."""
        if isinstance(raised, Suspend):
            ended = self.ended(job, pipe, started, "suspended", None, learn)
            top.index += 1
            # A signal that came while the pipe ran lets the step go on at once.
            resumed = await self._suspensions.suspend(job, chain, raised, ctx.path)
            return ended if resumed else None
        if isinstance(raised, PipeTimeout):
            pipe_deadline = math.inf if pipe.timeout is None else started + pipe.timeout
            timeout = timeout_of(job, chain, pipe_deadline, top, ctx.path)
            # The step's scope stays cancelled once a deadline passed: record the end shielded.
            with trio.CancelScope(shield=True):
                await self._failed(job, pipe, started, timeout, ctx.path, learn)
            return None
        cancellation = cancellation_in(raised, lambda: ctx.path)
        if cancellation is not None:
            # The step's (or the engine's) cancellation: the step boundary ends the job.
            self.ended(job, pipe, started, "cancelled")
            raise cancellation from None
        await self._failed(job, pipe, started, pipe_error(raised, ctx.path), ctx.path, learn)
        return None

    async def _failed(
        self, job: Job, pipe: Pipe, started: float, exc: BaseException, path: str, learn: bool
    ) -> None:
        outcome = "timeout" if isinstance(exc, DeadlineExceeded) else "error"
        if isinstance(exc, StateError):
            exc.http_status = 500  # a pipe wrote bad state: the server's fault, not input
            job.state = storable_part(job.state)  # the record must still be storable
        self.ended(job, pipe, started, outcome, exc, learn)
        where = exc.where if isinstance(exc, DeadlineExceeded) and exc.where else path
        note(exc, job, path)
        status = Status.EXPIRED if is_job_timeout(exc) else Status.FAILED
        await self._ends.finish(job, status, exc=exc, where=where)

    def _start_span(self, job: Job, chain: Chain, pipe: Pipe) -> None:
        """The pipe's span, current while it runs: the step's child (or, in a branch run
        in its parent's step, the parent's step's), its backend calls' parent."""
        self._spans[job.id] = _tracing.ACTIVE.start(
            f"pipe {pipe.name}",
            "internal",
            {
                "pipework.pipe": pipe.name,
                "pipework.job_id": job.id,
                "pipework.chain": chain.name,
                "pipework.key": job.key,
            },
        )

    def _end_span(self, job: Job, outcome: str, exc: BaseException | None) -> None:
        span = self._spans.pop(job.id, None)
        if span is not None:
            span.set("pipework.outcome", outcome)
            span.end(exc if outcome in ("error", "timeout") else None)

    def ended(
        self,
        job: Job,
        pipe: Pipe,
        started: float,
        outcome: str,
        exc: BaseException | None = None,
        learn: bool = True,
    ) -> float:
        """Measure, record and log a pipe's end; returns the clock read at its end.
        ``learn``: feed its key's adaptive limit (see :meth:`run`)."""
        now = self._flight.clock()
        if job.plan == INTERNAL_PLAN:
            return now  # the engine's own probe: no user pipe to measure, nothing to learn
        if self._spans:
            self._end_span(job, outcome, exc)
        duration = now - started
        metrics = self._metrics
        if outcome == "ok":
            observe = self._ok.get(pipe.name)
            if observe is None:
                observe = metrics.observer(metrics.pipe_duration, (pipe.name, outcome))
                self._ok[pipe.name] = observe
            observe(duration)
        else:
            metrics.observe(metrics.pipe_duration, (pipe.name, outcome), duration)
        # Only the backend's trouble (its errors, timeouts) may shrink an adaptive limit: a
        # bug in a pipe says nothing about the backend's capacity; a cancel says nothing.
        if not learn:
            pass
        elif outcome in ("ok", "suspended"):
            self._pool.record(job.key, ok=True, latency=duration)
        elif outcome == "timeout" or (exc is not None and backend_trouble(exc)):
            self._pool.record(job.key, ok=False, latency=duration)
        if exc is None or refused_by_service(exc) or reported(exc) or is_job_timeout(exc):
            # A pipe's end is part of its job's life (DEBUG); a service's refusal is
            # expected while its breaker is open (the breaker's change was the WARNING,
            # docs/resilience.md); a failure logged where it happened (a backend call's
            # WARNING) is not logged twice; the job's own deadline is its end's line.
            level = logging.DEBUG
        else:
            level = logging.WARNING  # this line is the failure's one line
            mark_reported(exc)
        if not job_logger.isEnabledFor(level):
            return now  # the common case: skip building the record's fields
        log_job(
            "pipe ended",
            level,
            # A backend's failure is logged where it happens, in one line; its traceback
            # (its chain of causes) only at DEBUG. A pipe's own bug keeps its traceback.
            exc
            if outcome == "error"
            and level == logging.WARNING
            and exc is not None
            and not (
                (isinstance(exc, BackendError) or backend_trouble(exc))
                and not job_logger.isEnabledFor(logging.DEBUG)
            )
            else None,
            correlation_id=job.correlation_id,
            job_id=job.id,
            route=job.chain,
            pipe=pipe.name,
            key=job.key,
            duration=round(duration, 6),
            outcome=outcome,
            error=None if exc is None else f"{type(exc).__name__}: {exc}",
        )
        return now
