"""The event queue on a Redis Stream with a consumer group: every process that opens one on
the same server and prefix takes its share of the events, and a dead one's are claimed.

The queue's interface is synchronous where the dispatcher must not wait (``submit_nowait``,
``put_nowait``, ``ack``), so those only touch memory: events go to an outbox that a task
writes with ``XADD`` (a batch per round trip), and acknowledgements to one that a task sends
with ``XACK``. :meth:`flush` waits until every event put so far is in Redis; the engine calls
it before it answers a submission, so an accepted job's first event is never only in memory.

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
- **A dead consumer's steps.** A ``RunJob`` or ``Resume`` stops counting toward the depth
  when its step gets a worker slot (``ack``), but it is acknowledged in the group only when
  the step ends (``step_ended``); until then its consumer keeps it fresh. A process that
  dies during a step so leaves the event pending, another claims it, and the dispatcher,
  told the event was ``reclaimed``, runs the job again from its cursor: the pipe that was
  running when the process died runs again.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import socket
from types import TracebackType
from typing import Any, Final

import coredis
import coredis.exceptions
import msgpack
import trio

from .._errors import Overloaded
from ._events import BranchDone, Event, Expire, Resume, RunJob
from ._queue import QueueStatistics
from ._redis_store import _public

__all__ = ["RedisEventQueue", "decode_event", "encode_event"]

_log = logging.getLogger("pipework.dispatcher")

_FIELD: Final = b"e"


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
    data: bytes = msgpack.packb(wire, use_bin_type=True)
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
    before another consumer takes it. Use as an async context manager (an
    :class:`~pipework.Engine` given it does so).
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
    ) -> None:
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
        self._client: coredis.Redis[bytes] | None = None
        self._nursery: trio.Nursery | None = None
        self._outbox: list[tuple[int, bytes]] = []
        self._put = 0  # events put so far
        self._written = 0  # events written to Redis so far
        self._have_outbox = trio.Event()
        self._wrote = trio.Event()
        self._acks: list[bytes] = []
        self._have_acks = trio.Event()
        self._send, self._receive = trio.open_memory_channel[Event](math.inf)
        self._inflight: dict[int, tuple[Event, bytes]] = {}  # id(event) -> (event, entry id)
        self._started: dict[int, tuple[Event, bytes]] = {}  # steps running: not acked yet
        self._claimed: set[int] = set()  # ids of events taken over from a silent consumer
        self._room = trio.Event()
        self._shared_depth = 0
        self._accepted = 0
        self._refused = 0
        self._running: Any = None

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> RedisEventQueue:
        client: coredis.Redis[bytes] = coredis.Redis.from_url(self.url)
        await client.__aenter__()
        try:
            self._client = client
            await self._create_group()
            await self._refresh_depth()
            nursery_manager = trio.open_nursery()
            nursery = await nursery_manager.__aenter__()
        except BaseException:
            await client.__aexit__(None, None, None)
            raise
        self._running = (client, nursery_manager)
        self._nursery = nursery
        for task in (self._write_loop, self._read_loop, self._ack_loop, self._claim_loop):
            nursery.start_soon(task)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        client, nursery_manager = self._running
        assert self._nursery is not None
        # What the engine's last steps put and acknowledged is still sent, briefly.
        with trio.move_on_after(2, shield=True):
            await self.flush()
            await self._send_acks()
        self._nursery.cancel_scope.cancel()
        try:
            await nursery_manager.__aexit__(None, None, None)
        finally:
            self._running = self._nursery = self._client = None
            await client.__aexit__(None, None, None)

    async def _create_group(self) -> None:
        assert self._client is not None
        # Another process may have made the group first.
        with contextlib.suppress(coredis.exceptions.StreamDuplicateConsumerGroupError):
            await self._client.xgroup_create(self.stream, self.group, identifier="0", mkstream=True)

    # -- the EventQueue interface --------------------------------------------------------

    def submit_nowait(self, event: Event) -> None:
        depth = self._depth()
        if depth >= self.capacity:
            self._refused += 1
            raise Overloaded(
                f"the event queue is full ({depth} of {self.capacity} events waiting); "
                f"retry after {self.retry_after:g}s",
                reason="queue_full",
                retry_after=self.retry_after,
            )
        self.put_nowait(event)

    def put_nowait(self, event: Event) -> None:
        self._put += 1
        self._accepted += 1
        self._outbox.append((self._put, encode_event(event)))
        self._have_outbox.set()

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
        self._acks.append(held[1])
        self._have_acks.set()

    def step_ended(self, event: Event) -> None:
        """The step the event started has ended (finished, handed off, suspended, failed):
        acknowledge it in the group."""
        held = self._started.pop(id(event), None)
        self._claimed.discard(id(event))
        if held is not None:
            self._acks.append(held[1])
            self._have_acks.set()

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

    # -- the tasks -----------------------------------------------------------------------

    def _depth(self) -> int:
        return self._shared_depth + len(self._outbox)

    async def _refresh_depth(self) -> None:
        assert self._client is not None
        try:
            groups = await self._client.xinfo_groups(self.stream)
        except coredis.exceptions.ResponseError:
            return  # the stream is gone (Redis restarted empty): the reader recreates it
        for info in groups:
            if info.get(b"name") == self.group.encode():
                pending = info.get(b"pending") or 0
                lag = info.get(b"lag") or 0
                self._shared_depth = int(pending) + int(lag)

    async def _write_loop(self) -> None:
        while True:
            await self._have_outbox.wait()
            self._have_outbox = trio.Event()
            while self._outbox:
                batch, self._outbox = self._outbox, []
                await self._retrying("writing events", self._write, batch)

    async def _write(self, batch: list[tuple[int, bytes]]) -> None:
        assert self._client is not None
        async with self._client.pipeline(transaction=False) as pipe:
            for _, data in batch:
                pipe.xadd(self.stream, {_FIELD: data})
        self._written = batch[-1][0]
        self._shared_depth += len(batch)
        self._wrote.set()
        self._wrote = trio.Event()

    async def _read_loop(self) -> None:
        while True:
            while len(self._inflight) >= self.max_inflight:
                self._room = trio.Event()
                await self._room.wait()
            count = self.max_inflight - len(self._inflight)
            reply = await self._retrying("reading events", self._read, count)
            if reply:
                self._deliver(reply)

    async def _read(self, count: int) -> Any:
        assert self._client is not None
        reply = await self._client.xreadgroup(
            self.group,
            self.consumer,
            streams={self.stream: ">"},
            count=count,
            block=int(self.block * 1000),
        )
        return [] if not reply else reply.get(self.stream.encode(), ())

    def _deliver(self, entries: Any, *, claimed: bool = False) -> None:
        for entry in entries:
            if entry.field_values is None:  # trimmed away meanwhile
                continue
            try:
                event = decode_event(entry.field_values[_FIELD])
            except Exception:
                _log.exception("pipework: an unreadable event %r was dropped", entry.identifier)
                self._acks.append(entry.identifier)
                self._have_acks.set()
                continue
            self._inflight[id(event)] = (event, entry.identifier)
            if claimed:
                self._claimed.add(id(event))
            self._send.send_nowait(event)

    async def _ack_loop(self) -> None:
        while True:
            await self._have_acks.wait()
            self._have_acks = trio.Event()
            await self._retrying("acknowledging events", self._send_acks)

    async def _send_acks(self) -> None:
        if not self._acks or self._client is None:
            return
        # What a step put (a hand-off, a branch's end) is in Redis before the step's event
        # is acknowledged: a process dying in between leaves the event to be claimed.
        await self.flush()
        ids, self._acks = self._acks, []
        try:
            await self._client.xack(self.stream, self.group, ids)
        except BaseException:
            self._acks[:0] = ids
            raise
        await self._refresh_depth()

    async def _claim_loop(self) -> None:
        while True:
            await trio.sleep(self.claim_idle / 3)
            await self._retrying("claiming events", self._claim)

    async def _claim(self) -> None:
        assert self._client is not None
        held = [identifier for _, identifier in self._inflight.values()]
        held += [identifier for _, identifier in self._started.values()]
        if held:  # still ours: not idle, whatever they wait for
            await self._client.xclaim(self.stream, self.group, self.consumer, 0, held, justid=True)
        mine = set(held)
        start: Any = "0-0"
        idle = int(self.claim_idle * 1000)
        # Claims count toward max_inflight as reads do: a consumer with a full pool leaves
        # a dead one's events to the others (or to its next round) rather than taking them
        # all at once, to wait for its slots past their wait timeout.
        room = self.max_inflight - len(self._inflight)
        while room > 0:
            reply = await self._client.xautoclaim(
                self.stream, self.group, self.consumer, idle, start, count=min(100, room)
            )
            start, entries = reply[0], reply[1]
            claimed = [e for e in entries if e.identifier not in mine]
            if claimed:
                _log.warning(
                    "pipework: claimed %d events left pending by a silent consumer", len(claimed)
                )
                self._deliver(claimed, claimed=True)
                room -= len(claimed)
            if start in (b"0-0", "0-0"):
                return

    async def _retrying(self, what: str, fn: Any, *args: Any) -> Any:
        """Run one round trip; while Redis is away, log and try again (nothing accepted is
        dropped meanwhile: it waits in the outboxes)."""
        delay = 0.05
        while True:
            try:
                return await fn(*args)
            except (coredis.exceptions.ConnectionError, OSError) as exc:
                _log.warning(
                    "pipework: %s on %s failed (%s); retrying in %gs",
                    what,
                    _public(self.url),
                    exc,
                    delay,
                )
            except coredis.exceptions.StreamConsumerGroupError:
                # Redis came back without its data (no persistence): the stream and its
                # group are new, and what was in them is lost (docs/scaling.md).
                _log.error("pipework: the event stream %s was lost; recreating it", self.stream)
                await self._create_group()
                continue
            await trio.sleep(delay)
            delay = min(delay * 2, 2.0)
