"""How the dispatcher asks for a worker slot.

The dispatcher knows one thing about capacity: ``async with admission.slot(key,
deadline=...)``. Entering waits for a slot under ``key`` (or raises
:class:`~pipework.Rejected` with a reason); leaving gives it back. Being cancelled while
waiting withdraws the waiter. Anything with that shape can govern the engine: the weighted
pool does, and :class:`GlobalLimit` is the simplest one (one limit for every key).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Protocol

import trio

from .._errors import Rejected

__all__ = ["Admission", "GlobalLimit"]


class Admission(Protocol):
    """What the dispatcher needs from a worker pool."""

    def slot(self, key: str, *, deadline: float = math.inf) -> AbstractAsyncContextManager[None]:
        """Hold one worker slot under ``key`` for the body of the ``async with``."""
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
        return self._slot(key, deadline)

    @asynccontextmanager
    async def _slot(self, key: str, deadline: float) -> AsyncIterator[None]:
        # A token object per holder: CapacityLimiter refuses one borrower holding two slots.
        token = object()
        try:
            self._limiter.acquire_on_behalf_of_nowait(token)
        except trio.WouldBlock:
            if self._waiting >= self._max_waiting:
                raise Rejected(
                    f"worker pool is full and {self._waiting} steps already wait; try again later",
                    key=key,
                    reason="queue_full",
                ) from None
            self._waiting += 1
            try:
                with trio.move_on_at(deadline) as scope:
                    await self._limiter.acquire_on_behalf_of(token)
            finally:
                self._waiting -= 1
            if scope.cancelled_caught:
                raise Rejected(
                    f"no worker slot for key {key!r} before the job's deadline",
                    key=key,
                    reason="deadline",
                ) from None
        try:
            yield
        finally:
            self._limiter.release_on_behalf_of(token)
