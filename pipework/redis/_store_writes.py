"""The Redis job store's writes: a job created (with its first event, perhaps claimed for
this process's step), updated whole, at the version it was read at or whatever it is (an
end), its status alone, with no wait when a round trip is on its way (``update_soon``), and
deleted. Each is one Lua script, its command built as bytes (:mod:`._store_scripts`); one
whose round trip failed is sent again marked, until its job's deadline
(:mod:`._store_resend`).

Separate from the reads (:mod:`._store_reads`): a write may have been made when its answer
never came, and each says how it is sent again and what its script's answer means.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import msgpack
import trio

from .._errors import JobNotFound, StoreUnavailable
from ..dispatcher._job import Job
from ..dispatcher._status import TERMINAL, Status
from ._batches import _Call
from ._record import _moved, encode
from ._store_ends import _ENDED_KEPT
from ._store_reads import _OWN_KEPT, Reads
from ._store_scripts import (
    _AGAIN,
    _CREATE_FORMAT,
    _NO_OWNER,
    _NO_TOKEN_ARG,
    _NOT_FINISHED_ARG,
    _STATUS_ARG,
    _STATUS_FORMAT,
    _TERMINAL_ARG,
    _UPDATE_FORMAT,
    _bulk,
    _entry_tail,
    _sent_again,
    _version_arg,
)
from ._wire import encode_args

__all__ = ["Writes"]

#: The wall-clock TTL a finished record gets beyond its retention: a safety net only.
_SLACK_SECONDS: Final = 60.0


class Writes(Reads):
    """The store's writes (see the module). The store sets what they use in its
    ``__init__``: the retention, the record packer, its name in the records it creates,
    and the parts of the scripts' commands encoded once."""

    retain_seconds: float
    retain_count: int
    _packer: msgpack.Packer
    _origin: str
    _origin_arg: bytes
    _update_head: bytes
    _update_entry_head: bytes
    _status_head: bytes
    _prefix_arg: bytes
    _create_heads: tuple[bytes, bytes, bytes]
    _gone_arg: bytes
    _finished_arg: bytes
    _active_arg: bytes
    _tail_given: tuple[object, ...]
    _tail_bytes: bytes

    def _encode(self, job: Job) -> bytes:
        """The record as a msgpack array, with this process's clock (:func:`~._record.encode`)."""
        return encode(self._packer, job, self._shift())

    async def create(
        self,
        job: Job,
        *,
        entry: tuple[str, bytes, bytes] | None = None,
        claim: tuple[bytes, int, Callable[[Any], None]] | None = None,
    ) -> None:
        """``entry``: ``(stream, field, value)`` added to a stream in the same write (the
        job's first event), so the record and the event that runs it arrive together.
        ``claim``: ``(group and consumer encoded, count, read)``: the entry is also read for
        the consumer with up to ``count`` entries before it (see _CREATE), and ``read`` is
        told the answer (the entry's id, b"" if it was not among them, and the entries
        read; 0 if the record exists) as the batch's replies are taken in order, before
        the entries of a read later in the batch are delivered."""
        job_id = job.id.encode()
        blob = self._encode(job)
        again = job.id in self._unsure
        version = b"%b%d" % (b"=" if again else b"", job.version)
        head = self._create_heads[0 if entry is None else 1 if claim is None else 2]
        tail = b"" if entry is None else _bulk(entry[1]) + _bulk(entry[2])
        if claim is not None:
            updated = repr(job.updated_at).encode()
            count = b"%d" % claim[1]
            tail += b"%b$%d\r\n%b\r\n$%d\r\n%b\r\n" % (
                claim[0],
                len(count),
                count,
                len(updated),
                updated,
            )
        parts = [
            head,
            len(self._job_prefix) + len(job_id),
            self._job_prefix,
            job_id,
            self._active_arg,
            b"" if entry is None else _bulk(entry[0].encode()),
            len(blob),
            blob,
            _STATUS_ARG[job.status],
            len(version),
            version,
            len(job_id),
            job_id,
            self._origin_arg,
            _NO_OWNER if job.owner is None else encode_args([job.owner, repr(job.created_at)]),
            tail,
        ]
        call = _Call([_CREATE_FORMAT % tuple(parts)], "create", many=False)
        read = None if claim is None else claim[2]
        call.read = read
        try:
            try:
                created = await self._call(call)
            except StoreUnavailable as exc:
                # Sent again marked (a record of this very blob is the one the first wrote),
                # once at once: a submission is answered without waiting for Redis.
                if not again:
                    parts[9], parts[10] = len(version) + 1, b"=" + version
                command = _CREATE_FORMAT % tuple(parts)
                created = await self._resend(command, "create", trio.current_time(), exc, read)
        except BaseException:
            self._unsure_of(job.id)
            raise
        self._unsure.pop(job.id, None)
        if not created:
            raise ValueError(f"job {job.id} already exists")
        if claim is not None and created[0]:
            # Its step, this process's, is the only one that can run it now: it takes the
            # record itself (read_own), as a step on the memory store does.
            self._claimed[job.id] = job
            if len(self._claimed) > _OWN_KEPT:
                del self._claimed[next(iter(self._claimed))]
        elif job.status is Status.QUEUED:
            self._keep_own(job, blob)
        if self._hearing():
            self._active[job.id] = job

    async def update(self, job: Job, *, entry: tuple[str, bytes, bytes] | None = None) -> None:
        """``entry``: ``(stream, field, value)`` added to a stream once the record is written,
        in the same write (the job's next event, as for :meth:`create`).

        A job still active is written at the version it holds: a step writes its job without
        the lock, and another process may have kept a signal on the record since (a signal
        sent while the pipe ran). Then the record is read again, the signals kept there (and
        those taken) are taken into ``job``, and it is written at the record's version: never
        written back without them — nor by a write sent again after its round trip failed,
        landing after theirs (the version, sent with it, tells the two apart). An end is
        written whatever the version (the first end stands)."""
        if job.status in TERMINAL:
            await self._update(job, "", entry)
            return
        while not await self._update(job, str(job.version), entry):
            _take_mailbox(job, await self.get(job.id))

    async def update_status(self, job: Job, *, verify: bool = False) -> bool:
        """``update`` of a job read from this store whose status (and ``updated_at``) is all
        that changed since: while the record is still at the version read, only those are
        written and its blob is left as it is (no encoding, far fewer bytes); else the whole
        record is written as ``update`` does, or, with ``verify``, nothing is written and
        False returned. A step marks its job running so."""
        self._own.pop(job.id, None)
        if job.status in TERMINAL:
            await self._update(job, "")
            return True
        try:
            code = await self._run(self._status_command(job), "status")
        except StoreUnavailable as exc:
            # Sent again marked: a record with this status and time is the first's write.
            again = self._status_command(job, again=True)
            code = await self._resend(again, "status", self._resend_until(job), exc)
        if code > 0:
            job.version = code
        elif code == -3:
            if verify:
                return False
            await self.update(job)  # written since it was read: written whole
        else:
            raise JobNotFound(f"job {job.id} is not active; it cannot be updated")
        return True

    def _status_command(self, job: Job, *, again: bool = False) -> bytes:
        """The status script's command for ``job`` (``again``: marked as sent again)."""
        job_id = job.id.encode()
        updated = repr(job.updated_at).encode()
        version = b"%b%d" % (b"=" if again else b"", job.version)
        return _STATUS_FORMAT % (
            self._status_head,
            len(self._job_prefix) + len(job_id),
            self._job_prefix,
            job_id,
            _STATUS_ARG[job.status],
            len(updated),
            updated,
            len(job_id),
            job_id,
            self._prefix_arg,
            len(version),
            version,
        )

    async def update_unless_changed(
        self, job: Job, *, entry: tuple[str, bytes, bytes] | None = None
    ) -> bool:
        """``update``, only if nobody wrote the record since ``job`` was read from it (its
        version is still ``job.version``); False if somebody did, and nothing is written.
        For a write made from a record read a while ago, under :meth:`lock`, that a step
        (which writes without the lock) may have moved on meanwhile: a signal kept for
        the job must not bring back the record as it was before the step's write.
        ``entry``: as for :meth:`update` (a delivered signal's ``Resume``), added only if
        the record is written."""
        return await self._update(job, str(job.version), entry)

    def update_soon(
        self,
        job: Job,
        then: Callable[[BaseException | None], None],
        *,
        entry: tuple[str, bytes, bytes] | None = None,
    ) -> bool:
        """``update`` with no wait, when a round trip is on its way: the write joins the
        next batch (after every call made before it, on the one connection), and ``then``
        is told how it went (None once written, else the error ``update`` would raise), in
        the task that sent it. False, with nothing done, when none is on its way (the
        caller awaits ``update``: somebody must send the batch)."""
        if not (self._lead or self._flights) or not self._entered:
            return False
        status = job.status
        again = job.id in self._unsure
        command, blob = self._update_command(job, _AGAIN if again else "", entry)
        call = _Call([command], "update", many=False)

        def told(call: _Call) -> None:
            if call.error is not None:
                if isinstance(call.error, StoreUnavailable):
                    # It may have been written: the job's next write (the caller's write of
                    # it again) is sent as one sent again.
                    self._unsure_of(job.id)
                then(call.error)
                return
            self._unsure.pop(job.id, None)
            try:
                self._updated(job, call.result, blob, status)
            except Exception as exc:
                then(exc)
                return
            then(None)

        call.then = told
        self._calls.append(call)
        self._outstanding += 1
        return True

    async def _update(
        self, job: Job, expected: str, entry: tuple[str, bytes, bytes] | None = None
    ) -> bool:
        """Write the record; a round trip that fails is sent again (marked: the script
        tells a write the first made) until the job's deadline (:meth:`_resend_until`)."""
        status = job.status
        again = job.id in self._unsure
        command, blob = self._update_command(job, _AGAIN + expected if again else expected, entry)
        try:
            try:
                code = await self._run(command, "update")
            except StoreUnavailable as exc:
                if not again:
                    command = _sent_again(command, expected, entry)
                code = await self._resend(command, "update", self._resend_until(job), exc)
        except BaseException:
            self._unsure_of(job.id)
            raise
        self._unsure.pop(job.id, None)
        return self._updated(job, code, blob, status)

    def _update_command(
        self, job: Job, expected: str, entry: tuple[str, bytes, bytes] | None
    ) -> tuple[bytes, bytes]:
        """The update script's command for ``job``, and the record's blob."""
        terminal = job.status in TERMINAL
        # (A write sent again keeps the time of the first: the same blob.)
        if terminal and not (expected.startswith(_AGAIN) and job.retain_until is not None):
            job.retain_until = trio.current_time() + self.retain_seconds
            # Written or not, its waiters read it from now on: a write that fails after
            # Redis applied it must not leave it known as active here.
            self._active.pop(job.id, None)
        # The command built as bytes: the arguments every update sends alike are encoded
        # once (the same as encode_args of _UPDATE's KEYS and ARGV, in order).
        job_id = job.id.encode()
        status = job.status
        token = job.token_hash
        blob = self._encode(job)
        self._own.pop(job.id, None)
        job_prefix, size = self._job_prefix, len(job_id)
        # One format for the whole command: far fewer small bytes objects than a part each.
        command = _UPDATE_FORMAT % (
            self._update_head if entry is None else self._update_entry_head,
            len(job_prefix) + size,
            job_prefix,
            job_id,
            self._finished_arg,
            self._gone_arg,
            b"" if entry is None else _bulk(entry[0].encode()),
            len(blob),
            blob,
            _STATUS_ARG[status],
            size,
            job_id,
            _TERMINAL_ARG[status],
            (
                _bulk(repr(_moved(job.retain_until, self._shift())).encode())
                if terminal
                else _NOT_FINISHED_ARG
            ),
            _NO_TOKEN_ARG if token is None else _bulk(token.encode()),
            self._tail(),
            _version_arg(expected),
            _entry_tail(entry),
        )
        return command, blob

    def _updated(self, job: Job, code: int, blob: bytes, status: Status) -> bool:
        """The update script's answer, taken into ``job`` (False: written elsewhere since
        it was read, nothing written)."""
        terminal = status in TERMINAL
        if code == -3:
            return False  # written by somebody else since it was read
        if code > 0:
            job.version = code
            if status is Status.QUEUED:
                self._keep_own(job, blob)
            if terminal:
                self._ended[job.id] = job
                if len(self._ended) > _ENDED_KEPT:
                    del self._ended[next(iter(self._ended))]
        elif code <= -10:
            job.version = -10 - code  # already final: the first end stands
        else:
            raise JobNotFound(f"job {job.id} is not active; it cannot be updated")
        return True

    async def delete(self, job_id: str) -> None:
        self._active.pop(job_id, None)
        self._own.pop(job_id, None)
        self._claimed.pop(job_id, None)
        self._ended.pop(job_id, None)
        await self._script(
            "delete", [self._key(job_id), f"{self.prefix}:finished"], [job_id, self.prefix]
        )

    def _tail(self) -> bytes:
        """The arguments every update sends alike, encoded once (see _UPDATE)."""
        # With several engines on this store, an end recorded here may have a waiter in
        # another one: published always.
        origin = self._origin if self._following <= 1 else ""
        # Compared as given (cheap), encoded only when one of them changes.
        given = (
            self.prefix,
            self.retain_seconds,
            self.retain_count,
            origin,
            self.remember_gone_seconds,
            self.remember_gone_count,
        )
        if given != self._tail_given:
            self._tail_given = given
            self._tail_bytes = encode_args(
                [
                    self.prefix,
                    int((self.retain_seconds + _SLACK_SECONDS) * 1000),
                    repr(float(self.retain_seconds)),
                    self.retain_count,
                    origin,
                    repr(float(self.remember_gone_seconds)),
                    self.remember_gone_count,
                ]
            )
        return self._tail_bytes


def _take_mailbox(job: Job, record: Job) -> None:
    """What another writer may have added to an active job's ``record`` since ``job`` was
    read — signals kept for it, signals it took — taken into ``job``, with the record's
    version (see RedisJobStore.update)."""
    for name, payload in record.signals.items():
        if name not in job.signals and name not in job.delivered:
            job.signals[name] = payload
    for name in record.delivered:
        job.took(name)
    job.version = record.version
