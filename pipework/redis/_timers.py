"""Suspend timers that outlive the process that set them: a sorted set in Redis.

A suspended job's timeout is an :class:`~pipework.dispatcher._events.Expire` event due at a
deadline. On the memory queue it waits in the dispatcher's heap, and dies with the process;
on Redis it is a member of ``{prefix}:timers`` (the encoded event), scored by its deadline
on the wall clock. Every process runs :meth:`RedisTimers.run`: it wakes at the earliest
deadline it set itself, and at least every ``poll`` seconds for the others', and claims the
due ones with one script that moves each from the set onto the event stream (``XADD`` and
``ZREM`` in one atomic step). A timer so fires exactly once, on whichever process gets there
first, and a process that died leaves its timers to the others.

Deadlines are absolute trio times, and each process's trio clock has its own origin: a score
is the deadline plus this process's offset from the wall clock (measured once), as the job
store does, so a process's own timers fire exactly when its trio clock says (virtual time in
tests holds) and other processes' agree as far as the machines' wall clocks do.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import trio

from ._scripts import load
from ._wire import Arg, ReplyError

__all__ = ["RedisTimers"]

#: Moves every due timer onto the event stream, once.
_CLAIM: Final = load("timers_claim")


class RedisTimers:
    """The timers of the event queue on ``stream`` (its entries' field ``field``).

    ``add`` only touches memory (the dispatcher calls it from a step); :meth:`run` writes
    what was added and fires what is due, in ``call``'s round trips (the queue's: on its
    own connection or in the job store's), through ``retrying`` (which waits out a Redis
    that is away). :meth:`flush` waits until every timer added so far is in Redis;
    ``written`` is called each time more are (the queue acknowledges a step's event only
    once the timer it set is).
    """

    def __init__(
        self,
        call: Callable[[list[list[Arg]]], Awaitable[list[Any]]],
        *,
        prefix: str,
        stream: str,
        field: bytes,
        retrying: Callable[..., Awaitable[Any]],
        poll: float = 1.0,
        batch: int = 100,
        written: Callable[[], None] = lambda: None,
    ) -> None:
        if poll <= 0:
            raise ValueError(f"the timer poll interval must be positive, got {poll}")
        self._call = call
        self.key = f"{prefix}:timers"
        self.stream = stream
        self.field = field
        self.poll = poll
        self.batch = batch
        self._retrying = retrying
        self._on_written = written
        self._offset: float | None = None
        self._outbox: list[tuple[float, bytes]] = []
        self.added = 0  # timers added so far
        self.written = 0  # timers written to Redis so far
        self._wrote = trio.Event()
        self._wake = trio.Event()
        self._mine: list[float] = []  # deadlines set here: the loop wakes at the earliest
        self.fired = 0  # timers this process claimed

    def shift(self) -> float:
        """wall time = trio time + shift (measured once, see the module)."""
        if self._offset is None:
            self._offset = time.time() - trio.current_time()
        return self._offset

    def add(self, deadline: float, event: bytes) -> None:
        """Fire ``event`` (an encoded Expire) at ``deadline`` (trio time), once, anywhere."""
        # To the millisecond, rounded down: a score rounded up would not be due when its
        # deadline comes.
        self._outbox.append((math.floor((deadline + self.shift()) * 1000) / 1000, event))
        self.added += 1
        heapq.heappush(self._mine, deadline)
        self._wake.set()  # to write it now, and to wake by its deadline

    async def flush(self) -> None:
        """Wait until every timer added so far is in Redis."""
        target = self.added
        while self.written < target:
            await self._wrote.wait()

    async def run(self) -> None:
        """Write added timers and fire due ones until cancelled."""
        mine = self._mine
        next_poll = -math.inf
        while True:
            wake = self._wake = trio.Event()
            if self._outbox:
                await self._retrying("writing suspend timers", self._write)
            now = trio.current_time()
            if now >= next_poll or (mine and mine[0] <= now):
                while mine and mine[0] <= now:
                    heapq.heappop(mine)
                await self._retrying("firing suspend timers", self._claim, now)
                next_poll = now + self.poll
            if self._outbox:
                continue
            with trio.move_on_at(min(next_poll, mine[0] if mine else math.inf)):
                await wake.wait()

    async def _write(self) -> None:
        batch, self._outbox = self._outbox, []
        command: list[Arg] = ["ZADD", self.key]
        for score, event in batch:
            command += [repr(score), event]
        try:
            _answered(await self._call([command]))
        except BaseException:
            self._outbox[:0] = batch
            raise
        self.written += len(batch)
        self._wrote.set()
        self._wrote = trio.Event()
        self._on_written()

    async def _claim(self, now: float) -> None:
        score = repr(now + self.shift())
        args: list[Arg] = [2, self.key, self.stream, score, self.batch, self.field]
        while True:
            (reply,) = await self._call([["EVALSHA", _CLAIM.sha, *args]])
            if isinstance(reply, ReplyError) and reply.code == "NOSCRIPT":
                # A new or restarted server: the script goes along once (then it is cached).
                (reply,) = await self._call([["EVAL", _CLAIM.source, *args]])
            fired = int(_answered([reply]))
            self.fired += fired
            if fired < self.batch:
                return


def _answered(replies: list[Any]) -> Any:
    """The one reply, unless it is an error."""
    (reply,) = replies
    if isinstance(reply, ReplyError):
        raise reply
    return reply
