"""How the dispatcher asks for a worker slot.

The dispatcher knows one thing about capacity: ``async with admission.slot(key,
deadline=...)``. Entering waits for a slot under ``key`` (or raises
:class:`~pipework.Rejected` with a reason); leaving gives it back. Being cancelled while
waiting withdraws the waiter. Anything with that shape can govern the engine: the weighted
pool does, and :class:`GlobalLimit` is the simplest one (one limit for every key).
"""

from __future__ import annotations

import math
from contextlib import AbstractAsyncContextManager
from typing import Protocol

import trio

from .._errors import Rejected

__all__ = ["Admission", "GlobalLimit"]


class Admission(Protocol):
    """What the dispatcher needs from a worker pool."""

    def slot(self, key: str, *, deadline: float = math.inf) -> AbstractAsyncContextManager[None]:
        """Hold one worker slot under ``key`` for the body of the ``async with``."""
        ...

    def record(self, key: str, *, ok: bool, latency: float) -> None:
        """How a pipe run under ``key`` went (feeds adaptive limits); called inside the slot."""
        ...


class GlobalLimit:
    """At most ``max_workers`` slots in use, whatever the key; at most ``max_waiting`` waiters.

    A waiter is refused with ``queue_full`` when ``max_waiting`` are already waiting, and with
    ``deadline`` when ``deadline`` passes before it is admitted.
    """

    def __init__(self, max_workers: int = 64, *, max_waiting: int = 10_000) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        self._limiter = trio.CapacityLimiter(max_workers)
        self._max_waiting = max_waiting
        self._waiting = 0

    @property
    def max_workers(self) -> int:
        return int(self._limiter.total_tokens)

    @property
    def in_use(self) -> int:
        return self._limiter.borrowed_tokens

    @property
    def waiting(self) -> int:
        return self._waiting

    def slot(self, key: str, *, deadline: float = math.inf) -> AbstractAsyncContextManager[None]:
        return _Slot(self, key, deadline)

    def record(self, key: str, *, ok: bool, latency: float) -> None:
        """A global limit does not adapt."""


class _Slot:
    """One holder's slot: a plain class, not a generator, because it is on every step."""

    __slots__ = ("_deadline", "_key", "_limit", "_token")

    def __init__(self, limit: GlobalLimit, key: str, deadline: float) -> None:
        self._limit = limit
        self._key = key
        self._deadline = deadline
        # A token object per holder: CapacityLimiter refuses one borrower holding two slots.
        self._token = object()

    async def __aenter__(self) -> None:
        limit = self._limit
        try:
            # No checkpoint on the fast path: a cancellation landing after the grant would
            # leak the slot, and the step that follows checkpoints anyway.
            limit._limiter.acquire_on_behalf_of_nowait(self._token)
        except trio.WouldBlock:
            await self._wait(limit)

    async def _wait(self, limit: GlobalLimit) -> None:
        if limit._waiting >= limit._max_waiting:
            raise Rejected(
                f"worker pool is full and {limit._waiting} steps already wait; try again later",
                key=self._key,
                reason="queue_full",
            )
        limit._waiting += 1
        try:
            if self._deadline == math.inf:
                await limit._limiter.acquire_on_behalf_of(self._token)
                return
            with trio.move_on_at(self._deadline) as scope:
                await limit._limiter.acquire_on_behalf_of(self._token)
        finally:
            limit._waiting -= 1
        if scope.cancelled_caught:
            raise Rejected(
                f"no worker slot for key {self._key!r} before the job's deadline",
                key=self._key,
                reason="deadline",
            )

    async def __aexit__(self, *exc_info: object) -> None:
        self._limit._limiter.release_on_behalf_of(self._token)
