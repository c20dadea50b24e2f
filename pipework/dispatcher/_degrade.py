"""Degradation, acted on: a pipe its job can do without (``Pipe.degradable``) is skipped, or
answered by its fallback, instead of waited for or failing its job. :mod:`._degrade_core`
decides why; this module runs such a pipe and what answers in its place.

Where the engine asks:

- **before it runs** (:meth:`Degrader.run`, and in a step's own loop, where the step would
  hand its job off to the pipe's key): ``refused`` or ``deadline``, with the slot the step
  already holds, if any, kept for the moment the fallback takes;
- **where a step would wait for a slot** of the pipe's key (:meth:`Degrader.unheld`, from a
  step or an in-step branch with no slot free at once): ``no_slot`` (after the two above),
  the pipe degraded holding no slot at all;
- **when it ends**: ``error`` or ``timeout`` (its own). It runs on a copy of the state,
  adopted only when it ends well, so what a failed run wrote never reaches the job.

Degrading writes the pipe's name and reason to ``state["degraded"]``, counts it in
``pipework_degraded_total`` and logs it; then a fallback mapping is set in the state, or a
fallback pipe runs in the pipe's place at once (taking no slot; a failure of its own fails
the job, as any pipe's does), and the cursor moves past the pipe.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Final, Protocol, runtime_checkable

import trio

from .._errors import DeadlineExceeded, Rejected
from .._logging import job_logger, log_job
from .._metrics import Metrics
from ..pipes._merge import Delta, snapshot
from ..pipes._pipe import DEGRADED_KEY, Pipe, Suspend
from ..pipes._stages import Chain, Parallel
from ..pipes._state import check_state
from ._cursor import advance, peek
from ._degrade_core import (
    Estimates,
    Reason,
    degraded_delta,
    mark,
    reason_after,
    reason_before,
)
from ._flight import Flight
from ._job import Frame, Job
from ._outcomes import PipeTimeout, cancellation_in, invoke, pipe_error
from ._pipe_run import PipeRunner
from ._status import RUNNING, Status

__all__ = ["NEVER_REFUSING", "Degrader", "Refusals"]

#: Start times of branches run as child jobs kept at most (see ``Degrader.branch_starts``).
_STARTS_MAX: Final = 4096


@runtime_checkable
class Refusals(Protocol):
    """What says whether an admission key refuses calls right now (a service whose circuit
    breaker is open): a pipe its job can do without is then degraded instead of tried."""

    def refusing(self, key: str) -> bool:
        """Whether calls under ``key`` are refused now. Asked before each such pipe runs:
        answer at once, from memory."""
        ...


class _NeverRefusing:
    def refusing(self, key: str) -> bool:
        return False


#: The refusals of an engine given none: no key ever refuses.
NEVER_REFUSING: Refusals = _NeverRefusing()


class Degrader:
    """Runs the pipes a job can do without, and degrades them (see the module docstring).
    ``grants``: the pool says at once whether a slot is free (``FastAdmission``); without
    that, nothing is degraded for ``no_slot``."""

    def __init__(
        self,
        flight: Flight,
        runner: PipeRunner,
        metrics: Metrics,
        refusals: Refusals,
        *,
        grants: bool,
    ) -> None:
        self._flight = flight
        self._runner = runner
        self._metrics = metrics
        self._refusals = refusals
        self.grants = grants
        #: What each such pipe usually takes (the ``deadline`` reason).
        self.estimates = Estimates()
        #: What each branch its job can do without usually takes, by chain and branch name.
        self.branch_estimates = Estimates()
        #: When this process started each such branch run as a child job, by its id: its
        #: end may be heard in another process, whose clock is not comparable.
        self.branch_starts: dict[str, float] = {}

    def before(self, pipe: Pipe, key: str, deadline: float, now: float) -> Reason | None:
        """Why ``pipe``, about to run under ``key`` with ``deadline`` (its stage's), is
        degraded instead; None: it runs."""
        estimates = self.estimates
        reason = reason_before(
            self._refusals.refusing(key), deadline - now, estimates.usual(pipe.name)
        )
        if reason == "deadline":
            estimates.skipped(pipe.name)
        return reason

    def pending(self, job: Job, chain: Chain) -> Pipe | None:
        """The pipe the job's cursor is at, when its job can do without it (the cursor does
        not move: no stage is entered)."""
        node = peek(job, chain)
        return node if isinstance(node, Pipe) and node.degradable else None

    # -- a pipe its job can do without, run --------------------------------------------------

    async def run(self, job: Job, chain: Chain, pipe: Pipe, now: float, top: Frame) -> float | None:
        """:meth:`PipeRunner.run` for a pipe its job can do without: degraded before it runs
        (``refused``, ``deadline``) or when it fails (``error``, its own ``timeout``)."""
        reason = self.before(pipe, job.key, top.deadline, now)
        if reason is not None:
            return await self.instead(job, chain, pipe, reason, now, top)
        return await self.attempt(job, chain, pipe, now, top)

    async def attempt(
        self, job: Job, chain: Chain, pipe: Pipe, now: float, top: Frame
    ) -> float | None:
        """Run ``pipe`` on a copy of the state, in a cancel scope of its own (the step's
        must stay usable: the job goes on after a timeout here); degrade it if it fails.
        Returns the clock to go on from, or None when the job's step ended here."""
        runner = self._runner
        ctx = runner.context(job, chain, pipe, now, top)
        if not pipe.blocking:  # a blocking pipe's context holds a copy already
            ctx.state = snapshot(job.state)
        own = math.inf if pipe.timeout is None else now + pipe.timeout
        try:
            with trio.CancelScope(deadline=ctx.deadline) as scope:
                await invoke(pipe, ctx)
                # A pipe that swallowed a cancellation must not carry on as if none came.
                await trio.lowlevel.checkpoint_if_cancelled()
            if not scope.cancelled_caught:
                check_state(ctx.state)
        except BaseException as raised:
            if isinstance(raised, Suspend):
                job.state = ctx.state  # what it wrote before it suspended is the job's
            if (
                isinstance(raised, Suspend)
                or not isinstance(raised, Exception)
                or cancellation_in(raised, lambda: ctx.path) is not None
            ):
                # A suspension, the step's cancellation or a contract error: as any pipe's.
                return await runner.raised(job, chain, pipe, now, raised, ctx, top)
            error = pipe_error(raised, ctx.path)
            ended = runner.ended(job, pipe, now, "error", error)
            return await self.instead(job, chain, pipe, "error", ended, top)
        if scope.cancelled_caught:
            if own >= top.deadline:
                # Its stage's time (or its job's) ran out: nothing is left to go on in.
                return await runner.raised(job, chain, pipe, now, PipeTimeout(), ctx, top)
            timeout = DeadlineExceeded(
                f"the pipe's timeout ran out in {ctx.path}",
                scope="pipe",
                where=ctx.path,
                deadline=own,
            )
            ended = runner.ended(job, pipe, now, "timeout", timeout)
            self.estimates.observe(pipe.name, ended - now)
            return await self.instead(job, chain, pipe, "timeout", ended, top)
        job.state = ctx.state
        ended = runner.ok(job, pipe, now, ctx, top)
        self.estimates.observe(pipe.name, ended - now)
        return ended

    # -- degrading -----------------------------------------------------------------------------

    async def instead(
        self, job: Job, chain: Chain, pipe: Pipe, reason: Reason, now: float, top: Frame
    ) -> float | None:
        """Degrade ``pipe`` at the cursor's ``top`` frame: record it, then its fallback in
        its place; the cursor moves past it. Returns the clock to go on from, or None when
        a fallback pipe ended the job's step (it failed or suspended)."""
        mark(job.state, pipe.name, reason)
        self._metrics.degraded.labels(job.chain, pipe.name, reason).inc()
        # DEBUG: the failure behind it was its own line (or the breaker's change was), the
        # answer says it (Pipework-Degraded) and pipework_degraded_total counts it.
        if job_logger.isEnabledFor(logging.DEBUG):
            log_job(
                "pipe degraded",
                logging.DEBUG,
                correlation_id=job.correlation_id,
                job_id=job.id,
                route=job.chain,
                pipe=pipe.name,
                key=job.key,
                outcome=reason,
            )
        fallback = pipe.fallback
        if isinstance(fallback, Pipe):
            # In the pipe's place, now: no slot of its own, nothing learnt for the key.
            return await self._runner.run(job, chain, fallback, now, top, learn=False)
        if fallback is not None:
            job.state.update(pipe.fallback_state())
        top.index += 1
        return now

    async def unheld(self, job: Job, chain: Chain, pipe: Pipe, now: float) -> float | None:
        """Degrade ``pipe`` (:meth:`pending`), holding no slot: its key has none free at
        once, where the job's step would otherwise wait. The cursor enters the stages up to
        it (their timers start now, as when a worker reaches them) and moves past it; the
        job is left running. Returns the clock to go on from, or None when a fallback pipe
        ended the step."""
        found = advance(job, chain, self._flight.clock)
        assert found is pipe, "pending() named the pipe the cursor is at"
        top = job.frames[-1]
        reason = self.before(pipe, job.key, top.deadline, now) or "no_slot"
        job.transition(RUNNING)
        return await self.instead(job, chain, pipe, reason, now, top)

    # -- a branch its job can do without (``pw.branch``) -------------------------------------

    def branch_before(
        self,
        chain: Chain,
        stage: Parallel,
        index: int,
        deadline: float,
        now: float,
        pool_key: str | None = None,
    ) -> Reason | None:
        """Why branch ``index`` of ``stage``, about to start with ``deadline`` (its stage's),
        is degraded instead (None: it runs, or it is not one its job can do without):
        ``refused`` when its first pipe's key refuses, ``deadline`` when the time left is
        below what the branch usually takes. ``pool_key``: its job's (a pipe without a key
        of its own runs under it)."""
        root = stage.branches[index]
        if not root.degradable:
            return None
        first = root.first_pipe()
        key = (first.key if first is not None else None) or pool_key or chain.key
        name = f"{chain.name}/{stage.names[index]}"
        estimates = self.branch_estimates
        reason = reason_before(self._refusals.refusing(key), deadline - now, estimates.usual(name))
        if reason == "deadline":
            estimates.skipped(name)
        return reason

    def branch_started(self, branch_id: str, now: float) -> None:
        """A branch its job can do without was started as a child job at ``now``."""
        starts = self.branch_starts
        if len(starts) >= _STARTS_MAX:  # ends heard by other processes: forget the oldest
            del starts[next(iter(starts))]
        starts[branch_id] = now

    def branch_ended(
        self,
        chain: Chain,
        stage: Parallel,
        index: int,
        branch: Job,
        started: float | None,
        now: float,
    ) -> Reason | None:
        """Why an ended branch its job can do without is degraded now (``error``, or
        ``timeout`` of its own), None when it is not (it ended well, was cancelled, ran out
        of its stage's or its job's time, or is not such a branch). Its duration, when it
        ran to its end or its own timeout, is what it usually takes (``started``: when this
        process started it; None: it does not know)."""
        root = stage.branches[index]
        if not root.degradable:
            return None
        exc = branch.exception
        rejected_late = isinstance(exc, Rejected) and exc.reason == "deadline"
        if exc is None:
            timed_out = branch.error is not None and branch.error.type == "DeadlineExceeded"
        else:
            timed_out = isinstance(exc, DeadlineExceeded)
        reason = reason_after(branch.status is Status.FAILED and not rejected_late, timed_out)
        name = stage.names[index]
        marks = branch.state.get(DEGRADED_KEY)
        skipped = isinstance(marks, dict) and name in marks  # degraded at its start
        ran = (branch.status is Status.DONE and not skipped) or reason == "timeout"
        if ran and started is not None and started <= now:
            self.branch_estimates.observe(f"{chain.name}/{name}", now - started)
        return reason

    def branch_instead(
        self,
        parent: Job,
        chain: Chain,
        stage: Parallel,
        index: int,
        reason: Reason,
        start: dict[str, Any],
    ) -> Delta:
        """Degrade branch ``index``: recorded, counted and logged; what it hands its stage
        instead, against ``parent``'s state: ``start`` (the state it started, or would have
        started, from), its fallback and its mark: nothing it wrote."""
        name = stage.names[index]
        self._note(parent, chain, stage, index, reason)
        fallback = stage.branches[index].fallback_state()
        return degraded_delta(parent.state, start, fallback, name, reason)

    def _note(self, job: Job, chain: Chain, stage: Parallel, index: int, reason: Reason) -> None:
        name = stage.names[index]
        self._metrics.degraded.labels(job.chain, name, reason).inc()
        if job_logger.isEnabledFor(logging.INFO):
            first = stage.branches[index].first_pipe()
            log_job(
                "branch degraded",
                correlation_id=job.correlation_id,
                job_id=job.id,
                route=job.chain,
                pipe=name,
                key=(first.key if first is not None else None) or job.pool_key or chain.key,
                outcome=reason,
            )

    def branch_pending(self, job: Job, chain: Chain) -> tuple[Parallel, int] | None:
        """The stage and index of ``job``, when it is a branch its job can do without that
        has not started yet (a step would wait for its first slot)."""
        index = job.branch
        frames = job.frames
        if index is None or len(frames) != 1 or frames[0].index or not job.root:
            return None
        stage = chain.node_at(job.root[:-1])
        if not isinstance(stage, Parallel) or not stage.branches[index].degradable:
            return None
        return stage, index

    def branch_unheld(self, job: Job, chain: Chain, stage: Parallel, index: int) -> None:
        """Degrade the branch ``job`` (:meth:`branch_pending`) before its first pipe, holding
        no slot: its state is the one it started from, with its fallback and its mark. The
        caller ends it done; its stage then merges just that."""
        now = self._flight.clock()
        reason = (
            self.branch_before(chain, stage, index, job.deadline, now, job.pool_key) or "no_slot"
        )
        self._note(job, chain, stage, index, reason)
        job.state.update(stage.branches[index].fallback_state())
        mark(job.state, stage.names[index], reason)
        job.frames = []
        job.transition(RUNNING)
