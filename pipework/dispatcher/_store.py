"""The job pool: where job records live. The source of truth for every worker.

:class:`JobStore` is the interface; :class:`MemoryJobStore` is the embedded default and a
Redis store implements the same methods. Active jobs are never evicted. A job that reaches a
terminal status is moved to a retention list bounded by count and by time (on the trio
clock, so tests can use virtual time); its ``retain_until`` says when it goes. After
that, ``get`` raises :class:`JobGone` for as long as the id is remembered (so the HTTP side
can answer 410 rather than 404).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import trio

from .._errors import JobGone, JobNotFound
from ._job import Job
from ._status import TERMINAL, Status

__all__ = ["JobGone", "JobStore", "MemoryJobStore", "NowaitAccess"]

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


class MemoryJobStore:
    """Jobs in this process's memory. ``retain_count`` finished jobs at most, each for at
    most ``retain_seconds``; ``tombstones`` dropped ids are remembered to answer "gone"."""

    def __init__(
        self,
        *,
        retain_seconds: float = 3600.0,
        retain_count: int = 10_000,
        tombstones: int = 100_000,
    ) -> None:
        if retain_seconds <= 0 or retain_count < 1:
            raise ValueError("retain_seconds must be positive and retain_count at least 1")
        self.retain_seconds = retain_seconds
        self.retain_count = retain_count
        self._active: dict[str, Job] = {}
        # Finished jobs in the order they finished, which is the order they expire in (every
        # one is kept for the same time): the oldest is always first, so dropping the
        # expired ones looks at the head only. Dropped ids become tombstones (id -> owner
        # token hash, "" for none), oldest dropped first, so a lookup tells gone from unknown.
        self._finished: dict[str, Job] = {}
        self._gone: dict[str, str] = {}
        self._tombstones = tombstones

    async def create(self, job: Job) -> None:
        self.create_nowait(job)

    def create_nowait(self, job: Job) -> None:
        # Ids are 128 random bits: only a caller reusing a record can collide, and it would
        # do so with an active job.
        if job.id in self._active:
            raise ValueError(f"job {job.id} already exists")
        self._active[job.id] = job

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
        token_hash = self._gone.get(job_id)
        if token_hash is not None:
            raise JobGone(
                f"job {job_id} finished and was dropped after its retention time",
                token_hash=token_hash or None,
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
        if self._active.pop(job_id, None) is None:
            self._finished.pop(job_id, None)

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
            self._bury(oldest)

    def _bury(self, job: Job) -> None:
        self._gone[job.id] = job.token_hash or ""
        if len(self._gone) > self._tombstones:
            del self._gone[next(iter(self._gone))]
