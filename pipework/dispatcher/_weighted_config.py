"""The weighted pool's configuration: what each key may use (:class:`Weights`, with an
optional :class:`Adaptive` limit) and the whole pool (:class:`PoolConfig`).

Frozen values, validated when made, so a config that exists is one the pool can apply. A
module of its own because the registry, the admin API and the config file build and check
them without the admission state machine (``_weighted_core.py``) that applies them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from .._errors import PoolConfigError

__all__ = ["Adaptive", "PoolConfig", "PoolConfigError", "Weights"]


@dataclass(frozen=True, slots=True)
class Adaptive:
    """AIMD bounds for one key's adaptive limit (see docs/weighted-pool.md).

    Each success adds ``increase / limit`` (about ``increase`` per round of ``limit`` steps);
    a failure, a timeout, or recent latency above ``latency_tolerance`` times the baseline
    multiplies the limit by ``backoff``, at most once per typical latency. The limit stays in
    ``[min_limit, max_limit]``; ``max_limit=None`` means the static limit, else ``max_workers``.
    """

    min_limit: int = 1
    max_limit: int | None = None
    increase: float = 1.0
    backoff: float = 0.5
    latency_tolerance: float | None = 2.0

    def __post_init__(self) -> None:
        if self.min_limit < 1:
            raise PoolConfigError(f"adaptive min_limit must be at least 1, got {self.min_limit}")
        if self.max_limit is not None and self.max_limit < self.min_limit:
            raise PoolConfigError(
                f"adaptive max_limit {self.max_limit} is below min_limit {self.min_limit}"
            )
        if not self.increase > 0:
            raise PoolConfigError(f"adaptive increase must be above 0, got {self.increase}")
        if not 0 < self.backoff < 1:
            raise PoolConfigError(f"adaptive backoff must be in (0, 1), got {self.backoff}")
        if self.latency_tolerance is not None and not self.latency_tolerance > 1:
            raise PoolConfigError(
                f"adaptive latency_tolerance must be above 1 (or None), "
                f"got {self.latency_tolerance}"
            )


@dataclass(frozen=True, slots=True)
class Weights:
    """How one key may use the pool.

    ``reserve``: slots only this key may use. ``limit``: the most it may hold (``None``: no
    limit of its own; ``0``: paused, which keeps its reserve for when it resumes).
    ``max_waiting``: its queue bound. ``wait_timeout``: the longest a step waits (``None``:
    the pool's). ``adaptive``: an optional AIMD limit under ``limit``.
    """

    reserve: int = 0
    limit: int | None = None
    max_waiting: int = 1000
    wait_timeout: float | None = None
    adaptive: Adaptive | None = None

    def __post_init__(self) -> None:
        if self.reserve < 0:
            raise PoolConfigError(f"reserve must be 0 or more, got {self.reserve}")
        if self.limit is not None and self.limit < 0:
            raise PoolConfigError(f"limit must be 0 (paused) or more, got {self.limit}")
        if self.limit and self.reserve > self.limit:
            raise PoolConfigError(
                f"reserve {self.reserve} is above limit {self.limit}: the key could never use "
                "all of its reserve; lower the reserve or raise the limit"
            )
        if self.max_waiting < 0:
            raise PoolConfigError(f"max_waiting must be 0 or more, got {self.max_waiting}")
        if self.wait_timeout is not None and not self.wait_timeout > 0:
            raise PoolConfigError(f"wait_timeout must be above 0, got {self.wait_timeout}")


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """The whole pool: ``max_workers`` slots, ``keys`` with their weights, ``default`` for
    every other key, the pool ``wait_timeout`` and the starvation bound ``max_passed_over``.
    ``max_keys`` bounds the unnamed keys the pool remembers while they are idle (a tenant
    per caller must not grow it without bound; see docs/weighted-pool.md)."""

    max_workers: int = 64
    keys: Mapping[str, Weights] = field(default_factory=dict)
    default: Weights = Weights()
    wait_timeout: float | None = 10.0
    max_passed_over: int = 8
    max_keys: int = 10_000

    def __post_init__(self) -> None:
        # A private copy: the caller's dict changing later must not change a validated config.
        object.__setattr__(self, "keys", MappingProxyType(dict(self.keys)))
        if self.max_workers < 1:
            raise PoolConfigError(f"max_workers must be at least 1, got {self.max_workers}")
        reserved = sum(w.reserve for w in self.keys.values())
        if reserved > self.max_workers:
            parts = ", ".join(f"{k}={w.reserve}" for k, w in self.keys.items() if w.reserve)
            raise PoolConfigError(
                f"reserves add up to {reserved} ({parts}) but max_workers is "
                f"{self.max_workers}; lower a reserve or raise max_workers"
            )
        if self.default.reserve:
            raise PoolConfigError(
                f"default weights cannot reserve slots (got reserve={self.default.reserve}): "
                "they apply to every unnamed key; name the key to reserve for it"
            )
        if self.wait_timeout is not None and not self.wait_timeout > 0:
            raise PoolConfigError(f"wait_timeout must be above 0, got {self.wait_timeout}")
        if self.max_passed_over < 1:
            raise PoolConfigError(f"max_passed_over must be at least 1, got {self.max_passed_over}")
        if self.max_keys < 1:
            raise PoolConfigError(f"max_keys must be at least 1, got {self.max_keys}")

    @property
    def shared_pool(self) -> int:
        """Slots any key may use: ``max_workers`` minus every reserve."""
        return self.max_workers - sum(w.reserve for w in self.keys.values())

    def weights(self, key: str) -> Weights:
        return self.keys.get(key, self.default)

    def with_weights(self, key: str, weights: Weights) -> PoolConfig:
        """This config with ``key`` set to ``weights`` (validated again)."""
        return replace(self, keys={**self.keys, key: weights})
