"""The hosts of a service and how a call picks one: sans-IO, no clock (the time is passed
in), randomness only from the ``random.Random`` given.

Each :class:`Host` carries what the balancers read -- calls outstanding, a latency
estimate -- and what the other cores keep on it (health, ejection, drain). The estimate is
Finagle's *peak EWMA*: a sample above the current estimate replaces it at once (a host
turning slow is seen on its first slow answer), a lower one is blended in with the weight
``1 - exp(-Δt / τ)`` of the time since the last sample, and between samples the estimate
decays toward zero with the same ``τ`` (10 s), so a host left alone for being slow is
tried again after a while rather than never. A try stopped without its answer because
another try of its call answered first gives a *lower bound* (:meth:`Host.observe_at_least`):
it raises the estimate as a slower answer would, and never lowers it.

Three balancers choose among the hosts they are given (the caller has already left out
those that may not serve, see ``_hosts_core``):

* ``p2c`` (the default): two distinct candidates drawn with probability proportional to
  weight; the second is taken only if its cost is strictly lower, where
  ``cost = latency * (1 + outstanding / weight)`` -- Finagle's ``latency * (outstanding + 1)``
  for hosts of weight 1, and a heavier host counted as less loaded by the same number of
  calls. With equal costs the first candidate wins, so among equal hosts the long-run share
  of each is exactly its share of the weight (in expectation);
* ``round_robin``: nginx's smooth weighted round robin -- every pick adds each candidate's
  weight to its counter, takes the highest counter and lowers it by the candidates' total
  weight. Over every run of Σweight picks among the same hosts each host is picked exactly
  ``weight`` times, spread out rather than in bursts;
* ``random``: a draw with probability proportional to weight.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Final, Protocol

from ._resilience_spec import Balance, HostSpec

__all__ = [
    "DECAY_TIME",
    "P2C",
    "Balancer",
    "Host",
    "RandomBalancer",
    "RoundRobin",
    "make_balancer",
]

#: τ of the peak EWMA, in seconds (Finagle's default decay time).
DECAY_TIME: Final = 10.0
#: The least latency a cost is computed with: a host whose estimate decayed to nothing still
#: counts its outstanding calls.
_FLOOR: Final = 1e-9


class Host:
    """One host of a service and its live state. ``tag`` is the driver's (its connection
    pool, say); every other attribute is the cores' to change and the driver's to read."""

    __slots__ = (
        "consecutive_5xx",
        "consecutive_gateway",
        "consecutive_local",
        "draining",
        "ejected_until",
        "ejection_multiplier",
        "ejections",
        "ewma",
        "failures",
        "health_failed",
        "health_passed",
        "healthy",
        "on_probation",
        "outstanding",
        "requests",
        "returned_at",
        "rr_current",
        "spec",
        "stamp",
        "tag",
    )

    def __init__(self, spec: HostSpec) -> None:
        self.spec = spec
        self.tag: object = None
        # load
        self.outstanding = 0
        self.requests = 0
        self.failures = 0
        self.ewma: float | None = None
        self.stamp = 0.0
        self.rr_current = 0
        # active health (see _outlier_core.apply_check)
        self.healthy = True
        self.on_probation = True
        self.health_passed = 0
        self.health_failed = 0
        # passive outlier detection (see _outlier_core.OutlierDetector)
        self.consecutive_5xx = 0
        self.consecutive_gateway = 0
        self.consecutive_local = 0
        self.ejected_until: float | None = None
        self.ejection_multiplier = 0
        self.ejections = 0
        self.returned_at = -math.inf  # when its last ejection ended
        # operator
        self.draining = False

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def weight(self) -> int:
        return self.spec.weight

    @property
    def ejected(self) -> bool:
        return self.ejected_until is not None

    @property
    def available(self) -> bool:
        """May take new calls: healthy, not ejected, not draining."""
        return self.healthy and self.ejected_until is None and not self.draining

    def latency(self, now: float) -> float | None:
        """The latency estimate at ``now`` (None before the first sample)."""
        if self.ewma is None:
            return None
        return self.ewma * math.exp(-max(now - self.stamp, 0.0) / DECAY_TIME)

    def observe(self, now: float, latency: float) -> None:
        """Fold one latency sample (seconds) into the peak EWMA."""
        current = self.latency(now)
        if current is None or latency > current:
            self.ewma = latency  # the peak: a slow answer counts in full at once
        else:
            w = math.exp(-max(now - self.stamp, 0.0) / DECAY_TIME)
            self.ewma = current + latency * (1.0 - w)
        self.stamp = now

    def observe_at_least(self, now: float, latency: float) -> None:
        """Fold in a lower bound: a try stopped after ``latency`` seconds without its answer
        (another try answered first). Above the estimate it counts as a slower answer would,
        in full; below, it changes nothing -- blended in, it would pull the estimate down
        with a time the host never answered in."""
        current = self.latency(now)
        if current is None or latency > current:
            self.ewma = latency
            self.stamp = now

    def cost(self, now: float, fallback: float) -> float:
        """What p2c compares: the latency (``fallback`` before any sample) scaled by the
        calls outstanding per unit of weight."""
        latency = self.latency(now)
        base = fallback if latency is None else latency
        return max(base, _FLOOR) * (1.0 + self.outstanding / self.spec.weight)

    def __repr__(self) -> str:
        return f"<Host {self.url} weight={self.weight} outstanding={self.outstanding}>"


class Balancer(Protocol):
    name: Balance

    def choose(self, candidates: Sequence[Host], now: float) -> Host:
        """One of ``candidates`` (never empty)."""
        ...


def _weighted(candidates: Sequence[Host], rng: random.Random) -> int:
    """An index into ``candidates`` drawn with probability proportional to weight."""
    total = sum(h.spec.weight for h in candidates)
    point = rng.random() * total
    for i, host in enumerate(candidates):
        point -= host.spec.weight
        if point < 0:
            return i
    return len(candidates) - 1  # rounding at the very top


class P2C:
    """Power of two choices over the peak-EWMA cost (see the module docstring)."""

    name: Balance = "p2c"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def choose(self, candidates: Sequence[Host], now: float) -> Host:
        if len(candidates) == 1:
            return candidates[0]
        i = _weighted(candidates, self.rng)
        rest = [h for j, h in enumerate(candidates) if j != i]
        first, second = candidates[i], rest[_weighted(rest, self.rng)]
        fallback = _fallback_latency(candidates, now)
        if second.cost(now, fallback) < first.cost(now, fallback):
            return second
        return first


def _fallback_latency(hosts: Sequence[Host], now: float) -> float:
    """A host without a sample yet is taken to be as fast as the others' mean."""
    known = [x for h in hosts if (x := h.latency(now)) is not None]
    return sum(known) / len(known) if known else 1.0


class RoundRobin:
    """nginx's smooth weighted round robin (see the module docstring)."""

    name: Balance = "round_robin"

    def choose(self, candidates: Sequence[Host], now: float) -> Host:
        total = 0
        best = candidates[0]
        for host in candidates:
            host.rr_current += host.spec.weight
            total += host.spec.weight
            if host.rr_current > best.rr_current:
                best = host
        best.rr_current -= total
        return best


class RandomBalancer:
    """A weighted random draw."""

    name: Balance = "random"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def choose(self, candidates: Sequence[Host], now: float) -> Host:
        return candidates[_weighted(candidates, self.rng)]


def make_balancer(balance: Balance, rng: random.Random) -> Balancer:
    if balance == "round_robin":
        return RoundRobin()
    if balance == "random":
        return RandomBalancer(rng)
    return P2C(rng)
