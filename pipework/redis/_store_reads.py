"""The Redis job store's reads: a record by id (one ``HMGET``), for a waiter
(:meth:`Reads.read_awaited`, which may need none), as this store last wrote it
(:meth:`Reads.read_own`, no round trip), by owner and by status; a record past its
retention dropped and a tombstone answered as :class:`JobGone` (``store_expire.lua``); and
the records decoded with this process's clock (:mod:`._record`).

Separate from the writes (:mod:`._store_writes`), which read only to merge what another
writer added: a read changes nothing a client asked for, so one whose round trip failed is
always sent again.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, Final

import trio

from .._errors import JobGone, JobNotFound, StoreUnavailable
from ..dispatcher._job import Job
from ..dispatcher._status import ACTIVE, TERMINAL, Status
from ._record import decode
from ._store_ends import EndsHeard
from ._store_resend import Resending
from ._store_scripts import _bulk
from ._wire import Arg

__all__ = ["Reads"]

#: How many records this store wrote, left queued, it keeps for the step that reads them
#: next (``read_own``).
_OWN_KEPT: Final = 4096


class Reads(EndsHeard, Resending):
    """The store's reads (see the module). The store sets what they use in its
    ``__init__``: the remembered tombstones' bounds, the clock's offset (None until
    measured), the records left queued by this store (``_own``) and those whose event it
    claimed (``_claimed``), and the ``HMGET``'s encoded parts."""

    remember_gone_seconds: float
    remember_gone_count: int
    _offset: float | None
    _own: dict[str, tuple[bytes, int]]
    _claimed: dict[str, Job]
    _get_head: bytes
    _get_tail: bytes
    _job_prefix: bytes

    def _shift(self) -> float:
        """wall time = trio time + shift (measured once, see the module)."""
        if self._offset is None:
            self._offset = time.time() - trio.current_time()
        return self._offset

    def _decode(
        self, blob: bytes, version: Any, status: bytes | None = None, updated: bytes | None = None
    ) -> Job:
        """The record from its blob and version (:func:`~._record.decode`)."""
        return decode(blob, version, status, updated, self._shift)

    def _key(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    async def get(self, job_id: str) -> Job:
        # A plain read: one HMGET is atomic, and far cheaper than a script.
        key = self._job_prefix + job_id.encode()
        command = b"*6\r\n%b%b%b" % (self._get_head, _bulk(key), self._get_tail)
        try:
            reply = await self._run(command)
        except StoreUnavailable as exc:  # sent again at once, on a new connection
            reply = await self._resend(command, None, trio.current_time(), exc, reads=True)
        blob, version, status, updated = reply
        return await self._found(job_id, blob, version, status, updated)

    async def read_awaited(self, job_id: str) -> Job:
        """The job's record for a caller about to wait for its end (``Engine.wait``): its
        status tells whether to wait. A job this process created and whose end it has not
        heard of, or whose end it recorded, needs no read; any other read marks the record
        so that its end is published to every process."""
        job = self._ended.pop(job_id, None)
        if job is not None and (job.retain_until is None or job.retain_until > trio.current_time()):
            return job
        generation = self._generation
        job = self._active.get(job_id)
        if job is not None and self._hearing():
            self._read_at[job_id] = generation  # for wait_end: read while hearing
            return job
        # A parked request waits: its read is sent again for resend_seconds (within the
        # request's own time limit) before it is answered that the store is away.
        until = trio.current_time() + self.resend_seconds
        reply = await self._script("awaited", [self._key(job_id)], [], until=until, reads=True)
        if not reply:
            return await self._found(job_id, None, None)
        job = await self._found(job_id, reply[0], reply[1], reply[3], reply[4])
        if job.status not in TERMINAL:
            self._read_at[job_id] = generation
        return job

    async def _found(
        self,
        job_id: str,
        blob: bytes | None,
        version: Any,
        status: bytes | None = None,
        updated: bytes | None = None,
    ) -> Job:
        """The record read (``blob``, None for none), if it is still kept; else whether its
        id is remembered, once what is due is dropped and forgotten (as the memory store
        does before it answers)."""
        if blob is not None:
            job = self._decode(blob, version, status, updated)
            if job.retain_until is None or job.retain_until > trio.current_time():
                return job
        tombstone = await self._expire(job_id)
        if tombstone is None:
            raise JobNotFound(f"no job with id {job_id!r}")
        raise JobGone(
            f"job {job_id} finished and was dropped after its retention time",
            token_hash=tombstone.decode() or None,
        )

    def read_own(self, job_id: str) -> Job | None:
        """The job's record as this store last wrote it whole, left queued (a job it created
        or handed off), decoded afresh without a round trip, once; None if it holds none.
        Another process may have written the record since: the caller writes it back with
        ``update_status(job, verify=True)``, which then writes nothing and says so. A job
        created here with its event claimed (see create) is returned itself, not a copy:
        the step of that event is the only one that can run it (its creator keeps only
        its id; a waiter here reads it only once it is final, see _update_command)."""
        claimed = self._claimed.pop(job_id, None)
        if claimed is not None:
            return claimed
        own = self._own.pop(job_id, None)
        return None if own is None else self._decode(own[0], own[1])

    def _keep_own(self, job: Job, blob: bytes) -> None:
        self._own[job.id] = (blob, job.version)
        if len(self._own) > _OWN_KEPT:
            del self._own[next(iter(self._own))]

    async def owned(
        self, owner: str, *, limit: int, before: float | None = None
    ) -> tuple[list[Job], float | None]:
        """``owner``'s jobs, newest first: a page of at most ``limit`` of its index's ids
        created before ``before`` (wall clock; None: the newest), those still kept, and
        where the next page starts (None: nothing older in the index)."""
        await self._expire()
        bound = "+inf" if before is None else f"({before!r}"
        index = f"{self.prefix}:owner:{owner}"
        reply = await self._script("owned", [index], [self.prefix, bound, limit], reads=True)
        now = trio.current_time()
        jobs = [self._decode(*reply[i : i + 4]) for i in range(0, len(reply) - 1, 4)]
        kept = [j for j in jobs if j.retain_until is None or j.retain_until > now]
        return kept, float(reply[-1]) if reply[-1] else None

    async def list(self, status: Status | Iterable[Status] | None = None) -> list[Job]:
        if status is None:
            wanted = set(Status)
        elif isinstance(status, Status):
            wanted = {status}
        else:
            wanted = set(status)
        await self._expire()
        keys = [f"{self.prefix}:active"] if wanted & ACTIVE else []
        if wanted & TERMINAL:
            keys.append(f"{self.prefix}:finished")
        reply = await self._script("list", keys, [self.prefix], reads=True)
        jobs = [self._decode(*reply[i : i + 4]) for i in range(0, len(reply), 4)]
        return [job for job in jobs if job.status in wanted]

    async def _expire(self, job_id: str | None = None) -> Any:
        """Drop the finished records and forget the tombstones whose time has come (on this
        process's trio clock, see the module), and the tombstones beyond the count; with
        ``job_id``, answer its tombstone then (None if it is not remembered)."""
        now = trio.current_time() + self._shift()
        p = self.prefix
        keys = [f"{p}:finished", f"{p}:gone", f"{p}:remembered"]
        args: list[Arg] = [repr(now), p, repr(self.remember_gone_seconds), self.remember_gone_count]
        args = args if job_id is None else [*args, job_id]
        return await self._script("expire", keys, args, reads=True)
