"""The job pool on Redis: the same contract as :class:`~pipework.MemoryJobStore`, shared by
every process that points at the same server and prefix.

Layout under ``prefix`` (one logical Redis, not Redis Cluster: the scripts name keys they
build themselves):

- ``{p}:job:{id}`` a hash: ``d`` the record as a msgpack array (:data:`_FIELDS`), ``s`` its
  status, ``v`` its version, ``o`` the store that created it, ``w`` set once a process
  that did not create it waits for its end, ``u`` the ``updated_at`` of a write of the
  status alone (:meth:`RedisJobStore.update_status`: the blob is older than ``s`` then;
  empty after a whole write). The version lives outside the blob so a script can compare
  and bump it without decoding the record.
- ``{p}:active`` a set of the ids of active jobs (``list`` by status reads their records
  and keeps those in the statuses asked for: a change of status between active ones
  writes no index).
- ``{p}:finished`` a sorted set of finished ids scored by when they go (``retain_until``).
- ``{p}:owner:{owner}`` a sorted set of the ids of an owner's jobs (``JobRecord.owner``)
  scored by their creation time (wall clock), written with the record (whose hash keeps
  the owner in ``n``): :meth:`RedisJobStore.owned` reads it newest first. Bounded as the
  records are: a record dropped (past its retention, beyond ``retain_count``, deleted)
  leaves it in the same script; an id whose record its Redis TTL dropped unread leaves it
  at the next end of one of the owner's jobs (the oldest few are looked at) or read of it.
- ``{p}:watch:{id}`` set while a process follows the job's changes: an update then
  publishes the new version on ``{p}:relay:{id}`` (see ``_relay.py``).
- ``{p}:gone`` a hash of tombstones, id -> the owner-token hash ("" for none), and
  ``{p}:remembered`` a sorted set of the same ids scored by when their retention ends (as
  in ``{p}:finished``). A tombstone is written when the job finishes; once the record is
  dropped, ``get`` raises :class:`JobGone` rather than :class:`JobNotFound` until the id is
  forgotten, ``remember_gone_seconds`` after its retention ended. Bounded by time and by
  count: an end forgets the tombstones whose time has come and the oldest beyond
  ``remember_gone_count`` (counted beyond the finished records kept), as it drops the
  oldest finished records beyond ``retain_count``; so does a read that finds no record
  (``store_expire.lua``); a delete takes the tombstone with it.
- ``{p}:callback_secret`` the secret callback URLs are signed with when none is configured,
  written once by the first process that serves (:meth:`RedisJobStore.callback_secret`).

Every write is one Lua script, so it is atomic against every other process: a create never
overwrites, an update of a finished job never brings it back (a second terminal write
changes nothing; a non-terminal one is refused as for the memory store), and finishing a job
moves it between the indexes, writes its tombstone and drops the oldest finished records
beyond ``retain_count`` in the same step. Read-modify-write sequences that span several
commands (a join's record when two branches end at once) take :meth:`lock`. A read is one
``HMGET``, and a step's read of a record this store wrote and left queued none
(:meth:`RedisJobStore.read_own`). Calls go in batches on the store's one connection, with
the event queue's writes and reads when it shares the store (:mod:`._batches`, and
:class:`RedisEventQueue`).

**Sent again.** A call whose round trip failed for the store (its connection lost, no
answer in time, a server loading) is sent again on a new connection (:mod:`._resend` says
when): a read at once; a step's write until its job's deadline (``resend_seconds`` at
most), marked (:data:`_AGAIN`) so that its script answers as written when the record holds
that very write already, and makes nothing twice. A write whose answer never came marks
its job (``_unsure``): the job's next write goes marked too.

**Ends.** An end is published on ``{p}:finished`` only when a process other than the one
that records it may wait for it: the job was created elsewhere, or its record is marked
``w`` (:meth:`read_awaited`). The creating process's waiters are woken by its own
dispatcher; they take an end recorded here from memory, and a job created here whose end
was not heard of needs no read while every subscription is live.

**Time.** The engine's deadlines are absolute trio times, and each process's trio clock has
its own origin. A record carries its writer's offset from the wall clock (measured once, when
the store is first used), and a reader in another process moves every absolute time from the
writer's trio clock to its own: within one process times come back exactly as written (so
virtual time in tests holds), and between processes deadlines agree as far as their wall
clocks do. Retention is counted on
the trio clock too: ``get`` and ``list`` drop a finished record whose ``retain_until`` has
passed (lazily, as the memory store does), and the record's Redis TTL — ``retain_seconds``
plus a minute of slack, on the wall clock — is only a safety net for records nobody reads
again.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any, Final

import msgpack
import trio

from .._errors import JobGone, JobNotFound, StoreUnavailable
from ..dispatcher._job import ErrorInfo, Frame, Job, JobRecord, JoinRecord, Progress
from ..dispatcher._status import ACTIVE, TERMINAL, Status
from ..dispatcher._store import REMEMBER_GONE_COUNT, REMEMBER_GONE_SECONDS, check_retention
from ..dispatcher._wake import Waiting, Wake
from ._batches import Batches, _Call
from ._client import Subscription
from ._resend import Resend
from ._scripts import Script, load, terminal_statuses
from ._wire import UNREACHABLE, Arg, Command, Connection, ReplyError, encode_args

__all__ = ["RedisJobStore", "StoreUnavailable"]

_log = logging.getLogger("pipework.dispatcher")

#: The wall-clock TTL a finished record gets beyond its retention: a safety net only.
_SLACK_SECONDS: Final = 60.0

#: The shortest callback secret a signer takes (the container's rule).
_MIN_SECRET: Final = 16

#: How many ends recorded here are kept for this process's waiters (each taken once).
_ENDED_KEPT: Final = 4096

#: How many records this store wrote, left queued, it keeps for the step that reads them
#: next (``read_own``).
_OWN_KEPT: Final = 4096


def _load(name: str) -> Script:
    """The store's script ``name`` (``lua/store_{name}.lua``). A script that tells finished
    jobs apart lists the terminal statuses itself: the engine's, or this module refuses to
    load."""
    script = load(f"store_{name}")
    wanted = {status.value for status in TERMINAL}
    if "local terminal" in script.source and terminal_statuses(script) != wanted:
        raise RuntimeError(f"lua/store_{name}.lua's terminal statuses are not {sorted(wanted)}")
    return script


_SCRIPTS: Final = {
    name: _load(name)
    for name in (
        "create",
        "update",
        "status",
        "awaited",
        "delete",
        "expire",
        "list",
        "release",
        "owned",
    )
}
#: The scripts' sources and SHA1s by name (a store's calls name the script they run).
_SOURCES: Final = {name: script.source for name, script in _SCRIPTS.items()}
_SHAS: Final = {name: script.sha for name, script in _SCRIPTS.items()}

#: The update script's last argument when the record may have any version.
_ANY_VERSION: Final = encode_args([""])

#: Before a version argument: the write is sent again after its round trip failed, and the
#: script answers as if it wrote it if the record holds it already (lua/store_update.lua).
_AGAIN: Final = "="

#: How many jobs whose last write may or may not have been made are remembered (their next
#: write is sent as one sent again).
_UNSURE_KEPT: Final = 4096

#: Arguments an update sends often, encoded once: a status, whether it is terminal.
_STATUS_ARG: Final = {s: encode_args([s.value]) for s in Status}
_TERMINAL_ARG: Final = {s: encode_args(["1" if s in TERMINAL else "0"]) for s in Status}
_NOT_FINISHED_ARG: Final = encode_args([repr(0.0)])
_NO_TOKEN_ARG: Final = encode_args([""])


#: The fields a record's blob holds, in the order of JobRecord's (so a decoded record is
#: ``Job(*fields, version)``): every stored field but the version, the last (kept in the
#: hash's ``v``). What only the running process holds (Job's own fields) is not stored.
_FIELDS: Final = tuple(f.name for f in dataclasses.fields(JobRecord))[:-1]
if dataclasses.fields(JobRecord)[-1].name != "version":
    raise RuntimeError("JobRecord's last field must be version (see _FIELDS)")
#: The layout of a blob: its last element. A blob written before it had one (its last
#: element the writer's clock, a float) held the running process's cancel flag before
#: ``created_at``; it is read still, that element dropped.
_LAYOUT: Final = 2
_AT_OLD_CANCEL: Final = _FIELDS.index("created_at")
_GET: Final = operator.attrgetter(*_FIELDS)
_AT_STATUS, _AT_UPDATED, _AT_FRAMES, _AT_ROOT, _AT_PROGRESS, _AT_ERROR, _AT_OUTPUT, _AT_JOIN = (
    _FIELDS.index(name)
    for name in ("status", "updated_at", "frames", "root", "progress", "error", "output", "join")
)
#: The signals a job took, then its tracestate and baggage, then its pool key: the last
#: fields, which a record written before each lacks.
_AT_DELIVERED: Final = _FIELDS.index("delivered")
_AT_TRACESTATE: Final = _FIELDS.index("tracestate")
_AT_POOL_KEY: Final = _FIELDS.index("pool_key")
_AT_OWNER: Final = _FIELDS.index("owner")
if _FIELDS[_AT_DELIVERED:] != ("delivered", "tracestate", "baggage", "pool_key", "owner"):
    raise RuntimeError(
        "Job's fields delivered, tracestate, baggage, pool_key and owner must be the last "
        "ones stored (see _decode)"
    )
#: The fields that are absolute trio times (moved between processes' clocks).
_TIMES: Final = tuple(
    _FIELDS.index(name) for name in ("deadline", "suspend_deadline", "retain_until", "accepted_at")
)
_STATUS_OF: Final = {s.value: s for s in Status}


#: The update script's command (see _update_command): head, the job's key, the finished
#: set, the tombstones' hash, the stream if any, the blob, and the rest already encoded.
_UPDATE_FORMAT: Final = b"%b$%d\r\n%b%b\r\n%b%b%b$%d\r\n%b\r\n%b$%d\r\n%b\r\n%b%b%b%b%b%b"
#: The create script's command (see create).
_CREATE_FORMAT: Final = b"%b$%d\r\n%b%b\r\n%b%b$%d\r\n%b\r\n%b$%d\r\n%b\r\n$%d\r\n%b\r\n%b%b%b"
#: create's owner and creation time for a job without an owner (see lua/store_create.lua).
_NO_OWNER: Final = encode_args(["", ""])
#: The status script's command (see update_status).
_STATUS_FORMAT: Final = b"%b$%d\r\n%b%b\r\n%b$%d\r\n%b\r\n$%d\r\n%b\r\n%b$%d\r\n%b\r\n"


def _bulk(data: bytes) -> bytes:
    """One argument as a RESP bulk string."""
    return b"$%d\r\n%b\r\n" % (len(data), data)


class RedisJobStore(Batches):
    """Job records on Redis. ``url`` is where (``redis://[user:password@]host:port/db``,
    ``rediss://`` for TLS, ``unix:///path?db=N``). ``prefix`` keeps several deployments
    (or tests) apart on one server. Retention, and how many dropped ids are remembered
    for how long, as for the memory store. ``resend_seconds``: how long a step's write
    whose round trip failed is sent again, within its job's deadline (and a waiter's read;
    see the module).

    Use it as an async context manager (an :class:`~pipework.Engine` given it does so): its
    connection closes on the last exit.
    """

    _scripts = _SOURCES

    def __init__(
        self,
        url: str = "redis://localhost:6379/0",
        *,
        prefix: str = "pipework",
        retain_seconds: float = 3600.0,
        retain_count: int = 10_000,
        remember_gone_count: int = REMEMBER_GONE_COUNT,
        remember_gone_seconds: float = REMEMBER_GONE_SECONDS,
        lock_seconds: float = 10.0,
        io_timeout: float = 10.0,
        resend_seconds: float = 30.0,
    ) -> None:
        check_retention(retain_seconds, retain_count, remember_gone_count, remember_gone_seconds)
        if not resend_seconds >= 0:
            raise ValueError(f"resend_seconds must be 0 or more, got {resend_seconds!r}")
        if ":" in prefix or not prefix:
            raise ValueError(f"the Redis key prefix must be non-empty without ':', got {prefix!r}")
        self.url = url
        self.prefix = prefix
        self.retain_seconds = retain_seconds
        self.retain_count = retain_count
        self.remember_gone_count = remember_gone_count
        self.remember_gone_seconds = remember_gone_seconds
        self.lock_seconds = lock_seconds
        self.io_timeout = io_timeout
        self.resend_seconds = resend_seconds
        self._connection: Connection | None = None
        self._entered = 0
        self._offset: float | None = None
        self._locks: dict[str, tuple[trio.Lock, int]] = {}
        self._init_batches()
        #: This store's name in the records it creates (see _UPDATE).
        self._origin = secrets.token_hex(8)
        self._origin_arg = encode_args([self._origin])
        # Subscriptions to the ends of other processes' jobs: running, and subscribed now.
        self._following = 0
        self._subscribed = 0
        #: Jobs created here whose end has not been heard of: while every subscription is
        #: live, an end recorded anywhere reaches this process, so a waiter need not read.
        self._active: dict[str, Job] = {}
        #: Subscriptions dropped so far; the count when a job was last found active
        #: (read_awaited), for the wait that follows (wait_end); the waits without a limit.
        self._generation = 0
        self._read_at: dict[str, int] = {}
        self._waits: set[Waiting] = set()
        #: Ends recorded here (the record as written), for this process's waiters.
        self._ended: dict[str, Job] = {}
        #: Records written here whole and left queued: (blob, version), see read_own.
        self._own: dict[str, tuple[bytes, int]] = {}
        #: Jobs created here whose first event this process claimed (see create).
        self._claimed: dict[str, Job] = {}
        #: Jobs whose last write failed with no answer (it may have been made): their next
        #: write is sent as one sent again (see _resend).
        self._unsure: dict[str, None] = {}
        self.rider = None
        self._update_head = b"*%d\r\n%b" % (20, encode_args(["EVALSHA", _SHAS["update"], 3]))
        self._update_entry_head = b"*%d\r\n%b" % (
            23,
            encode_args(["EVALSHA", _SHAS["update"], 4]),
        )
        self._status_head = b"*%d\r\n%b" % (9, encode_args(["EVALSHA", _SHAS["status"], 1]))
        self._prefix_arg = encode_args([prefix])
        # create's command without a stream entry, with one, and claiming it: 2, 3 or 3
        # keys, 7, 9 or 13 arguments.
        self._create_heads = (
            b"*12\r\n%b" % encode_args(["EVALSHA", _SHAS["create"], 2]),
            b"*15\r\n%b" % encode_args(["EVALSHA", _SHAS["create"], 3]),
            b"*19\r\n%b" % encode_args(["EVALSHA", _SHAS["create"], 3]),
        )
        self._get_head = encode_args(["HMGET"])
        self._get_tail = encode_args(["d", "v", "s", "u"])
        self._job_prefix = f"{prefix}:job:".encode()
        self._gone_arg = encode_args([f"{prefix}:gone"])
        self._finished_arg = encode_args([f"{prefix}:finished"])
        self._active_arg = encode_args([f"{prefix}:active"])
        self._tail_given: tuple[object, ...] = ()
        self._packer = msgpack.Packer(use_bin_type=True, default=_wire)
        self._tail_bytes = b""

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> RedisJobStore:
        self._entered += 1
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._entered -= 1
        if self._entered == 0 and self._connection is not None:
            connection, self._connection = self._connection, None
            await connection.aclose()

    async def _script(
        self,
        name: str,
        keys: list[str],
        args: list[Arg],
        *,
        until: float | None = None,
        reads: bool = False,
    ) -> Any:
        """One of the store's scripts that may run twice (a read, or a write of the same
        outcome again): sent again on a new connection if its round trip failed, at once,
        and until ``until`` (None: only at once). ``reads``: it changes nothing a client
        asked for (its failure says nothing was done)."""
        command: Command = ["EVALSHA", _SHAS[name], len(keys), *keys, *args]
        try:
            return await self._run(command, name)
        except StoreUnavailable as exc:
            now = trio.current_time()
            until = now if until is None else until
            return await self._resend(command, name, until, exc, reads=reads)

    async def _resend(
        self,
        command: Command,
        script: str | None,
        until: float,
        lost: StoreUnavailable,
        read: Callable[[Any], None] | None = None,
        *,
        reads: bool = False,
    ) -> Any:
        """Send ``command`` again after its round trip failed with ``lost``: at once (on a
        new connection), then with growing pauses while ``until`` has not passed
        (:class:`Resend`); the last failure is raised if none goes through. ``command``
        must be one that may run twice: a read, or a write marked as sent again (its script
        then tells a write already made, see _AGAIN). ``read``: as ``_Call.read``.
        ``reads``: ``command`` changes nothing a client asked for: its failure says
        nothing was done (``StoreUnavailable.maybe_done``)."""
        resend = Resend(until)
        maybe_done = lost.maybe_done
        while (pause := resend.pause(trio.current_time())) is not None:
            if pause > 0:
                await trio.sleep(pause)
            call = _Call([command], script, many=False)
            call.read = read
            try:
                return await self._call(call)
            except StoreUnavailable as exc:
                lost = exc
                maybe_done = maybe_done or exc.maybe_done
        lost.maybe_done = maybe_done and not reads  # (perhaps, if any of them may have been)
        raise lost

    def _resend_until(self, job: Job) -> float:
        """Until when a write of ``job``'s is sent again: its deadline, and
        ``resend_seconds`` from now at most."""
        return min(job.deadline, trio.current_time() + self.resend_seconds)

    def _unsure_of(self, job_id: str) -> None:
        """The job's last write got no answer: its next one is sent as one sent again."""
        self._unsure[job_id] = None
        if len(self._unsure) > _UNSURE_KEPT:
            del self._unsure[next(iter(self._unsure))]

    # -- time ----------------------------------------------------------------------------

    def _shift(self) -> float:
        """wall time = trio time + shift (measured once, see the module)."""
        if self._offset is None:
            self._offset = time.time() - trio.current_time()
        return self._offset

    def _encode(self, job: Job) -> bytes:
        """The record as a msgpack array: the job's fields in :data:`_FIELDS`'s order, then
        the writer's clock (for readers elsewhere). No field names: a third of the bytes of
        a map, and cheaper to write and read. The cursor's frames, the progress, the error
        and the join are arrays of their own (_wire)."""
        data: bytes = self._packer.pack((*_GET(job), self._shift(), _LAYOUT))
        return data

    def _decode(
        self, blob: bytes, version: Any, status: bytes | None = None, updated: bytes | None = None
    ) -> Job:
        """The record from its blob and version; ``updated`` (``u``) set means a status
        write came after the blob (:meth:`update_status`): ``status`` and it are newer."""
        values = msgpack.unpackb(blob, raw=False)
        if type(values) is dict:  # written as a map (Job.to_wire) by an older pipework
            values = [values.get(name, False) for name in _FIELDS[:_AT_TRACESTATE]] + [
                values["clock"]
            ]
        elif type(values[-1]) is int:  # the layout (_LAYOUT)
            values.pop()
        else:  # written before the layout was marked: the cancel flag was stored then
            del values[_AT_OLD_CANCEL]
        # Times written by another process move from its trio clock to this one's; this
        # process's own come back exactly as they were written.
        shift = values.pop() - self._shift()
        stored = len(values)
        if stored == _AT_DELIVERED:  # written before jobs remembered their signals
            values.append(())
        elif values[_AT_DELIVERED]:
            values[_AT_DELIVERED] = tuple(values[_AT_DELIVERED])
        else:
            values[_AT_DELIVERED] = ()
        if stored <= _AT_TRACESTATE:  # written before jobs carried tracestate and baggage
            values += (None, None)
        if stored <= _AT_POOL_KEY:  # written before jobs carried a pool key
            values.append(None)
        if stored <= _AT_OWNER:  # written before jobs carried an owner
            values.append(None)
        if updated:
            assert status is not None
            values[_AT_STATUS] = status.decode()
            values[_AT_UPDATED] = float(updated)
        values[_AT_STATUS] = _STATUS_OF[values[_AT_STATUS]]
        frames = values[_AT_FRAMES]
        if frames:
            values[_AT_FRAMES] = [Frame(int(i), float(d) + shift, int(b)) for i, d, b in frames]
        values[_AT_ROOT] = tuple(values[_AT_ROOT])
        if values[_AT_PROGRESS] is not None:
            values[_AT_PROGRESS] = Progress(*values[_AT_PROGRESS])
        if values[_AT_ERROR] is not None:
            values[_AT_ERROR] = ErrorInfo(*values[_AT_ERROR])
        if not values[_AT_OUTPUT]:
            values[_AT_OUTPUT] = ()
        if values[_AT_JOIN] is not None:
            join = JoinRecord.from_wire(values[_AT_JOIN])
            if shift:
                join.deadline = join.deadline + shift
            values[_AT_JOIN] = join
        if shift:
            for i in _TIMES:
                values[i] = _moved(values[i], shift)
        values.append(int(version))
        return Job(*values)

    # -- the contract --------------------------------------------------------------------

    def _key(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

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

    async def wait_end(self, job_id: str, wake: Wake, recheck: float) -> None:
        """Engine.wait's wait for the end of a job that :meth:`read_awaited` has just found
        active: until ``wake`` is set, or an end may have been missed. While every end
        recorded anywhere has reached this process since that read (its subscription has
        not dropped), none can be, so it waits with no time limit (no cancel scope either),
        and a drop of the subscription wakes it; otherwise for ``recheck`` seconds at most."""
        if wake.is_set():  # the end came while the record was read
            return
        if self._read_at.pop(job_id, None) == self._generation and self._hearing():
            waiting = wake.join(trio.lowlevel.current_task())
            self._waits.add(waiting)
            try:
                await trio.lowlevel.wait_task_rescheduled(waiting)
            finally:
                self._waits.discard(waiting)
            return
        with trio.move_on_after(recheck):
            await wake.wait()

    def _deaf(self) -> None:
        """A subscription dropped: ends recorded from now on may not be heard, so whoever
        waits without a time limit reads the record again."""
        self._generation += 1
        self._active.clear()
        self._read_at.clear()
        for waiting in list(self._waits):
            waiting.cut()

    def _hearing(self) -> bool:
        """Whether every end recorded elsewhere reaches this process now."""
        return self._following > 0 and self._subscribed == self._following

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

    # -- other processes' ends ----------------------------------------------------------

    async def follow_finished(
        self,
        finished: Callable[[str], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Call ``finished(job_id)`` for every job any process finishes (published by the
        update that records the end), until cancelled: whoever waits here for a job that
        another process ran hears of its end. Reconnects while Redis is away."""

        def heard(channel: bytes, data: bytes) -> None:
            job_id = data.decode()
            self._active.pop(job_id, None)  # before the waiter wakes
            finished(job_id)

        def live() -> None:
            self._subscribed += 1

        def dropped() -> None:
            # Ends published until it subscribes again are not heard: whoever waits reads
            # the record from now on.
            self._subscribed -= 1
            self._deaf()

        subscription = Subscription(
            self.url, [f"{self.prefix}:finished"], what="the job store's subscription to ends"
        )
        self._following += 1
        try:
            await subscription.run(heard, live=live, dropped=dropped, task_status=task_status)
        except UNREACHABLE as exc:  # the first connection failed
            raise self._unavailable(exc) from exc
        finally:
            self._following -= 1
            self._deaf()

    # -- one callback secret -------------------------------------------------------------

    async def callback_secret(self, proposed: bytes) -> bytes:
        """The secret every process on this server and prefix signs callback URLs with
        (when none is configured): the one kept at ``{prefix}:callback_secret``, else
        ``proposed``, kept there from now on (no expiry, so URLs outlive restarts as the
        jobs do). The container asks once, when it starts serving."""
        key = f"{self.prefix}:callback_secret"
        written, kept = await self.pipeline([["SET", key, proposed, "NX"], ["GET", key]])
        for reply in (written, kept):
            if isinstance(reply, ReplyError):
                raise reply
        if not isinstance(kept, bytes) or len(kept) < _MIN_SECRET:
            raise ValueError(
                f"the callback secret kept in Redis at {key!r} is not one pipework wrote "
                f"(a string of {_MIN_SECRET} bytes or more): delete that key (the next "
                "process to start keeps its own) or configure [server] callback_secret_env"
            )
        return kept

    # -- exclusive sections --------------------------------------------------------------

    @asynccontextmanager
    async def lock(self, job_id: str) -> AsyncIterator[None]:
        """Hold the job's record for a read-modify-write across several commands: one
        holder at a time in this process (a trio lock) and across processes (a Redis key
        with a lease of ``lock_seconds``, so a holder that died frees it)."""
        local, users = self._locks.get(job_id, (trio.Lock(), 0))
        self._locks[job_id] = (local, users + 1)
        try:
            async with local:
                token = f"{id(self)}:{trio.current_time()}:{time.time()}"
                key = f"{self.prefix}:lock:{job_id}"
                px = int(self.lock_seconds * 1000)
                while True:
                    if await self._take_lock(key, token, px):
                        break
                    # Another process holds it, and no event can cross processes: poll
                    # briefly (a holder keeps it for one join's bookkeeping).
                    await trio.sleep(0.002)
                try:
                    yield
                finally:
                    with trio.CancelScope(shield=True):
                        try:
                            await self._script("release", [key], [token])
                        except StoreUnavailable as exc:
                            # Its lease frees it within lock_seconds. Raised, it would undo
                            # what the section did for its caller: a signal delivered
                            # would be answered as if nothing was done.
                            _log.debug(
                                "pipework: the lock of job %s left to expire: %s", job_id, exc
                            )
        finally:
            local, users = self._locks[job_id]
            if users == 1:
                del self._locks[job_id]
            else:
                self._locks[job_id] = (local, users - 1)

    async def _take_lock(self, key: str, token: str, px: int) -> bool:
        """Whether the lock at ``key`` is taken for ``token`` (``SET NX``); a round trip that
        failed is sent again for ``resend_seconds``, and an answer "held" then looks whether
        the holder is this very call, whose first answer was lost."""
        take: Command = ["SET", key, token, "NX", "PX", px]
        try:
            return bool(await self._run(take))
        except StoreUnavailable as exc:
            lost = exc
        until = trio.current_time() + self.resend_seconds
        if await self._resend(take, None, until, lost):
            return True
        held = await self._resend(["GET", key], None, until, lost)  # (at once, first)
        return bool(held == token.encode())


def _wire(value: object) -> Any:
    """The parts of a record msgpack does not know, as the arrays _decode reads back."""
    if isinstance(value, Frame):
        return [value.index, value.deadline, value.bound]
    if isinstance(value, Progress):
        return [value.done, value.total, value.message, value.branch]
    if isinstance(value, ErrorInfo):
        return [value.type, value.message, value.where, value.status]
    if isinstance(value, JoinRecord):
        return value.to_wire()
    raise TypeError(f"a job record cannot hold a {type(value).__name__}")


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


def _version_arg(expected: str) -> bytes:
    """The update script's last argument: the version the record must have (see _AGAIN)."""
    return _ANY_VERSION if expected == "" else encode_args([expected])


def _entry_tail(entry: tuple[str, bytes, bytes] | None) -> bytes:
    """The update script's arguments after the version: the entry's field and value."""
    return b"" if entry is None else _bulk(entry[1]) + _bulk(entry[2])


def _sent_again(command: bytes, expected: str, entry: tuple[str, bytes, bytes] | None) -> bytes:
    """The update script's ``command`` marked as sent again (see _AGAIN): its version
    argument, before the entry's, replaced."""
    tail = _entry_tail(entry)
    cut = len(command) - len(tail) - len(_version_arg(expected))
    return command[:cut] + _version_arg(_AGAIN + expected) + tail


def _moved(value: float | None, shift: float) -> float | None:
    if value is None or math.isinf(value):
        return value
    return value + shift
