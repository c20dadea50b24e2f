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
from types import TracebackType
from typing import Any

import trio

from .._errors import Overloaded, StoreUnavailable
from ..dispatcher._events import Event, Expire, Resume, RunJob
from ..dispatcher._queue import QueueStatistics
from ._queue_events import FIELD, encode_event
from ._queue_shared import SharedWrites
from ._relay import RedisRelay
from ._store import RedisJobStore
from ._timers import RedisTimers
from ._wire import (
    NOT_NOW,
    UNREACHABLE,
    Arg,
    Connection,
    ReplyError,
    encode_args,
    public_url,
    redis_outage,
)

__all__ = ["RedisEventQueue"]

_log = logging.getLogger("pipework.dispatcher")


class RedisEventQueue(SharedWrites):
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
            field=FIELD,
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
        commands: list[list[Arg]] = [["XADD", self.stream, "*", FIELD, d] for _, d in batch]
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
