"""What a job store, an event queue and a worker pool may offer beyond their interfaces,
declared once and resolved once.

The engine works with any :class:`~._store.JobStore`, :class:`~._queue.EventQueue` and
:class:`~._admission.Admission`. Some can do more, and the engine uses it:

- an **in-process store** answers without awaiting (:class:`InProcessStore`, the memory
  store): the steps then read and write records with no coroutine at all;
- a **shared store** (:class:`SharedStore`, Redis) is read and written by other processes
  too: writes that depend on what was read compare versions or hold a lock, and a step may
  leave its last write to the store; one that **follows ends** (:class:`FollowingStore`)
  tells a waiter here of ends recorded elsewhere;
- a **shared queue** (:class:`SharedQueue`, Redis) keeps a step's event until the step
  ends, hands a dead process's events to the living, keeps suspend timers, and writes a
  record and an event in one round trip;
- a **fast pool** (:class:`FastAdmission`, the weighted pool) grants an uncontended slot
  with no schedule point, says which keys are limited, and so says at once whether a key
  has a slot free (a pipe its job can do without is degraded rather than wait for one);
- a **reporting pool** (:class:`ReportingPool`, the weighted pool) says its keys' state,
  which the metrics read at each scrape.

:class:`Abilities` looks at the three once, when the engine is built, and gives the engine
one object to call: each of its operations is the part's own when the part has the ability,
and what the plain interface does otherwise. Nothing asks a part what it can do later.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import trio

from ._admission import Admission
from ._events import Event, RunJob
from ._job import Job
from ._queue import EventQueue
from ._status import Status
from ._store import JobStore, NowaitAccess
from ._wake import Wake
from ._weighted_config import PoolConfig
from ._weighted_statistics import PoolStatistics

__all__ = [
    "Abilities",
    "CheckedAdmission",
    "CountingStore",
    "FastAdmission",
    "FollowingStore",
    "InProcessStore",
    "KeyedAdmission",
    "ReportingPool",
    "SharedQueue",
    "SharedStore",
]

#: Called once a write left to a shared store lands: with None, or with what failed.
Then = Callable[[BaseException | None], None]


@runtime_checkable
class InProcessStore(Protocol):
    def nowait_access(self) -> NowaitAccess | None:
        """``(get, update, create)`` as plain calls, or None if this store must be awaited."""
        ...


@runtime_checkable
class CountingStore(Protocol):
    retain_count: int
    retain_seconds: float

    def counts(self) -> dict[Status, int]:
        """Jobs per status (for metrics)."""
        ...


@runtime_checkable
class SharedStore(Protocol):
    """A store other processes read and write too (see the module docstring)."""

    def read_own(self, job_id: str) -> Job | None:
        """The record as this store last wrote it (no round trip), or None."""
        ...

    async def update_status(self, job: Job, *, verify: bool = False) -> bool:
        """Write a record whose status is all that changed since it was read; ``verify``:
        False, writing nothing, if somebody else wrote it since."""
        ...

    async def update_unless_changed(self, job: Job) -> bool:
        """``update``, only if nobody wrote the record since ``job`` was read."""
        ...

    def update_soon(self, job: Job, then: Then) -> bool:
        """Take the write with no wait, ``then`` called once it lands; False if it cannot."""
        ...

    def lock(self, job_id: str) -> AbstractAsyncContextManager[None]:
        """Hold the record for a read-modify-write, here and across processes."""
        ...


@runtime_checkable
class FollowingStore(Protocol):
    """A shared store that tells this process of ends recorded by any process."""

    async def read_awaited(self, job_id: str) -> Job:
        """The record, for a caller about to wait for the job's end."""
        ...

    async def follow_finished(
        self,
        finished: Callable[[str], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Call ``finished(job_id)`` for every end recorded by any process."""
        ...

    async def wait_end(self, job_id: str, wake: Wake, recheck: float) -> None:
        """Until ``wake`` is set, or an end of the job may have been missed."""
        ...


@runtime_checkable
class SharedQueue(Protocol):
    """A queue other processes consume too (see the module docstring)."""

    #: Carries cancels, chunks and changes of jobs between processes.
    relay: Any

    def step_ended(self, event: Event) -> None: ...

    def let_go(self, event: Event) -> None:
        """The event's step could not start (the store away): neither acknowledged nor
        held here, it is taken again once idle, here or by another process."""
        ...

    def reclaimed(self, event: Event) -> bool:
        """Whether the event was taken over from a process that died in its step."""
        ...

    def expire_at(self, deadline: float, job_id: str, version: int) -> None:
        """A suspended job's timer, kept where it outlives this process."""
        ...

    async def flush(self) -> None:
        """Until every event put so far is in the shared queue."""
        ...

    async def create_and_submit(self, store: object, job: Job, event: RunJob) -> bool: ...

    def can_claim(self, store: object) -> bool: ...

    async def create_and_claim(self, store: object, job: Job, event: RunJob) -> bool | None: ...

    async def update_and_put(self, store: object, job: Job, event: RunJob) -> bool: ...

    async def update_unless_changed_and_put(
        self, store: object, job: Job, event: Event
    ) -> bool | None: ...

    def update_and_put_soon(self, store: object, job: Job, event: RunJob, then: Then) -> bool: ...


@runtime_checkable
class FastAdmission(Protocol):
    """A pool with a synchronous path for the uncontended grant."""

    def grant_nowait(self, key: str) -> object | None: ...

    def release_nowait(self, handle: object, granted_at: float, now: float) -> None: ...

    def withdraw_nowait(self, handle: object) -> None:
        """Give back a grant never used: no hold time counted."""
        ...

    def limited(self, key: str) -> bool:
        """Whether work under ``key`` must hold a slot of its own to be counted."""
        ...


@runtime_checkable
class KeyedAdmission(Protocol):
    """A pool configured key by key (its keys label the metrics)."""

    @property
    def config(self) -> _Keyed: ...


@runtime_checkable
class ReportingPool(Protocol):
    """A pool that reports its state: the metrics' pool families."""

    @property
    def config(self) -> PoolConfig: ...

    def statistics(self) -> PoolStatistics: ...


class _Keyed(Protocol):
    @property
    def keys(self) -> Mapping[str, object]: ...


@runtime_checkable
class CheckedAdmission(Protocol):
    def check_admission(self, key: str, *, deadline: float = ...) -> None:
        """Raise Rejected if a new step under ``key`` would be refused now."""
        ...


@dataclass(frozen=True, slots=True, eq=False)
class Abilities:
    """The parts' abilities, resolved once (see the module docstring): each operation is
    the part's own where it has the ability, the plain interface's otherwise."""

    store: JobStore
    queue: EventQueue
    pool: Admission
    #: The store's synchronous access (an in-process store), else None: the steps' common
    #: path then awaits nothing.
    nowait: NowaitAccess | None
    #: The store and the queue when other processes share them, for what only they do.
    shared_store: SharedStore | None
    shared_queue: SharedQueue | None
    #: The queue shares the store's round trips: the process that writes a new job's record
    #: can claim its first event in the same write.
    claims: bool
    #: An uncontended slot under a key held at once, or None (then enter ``pool.slot``).
    grant: Callable[[str], object | None]
    #: ``grant``'s None means "no slot is free at once" (a fast pool); without it, ``grant``
    #: never grants, and says nothing of the pool (nothing is degraded for ``no_slot``).
    grants: bool
    #: Give back what ``grant`` held (``handle, granted_at, now``).
    release: Callable[[object, float, float], None]
    #: Give back what ``grant`` held, never used: no hold time counted.
    withdraw: Callable[[object], None]
    #: Whether work under a key must hold a slot of its own to be counted.
    limited: Callable[[str], bool]
    #: Hold a record for a read-modify-write (nothing to hold on a store of this process's
    #: only, whose read, change and write no other task comes between).
    lock: Callable[[str], AbstractAsyncContextManager[None]]
    #: Write a record unless somebody wrote it since it was read (on a store of this
    #: process's only nobody can have: the caller read it with no checkpoint since).
    update_unless_changed: Callable[[Job], Awaitable[bool]]
    #: Leave a step's write to the store, ``then`` told when it lands; False if it cannot.
    update_soon: Callable[[Job, Then], bool]
    #: Whether an event was taken over from a process that died during its step.
    reclaimed: Callable[[Event], bool]
    #: A step's event is done with (a shared queue keeps it until then).
    step_ended: Callable[[Event], None]
    #: Until every event put so far is where every process sees it.
    flush: Callable[[], Awaitable[None]]
    #: A suspended job's timer kept where it outlives this process, or None: this process
    #: keeps its own.
    expire_at: Callable[[float, str, int], None] | None
    #: How many finished jobs the store keeps, and for how long.
    retain_count: int
    retain_seconds: float

    @classmethod
    def of(cls, store: JobStore, queue: EventQueue, pool: Admission) -> Abilities:
        shared_store = store if isinstance(store, SharedStore) else None
        shared_queue = queue if isinstance(queue, SharedQueue) else None
        fast = pool if isinstance(pool, FastAdmission) else None
        counting = store if isinstance(store, CountingStore) else None

        async def update_unless_changed(job: Job) -> bool:
            await store.update(job)
            return True

        return cls(
            store=store,
            queue=queue,
            pool=pool,
            nowait=store.nowait_access() if isinstance(store, InProcessStore) else None,
            shared_store=shared_store,
            shared_queue=shared_queue,
            claims=shared_queue is not None and shared_queue.can_claim(store),
            grant=_no_grant if fast is None else fast.grant_nowait,
            grants=fast is not None,
            release=_never_granted if fast is None else fast.release_nowait,
            withdraw=_never_granted if fast is None else fast.withdraw_nowait,
            limited=_always if fast is None else fast.limited,
            lock=_unlocked if shared_store is None else shared_store.lock,
            update_unless_changed=(
                update_unless_changed
                if shared_store is None
                else shared_store.update_unless_changed
            ),
            update_soon=_not_soon if shared_store is None else shared_store.update_soon,
            reclaimed=_never if shared_queue is None else shared_queue.reclaimed,
            step_ended=_nothing if shared_queue is None else shared_queue.step_ended,
            flush=_flushed if shared_queue is None else shared_queue.flush,
            expire_at=None if shared_queue is None else shared_queue.expire_at,
            retain_count=10_000 if counting is None else counting.retain_count,
            retain_seconds=3600.0 if counting is None else counting.retain_seconds,
        )


def _no_grant(key: str) -> object | None:
    return None


def _never_granted(*args: object) -> None:
    raise AssertionError("nothing was granted: a pool without grant_nowait grants nothing")


def _always(key: str) -> bool:
    return True


def _never(event: Event) -> bool:
    return False


def _nothing(event: Event) -> None:
    return None


def _not_soon(job: Job, then: Then) -> bool:
    return False


async def _flushed() -> None:
    return None


@contextlib.asynccontextmanager
async def _unlocked(job_id: str) -> AsyncIterator[None]:
    yield
