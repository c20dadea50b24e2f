"""The event queue on a Redis Stream with a consumer group: every process that opens one on
the same server and prefix takes its share of the events, and a dead one's are claimed.

The queue's interface is synchronous where the dispatcher must not wait (``submit_nowait``,
``put_nowait``, ``ack``), so those only touch memory: events go to an outbox that a task
writes with ``XADD`` (a batch per round trip), and acknowledgements to one that the same
task sends with ``XACK``, each in a round trip after the one that wrote what was put before
it. :meth:`flush` waits until every event put so far is in Redis; the engine calls it
before it answers a submission, so an accepted job's first event is never only in memory.
Given the job store (``store=``), the queue sends those in the store's round trips, and a
non-blocking ``XREADGROUP`` rides at the end of each of them (:meth:`board`): the events a
round trip writes come back in it. A blocking read on a connection of its own waits for
events only once those reads have brought nothing for a moment.

- **Bounded new work.** ``depth`` is the group's pending entries (delivered, not yet
  acknowledged) plus its lag (not yet delivered), refreshed after every batch written or
  acknowledged and adjusted locally in between, plus the outbox. A submission is refused
  with :class:`~pipework.Overloaded` once it reaches ``capacity``; events of accepted jobs
  are always taken.
- **Fair shares.** A consumer reads only while it holds fewer than ``max_inflight`` events
  unacknowledged (a ``RunJob`` is acknowledged when a worker slot is granted), so a process
  whose pool is full leaves new events to the others.
- **A dead consumer.** Entries delivered to a consumer and not acknowledged stay pending in
  the group. Every ``claim_idle / 3`` seconds a consumer resets the idle time of the events
  it still holds (``XCLAIM ... JUSTID``) and claims every entry idle for ``claim_idle``
  seconds (``XAUTOCLAIM``): those are a dead consumer's, and run here. Delivery is at least
  once: the dispatcher already ignores an event whose job has moved on.
- **Suspend timers** live in Redis too (:class:`~._timers.RedisTimers`): a timer set
  here fires on whichever process is alive when it is due, once.
- **A dead consumer's steps.** A ``RunJob`` or ``Resume`` stops counting toward the depth
  when its step gets a worker slot (``ack``), but it is acknowledged in the group only when
  the step ends (``step_ended``); until then its consumer keeps it fresh. A process that
  dies during a step so leaves the event pending, another claims it, and the dispatcher,
  told the event was ``reclaimed``, runs the job again from its cursor: the pipe that was
  running when the process died runs again.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import socket
from collections.abc import Callable
from types import TracebackType
from typing import Any, Final

import msgpack
import trio

from .._errors import Overloaded, StoreUnavailable
from ..dispatcher._events import BranchDone, Event, Expire, Resume, RunJob
from ..dispatcher._job import Job
from ..dispatcher._queue import QueueStatistics
from ._relay import RedisRelay
from ._store import RedisJobStore
from ._timers import RedisTimers
from ._wire import (
    NOT_NOW,
    UNREACHABLE,
    Arg,
    Command,
    Connection,
    ReplyError,
    encode_args,
    public_url,
    redis_outage,
)

__all__ = ["RedisEventQueue", "decode_event", "encode_event"]

_log = logging.getLogger("pipework.dispatcher")

_FIELD: Final = b"e"

#: How long after the last events a store's round trips brought the blocking read
#: resumes (a process whose store is busy reads in its round trips).
_QUIET: Final = 0.01

#: How many entries create_and_claim's read may take: its own, and a few before it (other
#: processes' events, or events put without a claim); with more before it, the job's
#: event is left to the next read and the job runs as any other.
_CLAIM_READ: Final = 4

#: How many entries a read riding in a store's round trip takes at most: no more than half
#: the room left, the rest is for create_and_claim's reads meanwhile.
_RIDE_READ: Final = 64


#: One packer for every event (msgpack.packb makes one per call).
_pack: Final = msgpack.Packer(use_bin_type=True).pack


def encode_event(event: Event) -> bytes:
    if isinstance(event, RunJob):
        wire: list[Any] = ["run", event.job_id]
    elif isinstance(event, Resume):
        wire = ["resume", event.job_id, event.signal]
    elif isinstance(event, Expire):
        wire = ["expire", event.job_id, event.version]
    else:
        wire = [
            "branch",
            event.parent_id,
            event.branch_id,
            event.index,
            event.outcome,
            event.delta,
            event.join_id,
            list(event.stage),
            None if event.error is None else list(event.error),
        ]
    data: bytes = _pack(wire)
    return data


def decode_event(data: bytes) -> Event:
    wire = msgpack.unpackb(data, raw=False)
    kind = wire[0]
    if kind == "run":
        return RunJob(wire[1])
    if kind == "resume":
        return Resume(wire[1], wire[2])
    if kind == "expire":
        return Expire(wire[1], int(wire[2]))
    if kind == "branch":
        error = wire[8]
        return BranchDone(
            wire[1],
            wire[2],
            int(wire[3]),
            wire[4],
            wire[5],
            join_id=wire[6],
            stage=tuple(wire[7]),
            error=None if error is None else (error[0], error[1], error[2], int(error[3])),
        )
    raise ValueError(f"unknown event kind {kind!r} on the event stream")


class RedisEventQueue:
    """Events on the stream ``{prefix}:events``, read by consumer group ``group``.

    ``consumer`` names this process in the group (default: host, pid and a random tail);
    ``claim_idle`` is how long an event may sit unacknowledged with its consumer silent
    before another consumer takes it. ``store``: a :class:`RedisJobStore` on the same
    server whose round trips the queue's writes, acknowledgements and claims share (what
    ``[store] backend = "redis"`` builds): a job's record and its events then travel
    together. Use as an async context manager (an :class:`~pipework.Engine` given it does
    so).
    """

    def __init__(
        self,
        url: str = "redis://localhost:6379/0",
        *,
        prefix: str = "pipework",
        capacity: int = 10_000,
        retry_after: float = 1.0,
        group: str = "workers",
        consumer: str | None = None,
        claim_idle: float = 30.0,
        max_inflight: int = 256,
        block: float = 1.0,
        store: RedisJobStore | None = None,
        timer_poll: float = 1.0,
    ) -> None:
        if store is not None and store.url != url:
            raise ValueError(
                f"the queue shares the store's connection: give both the same URL "
                f"(the store's is {public_url(store.url)}, the queue's {public_url(url)})"
            )
        if capacity < 1:
            raise ValueError(f"queue capacity must be at least 1, got {capacity}")
        if claim_idle <= 0:
            raise ValueError(f"claim_idle must be positive, got {claim_idle}")
        self.url = url
        self.capacity = capacity
        self.retry_after = retry_after
        self.group = group
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.claim_idle = claim_idle
        self.max_inflight = max_inflight
        self.block = block
        self.stream = f"{prefix}:events"
        # Writes, acknowledgements and claims take turns on one connection; the blocking
        # read has one of its own.
        self._store = store
        self._connection: Connection | None = None
        self._reader: Connection | None = None
        self._reading = False  # the blocking read is on its way
        self._riding = 0  # the COUNT of the read riding in a store's round trip (board)
        #: The COUNTs of the reads riding in the store's round trips on their way (board's,
        #: create_and_claim's): what they bring counts against max_inflight before it comes.
        self._reserved = 0
        self._last_read = -math.inf  # when a read last brought events (trio clock)
        self._turn = trio.Lock()
        self._nursery: trio.Nursery | None = None
        self._outbox: list[tuple[int, bytes]] = []
        self._put = 0  # events put so far
        self._written = 0  # events written to Redis so far
        self._wrote = trio.Event()
        # Entry ids to acknowledge, each with the counts of events put and suspend timers
        # added before it was: what a step put (a hand-off, a branch's end, its timer) is in
        # Redis before its event is acknowledged.
        self._acks: list[tuple[bytes, int, int]] = []
        self._have_work = trio.Event()
        self._send, self._receive = trio.open_memory_channel[Event](math.inf)
        self._inflight: dict[int, tuple[Event, bytes]] = {}  # id(event) -> (event, entry id)
        self._started: dict[int, tuple[Event, bytes]] = {}  # steps running: not acked yet
        self._claimed: set[int] = set()  # ids of events taken over from a silent consumer
        self._room = trio.Event()
        self._shared_depth = 0
        self._accepted = 0
        self._refused = 0
        self._running: Any = None
        self._timers = RedisTimers(
            self._call,
            prefix=prefix,
            stream=self.stream,
            field=_FIELD,
            retrying=self._retrying,
            poll=timer_poll,
            written=self._wake,
        )
        #: create_and_claim's group and consumer arguments, encoded once.
        self._claim_arg = encode_args([group, self.consumer])
        #: Progress, chunks and cancels between processes (the engine runs it).
        self.relay = RedisRelay(url, prefix=prefix)

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> RedisEventQueue:
        try:
            await self._create_group()
            await self._refresh_depth()
            await self.relay.__aenter__()
        except BaseException:
            await self._close()
            raise
        nursery_manager = trio.open_nursery()
        nursery = await nursery_manager.__aenter__()
        self._running = nursery_manager
        self._nursery = nursery
        if self._store is not None:
            if self._store.rider is not None:
                raise RuntimeError("a job store carries the reads of one event queue only")
            self._store.rider = self
        for task in (self._write_loop, self._read_loop, self._claim_loop, self._timers.run):
            nursery.start_soon(task)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        nursery_manager = self._running
        assert self._nursery is not None
        if self._store is not None and self._store.rider is self:
            self._store.rider = None
        # What the engine's last steps put and acknowledged is still sent, briefly.
        with trio.move_on_after(2, shield=True):
            await self.flush()
            while self._ready():
                await self._send_outbox()
        self._nursery.cancel_scope.cancel()
        try:
            await nursery_manager.__aexit__(None, None, None)
        finally:
            self._running = self._nursery = None
            try:
                await self.relay.__aexit__(None, None, None)
            finally:
                await self._close()

    async def _close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.aclose()

    async def _call(self, commands: list[list[Arg]]) -> list[Any]:
        """One round trip: in the store's next one, or on the queue's own connection
        (opened again if it was lost)."""
        if self._store is not None:
            return await self._store.pipeline(commands)
        async with self._turn:
            connection = self._connection
            if connection is None or connection.closed:
                connection = self._connection = await Connection.open(self.url)
            return await connection.call(commands)

    async def _create_group(self) -> None:
        (reply,) = await self._call(
            [["XGROUP", "CREATE", self.stream, self.group, "0", "MKSTREAM"]]
        )
        if isinstance(reply, ReplyError) and reply.code != "BUSYGROUP":
            raise reply  # BUSYGROUP: another process made the group first

    # -- the EventQueue interface --------------------------------------------------------

    def submit_nowait(self, event: Event) -> None:
        self._check_room()
        self.put_nowait(event)

    def _check_room(self) -> None:
        depth = self._depth()
        if depth >= self.capacity:
            self._refused += 1
            raise Overloaded(
                f"the event queue is full ({depth} of {self.capacity} events waiting); "
                f"retry after {self.retry_after:g}s",
                reason="queue_full",
                retry_after=self.retry_after,
            )

    def put_nowait(self, event: Event) -> None:
        self._put += 1
        self._accepted += 1
        self._outbox.append((self._put, encode_event(event)))
        self._have_work.set()

    async def create_and_submit(self, store: object, job: Job, event: RunJob) -> bool:
        """Create the job's record in ``store`` and submit its first event in one write, if
        ``store`` is the store this queue shares (False, doing nothing, otherwise): the
        record and the event reach Redis together, in one command and one round trip.
        Raises :class:`~pipework.Overloaded` as :meth:`submit_nowait` does, writing
        nothing."""
        if store is not self._store or self._store is None:
            return False
        self._check_room()
        await self._store.create(job, entry=(self.stream, _FIELD, encode_event(event)))
        self._accepted += 1
        self._shared_depth += 1  # as for a batch written (_send_outbox)
        return True

    def can_claim(self, store: object) -> bool:
        """Whether :meth:`create_and_claim` can claim a job of ``store``'s: the store is the
        one whose round trips this queue shares."""
        return self._store is not None and store is self._store

    async def create_and_claim(self, store: object, job: Job, event: RunJob) -> bool | None:
        """:meth:`create_and_submit`, with the event read for this consumer in the same
        write, for a creator that holds a worker slot for the job's first step: True if
        the event is this consumer's (pending for it, the record marked running: the
        caller starts the step with ``event``, which it must :meth:`ack` and
        :meth:`step_ended` as any delivered one), False if entries before it took the
        room this consumer has (the record stays queued, the event on the stream). The
        entries read before it are delivered as any read's. None, with nothing done, if
        ``store`` is not the queue's or the queue has no room to claim (the caller uses
        :meth:`create_and_submit`)."""
        room = min(self._room_left(), _CLAIM_READ)
        if store is not self._store or self._store is None or room <= 0 or self._running is None:
            return None
        self._check_room()
        self._reserved += room
        claimed: list[bytes] = []

        def read(reply: Any) -> None:
            # Told in reply order, before any later read's entries are delivered.
            self._reserved -= room
            self._room.set()
            claimed.append(b"")
            if not reply:
                return  # not created: it exists already
            at, entries = reply
            if entries:
                self._last_read = trio.current_time()
                others = [e for e in entries if e[0] != at] if at else entries
                if others:
                    self._deliver(others)
            if at:
                self._inflight[id(event)] = (event, at)
                claimed[0] = at

        try:
            await self._store.create(
                job,
                entry=(self.stream, _FIELD, encode_event(event)),
                claim=(self._claim_arg, room, read),
            )
        finally:
            if not claimed:  # no answer came
                self._reserved -= room
                self._room.set()
        self._accepted += 1
        self._shared_depth += 1  # as for a batch written (_send_outbox)
        return bool(claimed[0])

    async def update_and_put(self, store: object, job: Job, event: RunJob) -> bool:
        """Write the job's record to ``store`` and put its next event in the same write, if
        ``store`` is the store this queue shares (False, doing nothing, otherwise): a
        hand-off's record and the event that runs its next step reach Redis together, and
        nothing waits in the outbox before the step's own event is acknowledged."""
        if store is not self._store or self._store is None:
            return False
        await self._store.update(job, entry=(self.stream, _FIELD, encode_event(event)))
        self._accepted += 1
        self._shared_depth += 1  # as for a batch written (_send_outbox)
        return True

    async def update_unless_changed_and_put(
        self, store: object, job: Job, event: Event
    ) -> bool | None:
        """``store.update_unless_changed(job)`` with ``event`` put in the same write, if
        ``store`` is the store this queue shares (None, doing nothing, otherwise): a
        delivered signal's record and its ``Resume`` reach Redis together. Put in the
        outbox after the write, a process killed between the two left its job queued with
        no event to run it, for ever (found by the chaos harness)."""
        if store is not self._store or self._store is None:
            return None
        entry = (self.stream, _FIELD, encode_event(event))
        if not await self._store.update_unless_changed(job, entry=entry):
            return False
        self._accepted += 1
        self._shared_depth += 1  # as for a batch written (_send_outbox)
        return True

    def update_and_put_soon(
        self,
        store: object,
        job: Job,
        event: RunJob,
        then: Callable[[BaseException | None], None],
    ) -> bool:
        """:meth:`update_and_put` with no wait (``RedisJobStore.update_soon``): ``then`` is
        told how the write went. False, with nothing done, when the store cannot take it so
        (the caller awaits :meth:`update_and_put`)."""
        if store is not self._store or self._store is None:
            return False
        if not self._store.update_soon(job, then, entry=(self.stream, _FIELD, encode_event(event))):
            return False
        self._accepted += 1
        self._shared_depth += 1  # as for a batch written (_send_outbox)
        return True

    async def get(self) -> Event:
        return await self._receive.receive()

    async def get_batch(self, limit: int = 256) -> list[Event]:
        batch = [await self._receive.receive()]
        while len(batch) < limit:
            try:
                batch.append(self._receive.receive_nowait())
            except trio.WouldBlock:
                break
        return batch

    def ack(self, event: Event) -> None:
        held = self._inflight.pop(id(event), None)
        if held is None:
            return
        self._shared_depth = max(0, self._shared_depth - 1)
        if len(self._inflight) < self.max_inflight:
            self._room.set()
        if isinstance(event, RunJob | Resume):
            # A step started: the event no longer counts, but it stays pending in the group
            # (refreshed, so nobody claims it) until the step ends: if this process dies
            # during the step, another one takes the event and runs the step again.
            self._started[id(event)] = held
            return
        self._acks.append((held[1], self._put, self._timers.added))
        self._have_work.set()

    def step_ended(self, event: Event) -> None:
        """The step the event started has ended (finished, handed off, suspended, failed):
        acknowledge it in the group."""
        held = self._started.pop(id(event), None)
        self._claimed.discard(id(event))
        if held is not None:
            self._acks.append((held[1], self._put, self._timers.added))
            self._have_work.set()

    def let_go(self, event: Event) -> None:
        """The event's step could not start (the store was away while it read the job):
        it is not acknowledged, and no longer held here (its idle time no longer reset), so
        once idle for ``claim_idle`` a claim round takes it again, here or in another
        process, and its step runs then."""
        if self._inflight.pop(id(event), None) is not None:
            self._shared_depth = max(0, self._shared_depth - 1)
            if len(self._inflight) < self.max_inflight:
                self._room.set()
        self._started.pop(id(event), None)
        self._claimed.discard(id(event))

    def reclaimed(self, event: Event) -> bool:
        """Whether the event was taken over from a consumer that fell silent: a job it finds
        ``running`` lost its step with that consumer."""
        return id(event) in self._claimed

    def statistics(self) -> QueueStatistics:
        return QueueStatistics(self._depth(), self.capacity, self._accepted, self._refused)

    async def flush(self) -> None:
        """Wait until every event put so far is in Redis."""
        target = self._put
        while self._written < target:
            await self._wrote.wait()
        await self._timers.flush()

    def expire_at(self, deadline: float, job_id: str, version: int) -> None:
        """A suspended job's timer: ``Expire(job_id, version)`` goes on the stream at
        ``deadline`` (trio time), once, from whichever process is alive then."""
        self._timers.add(deadline, encode_event(Expire(job_id, version)))

    # -- the tasks -----------------------------------------------------------------------

    def _depth(self) -> int:
        return self._shared_depth + len(self._outbox)

    async def _refresh_depth(self) -> None:
        (reply,) = await self._call([["XINFO", "GROUPS", self.stream]])
        self._depth_from(reply)

    def _depth_from(self, reply: Any) -> None:
        if isinstance(reply, ReplyError):
            return  # the stream is gone (Redis restarted empty): the reader recreates it
        for info in reply:
            fields = dict(zip(info[::2], info[1::2], strict=True))
            if fields.get(b"name") == self.group.encode():
                pending = fields.get(b"pending") or 0
                lag = fields.get(b"lag") or 0
                self._shared_depth = int(pending) + int(lag)

    async def _write_loop(self) -> None:
        while True:
            await self._have_work.wait()
            self._have_work = trio.Event()
            while self._outbox or self._ready():
                await self._retrying("writing events", self._send_outbox)

    def _wake(self) -> None:
        self._have_work.set()

    def _ready(self) -> list[bytes]:
        """The acknowledgements whose steps' events and timers are all in Redis (one whose
        step's timer is not waits for the timers' task, which wakes the write loop)."""
        written, timed = self._written, self._timers.written
        return [entry for entry, put, timers in self._acks if put <= written and timers <= timed]

    async def _send_outbox(self) -> None:
        """One round trip: every event put so far (``XADD``), then the acknowledgements whose
        events' steps put nothing still unwritten (``XACK``) and the group's depth. An
        acknowledgement that must follow this round's events goes in the next round."""
        batch, self._outbox = self._outbox, []
        ready = self._ready()
        commands: list[list[Arg]] = [["XADD", self.stream, "*", _FIELD, d] for _, d in batch]
        if ready:
            commands.append(["XACK", self.stream, self.group, *ready])
            commands.append(["XINFO", "GROUPS", self.stream])
        try:
            replies = await self._call(commands)
        except BaseException:
            self._outbox[:0] = batch
            raise
        for reply in replies[: len(batch)]:
            if isinstance(reply, ReplyError):  # not written: put back, tried again
                self._outbox[:0] = batch
                raise reply
        if batch:
            self._written = batch[-1][0]
            self._shared_depth += len(batch)
            self._wrote.set()
            self._wrote = trio.Event()
        if ready:
            acked = set(ready)
            self._acks = [a for a in self._acks if a[0] not in acked]
            if isinstance(replies[-2], ReplyError):
                raise replies[-2]
            self._depth_from(replies[-1])

    async def _read_loop(self) -> None:
        try:
            while True:
                await self._until_room()
                if self._store is not None:
                    # While the store's round trips bring events (board), they read; a
                    # blocking read waits for new events only once they have gone quiet.
                    await self._quiet()
                count = self._room_left()
                if count <= 0:  # reads riding in round trips took it meanwhile
                    continue
                self._reading = True
                try:
                    reply = await self._retrying("reading events", self._read, count)
                finally:
                    self._reading = False
                if reply:
                    self._last_read = trio.current_time()
                    self._deliver(reply[0][1])
        finally:
            reader, self._reader = self._reader, None
            if reader is not None:
                await reader.aclose()

    async def _until_room(self) -> None:
        """Wait until this consumer may read more (see _room_left): an acknowledgement or a
        riding read landing sets ``_room``."""
        while self._room_left() <= 0:
            self._room = trio.Event()
            await self._room.wait()

    async def _quiet(self) -> None:
        while True:
            quiet = self._last_read + _QUIET - trio.current_time()
            if quiet <= 0:
                return
            await trio.sleep(quiet)

    def board(self) -> Command | None:
        """The read that rides along in the store's next round trip (after the events it
        writes, which so come back at once), unless the blocking read is waiting or a
        read is riding already (batches may be on their way two at a time): every read
        on its way counts against ``max_inflight`` until it lands (:meth:`alight`)."""
        room = self._room_left()
        room = min(room - room // 2, _RIDE_READ)  # half at most: the rest for claims
        if self._reading or self._riding or room <= 0 or self._running is None:
            return None
        self._riding = room
        self._reserved += room
        return [
            "XREADGROUP", "GROUP", self.group, self.consumer, "COUNT", room,
            "STREAMS", self.stream, ">",
        ]  # fmt: skip

    def alight(self, reply: Any) -> None:
        """The riding read's reply (None if it never came back)."""
        self._reserved -= self._riding
        self._riding = 0
        self._room.set()
        if isinstance(reply, ReplyError) or not reply or self._running is None:
            return  # an error reaches the blocking read too (NOGROUP: the group is made)
        self._last_read = trio.current_time()
        self._deliver(reply[0][1])

    def _room_left(self) -> int:
        """How many more events this consumer may read: ``max_inflight`` less those it
        holds and those reads on their way may bring."""
        return self.max_inflight - len(self._inflight) - self._reserved

    async def _read(self, count: int) -> Any:
        """One blocking ``XREADGROUP`` on the reader's own connection."""
        if self._reader is None or self._reader.closed:
            self._reader = await Connection.open(self.url)
        command: list[Arg] = [
            "XREADGROUP", "GROUP", self.group, self.consumer, "COUNT", count,
            "BLOCK", int(self.block * 1000), "STREAMS", self.stream, ">",
        ]  # fmt: skip
        (reply,) = await self._reader.call([command])
        if isinstance(reply, ReplyError):
            raise reply
        return reply

    def _deliver(self, entries: Any, *, claimed: bool = False) -> None:
        for identifier, fields in entries:
            if fields is None:  # trimmed away meanwhile
                continue
            try:
                if len(fields) == 2 and fields[0] == _FIELD:  # as this queue writes them
                    event = decode_event(fields[1])
                else:
                    event = decode_event(dict(zip(fields[::2], fields[1::2], strict=True))[_FIELD])
            except Exception:
                _log.exception("pipework: an unreadable event %r was dropped", identifier)
                self._acks.append((identifier, 0, 0))
                self._have_work.set()
                continue
            self._inflight[id(event)] = (event, identifier)
            if claimed:
                self._claimed.add(id(event))
            self._send.send_nowait(event)

    async def _claim_loop(self) -> None:
        while True:
            await trio.sleep(self.claim_idle / 3)
            await self._retrying("claiming events", self._claim)

    async def _claim(self) -> None:
        held = [identifier for _, identifier in self._inflight.values()]
        held += [identifier for _, identifier in self._started.values()]
        if held:  # still ours: not idle, whatever they wait for
            (reply,) = await self._call(
                [["XCLAIM", self.stream, self.group, self.consumer, 0, *held, "JUSTID"]]
            )
            if isinstance(reply, ReplyError):
                raise reply
        mine = set(held)
        start: bytes = b"0-0"
        idle = int(self.claim_idle * 1000)
        # Claims count toward max_inflight as reads do: a consumer with a full pool leaves
        # a dead one's events to the others (or to its next round) rather than taking them
        # all at once, to wait for its slots past their wait timeout.
        room = self._room_left()
        while room > 0:
            command: list[Arg] = [
                "XAUTOCLAIM", self.stream, self.group, self.consumer, idle, start,
                "COUNT", min(100, room),
            ]  # fmt: skip
            (reply,) = await self._call([command])
            if isinstance(reply, ReplyError):
                raise reply
            start, entries = reply[0], reply[1]
            claimed = [e for e in entries if e[0] not in mine]
            if claimed:
                _log.warning(
                    "pipework: claimed %d events left pending by a silent consumer", len(claimed)
                )
                self._deliver(claimed, claimed=True)
                room -= len(claimed)
            if start == b"0-0":
                return

    async def _retrying(self, what: str, fn: Any, *args: Any) -> Any:
        """Run one round trip; while Redis is away, log and try again (nothing accepted is
        dropped meanwhile: it waits in the outboxes)."""
        delay = 0.05
        while True:
            try:
                return await fn(*args)
            except (*UNREACHABLE, StoreUnavailable) as exc:
                # While Redis is away its outage says so, once: each retry is DEBUG.
                out = redis_outage(self.url).failed(exc, what)
                _log.log(
                    logging.DEBUG if out else logging.WARNING,
                    "pipework: %s on %s failed (%s); retrying in %gs",
                    what,
                    public_url(self.url),
                    exc,
                    delay,
                )
            except ReplyError as exc:
                if exc.code in NOT_NOW:
                    # A server that cannot take it yet (restarted and loading its AOF, a
                    # primary just made a replica): as if away. Raised, it stopped the
                    # engine and its process (found by the chaos harness).
                    _log.warning(
                        "pipework: %s on %s refused (%s); retrying in %gs",
                        what,
                        public_url(self.url),
                        exc,
                        delay,
                    )
                    await trio.sleep(delay)
                    delay = min(delay * 2, 2.0)
                    continue
                if exc.code != "NOGROUP":
                    raise
                # Redis came back without its data (no persistence): the stream and its
                # group are new, and what was in them is lost (docs/scaling.md).
                # Handled here; the outage before it was the ERROR.
                _log.warning(
                    "pipework: Redis came back without the event stream %s (what it held "
                    "is lost); recreating it",
                    self.stream,
                )
                await self._create_group()
                continue
            await trio.sleep(delay)
            delay = min(delay * 2, 2.0)
