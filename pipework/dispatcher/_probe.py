"""The engine's readiness probe, as the dispatcher sees it: the probe's own chain
(:data:`PROBE_CHAIN`, in a plan no reload replaces) and the lane of one slot its steps take
(:data:`PROBE_KEY`) in front of the pool.

Apart from the engine (``_engine.py``, whose ``Engine.probe`` submits the probe job) because
the lane is a pool of its own the dispatcher is handed: what it passes to the pool and what
it keeps for the probe reads on its own.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Final

import trio

from ..pipes._catalogue import Catalogue
from ..pipes._pipe import Context, Pipe
from ._abilities import FastAdmission
from ._admission import Admission

__all__ = ["PROBE_CHAIN", "PROBE_KEY", "internal_registry", "probe_lane"]

#: The engine's own chain that :meth:`Engine.probe` runs (in plan 0, not in any registry).
PROBE_CHAIN: Final = "_pipework_canary"
#: The probe's admission key: a lane of one slot of its own, outside the pool's keys, so
#: traffic can never starve readiness (see :class:`_ProbeLane`).
PROBE_KEY: Final = "_pipework_probe"


def internal_registry() -> Catalogue:
    """The engine's own plan: the probe chain, whose one pipe runs under :data:`PROBE_KEY`."""
    registry = Catalogue()

    async def probe(ctx: Context) -> None:
        ctx.state["ok"] = True

    registry.add_pipe(Pipe(probe, PROBE_CHAIN))
    registry.chain(PROBE_CHAIN, PROBE_CHAIN, key=PROBE_KEY)
    return registry


class _ProbeLane:
    """The pool as the dispatcher sees it: ``pool`` for every key but :data:`PROBE_KEY`,
    whose steps take a lane of one slot of their own. Readiness so proves the queue and a
    worker without competing with traffic for the pool's slots (a busy pool is not an
    unready one), and no pool config or reload can take that slot away."""

    def __init__(self, pool: Admission) -> None:
        self.pool = pool
        self._lane: trio.Lock | None = None

    def slot(
        self, key: str, *, deadline: float = math.inf, continuing: bool = False
    ) -> AbstractAsyncContextManager[None]:
        if key == PROBE_KEY:
            return self._probe_slot()
        return self.pool.slot(key, deadline=deadline, continuing=continuing)

    @asynccontextmanager
    async def _probe_slot(self) -> AsyncIterator[None]:
        if self._lane is None:
            self._lane = trio.Lock()
        async with self._lane:  # the probe's deadline is enforced by Engine.probe
            yield

    def record(self, key: str, *, ok: bool, latency: float) -> None:
        if key != PROBE_KEY:
            self.pool.record(key, ok=ok, latency=latency)


class _FastProbeLane(_ProbeLane):
    """The lane over a pool with an uncontended grant (every method of
    :class:`~._abilities.FastAdmission`, each the pool's but the probe's key's grant, which
    never comes: its steps take the lane)."""

    def __init__(self, pool: Admission, fast: FastAdmission) -> None:
        super().__init__(pool)
        self.fast = fast

    def grant_nowait(self, key: str) -> object | None:
        return None if key == PROBE_KEY else self.fast.grant_nowait(key)

    def release_nowait(self, handle: object, granted_at: float, now: float) -> None:
        self.fast.release_nowait(handle, granted_at, now)

    def withdraw_nowait(self, handle: object) -> None:
        self.fast.withdraw_nowait(handle)

    def limited(self, key: str) -> bool:
        return self.fast.limited(key)


def probe_lane(pool: Admission) -> _ProbeLane:
    if isinstance(pool, FastAdmission):
        return _FastProbeLane(pool, pool)
    return _ProbeLane(pool)
