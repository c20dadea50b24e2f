"""The dispatcher: takes events off the queue and turns them into steps on worker slots.

A *step* is what one worker does with one slot: load the job from the pool, run pipes from
the cursor while they share the slot's key, and stop at a key change (hand-off: the job goes
back through the queue), a suspension, or the end of the chain. Nothing survives a step but
the job record, so any worker can take the next one (see docs/design.md).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import trio

from .._errors import (
    DeadlineExceeded,
    JobCancelled,
    JobNotFound,
    PipeworkError,
    Rejected,
    StateError,
)
from .._logging import job_logger, log_job
from .._metrics import Metrics
from ..pipes._pipe import Context, Pipe, Suspend
from ..pipes._stages import Chain, Parallel, Serial
from ..pipes._state import check_state
from ..registry._registry import Registry
from ._admission import Admission
from ._events import BranchDone, Expire, Resume, RunJob
from ._job import ErrorInfo, Frame, Job, Progress
from ._parallel import cancel_branches, fork, on_branch_done, report_branch
from ._queue import EventQueue
from ._status import TERMINAL, Status
from ._store import JobStore

__all__ = ["INTERNAL_PLAN", "Dispatcher"]

_log = logging.getLogger("pipework.dispatcher")
_RUNNABLE = (Pipe, Parallel)  # what the cursor stops at: a tuple is the fastest isinstance

#: The plan generation of the engine's own chains (the readiness probe): below every user
#: plan, never swapped, and kept out of the per-route and per-pipe metrics.
INTERNAL_PLAN: Final = 0


class Dispatcher:
    def __init__(
        self,
        registry: Registry,
        store: JobStore,
        queue: EventQueue,
        pool: Admission,
        metrics: Metrics,
        key_label: Callable[[str], str],
    ) -> None:
        #: Every plan (registry) jobs may still run on, by generation: a reload adds one,
        #: and a job keeps the plan it was accepted under (its cursor means nothing elsewhere).
        self.plans: dict[int, Registry] = {1: registry}
        self.store = store
        self.queue = queue
        self.pool = pool
        self.metrics = metrics
        self.key_label = key_label
        self._nursery: trio.Nursery | None = None
        self._scopes: dict[str, trio.CancelScope] = {}
        self._timers: dict[str, trio.CancelScope] = {}
        self._waiters: dict[str, trio.Event] = {}
        self._streams: dict[str, trio.MemorySendChannel[Any]] = {}
        #: Exception objects of ended branches, until their join takes them (in-process only).
        self.branch_errors: dict[str, BaseException] = {}
        #: Set by an HTTP container: (job id, signal, ttl) -> a signed callback URL.
        self.callback_factory: Callable[[str, str, float], str] | None = None
        # Handlers run in the dispatcher's loop, one at a time: only a RunJob spawns a task
        # (pipes run concurrently); the others are short bookkeeping on the job pool.
        self._handlers: dict[type[Any], Callable[[Any], Awaitable[None]]] = {
            RunJob: self._on_run,
            Resume: self._on_run,
            Expire: self._expire,
            BranchDone: functools.partial(on_branch_done, self),
        }

    def chain_of(self, job: Job) -> Chain:
        return self.plans[job.plan].get_chain(job.chain)

    # -- the loop ------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Dispatch events until cancelled; steps run in this task's nursery."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            handlers = self._handlers
            while True:
                for event in await self.queue.get_batch():
                    try:
                        await handlers[type(event)](event)
                    except Exception:
                        # A bug in one event's bookkeeping must not stop every other job.
                        _log.exception("dispatching %r failed", event)

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        assert self._nursery is not None, "the dispatcher is not running"
        self._nursery.start_soon(fn, *args)

    async def _on_run(self, event: RunJob | Resume) -> None:
        self.spawn(self._step, event)

    # -- cursor --------------------------------------------------------------------------

    def start_frames(self, job: Job, chain: Chain) -> None:
        """Give a new job its root frame and the key of its first step."""
        root = chain.node_at(job.root)
        deadline = job.deadline
        if isinstance(root, Serial) and root.timeout is not None:
            deadline = min(deadline, trio.current_time() + root.timeout)
        job.frames = [Frame(0, deadline)]
        job.key = self._next_key(job, chain)

    def _next_key(self, job: Job, chain: Chain) -> str:
        step = self._advance(job, chain)
        return step.key or chain.key if isinstance(step, Pipe) else chain.key

    def _advance(self, job: Job, chain: Chain) -> Pipe | Parallel | None:
        """Move the cursor to the next pipe or parallel stage (entering and leaving serial
        stages); None when the job's sequence is complete."""
        frames = job.frames
        if not frames:
            return None
        node: Any = self._top_node(job, chain)
        while True:
            top = frames[-1]
            children = node.children
            if top.index >= len(children):
                frames.pop()
                if not frames:
                    return None
                frames[-1].index += 1
                node = self._top_node(job, chain)
                continue
            child = children[top.index]
            if isinstance(child, _RUNNABLE):
                return child
            deadline = top.deadline
            if child.timeout is not None:
                deadline = min(deadline, trio.current_time() + child.timeout)
            frames.append(Frame(0, deadline))
            node = child

    @staticmethod
    def _top_node(job: Job, chain: Chain) -> Any:
        """The serial sequence the top frame walks."""
        node: Any = chain.node_at(job.root)
        for frame in job.frames[:-1]:
            node = node.children[frame.index]
        return node

    def path_of(self, job: Job) -> tuple[int, ...]:
        frames = job.frames
        if len(frames) <= 1:
            return job.root  # the common case: a flat chain
        return (*job.root, *(f.index for f in frames[:-1]))

    # -- a step --------------------------------------------------------------------------

    async def _step(self, event: RunJob | Resume) -> None:
        acked = False
        try:
            try:
                job = await self.store.get(event.job_id)
            except PipeworkError:
                return
            if job.status is not Status.QUEUED:
                return  # cancelled or finished while the event waited: nothing to run
            with trio.CancelScope() as scope:
                self._scopes[job.id] = scope
                waited = trio.current_time()
                try:
                    # A resumed job carries an outside fact (a payment, an approval): it waits
                    # out the load up to its deadline rather than be refused. Every other
                    # step fails fast under load, as the pool's bounds intend.
                    continuing = isinstance(event, Resume)
                    slot = self.pool.slot(job.key, deadline=job.deadline, continuing=continuing)
                    async with slot:
                        self.queue.ack(event)
                        acked = True
                        self._waited(job.key, waited)
                        await self._run_held(job)
                except Rejected as exc:
                    self._waited(job.key, waited)
                    self.note(exc, job, f"admission key {job.key!r}")
                    await self.finish(job, Status.FAILED, exc=exc)
                except trio.Cancelled:
                    with trio.CancelScope(shield=True):
                        await self.finish(
                            job, Status.CANCELLED, exc=JobCancelled(f"job {job.id} was cancelled")
                        )
                    raise
                finally:
                    if self._scopes.get(job.id) is scope:
                        del self._scopes[job.id]
        finally:
            if not acked:
                self.queue.ack(event)

    def _waited(self, key: str, since: float) -> None:
        self.metrics.observe(
            self.metrics.pool_wait, (self.key_label(key),), trio.current_time() - since
        )

    async def _run_held(self, job: Job) -> None:
        """Run pipes while they share the held slot's key."""
        chain = self.chain_of(job)
        held = job.key
        job.transition(Status.RUNNING)
        while True:
            pipe = self._advance(job, chain)
            if pipe is None:
                if job.parent is not None:
                    result = None  # a branch's result is its delta, sent to the join
                elif chain.result is None:
                    result = job.state
                else:
                    result = job.state.get(chain.result)
                await self.finish(job, Status.DONE, result=result)
                return
            if isinstance(pipe, Parallel):
                await fork(self, job, chain, pipe)  # the slot is released on return
                return
            key = pipe.key or chain.key
            if key != held:
                job.key = key
                job.transition(Status.QUEUED)
                await self.store.update(job)
                self.queue.put_nowait(RunJob(job.id))
                log_job(
                    "job handed off",
                    correlation_id=job.correlation_id,
                    job_id=job.id,
                    route=job.chain,
                    key=key,
                    status=job.status.value,
                )
                return
            if not await self._run_pipe(job, chain, pipe):
                return

    async def _run_pipe(self, job: Job, chain: Chain, pipe: Pipe) -> bool:
        """Run one pipe; True to go on, False when the step ended (failure or suspension)."""
        position = self.path_of(job)

        def describe() -> str:  # formatted only when asked for: errors, logs, ctx.path
            return chain.describe(position, pipe)

        top = job.frames[-1]
        started = trio.current_time()
        pipe_deadline = math.inf if pipe.timeout is None else started + pipe.timeout
        deadline = min(pipe_deadline, top.deadline)
        ctx = Context(
            state=job.state,
            job_id=job.id,
            correlation_id=job.correlation_id,
            chain=chain.name,
            pipe=pipe,
            describe=describe,
            key=job.key,
            deadline=deadline,
            ops=self,
        )
        try:
            await self._call(pipe, ctx, job, top.deadline)
        except Suspend as suspend:
            self._pipe_ended(job, pipe, started, "suspended")
            top.index += 1
            return await self._suspend(job, chain, suspend, describe())
        except Exception as exc:
            outcome = "timeout" if isinstance(exc, DeadlineExceeded) else "error"
            if isinstance(exc, StateError):
                exc.http_status = 500  # a pipe wrote bad state: the server's fault, not input
            self._pipe_ended(job, pipe, started, outcome, exc)
            path = describe()
            self.note(exc, job, path)
            status = Status.EXPIRED if _is_job_timeout(exc) else Status.FAILED
            await self.finish(job, status, exc=exc, where=path)
            return False
        except trio.Cancelled:
            self._pipe_ended(job, pipe, started, "cancelled")
            raise
        self._pipe_ended(job, pipe, started, "ok")
        top.index += 1
        await self.store.update(job)
        return True

    def _pipe_ended(
        self, job: Job, pipe: Pipe, started: float, outcome: str, exc: BaseException | None = None
    ) -> None:
        if job.plan == INTERNAL_PLAN:
            return  # the engine's own probe: no user pipe to measure, nothing to learn
        duration = trio.current_time() - started
        self.metrics.observe(self.metrics.pipe_duration, (pipe.name, outcome), duration)
        if outcome != "cancelled":
            # Only the backend's trouble (errors, timeouts) should shrink an adaptive limit.
            self.pool.record(job.key, ok=outcome in ("ok", "suspended"), latency=duration)
        level = logging.WARNING if exc is not None else logging.INFO
        if not job_logger.isEnabledFor(level):
            return  # the common case: skip building the record's fields
        log_job(
            "pipe ended",
            level,
            exc if outcome == "error" else None,
            correlation_id=job.correlation_id,
            job_id=job.id,
            route=job.chain,
            pipe=pipe.name,
            key=job.key,
            duration=round(duration, 6),
            outcome=outcome,
            error=None if exc is None else f"{type(exc).__name__}: {exc}",
        )

    async def _call(self, pipe: Pipe, ctx: Context, job: Job, stage_deadline: float) -> None:
        # Async pipes are awaited directly: one coroutine frame fewer on every resume.
        call = pipe.run if pipe.blocking else pipe.fn
        if ctx.deadline == math.inf:
            await call(ctx)  # type: ignore[misc]  # no limit anywhere: skip the scope's cost
        else:
            with trio.CancelScope(deadline=ctx.deadline) as scope:
                await call(ctx)  # type: ignore[misc]  # async: checked at registration
            if scope.cancelled_caught:
                raise self._timeout(job, ctx.deadline, stage_deadline, ctx.path)
        check_state(job.state)

    def _timeout(self, job: Job, deadline: float, stage: float, path: str) -> DeadlineExceeded:
        if deadline == job.deadline:
            scope, what = "job", f"job {job.id} passed its deadline"
        elif deadline == stage:
            scope, what = "stage", "a stage timeout ran out"
        else:
            scope, what = "pipe", "the pipe's timeout ran out"
        return DeadlineExceeded(f"{what} in {path}", scope=scope, where=path, deadline=deadline)

    # -- suspend, resume, expire ---------------------------------------------------------

    async def _suspend(self, job: Job, chain: Chain, suspend: Suspend, path: str) -> bool:
        check_state(job.state)
        holder = await self._mailbox_with(job, suspend.signal)
        if holder is not None:  # it came while we ran: no need to park
            job.state[suspend.into] = holder.signals.pop(suspend.signal)
            if holder is not job:
                await self.store.update(holder)
            await self.store.update(job)
            return True
        top = job.frames[-1]
        now = trio.current_time()
        limit = math.inf if suspend.timeout is None else now + suspend.timeout
        job.suspend_deadline = min(limit, top.deadline)
        job.waiting_for = suspend.signal
        job.suspend_into = suspend.into
        job.key = self._next_key(job, chain)
        job.transition(Status.SUSPENDED)
        await self.store.update(job)
        if job.suspend_deadline < math.inf:
            self.spawn(self._timer, job.id, job.version, job.suspend_deadline)
        log_job(
            "job suspended",
            correlation_id=job.correlation_id,
            job_id=job.id,
            route=job.chain,
            stage=path,
            signal=suspend.signal,
            status=job.status.value,
        )
        return False

    async def _mailbox_with(self, job: Job, signal: str) -> Job | None:
        """The job, or the nearest parent, holding an early ``signal`` (a signal sent to a
        parent waiting at a join is meant for whichever branch suspends for it)."""
        current: Job | None = job
        while current is not None:
            if signal in current.signals:
                return current
            current = None if current.parent is None else await self.store.get(current.parent)
        return None

    async def find_waiting(self, job: Job, signal: str) -> Job | None:
        """The job or one of its branches (depth first) suspended waiting for ``signal``."""
        if job.status is Status.SUSPENDED and job.waiting_for == signal:
            return job
        if job.join is None:
            return None
        for child_id in job.join["children"].values():
            try:
                child = await self.store.get(child_id)
            except JobNotFound:
                continue  # ended and reported
            if child.status not in TERMINAL:
                found = await self.find_waiting(child, signal)
                if found is not None:
                    return found
        return None

    async def deliver(self, job: Job, signal: str, payload: Any) -> None:
        """Resume a suspended job waiting for ``signal`` (the caller checked both)."""
        assert job.suspend_into is not None
        job.state[job.suspend_into] = payload
        job.waiting_for = job.suspend_into = job.suspend_deadline = None
        job.transition(Status.QUEUED)
        await self.store.update(job)
        self._cancel_timer(job.id)
        self.queue.put_nowait(Resume(job.id, signal))
        log_job(
            "job resumed",
            correlation_id=job.correlation_id,
            job_id=job.id,
            route=job.chain,
            signal=signal,
            status=job.status.value,
        )

    async def _timer(self, job_id: str, version: int, deadline: float) -> None:
        with trio.CancelScope() as scope:
            self._timers[job_id] = scope
            try:
                await trio.sleep_until(deadline)
                self.queue.put_nowait(Expire(job_id, version))
            finally:
                if self._timers.get(job_id) is scope:
                    del self._timers[job_id]

    def _cancel_timer(self, job_id: str) -> None:
        scope = self._timers.pop(job_id, None)
        if scope is not None:
            scope.cancel()

    async def _expire(self, event: Expire) -> None:
        try:
            job = await self.store.get(event.job_id)
            if job.status is not Status.SUSPENDED or job.version != event.version:
                return  # resumed or finished meanwhile: the timer lost the race
            assert job.suspend_deadline is not None
            chain = self.chain_of(job)
            where = chain.describe(self.path_of(job))
            deadline = job.suspend_deadline
            if deadline == job.deadline:
                exc = DeadlineExceeded(
                    f"job {job.id} passed its deadline while suspended for {job.waiting_for!r}",
                    scope="job",
                    where=where,
                    deadline=deadline,
                )
            else:
                exc = DeadlineExceeded(
                    f"no signal {job.waiting_for!r} before the suspend timeout at {where}",
                    scope="suspend",
                    where=where,
                    deadline=deadline,
                )
            self.note(exc, job, where)
            status = Status.EXPIRED if exc.scope == "job" else Status.FAILED
            await self.finish(job, status, exc=exc, where=where)
        finally:
            self.queue.ack(event)

    # -- cancel and finish ---------------------------------------------------------------

    async def continue_later(self, job: Job, chain: Chain) -> None:
        """Send a job back through the queue to continue at its cursor (after a join)."""
        job.key = self._next_key(job, chain)
        job.transition(Status.QUEUED)
        await self.store.update(job)
        self.queue.put_nowait(RunJob(job.id))

    async def cancel(self, job: Job) -> None:
        job.cancel_requested = True
        scope = self._scopes.get(job.id)
        if scope is not None:
            scope.cancel()  # the step finishes it once the pipe's cleanup has run
        else:
            await self.finish(
                job, Status.CANCELLED, exc=JobCancelled(f"job {job.id} was cancelled")
            )

    async def finish(
        self,
        job: Job,
        status: Status,
        *,
        result: Any = None,
        exc: BaseException | None = None,
        where: str = "",
    ) -> None:
        if job.status in TERMINAL:
            return
        job.transition(status)
        job.finished_at = time.time()
        job.waiting_for = None
        if status is Status.DONE:
            job.result = result
        elif exc is not None:
            job.exception = exc
            job.error = ErrorInfo(
                type(exc).__name__, str(exc), where, getattr(exc, "http_status", 500)
            )
        if job.parent is None:
            await self.store.update(job)  # a branch's record is dropped once it reports
        duration = trio.current_time() - job.accepted_at
        if job.parent is None and job.plan != INTERNAL_PLAN:
            self.metrics.observe(self.metrics.job_duration, (job.chain, status.value), duration)
        log_job(
            "job finished" if job.parent is None else "branch finished",
            logging.INFO if status in (Status.DONE, Status.CANCELLED) else logging.WARNING,
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
        self._cancel_timer(job.id)
        if job.join is not None:
            await cancel_branches(self, job)
        if job.parent is not None:
            await report_branch(self, job)
        stream = self._streams.pop(job.id, None)
        if stream is not None:
            stream.close()
        waiter = self._waiters.pop(job.id, None)
        if waiter is not None:
            waiter.set()

    async def wait_finished(self, job_id: str) -> None:
        waiter = self._waiters.setdefault(job_id, trio.Event())
        await waiter.wait()

    def open_stream(self, job_id: str, buffer: int) -> trio.MemoryReceiveChannel[Any]:
        send, receive = trio.open_memory_channel[Any](buffer)
        self._streams[job_id] = send
        return receive

    @staticmethod
    def note(exc: BaseException, job: Job, where: str) -> None:
        note = f"pipework: in {where} (job {job.id}, correlation id {job.correlation_id})"
        if note not in getattr(exc, "__notes__", ()):
            exc.add_note(note)

    # -- what a pipe's Context calls -----------------------------------------------------

    async def report_progress(
        self, ctx: Context, done: float, total: float | None, message: str | None
    ) -> None:
        job = await self.store.get(ctx.job_id)
        job.progress = Progress(done, total, message)
        await self.store.update(job)

    def callback_url(self, ctx: Context, signal: str, ttl: float) -> str:
        if self.callback_factory is None:
            raise RuntimeError(
                "callback URLs need an HTTP container serving this engine; in process, "
                "call engine.signal(job_id, name, payload) instead"
            )
        return self.callback_factory(ctx.job_id, signal, ttl)

    async def emit(self, ctx: Context, chunk: Any) -> None:
        stream = self._streams.get(ctx.job_id)
        if stream is not None:
            await stream.send(chunk)
        else:
            job = await self.store.get(ctx.job_id)
            job.output.append(chunk)


def _is_job_timeout(exc: BaseException) -> bool:
    return isinstance(exc, DeadlineExceeded) and exc.scope == "job"
