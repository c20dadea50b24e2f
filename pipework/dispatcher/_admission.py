"""How the dispatcher asks for a worker slot.

The dispatcher knows one thing about capacity: ``async with admission.slot(key,
deadline=...)``. Entering waits for a slot under ``key`` (or raises
:class:`~pipework.Rejected` with a reason); leaving gives it back. Being cancelled while
waiting withdraws the waiter. Anything with that shape can govern the engine; the one pipework
ships is :class:`~pipework.WeightedPool`.
"""

from __future__ import annotations

import math
from contextlib import AbstractAsyncContextManager
from typing import Protocol

__all__ = ["Admission"]


class Admission(Protocol):
    """What the dispatcher needs from a worker pool."""

    def slot(
        self, key: str, *, deadline: float = math.inf, continuing: bool = False
    ) -> AbstractAsyncContextManager[None]:
        """Hold one worker slot under ``key`` for the body of the ``async with``.
        ``continuing``: the step continues an accepted job, which must not be refused for
        load (only its deadline bounds the wait)."""
        ...

    def record(self, key: str, *, ok: bool, latency: float) -> None:
        """How a pipe run under ``key`` went (feeds adaptive limits); called inside the slot."""
        ...
