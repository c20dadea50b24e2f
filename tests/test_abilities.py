"""What the engine finds its store, queue and pool can do, resolved once (_abilities.py)."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import trio

import pipework as pw
from pipework.dispatcher._abilities import Abilities, FastAdmission, ReportingPool
from pipework.dispatcher._probe import PROBE_KEY, probe_lane

from ._copying_store import CopyingJobStore


class PlainPool:
    """An Admission with nothing but the interface."""

    def __init__(self) -> None:
        self.slots = 0

    @asynccontextmanager
    async def _slot(self) -> AsyncIterator[None]:
        self.slots += 1
        yield

    def slot(
        self, key: str, *, deadline: float = math.inf, continuing: bool = False
    ) -> AbstractAsyncContextManager[None]:
        return self._slot()

    def record(self, key: str, *, ok: bool, latency: float) -> None:
        return None


def test_the_memory_parts_have_the_fast_paths_and_nothing_shared() -> None:
    abilities = Abilities.of(pw.MemoryJobStore(), pw.MemoryEventQueue(), pw.WeightedPool(2))
    assert abilities.nowait is not None
    assert abilities.shared_store is None
    assert abilities.shared_queue is None
    assert abilities.expire_at is None  # this process keeps its own timers
    assert not abilities.claims
    held = abilities.grant("k")
    assert held is not None
    abilities.release(held, 0.0, 1.0)
    assert not abilities.limited("k")


def test_a_store_handing_out_copies_is_awaited() -> None:
    abilities = Abilities.of(CopyingJobStore(), pw.MemoryEventQueue(), pw.WeightedPool(2))
    assert abilities.nowait is None
    assert abilities.shared_store is None


def test_a_plain_pool_grants_nothing_at_once_and_limits_every_key() -> None:
    abilities = Abilities.of(pw.MemoryJobStore(), pw.MemoryEventQueue(), PlainPool())
    assert abilities.grant("k") is None
    assert abilities.limited("k")


async def test_the_probe_lane_keeps_every_fast_ability_of_its_pool(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The lane forwarded the grant and the release but not the withdrawal, so a claimed
    slot given back unused counted a hold time (the pool's wait estimate) it never had."""
    pool = pw.WeightedPool(1)
    lane = probe_lane(pool)
    assert isinstance(lane, FastAdmission)
    abilities = Abilities.of(pw.MemoryJobStore(), pw.MemoryEventQueue(), lane)
    assert abilities.grant(PROBE_KEY) is None  # the probe takes its lane, never a slot
    used = abilities.grant("k")
    assert used is not None
    abilities.release(used, 0.0, 1.0)  # held one second: a sample
    unused = abilities.grant("k")
    assert unused is not None
    await trio.sleep(5)
    abilities.withdraw(unused)  # never used: no sample of five seconds
    stats = pool.statistics().keys["k"]
    assert stats.in_use == 0
    assert stats.mean_hold == 1.0


async def test_only_a_reporting_pool_gets_the_pool_families() -> None:
    """The metrics read the pool the engine resolved as reporting its keys once, by its
    fields; a pool with the plain interface alone gets no pool families (and no error)."""
    plain = pw.Engine(pool=PlainPool()).metrics.exposition().decode()
    assert "pipework_pool_in_use" not in plain
    assert "pipework_event_queue_depth 0.0" in plain  # the rest is there
    weighted = pw.Engine(pool=pw.WeightedPool(3)).metrics.exposition().decode()
    assert 'pipework_pool_reserve{key="default"} 0.0' in weighted
    assert "pipework_pool_max_workers 3.0" in weighted
    assert "pipework_pool_config_generation" in weighted
    assert "pipework_pool_shared_slots 3.0" in weighted
    assert isinstance(pw.WeightedPool(1), ReportingPool)
    assert not isinstance(PlainPool(), ReportingPool)
