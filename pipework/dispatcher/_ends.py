"""Ending jobs: recording an end, telling whoever waits, cancelling, and retention.

An end is recorded once (a job already final is left as it is): the record is written (a
branch's is not: it reports to its join instead), the job's duration and log line follow,
and then whoever waits hears of it — ``Engine.wait``'s waiter, a stream's reader, the
engine (which retires idle plans). A step's last write may be left to a shared store
(``update_soon``): what follows the end then follows once the store says it is written,
and a write that failed ends the job as an awaited one would have (one that failed for the
store, its connection lost, is first written again, awaited: the store sends it again until
the job's deadline, and only a store away past that fails the job). A step that leaves its
job neither final nor waiting on purpose ends it here too: ``cancelled`` if it was
cancelled, ``failed`` with an :class:`~pipework.InternalError` if the engine's own
bookkeeping failed for it.

The exception objects of failed jobs stay in this process (``exceptions``) for as long as
finished records are retained, for ``Engine.wait`` to raise as they were; only the latest
failures keep their tracebacks (:mod:`._tracebacks`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final, Protocol

import trio

from .._errors import InternalError, JobCancelled, JobGone, JobNotFound, StoreUnavailable
from .._logging import job_logger, log_job, mark_reported, reported
from .._metrics import Metrics
from ..pipes._state import storable_part
from ._abilities import Abilities
from ._boundary import split_outside
from ._events import Event, RunJob
from ._flight import Flight, Hooks
from ._job import ErrorInfo, Job
from ._lookup import ChainLookup
from ._outcomes import is_job_timeout, note, refused_by_service, where_in
from ._retained import Retained
from ._status import DONE, TERMINAL, Status
from ._tracebacks import FreshTracebacks
from ._wake import Wake

__all__ = ["INTERNAL_PLAN", "BranchEnds", "Ends"]

_log = logging.getLogger("pipework.dispatcher")

#: The plan generation of the engine's own chains (the readiness probe): below every user
#: plan, never swapped, and kept out of the per-route and per-pipe metrics.
INTERNAL_PLAN: Final = 0

#: The statuses whose end is logged at INFO (others at WARNING).
_ORDINARY_ENDS: Final = frozenset({Status.DONE, Status.CANCELLED})


class BranchEnds(Protocol):
    """Where the end of a branch run as a child job goes (the forked stages' driver)."""

    async def report(self, branch: Job) -> None:
        """A child job of a parallel stage ended: tell its parent's join."""
        ...

    async def cancel_branches(self, parent: Job) -> None:
        """A parent ended while waiting at its join: cancel its branches still going."""
        ...


class Ends:
    def __init__(
        self,
        abilities: Abilities,
        flight: Flight,
        hooks: Hooks,
        metrics: Metrics,
        plans: dict[int, ChainLookup],
    ) -> None:
        self._abilities = abilities
        self._store = abilities.store
        self._nowait = abilities.nowait
        self._soon = abilities.shared_store is not None
        self._flight = flight
        self._hooks = hooks
        self._metrics = metrics
        self._plans = plans
        #: Where a forked branch's end goes; set when the stages' driver is made.
        self.branches: BranchEnds | None = None
        #: ``Engine.wait``'s waiters, and the send side of streamed jobs, by job id.
        self.waiters: dict[str, Wake] = {}
        self.streams: dict[str, trio.MemorySendChannel[Any]] = {}
        #: The exception objects of failed jobs, for ``Engine.wait`` to raise as they are: a
        #: record read back from a store has only their type, message and stage path. Kept
        #: as long as finished records are, and only in the process that ran the job.
        self.exceptions: Retained[BaseException] = Retained(
            abilities.retain_count, abilities.retain_seconds
        )
        #: The latest failures, which keep their tracebacks (older ones let them go).
        self.fresh = FreshTracebacks()
        #: Jobs whose last write a shared store took with no wait (``update_soon``), with
        #: their step's event once the step has ended: let go of once the write lands.
        self.pending: dict[str, Event | None] = {}
        # The duration observers of finished jobs by route: no label tuples per job.
        self._job_done: dict[str, Callable[[float], None]] = {}

    # -- recording an end -----------------------------------------------------------------

    async def finish(
        self,
        job: Job,
        status: Status,
        *,
        result: Any = None,
        exc: BaseException | None = None,
        where: str = "",
        now: float | None = None,
    ) -> None:
        """End ``job`` with ``status`` (``now``: the caller's clock read, if it has one)."""
        if job.status in TERMINAL:
            return
        try:
            await self._record(job, status, result, exc, where, now)
        finally:
            self.heard(job)  # even if recording it failed

    def done_nowait(self, job: Job, result: Any, now: float) -> bool:
        """``finish(job, DONE)`` with no await (no coroutines for the common end) when
        nothing in it waits: a top-level job with no join, on a store that answers at once
        (or a shared one that takes the write with no wait). False, with nothing done,
        otherwise."""
        nowait = self._nowait
        if job.parent is not None or job.join is not None:
            return False
        if nowait is None:
            return self._soon and self._end_soon(job, result, now)
        if job.status in TERMINAL:
            return True
        try:
            previous = job.status
            self.mark(job, DONE, result, None, "")
            try:
                nowait[1](job, now)  # the step's clock read: the store reads none of its own
            except BaseException:
                job.status = previous  # not recorded: ending it may be tried again
                raise
            self.ended(job, DONE, "", now)
        finally:
            self.heard(job)
        return True

    def _end_soon(self, job: Job, result: Any, now: float) -> bool:
        """``finish(job, DONE)`` with the write left to the store (``update_soon``): the
        step goes on without waiting for it; what follows a recorded end (waiters woken,
        the step's event let go of) follows once the store says it is written, and a
        write that failed ends the job as an awaited one would have (:meth:`_unwritten`)."""
        if job.status in TERMINAL:
            return True
        if job.id in self.pending:  # a write of its own still on its way
            return False
        previous = job.status
        self.mark(job, Status.DONE, result, None, "")

        def written(error: BaseException | None) -> None:
            if error is None:
                self.ended(job, Status.DONE, "", now)
                self.heard(job)
                self.let_go(job)
                return
            if isinstance(error, StoreUnavailable):  # perhaps written: written again
                self._spawn_again(job, error, "end", self._store.update, written, previous)
                return
            job.status = previous  # not recorded: ending it may be tried again
            self.heard(job)
            self._spawn_unwritten(job, error, "end")

        if not self._abilities.update_soon(job, written):
            job.status = previous
            return False
        self.pending[job.id] = None
        return True

    def hand_off_soon(self, soon: Callable[..., bool], job: Job) -> bool:
        """A hand-off's write of the record and the next step's event, with no wait (as a
        step's end): its step's event is let go of once both are in the shared queue."""

        def written(error: BaseException | None) -> None:
            if error is None:
                self._hooks.changed(job)
                self.let_go(job)
                return
            if isinstance(error, StoreUnavailable):  # perhaps written: written again
                self._spawn_again(job, error, "hand-off", again, written, None)
                return
            self._spawn_unwritten(job, error, "hand-off")

        async def again(job: Job) -> None:
            queue = self._abilities.shared_queue
            assert queue is not None, "a hand-off with no wait goes through a shared queue"
            await queue.update_and_put(self._store, job, RunJob(job.id))

        if job.id in self.pending or not soon(self._store, job, RunJob(job.id), written):
            return False
        self.pending[job.id] = None
        return True

    def _spawn_again(
        self,
        job: Job,
        error: BaseException,
        what: str,
        write: Callable[[Job], Awaitable[object]],
        written: Callable[[BaseException | None], None],
        previous: Status | None,
    ) -> None:
        try:
            self._flight.spawn(self._again, job, write, written, previous)
        except RuntimeError:  # the dispatcher has stopped: the event stays pending
            _log.error("pipework: the %s of job %s was not written", what, job.id, exc_info=error)

    async def _again(
        self,
        job: Job,
        write: Callable[[Job], Awaitable[object]],
        written: Callable[[BaseException | None], None],
        previous: Status | None,
    ) -> None:
        """A step's write left to the store (``update_soon``) whose round trip failed for
        the store: written again, awaited (the store sends it again, marked so that a write
        the first made is not made twice, until the job's deadline); ``written`` is told
        once it is written; if it is not, the job ends as an awaited write's failure would
        have ended it. ``previous``: the job's status before an end, put back then."""
        failure: BaseException | None = None
        try:
            await write(job)
        except* Exception as errors:  # (a cancellation travels on: the engine stops)
            failure = errors.exceptions[0]
            while isinstance(failure, BaseExceptionGroup):
                failure = failure.exceptions[0]
        if failure is None:
            written(None)
            return
        if previous is not None:
            job.status = previous  # not recorded: ending it may be tried again
            self.heard(job)
        await self._unwritten(job, failure)  # as if the awaited write had raised

    def _spawn_unwritten(self, job: Job, error: BaseException, what: str) -> None:
        try:
            self._flight.spawn(self._unwritten, job, error)
        except RuntimeError:  # the dispatcher has stopped: the event stays pending
            _log.error("pipework: the %s of job %s was not written", what, job.id, exc_info=error)

    async def _unwritten(self, job: Job, error: BaseException) -> None:
        """A step's end the store did not write (``update_soon``): the job ends as if the
        step's awaited write had raised ``error``, then its event is let go of."""
        try:
            with trio.CancelScope(shield=True):
                await self.unsettled(job, trio.CancelScope(), error)
        finally:
            self.let_go(job)

    def let_go(self, job: Job) -> None:
        """Let go of the step's event kept while the job's write was on its way."""
        event = self.pending.pop(job.id, None)
        if event is not None:
            self._abilities.step_ended(event)

    def heard(self, job: Job) -> None:
        """Tell whoever waits for the job that it ended."""
        on_finished = self._hooks.on_finished
        if on_finished is not None and job.parent is None:
            on_finished(job)
        stream = self.streams.pop(job.id, None)
        if stream is not None:
            stream.close()
        waiter = self.waiters.pop(job.id, None)
        if waiter is not None:
            waiter.set()

    async def _record(
        self,
        job: Job,
        status: Status,
        result: Any,
        exc: BaseException | None,
        where: str,
        now: float | None,
    ) -> None:
        previous = job.status
        self.mark(job, status, result, exc, where)
        if job.parent is None:  # a branch's record is dropped once it reports
            try:
                nowait = self._nowait
                if nowait:
                    nowait[1](job)
                else:
                    await self._store.update(job)
            except BaseException:
                job.status = previous  # not recorded: ending it may be tried again
                raise
        self.ended(job, status, where, now)
        branches = self.branches
        assert branches is not None, "the stages' driver is wired in when the dispatcher is made"
        if job.join is not None:
            await branches.cancel_branches(job)
        if job.parent is not None:
            flight = self._flight
            stage = None if job.join_id is None else flight.in_step.get(job.join_id)
            if stage is None or job.id not in flight.unstored:
                await branches.report(job)
            elif stage.durable:
                await stage.report_late(job)
            else:
                await stage.report(job)

    def mark(
        self, job: Job, status: Status, result: Any, exc: BaseException | None, where: str
    ) -> None:
        """The end on the record, not yet written."""
        job.transition(status)
        job.finished_at = job.updated_at  # the transition's wall-clock read
        job.waiting_for = None
        if not job.frames:  # it ran to the end of its chain: nothing to keep of the cursor
            job.frames = []
        if status is DONE:
            job.result = result
        elif exc is not None:
            job.exception = exc
            self.fresh.add(exc)
            if job.parent is None:
                self.exceptions.put(job.id, exc, self._flight.clock())
            job.error = ErrorInfo(
                type(exc).__name__, str(exc), where, getattr(exc, "http_status", 500)
            )

    def ended(self, job: Job, status: Status, where: str, now: float | None) -> None:
        """What follows a recorded end: observers, the job's duration, its log line."""
        if self._hooks.observers:
            self._hooks.changed(job)
        duration = (self._flight.clock() if now is None else now) - job.accepted_at
        if job.parent is None and job.plan != INTERNAL_PLAN:
            metrics = self._metrics
            if status is DONE:
                observe = self._job_done.get(job.chain)
                if observe is None:
                    observe = metrics.observer(metrics.job_duration, (job.chain, status.value))
                    self._job_done[job.chain] = observe
                observe(duration)
            else:
                metrics.observe(metrics.job_duration, (job.chain, status.value), duration)
        # A job's end is part of its life (DEBUG), a failure too when it was logged where
        # it happened (a backend call's WARNING, a pipe's), or is expected (a service's
        # refusal while its breaker is open: docs/resilience.md). A failure nothing logged
        # yet (a deadline that passed while the job waited) is this line's WARNING.
        exc = job.exception
        level = (
            logging.DEBUG
            if status in _ORDINARY_ENDS
            or refused_by_service(exc)
            or reported(exc)
            # The job's own deadline: said once, by the job's end, not each branch's.
            or (job.parent is not None and exc is not None and is_job_timeout(exc))
            else logging.WARNING
        )
        if level == logging.WARNING and exc is not None:
            mark_reported(exc)  # the parent's end, if it fails with it, is DEBUG
        if job_logger.isEnabledFor(level):
            log_job(
                "job finished" if job.parent is None else "branch finished",
                level,
                None,
                correlation_id=job.correlation_id,
                job_id=job.id,
                route=job.chain,
                key=job.key,
                duration=round(duration, 6),
                outcome=status.value,
                stage=where or None,
                error=None if job.error is None else f"{job.error.type}: {job.error.message}",
            )

    # -- ends nobody chose ------------------------------------------------------------------

    async def unsettled(
        self, job: Job, scope: trio.CancelScope, escaped: BaseException | None
    ) -> None:
        """End a job its step left neither final nor waiting on purpose."""
        bugs = None if escaped is None else split_outside(escaped)[1]
        if isinstance(bugs, JobNotFound) and await self._ended_elsewhere(job):
            return
        if bugs is not None:
            # The bookkeeping (a store, metrics, the dispatcher itself) failed for this job.
            _log.error(
                "pipework: the step of job %s failed inside the engine", job.id, exc_info=bugs
            )
            await self.fail_inside(job, bugs)
            return
        if scope.cancel_called or job.cancel_requested:
            exc = JobCancelled(f"job {job.id} was cancelled")
        else:  # the engine is stopping: the step was cancelled from outside
            exc = JobCancelled(f"job {job.id} was cancelled: the engine stopped")
        try:
            await self.finish(job, Status.CANCELLED, exc=exc)
        except Exception as bug:
            await self.fail_inside(job, bug)

    async def _ended_elsewhere(self, job: Job) -> bool:
        """Whether the store refused the step's write because the job ended meanwhile (a
        cancel that reached a shared store while this step loaded the record): its end is
        recorded, and the step has nothing left to write."""
        try:
            stored = await self._store.get(job.id)
        except JobGone:
            return True
        except JobNotFound:
            return job.parent is not None  # a branch's record goes once its end is reported
        return stored.status in TERMINAL

    async def fail_inside(self, job: Job, bug: BaseException) -> None:
        """Fail ``job`` because the engine's own bookkeeping failed for it."""
        exc = InternalError(
            f"job {job.id} failed inside the engine ({type(bug).__name__}: {bug}); "
            "the traceback is in the log"
        )
        exc.__cause__ = bug
        plan = self._plans.get(job.plan)
        chain = None if plan is None else plan.get_chain(job.chain)
        where = where_in(chain, job)
        note(exc, job, where)
        job.state = storable_part(job.state)  # what a pipe left unstorable cannot stay
        try:
            await self.finish(job, Status.FAILED, exc=exc, where=where)
        except Exception:  # the job is marked final here; its record may be stale
            _log.exception("pipework: recording the failure of job %s failed", job.id)

    # -- cancels ----------------------------------------------------------------------------

    async def cancel(self, job: Job) -> None:
        """Cancel ``job``: through its step's scope if one runs it here (the step ends it
        once the pipe's cleanup has run), else at once (and in other processes)."""
        job.cancel_requested = True
        flight = self._flight
        scope = flight.scopes.get(job.id)
        if scope is not None:
            # The step's own record: its scope also carries pipe deadlines, and this is how
            # the step tells a cancel from a timeout.
            running = flight.running.get(job.id)
            if running is not None:
                running.cancel_requested = True
            scope.cancel()
            return
        claim = flight.claiming.get(job.id)
        if claim is not None:
            claim.cancelled = True  # its step has not started: it will not
        await self.finish(job, Status.CANCELLED, exc=JobCancelled(f"job {job.id} was cancelled"))
        cancel_elsewhere = self._hooks.cancel_elsewhere
        if cancel_elsewhere is not None:  # a step of it may run in another process
            cancel_elsewhere(job.id)

    def interrupt(self, job_id: str) -> None:
        """Cancel the step running ``job_id`` here, if one is (a cancel recorded by another
        process): the step ends the job once the pipe's cleanup has run."""
        flight = self._flight
        scope = flight.scopes.get(job_id)
        if scope is None:
            claim = flight.claiming.get(job_id)
            if claim is not None:  # its step has not started: it will not
                claim.cancelled = True
            return
        running = flight.running.get(job_id)
        if running is not None:
            running.cancel_requested = True
        scope.cancel()

    def open_stream(self, job_id: str, buffer: int) -> trio.MemoryReceiveChannel[Any]:
        """Where a streamed job's chunks go, for its reader (``Engine.stream``)."""
        send, receive = trio.open_memory_channel[Any](buffer)
        self.streams[job_id] = send
        return receive
