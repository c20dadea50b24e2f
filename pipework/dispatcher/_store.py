"""The job pool: where job records live. The source of truth for every worker.

:class:`JobStore` is the interface; :class:`MemoryJobStore` is the embedded default and a
Redis store implements the same methods. Active jobs are never evicted. A job that reaches a
terminal status is moved to a retention list bounded by count and by time (on the trio
clock, so tests can use virtual time); its ``retain_until`` says when it goes. After
that, ``get`` raises :class:`JobGone` for as long as the id is remembered (so the HTTP side
can answer 410 rather than 404): ``remember_gone_count`` dropped ids at most, each until
``remember_gone_seconds`` after its retention ended. A forgotten id is unknown again
(:class:`JobNotFound`, 404).

A store that is an :class:`OwnerIndex` also lists an owner's jobs (``JobRecord.owner``, an
authenticated caller's identity), newest first: the download centre's listing by identity.
Its index holds the jobs the store keeps, no more: a job leaves it when its record is
dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Final, Protocol, runtime_checkable

import trio

from .._errors import JobGone, JobNotFound
from ._job import Job
from ._status import TERMINAL, Status

__all__ = [
    "REMEMBER_GONE_COUNT",
    "REMEMBER_GONE_SECONDS",
    "JobGone",
    "JobStore",
    "MemoryJobStore",
    "NowaitAccess",
    "OwnerIndex",
    "check_retention",
]

#: How many dropped ids a store remembers at most, and for how long after their retention
#: ended (a week): every store's defaults, and the file's (``[store]``).
REMEMBER_GONE_COUNT: Final = 100_000
REMEMBER_GONE_SECONDS: Final = 7 * 86400.0

#: ``(get, update, create)`` as plain calls: an in-process store's synchronous access (see
#: ``_abilities.InProcessStore``).
NowaitAccess = tuple[Callable[[str], Job], "UpdateNowait", Callable[[Job], None]]


class UpdateNowait(Protocol):
    def __call__(self, job: Job, now: float | None = None, /) -> None: ...


class JobStore(Protocol):
    async def create(self, job: Job) -> None: ...

    async def get(self, job_id: str) -> Job:
        """Return the job or raise JobNotFound (JobGone when retention dropped it)."""
        ...

    async def update(self, job: Job) -> None:
        """Write the job back; a terminal status starts its retention."""
        ...

    async def delete(self, job_id: str) -> None: ...

    async def list(self, status: Status | Iterable[Status] | None = None) -> list[Job]: ...


@runtime_checkable
class OwnerIndex(Protocol):
    """A store that indexes its jobs by owner."""

    async def owned(
        self, owner: str, *, limit: int, before: float | None = None
    ) -> tuple[list[Job], float | None]:
        """``owner``'s jobs newest first: at most ``limit`` of those created (``created_at``,
        wall clock) before ``before`` (None: the newest), and where the next page starts
        (the oldest creation time looked at; None: the index holds nothing older)."""
        ...


class MemoryJobStore:
    """Jobs in this process's memory. ``retain_count`` finished jobs at most, each for at
    most ``retain_seconds``; then ``remember_gone_count`` dropped ids at most are
    remembered to answer "gone", each until ``remember_gone_seconds`` after its
    retention ended."""

    def __init__(
        self,
        *,
        retain_seconds: float = 3600.0,
        retain_count: int = 10_000,
        remember_gone_count: int = REMEMBER_GONE_COUNT,
        remember_gone_seconds: float = REMEMBER_GONE_SECONDS,
    ) -> None:
        check_retention(retain_seconds, retain_count, remember_gone_count, remember_gone_seconds)
        self.retain_seconds = retain_seconds
        self.retain_count = retain_count
        self.remember_gone_count = remember_gone_count
        self.remember_gone_seconds = remember_gone_seconds
        self._active: dict[str, Job] = {}
        # Finished jobs in the order they finished, which is the order they expire in (every
        # one is kept for the same time): the oldest is always first, so dropping the
        # expired ones looks at the head only. Dropped ids become tombstones (id -> when it
        # is forgotten, owner token hash or "" for none), oldest dropped first, which is
        # also the order they are forgotten in: a lookup tells gone from unknown.
        self._finished: dict[str, Job] = {}
        self._gone: dict[str, tuple[float, str]] = {}
        # Owner -> the ids of its jobs kept here, in the order they were created.
        self._owners: dict[str, dict[str, None]] = {}

    async def create(self, job: Job) -> None:
        self.create_nowait(job)

    def create_nowait(self, job: Job) -> None:
        # Ids are 128 random bits: only a caller reusing a record can collide, and it would
        # do so with an active job.
        if job.id in self._active:
            raise ValueError(f"job {job.id} already exists")
        self._active[job.id] = job
        if job.owner is not None:
            self._owners.setdefault(job.owner, {})[job.id] = None

    async def get(self, job_id: str) -> Job:
        return self.get_nowait(job_id)

    def get_nowait(self, job_id: str) -> Job:
        job = self._active.get(job_id)
        if job is not None:
            return job
        now = trio.current_time()
        job = self._finished.get(job_id)
        if job is not None:
            # Kept, unless its time is up or the count pushes it out: only then is there
            # anything to drop before answering (the others go at the next end or read).
            assert job.retain_until is not None
            if job.retain_until > now and len(self._finished) <= self.retain_count:
                return job
        self._expire(now)
        job = self._finished.get(job_id)
        if job is not None:
            return job
        tombstone = self._gone.get(job_id)
        if tombstone is not None and tombstone[0] > now:
            raise JobGone(
                f"job {job_id} finished and was dropped after its retention time",
                token_hash=tombstone[1] or None,
            )
        raise JobNotFound(f"no job with id {job_id!r}")

    def nowait_access(self) -> NowaitAccess | None:
        """``(get_nowait, update_nowait, create_nowait)``: the engine's fast path, taken only
        while this class's async ``get``/``update``/``create`` are exactly these. A subclass
        that overrides any of them (a store handing out copies, say) opts out, and is
        awaited like any store."""
        cls = type(self)
        base = MemoryJobStore
        names = ("get", "get_nowait", "update", "update_nowait", "create", "create_nowait")
        if any(getattr(cls, n) is not getattr(base, n) for n in names):
            return None
        return self.get_nowait, self.update_nowait, self.create_nowait

    async def update(self, job: Job) -> None:
        self.update_nowait(job)

    def update_nowait(self, job: Job, now: float | None = None) -> None:
        """``now``: the caller's trio clock read, if it has one at hand."""
        job.version += 1
        if job.status in TERMINAL:
            if self._active.pop(job.id, None) is not None:
                if now is None:
                    now = trio.current_time()
                job.retain_until = now + self.retain_seconds
                finished = self._finished
                finished[job.id] = job
                # _expire's first test, inline: most ends find nothing to drop.
                oldest = next(iter(finished.values()))
                if len(finished) > self.retain_count or oldest.retain_until <= now:  # type: ignore[operator]  # every finished record has its retain_until
                    self._expire(now)
        elif job.id not in self._active:
            raise JobNotFound(f"job {job.id} is not active; it cannot be updated")

    async def delete(self, job_id: str) -> None:
        job = self._active.pop(job_id, None)
        if job is None:
            job = self._finished.pop(job_id, None)
        if job is not None:
            self._disown(job)

    async def owned(
        self, owner: str, *, limit: int, before: float | None = None
    ) -> tuple[list[Job], float | None]:
        self._expire(trio.current_time())
        ids = self._owners.get(owner)
        jobs: list[Job] = []
        if not ids:
            return jobs, None
        looked = 0
        last: float | None = None
        for job_id in reversed(ids):
            job = self._active.get(job_id) or self._finished.get(job_id)
            if job is None or (before is not None and job.created_at >= before):
                continue
            if looked == limit:
                return jobs, last
            looked += 1
            last = job.created_at
            jobs.append(job)
        return jobs, None

    def _disown(self, job: Job) -> None:
        """Take a dropped job out of its owner's index."""
        if job.owner is None:
            return
        ids = self._owners.get(job.owner)
        if ids is not None:
            ids.pop(job.id, None)
            if not ids:
                del self._owners[job.owner]

    async def list(self, status: Status | Iterable[Status] | None = None) -> list[Job]:
        if status is None:
            wanted = set(Status)
        elif isinstance(status, Status):
            wanted = {status}
        else:
            wanted = set(status)
        self._expire(trio.current_time())
        jobs = [j for j in self._active.values() if j.status in wanted]
        if wanted & TERMINAL:
            jobs.extend(j for j in self._finished.values() if j.status in wanted)
        return jobs

    def counts(self) -> dict[Status, int]:
        """Jobs per status, for metrics."""
        self._expire(trio.current_time())
        counts = dict.fromkeys(Status, 0)
        for job in self._active.values():
            counts[job.status] += 1
        for job in self._finished.values():
            counts[job.status] += 1
        return counts

    def _expire(self, now: float) -> None:
        """Drop finished jobs past their time, and the oldest beyond the count."""
        finished = self._finished
        while finished:
            oldest = next(iter(finished.values()))
            assert oldest.retain_until is not None
            if oldest.retain_until > now and len(finished) <= self.retain_count:
                return
            del finished[oldest.id]
            if oldest.owner is not None:
                self._disown(oldest)
            self._bury(oldest, now)

    def _bury(self, job: Job, now: float) -> None:
        """Remember ``job``'s id, and forget the oldest beyond the count or past their time."""
        gone = self._gone
        if self.remember_gone_count:
            assert job.retain_until is not None
            gone[job.id] = (job.retain_until + self.remember_gone_seconds, job.token_hash or "")
        while gone:
            oldest = next(iter(gone))
            if gone[oldest][0] > now and len(gone) <= self.remember_gone_count:
                return
            del gone[oldest]


def check_retention(
    retain_seconds: float,
    retain_count: int,
    remember_gone_count: int,
    remember_gone_seconds: float,
) -> None:
    """A store's retention settings, checked alike by every store (ValueError)."""
    if not retain_seconds > 0 or retain_count < 1:
        raise ValueError("retain_seconds must be positive and retain_count at least 1")
    if remember_gone_count < 0 or not remember_gone_seconds >= 0:
        raise ValueError("remember_gone_count and remember_gone_seconds must not be negative")
