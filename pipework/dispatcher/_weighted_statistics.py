"""What the weighted pool reports: one frozen snapshot of the pool
(:class:`PoolStatistics`) with one per key (:class:`KeyStatistics`).

Values only, made by ``_weighted_ledger.py`` from its books; a module of their own because
the pool's callers (its trio driver, the metrics, the admin API) read them without the state
machine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["KeyStatistics", "PoolStatistics"]


@dataclass(frozen=True, slots=True)
class KeyStatistics:
    """One key at one moment; ``debt`` is how far it holds above its effective limit."""

    key: str
    configured: bool
    reserve: int
    limit: int | None
    effective_limit: int | None
    adaptive_limit: float | None
    in_use_reserved: int
    in_use_shared: int
    waiting: int
    oldest_wait: float
    admitted: int
    rejected: Mapping[str, int]
    debt: int
    mean_hold: float | None

    @property
    def in_use(self) -> int:
        return self.in_use_reserved + self.in_use_shared


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    """The whole pool at one moment, with every key seen so far in ``keys``."""

    max_workers: int
    shared_pool: int
    reserved: int
    in_use: int
    in_use_shared: int
    waiting: int
    admitted: int
    rejected: Mapping[str, int]
    debt: int
    shared_debt: int
    config_generation: int
    keys: Mapping[str, KeyStatistics]
    #: Unnamed keys forgotten while idle (``PoolConfig.max_keys``), and what they had been
    #: granted and refused: counted in ``admitted`` and ``rejected`` above, no longer in
    #: ``keys``, so the pool's totals never go down.
    keys_forgotten: int = 0
    forgotten_admitted: int = 0
    forgotten_rejected: Mapping[str, int] = field(default_factory=dict)
