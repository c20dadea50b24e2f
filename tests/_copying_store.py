"""A job store that hands out copies, as a shared (Redis) store does.

Every record is encoded with msgpack when written and decoded afresh on every read, so the
engine never shares a live object with its job pool: whatever works only because two parts
of the engine held the same record fails on this store. The engine's tests run on it and on
:class:`~pipework.MemoryJobStore` (the ``each_store`` fixture in conftest.py).
"""

from __future__ import annotations

import builtins
from typing import Any

import msgpack

import pipework as pw
from pipework.dispatcher._job import Job


def copy_of(job: Job) -> Job:
    """The record as a store that keeps bytes gives it back."""
    data = msgpack.packb(job.to_wire(), use_bin_type=True)
    return Job.from_wire(msgpack.unpackb(data, raw=False))


class CopyingJobStore(pw.MemoryJobStore):
    """The memory store's retention rules, but every write stores a copy and every read
    decodes a fresh one."""

    async def create(self, job: Job) -> None:
        await super().create(copy_of(job))

    def get_nowait(self, job_id: str) -> Job:
        return copy_of(super().get_nowait(job_id))

    async def update(self, job: Job) -> None:
        stored = copy_of(job)
        try:
            current = super().get_nowait(job.id)
        except pw.JobNotFound:
            current = None
        if current is not None and current.status not in _FINAL:
            stored.version = current.version
            self._active[job.id] = stored  # the new record replaces the old one
        await super().update(stored)
        # What a shared store's write answers: the new version and the retention.
        job.version = stored.version
        job.retain_until = stored.retain_until

    async def list(self, status: Any = None) -> list[Job]:
        return [copy_of(job) for job in await super().list(status)]

    async def owned(
        self, owner: str, *, limit: int, before: float | None = None
    ) -> tuple[builtins.list[Job], float | None]:
        jobs, more = await super().owned(owner, limit=limit, before=before)
        return [copy_of(job) for job in jobs], more


_FINAL = frozenset({pw.Status.DONE, pw.Status.FAILED, pw.Status.CANCELLED, pw.Status.EXPIRED})
__all__ = ["CopyingJobStore", "copy_of"]
