"""Reading the event stream: the blocking read, the reads riding in the job store's round
trips, and claiming a silent consumer's events.

A part of :class:`~._queue.RedisEventQueue` (a base it is made of), in a module of its own
so the queue reads in one sitting: what comes in and how much this consumer may hold
(``max_inflight``), apart from what it writes and acknowledges.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

import trio

from ..dispatcher._events import Event
from ._queue_events import FIELD, decode_event
from ._store import RedisJobStore
from ._wire import Arg, Command, Connection, ReplyError

__all__ = ["QueueReads"]

_log = logging.getLogger("pipework.dispatcher")

#: How long after the last events a store's round trips brought the blocking read
#: resumes (a process whose store is busy reads in its round trips).
_QUIET: Final = 0.01

#: How many entries a read riding in a store's round trip takes at most: no more than half
#: the room left, the rest is for create_and_claim's reads meanwhile.
_RIDE_READ: Final = 64


class QueueReads:
    """The queue's reads: :meth:`board` and :meth:`alight` (the store's rider), the read and
    claim loops, and delivering what they bring."""

    # Made by RedisEventQueue.__init__.
    url: str
    group: str
    consumer: str
    stream: str
    claim_idle: float
    max_inflight: int
    block: float
    _store: RedisJobStore | None
    _reader: Connection | None
    _reading: bool
    _riding: int
    _reserved: int
    _last_read: float
    _running: Any
    _acks: list[tuple[bytes, int, int]]
    _have_work: trio.Event
    _send: trio.MemorySendChannel[Event]
    _inflight: dict[int, tuple[Event, bytes]]
    _started: dict[int, tuple[Event, bytes]]
    _claimed: set[int]
    _room: trio.Event
    # RedisEventQueue's: one round trip, and one retried while Redis is away.
    _call: Callable[[list[list[Arg]]], Awaitable[list[Any]]]
    _retrying: Callable[..., Awaitable[Any]]

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
                if len(fields) == 2 and fields[0] == FIELD:  # as this queue writes them
                    event = decode_event(fields[1])
                else:
                    event = decode_event(dict(zip(fields[::2], fields[1::2], strict=True))[FIELD])
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
