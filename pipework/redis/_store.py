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

**Where the rest is.** :class:`RedisJobStore` is built in layers, each a module of its own
over the batches of :mod:`._batches`: calls sent again (:mod:`._store_resend`), the ends
heard of from other processes (:mod:`._store_ends`), the reads (:mod:`._store_reads`) and
the writes (:mod:`._store_writes`), with the record's format in :mod:`._record` and the
scripts' commands in :mod:`._store_scripts`. This module holds what is the store's alone:
its settings and state, its lifecycle, the callback secret and the lock.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Final

import trio

from .._errors import StoreUnavailable
from ..dispatcher._job import Job
from ..dispatcher._store import REMEMBER_GONE_COUNT, REMEMBER_GONE_SECONDS, check_retention
from ..dispatcher._wake import Waiting
from ._record import record_packer
from ._store_scripts import _SHAS, _SOURCES
from ._store_writes import Writes
from ._wire import Command, Connection, ReplyError, encode_args

__all__ = ["RedisJobStore", "StoreUnavailable"]

_log = logging.getLogger("pipework.dispatcher")

#: The shortest callback secret a signer takes (the container's rule).
_MIN_SECRET: Final = 16


class RedisJobStore(Writes):
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
        self._packer = record_packer()
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
