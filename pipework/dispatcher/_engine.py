"""The in-process API: an :class:`Engine` owns a registry, a job pool, an event queue, a
worker pool and the dispatcher, and runs them in its own nursery while it is open.

Here: making the parts, the plans (registry swaps and their retirement), the lifecycle,
waiting for a job's end, the probe, cancelling and streaming. The engine is also made of
bases in modules of their own, so that each reads in one sitting: accepting jobs
(``_engine_intake.py``), its observers (``_engine_observers.py``), reading a job back for
its owner (``_engine_access.py``) and signals (``_engine_signals.py``); the probe's chain and
lane are in ``_probe.py``.
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, AsyncExitStack, aclosing
from types import TracebackType
from typing import Any, Final, Protocol, overload

import trio

from .._errors import DeadlineExceeded, JobCancelled, JobFailed
from .._metrics import Metrics
from ..pipes._catalogue import Catalogue
from ..pipes._pipe import Pipe, PipeFunction
from ..pipes._stages import Chain, StageItem
from ._abilities import (
    Abilities,
    CheckedAdmission,
    CountingStore,
    FollowingStore,
    KeyedAdmission,
    ReportingPool,
)
from ._admission import Admission
from ._degrade import NEVER_REFUSING, Refusals
from ._dispatcher import INTERNAL_PLAN, Dispatcher
from ._engine_access import JobAccess
from ._engine_intake import JobIntake
from ._engine_observers import JobObserver
from ._engine_signals import JobSignals
from ._job import Job, JobView, degraded_of
from ._probe import PROBE_CHAIN, internal_registry, probe_lane
from ._queue import EventQueue, MemoryEventQueue
from ._status import DONE, TERMINAL, Status
from ._store import JobStore, MemoryJobStore, OwnerIndex
from ._wake import Wake
from ._weighted import WeightedPool

__all__ = ["Engine"]

#: How often a request parked on a job that another process may finish looks at the
#: record again: an end published while this process's subscription was away (Redis
#: restarted, the client reconnected) is not heard again.
_RECHECK_SECONDS: Final = 5.0


class _PipeDecorator(Protocol):
    @overload
    def __call__(self, fn: PipeFunction, /) -> Pipe: ...

    @overload
    def __call__(
        self,
        fn: None = None,
        /,
        *,
        name: str | None = None,
        key: str | None = None,
        timeout: float | None = None,
        blocking: bool = False,
        optional: bool = False,
        fallback: Mapping[str, Any] | Pipe | None = None,
    ) -> Callable[[PipeFunction], Pipe]: ...


#: The wake of every job that has ended (it is never waited on).
_ENDED: Final = Wake()
_ENDED.set()


class Engine(JobIntake, JobSignals, JobAccess):
    """Register pipes and chains, then ``async with engine:`` to run jobs.

    ``registry`` is where pipes and chains are registered (default: a new
    :class:`~pipework.Catalogue`; pass a :class:`~pipework.Registry` to keep HTTP routes
    with them); ``pool`` governs concurrency (default: a WeightedPool of 64 slots, no weights);
    ``store`` and ``queue`` default to in-memory ones; ``default_timeout`` bounds jobs whose
    chain sets none; ``refusals`` says which admission keys refuse calls now (a service's
    open circuit breaker), so that pipes a job can do without are degraded instead of tried
    (default: none ever does). Leaving the ``async with`` cancels whatever is still running.
    """

    def __init__(
        self,
        *,
        pool: Admission | None = None,
        registry: Catalogue | None = None,
        store: JobStore | None = None,
        queue: EventQueue | None = None,
        queue_capacity: int = 10_000,
        default_timeout: float | None = None,
        stream_buffer: int = 16,
        metrics: Metrics | None = None,
        refusals: Refusals | None = None,
    ) -> None:
        self.registry: Catalogue = registry if registry is not None else Catalogue()
        self.store: JobStore = store or MemoryJobStore()
        self.queue: EventQueue = queue or MemoryEventQueue(queue_capacity)
        self.pool: Admission = pool if pool is not None else WeightedPool(64)
        self.default_timeout = default_timeout
        self._stream_buffer = stream_buffer
        self.metrics = metrics or Metrics()
        # What the parts can do, looked at once; the dispatcher sees the pool through the
        # probe's lane.
        self._abilities = abilities = Abilities.of(self.store, self.queue, probe_lane(self.pool))
        self._checked = self.pool if isinstance(self.pool, CheckedAdmission) else None
        self._keyed = self.pool if isinstance(self.pool, KeyedAdmission) else None
        self._counting = self.store if isinstance(self.store, CountingStore) else None
        self._following = self.store if isinstance(self.store, FollowingStore) else None
        self._owner_index = self.store if isinstance(self.store, OwnerIndex) else None
        self._dispatcher = Dispatcher(
            self.registry,
            abilities,
            self.metrics,
            self.key_label,
            NEVER_REFUSING if refusals is None else refusals,
        )
        # The engine's own chains live in a plan of their own, which no swap replaces.
        self._dispatcher.plans[INTERNAL_PLAN] = internal_registry()
        # The active top-level jobs of each user plan: a replaced plan with none left is
        # retired (dropped, and whoever waits in wait_plan_retired is told).
        self._plan_jobs: dict[int, set[str]] = {1: set()}
        self._generation = 1  # the newest plan's
        self._retired: dict[int, trio.Event] = {}
        self._dispatcher.hooks.on_finished = self._job_finished
        self.metrics.watch(
            queue=self.queue,
            jobs=self._job_counts,
            pool=self.pool if isinstance(self.pool, ReportingPool) else None,
            key_label=self.key_label,
        )
        self._running: AsyncExitStack | None = None
        self._nursery: trio.Nursery | None = None
        self._receivers: dict[str, trio.MemoryReceiveChannel[Any]] = {}
        self._observers: list[JobObserver] = []
        self._dispatcher.hooks.changed = self._changed
        self._dispatcher.hooks.observers = self._observers  # the same list: see Hooks.observers
        # A shared queue's relay (Redis): steps of a job may run in other processes.
        shared_queue = abilities.shared_queue
        self._relay: Any = None if shared_queue is None else shared_queue.relay
        self._relayed: set[str] = set()  # streamed jobs whose chunks come through it

    @property
    def shares_store(self) -> bool:
        """Whether other processes share the job store (Redis): a read of it may fail
        while the job goes on."""
        return self._abilities.shared_store is not None

    @property
    def plan_generation(self) -> int:
        """Which plan (registry) new jobs run on: 1 at start, one more per swap."""
        return self._generation

    def swap_registry(self, registry: Catalogue) -> int:
        """Run new jobs on ``registry`` from now on, in one step; jobs already accepted
        finish on the plan they started with. Returns the new plan generation."""
        generation = self._generation = self._generation + 1
        self._dispatcher.plans[generation] = registry
        self._plan_jobs[generation] = set()
        self.registry = registry
        for older in list(self._plan_jobs):
            self._retire_if_idle(older)
        return generation

    async def wait_plan_retired(self, generation: int) -> None:
        """Wait until plan ``generation`` has been replaced (:meth:`swap_registry`) and the
        last job accepted on it has ended; the engine has then dropped it, and whatever
        its pipes use (a gateway's HTTP clients) may be closed. Returns at once for a plan
        already retired."""
        if generation not in self._plan_jobs:
            return
        await self._retired.setdefault(generation, trio.Event()).wait()

    def _finished_elsewhere(self, job_id: str) -> None:
        waiter = self._dispatcher.ends.waiters.pop(job_id, None)
        if waiter is not None:
            waiter.set()

    def _heard_finished(self, job_id: str) -> None:
        """A job ended, in this process or another (the store published it)."""
        self._finished_elsewhere(job_id)
        if self._relay is not None:
            self._relay.ended(job_id)

    def _job_finished(self, job: Job) -> None:
        if self._relay is not None and job.status in TERMINAL:
            self._relay.ended(job.id)
        jobs = self._plan_jobs.get(job.plan)
        if jobs is not None:
            jobs.discard(job.id)
            if not jobs:  # the plan may have run its last job
                self._retire_if_idle(job.plan)

    def _retire_if_idle(self, generation: int) -> None:
        if generation == self.plan_generation or self._plan_jobs.get(generation):
            return
        self._plan_jobs.pop(generation, None)
        self._dispatcher.plans.pop(generation, None)
        event = self._retired.pop(generation, None)
        if event is not None:
            event.set()

    def key_label(self, key: str) -> str:
        """The metrics label for an admission key: configured keys by name, others
        ``default``, so label values stay bounded whatever keys pipes use."""
        keyed = self._keyed
        return key if keyed is not None and key in keyed.config.keys else "default"

    def _job_counts(self) -> dict[str, int]:
        counting = self._counting
        return {} if counting is None else {s.value: n for s, n in counting.counts().items()}

    # -- registration --------------------------------------------------------------------

    @property
    def pipe(self) -> _PipeDecorator:
        """Register a pipe: ``@engine.pipe`` or ``@engine.pipe(key="users", timeout=0.5)``
        (the registry's decorator, so a swapped registry gets the next ones)."""
        return self.registry.pipe

    def chain(
        self,
        name: str,
        *items: StageItem,
        timeout: float | None = None,
        key: str = "default",
        result: str | None = None,
    ) -> Chain:
        """Register a chain of pipes and stages under ``name``."""
        return self.registry.chain(name, *items, timeout=timeout, key=key, result=result)

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> Engine:
        if self._running is not None:
            raise RuntimeError("this engine is already running")
        async with AsyncExitStack() as stack:
            # A shared store or queue (Redis) opens its connections first and closes them
            # after the nursery: the steps' last writes still reach it.
            for part in (self.store, self.queue):
                if isinstance(part, AbstractAsyncContextManager):
                    await stack.enter_async_context(part)
            nursery = await stack.enter_async_context(trio.open_nursery())
            following = self._following
            if following is not None:  # jobs parked here may finish in another process
                await nursery.start(following.follow_finished, self._heard_finished)
            if self._relay is not None:
                await nursery.start(self._relay.run, _RelayTarget(self))
                self._dispatcher.hooks.cancel_elsewhere = self._relay.cancel
                self._dispatcher.hooks.emit_elsewhere = self._relay.emit
            await nursery.start(self._dispatcher.run)
            self._running = stack.pop_all()  # started: the nursery stays open until __aexit__
        self._nursery = nursery
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        running, nursery = self._running, self._nursery
        if running is None or nursery is None:
            raise RuntimeError("this engine is not running")
        nursery.cancel_scope.cancel()  # leaving the block ends whatever still runs
        try:
            await running.__aexit__(exc_type, exc, tb)
        except BaseExceptionGroup as group:
            if exc is None or group.exceptions != (exc,):
                raise
            # Nothing inside failed: the block's own exception goes on as it is.
        finally:
            self._running = self._nursery = None

    # -- jobs ----------------------------------------------------------------------------

    async def wait(self, job_id: str) -> Any:
        """Wait for the job to end: its result, or its original exception raised here."""
        nowait = self._dispatcher.nowait
        if nowait:  # an in-process store: no read waits, so no end can slip past one
            job = nowait[0](job_id)
            waiters = self._dispatcher.ends.waiters
            while job.status not in TERMINAL:
                # The waiter's wait awaited here: no frame between a parked request and it.
                await waiters.setdefault(job_id, Wake()).wait()
                job = nowait[0](job_id)
            if job.status is DONE:
                return job.result
            return _outcome(job, self._dispatcher.ends.exceptions.get(job_id))
        return _outcome(await self._ended(job_id), self._dispatcher.ends.exceptions.get(job_id))

    async def wait_answer(self, job_id: str) -> tuple[Any, Mapping[str, str]]:
        """:meth:`wait`, and what the job degraded on its way: ``{pipe: reason}`` (its
        state's ``"degraded"``; empty when it degraded nothing), for an answer that says
        so (docs/degradation.md). One read of the record, as :meth:`wait`."""
        nowait = self._dispatcher.nowait
        if nowait:
            job = nowait[0](job_id)
            if job.status not in TERMINAL:
                await self.wait(job_id)
                job = nowait[0](job_id)
        else:
            job = await self._ended(job_id)
        result = _outcome(job, self._dispatcher.ends.exceptions.get(job_id))
        return result, degraded_of(job.state)

    async def _ended(self, job_id: str) -> Job:
        """The record of the job once it has ended, from a store other processes share."""
        waiters = self._dispatcher.ends.waiters
        following = self._following
        # A shared store may know the record without reading it (a job it ended itself).
        read = self.store.get if following is None else following.read_awaited
        # Ends recorded elsewhere are heard through a subscription that may miss some.
        recheck = math.inf if following is None else _RECHECK_SECONDS
        wait_end = None if following is None else following.wait_end
        while True:
            # The waiter exists before the record is read: an end recorded while the read
            # waits on a shared store still wakes it.
            waiter = waiters.setdefault(job_id, Wake())
            try:
                job = await read(job_id)
            except BaseException:
                self._finished_elsewhere(job_id)  # wakes whoever shares the waiter
                raise
            if job.status in TERMINAL:
                self._finished_elsewhere(job_id)
                return job
            if wait_end is not None:  # the store knows when no end can be missed
                await wait_end(job_id, waiter, recheck)
                continue
            with trio.move_on_after(recheck):
                await waiter.wait()

    def wake(self, job_id: str) -> Wake | None:
        """What the end of ``job_id`` sets, for a caller that waits on it directly (then
        reads the outcome with :meth:`wait`, which returns at once): its own frame and
        deadline, no frame of the engine's. None when the store is shared (use
        :meth:`wait`); an already set one when the job has ended."""
        nowait = self._dispatcher.nowait
        if not nowait:
            return None
        if nowait[0](job_id).status in TERMINAL:
            return _ENDED
        return self._dispatcher.ends.waiters.setdefault(job_id, Wake())

    async def run(self, chain: str, state: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        """Submit and wait: the job's result, or its exception."""
        return await self.wait(await self.submit(chain, state, **kwargs))

    async def probe(self, timeout: float) -> None:  # noqa: ASYNC109 - also the job's limit
        """Prove that work gets through: one job on the engine's own probe chain, through
        the queue and a worker slot, within ``timeout`` seconds.

        Raises :class:`Overloaded` if it is refused (queue or pool), ``trio.TooSlowError``
        if it does not finish in time. The probe chain is the engine's, not the registry's,
        so a reload (:meth:`swap_registry`) leaves it in place; its jobs add no route or
        pipe series to the metrics, and a finished probe's record is dropped.
        """
        job_id = await self._accept(INTERNAL_PLAN, PROBE_CHAIN, None, timeout=timeout)
        try:
            with trio.fail_after(timeout):
                await self.wait(job_id)
        except DeadlineExceeded:
            raise trio.TooSlowError(f"the probe job did not get through in {timeout:g}s") from None
        finally:
            with trio.move_on_after(timeout, shield=True):  # cleanup, bounded
                job = await self.store.get(job_id)
                if job.status in TERMINAL:
                    await self.store.delete(job_id)
                else:  # cancelled, or too slow: the step ends it and its record retires
                    await self._dispatcher.ends.cancel(job)

    def set_callback_factory(self, factory: Callable[[str, str, float], str] | None) -> None:
        """Let pipes hand out callback URLs: ``factory(job_id, signal, ttl) -> url``."""
        self._dispatcher.hooks.callback_factory = factory

    async def cancel(self, job_id: str) -> JobView:
        """Cancel the job if it is still active (a running pipe's cleanup runs first)."""
        branch = self._dispatcher.flight.in_step_branch(job_id)  # a branch running in a step
        job = branch if branch is not None else await self.store.get(job_id)
        if job.status not in TERMINAL:
            await self._dispatcher.ends.cancel(job)
        return job.view()

    async def stream(self, job_id: str) -> AsyncGenerator[Any, None]:
        """Yield the chunks the job emits as they come, then its outcome's error if any.
        Only for jobs submitted with ``stream=True``, and only once."""
        if job_id in self._relayed:  # its steps may run in other processes
            self._relayed.discard(job_id)
            # Closed with this generator, not left to the garbage collector.
            async with aclosing(self._relay.chunks(job_id)) as chunks:
                async for chunk in chunks:
                    yield chunk
            await self.wait(job_id)
            return
        try:
            receive = self._receivers.pop(job_id)
        except KeyError:
            raise LookupError(
                f"job {job_id} has no stream to read: submit it with stream=True, and read it once"
            ) from None
        async with receive:
            async for chunk in receive:
                yield chunk
        await self.wait(job_id)


class _RelayTarget:
    """What a relay acts on: this engine's steps, store and observers."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def interrupt(self, job_id: str) -> None:
        self._engine._dispatcher.ends.interrupt(job_id)

    async def read(self, job_id: str) -> Job:
        return await self._engine.store.get(job_id)

    def changed(self, job: Job) -> None:
        self._engine._changed(job)


def _outcome(job: Job, exception: BaseException | None) -> Any:
    if job.status is Status.DONE:
        return job.result
    exception = job.exception or exception
    if exception is not None:
        raise exception
    error = job.error
    if job.status is Status.CANCELLED:
        raise JobCancelled(error.message if error else f"job {job.id} was cancelled")
    assert error is not None
    raise JobFailed(error.message, error_type=error.type, where=error.where)
