"""The weighted pool's books: the keys it knows (what each holds, who waits under it, its
hold times and adaptive limit), one :class:`Ticket` per request for a slot, the pool-wide
counts, the config applied to them, and the statistics read from them. No I/O, no clock,
no trio.

The admission decisions (``_weighted_core.py``: who is granted, who waits, who is refused,
who goes next) read and change these books; they are kept apart so that the rules read on
their own, above the accounting they rely on. How slots are counted (held, reserved,
shared) is described there.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from enum import Enum
from types import MappingProxyType

from .._errors import Rejected
from ._weighted_config import Adaptive, PoolConfig, Weights
from ._weighted_statistics import KeyStatistics, PoolStatistics

__all__ = ["UNLIMITED", "KeyState", "Ledger", "Ticket", "TicketState", "effective_limit_of"]

UNLIMITED = sys.maxsize


class TicketState(Enum):
    WAITING = "waiting"
    GRANTED = "granted"
    RELEASED = "released"
    WITHDRAWN = "withdrawn"
    REJECTED = "rejected"


class Ticket:
    """One request for a slot: granted at once, or waiting until granted or rejected.

    ``tag`` is the driver's: the trio driver keeps the waiting task there.
    """

    __slots__ = (
        "_key",
        "_starved",
        "continuing",
        "enqueued_at",
        "expires_at",
        "expiry_reason",
        "granted_at",
        "key",
        "passed_over",
        "rejection",
        "seq",
        "state",
        "tag",
    )

    def __init__(self, key: KeyState, seq: int, now: float) -> None:
        self._key = key
        self.key = key.name
        self.seq = seq
        self.state = TicketState.WAITING
        self.enqueued_at = now
        self.granted_at = now
        self.expires_at = math.inf
        self.expiry_reason = "wait_timeout"
        #: A step of accepted work (see ``acquire``): a pause never refuses it.
        self.continuing = False
        self.passed_over = 0
        self._starved = -1  # order in which it hit the passed-over bound; -1: not yet
        self.rejection: Rejected | None = None
        self.tag: object = None

    @property
    def granted(self) -> bool:
        return self.state is TicketState.GRANTED

    def __repr__(self) -> str:
        return f"<Ticket {self.key!r} #{self.seq} {self.state.value}>"


class _Aimd:
    __slots__ = ("fast", "high", "last_cut", "limit", "low", "samples", "slow", "spec")

    def __init__(self, spec: Adaptive, low: int, high: int) -> None:
        self.spec = spec
        self.low = low
        self.high = high
        self.limit = float(high)  # start open; trouble shrinks it
        self.fast: float | None = None
        self.slow = 0.0
        self.samples = 0
        self.last_cut = -math.inf


class KeyState:
    """One key's books: its weights as applied, what it holds, who waits under it, its counts,
    its hold-time average and its adaptive limit."""

    __slots__ = (
        "admitted",
        "aimd",
        "configured",
        "effective",
        "held",
        "hold_avg",
        "name",
        "queue",
        "rejected",
        "reserve",
        "wait_timeout",
        "weights",
    )

    def __init__(self, name: str) -> None:
        self.name = name
        self.weights = Weights()
        self.configured = False
        self.reserve = 0
        self.effective = UNLIMITED
        self.wait_timeout: float | None = None
        self.aimd: _Aimd | None = None
        self.held = 0
        self.queue: deque[Ticket] = deque()
        self.admitted = 0
        self.rejected = dict.fromkeys(Rejected.REASONS, 0)
        self.hold_avg: float | None = None


class Ledger:
    """The state of a weighted pool and its bookkeeping;
    :class:`~._weighted_core.AdmissionCore` adds the decisions."""

    def __init__(self, config: PoolConfig) -> None:
        self._keys: dict[str, KeyState] = {}
        self._queued: dict[KeyState, None] = {}  # keys with waiters, as an ordered set
        self._in_use = 0
        self._shared_in_use = 0
        self._waiting = 0
        self._seq = 0
        self._starve_seq = 0
        self._generation = 0
        self._config = config
        #: Unnamed idle keys are forgotten when this many keys are known (see _forget).
        self._forget_at = config.max_keys
        self._forgotten = 0
        self._forgotten_admitted = 0
        self._forgotten_rejected = dict.fromkeys(Rejected.REASONS, 0)
        self._apply(config)

    @property
    def config(self) -> PoolConfig:
        return self._config

    @property
    def config_generation(self) -> int:
        return self._generation

    def statistics(self, now: float) -> PoolStatistics:
        keys: dict[str, KeyStatistics] = {}
        rejected = dict(self._forgotten_rejected)
        for k in self._keys.values():
            reserved = min(k.held, k.reserve)
            for reason, n in k.rejected.items():
                rejected[reason] += n
            keys[k.name] = KeyStatistics(
                key=k.name,
                configured=k.configured,
                reserve=k.reserve,
                limit=k.weights.limit,
                effective_limit=None if k.effective == UNLIMITED else k.effective,
                adaptive_limit=None if k.aimd is None else k.aimd.limit,
                in_use_reserved=reserved,
                in_use_shared=k.held - reserved,
                waiting=len(k.queue),
                oldest_wait=now - k.queue[0].enqueued_at if k.queue else 0.0,
                admitted=k.admitted,
                rejected=MappingProxyType(dict(k.rejected)),
                debt=max(0, k.held - k.effective),
                mean_hold=k.hold_avg,
            )
        cfg = self._config
        return PoolStatistics(
            max_workers=cfg.max_workers,
            shared_pool=self._shared_pool,
            reserved=cfg.max_workers - self._shared_pool,
            in_use=self._in_use,
            in_use_shared=self._shared_in_use,
            waiting=self._waiting,
            admitted=self._forgotten_admitted + sum(k.admitted for k in self._keys.values()),
            rejected=MappingProxyType(rejected),
            debt=max(0, self._in_use - cfg.max_workers),
            shared_debt=max(0, self._shared_in_use - self._shared_pool),
            config_generation=self._generation,
            keys=MappingProxyType(keys),
            keys_forgotten=self._forgotten,
            forgotten_admitted=self._forgotten_admitted,
            forgotten_rejected=MappingProxyType(dict(self._forgotten_rejected)),
        )

    # -- keeping the books ----------------------------------------------------------------

    def _apply(self, config: PoolConfig) -> None:
        self._config = config
        self._forget_at = config.max_keys
        self._max_workers = config.max_workers
        self._shared_pool = config.shared_pool
        # Every known key's weights (and whether it is named) first: a sweep while the
        # named keys are added must see which keys the new config names.
        for k in self._keys.values():
            self._set_weights(k)
        for name in config.keys:
            if name not in self._keys:
                self._add_key(name)
        self._shared_in_use = sum(max(0, k.held - k.reserve) for k in self._keys.values())
        self._generation += 1

    def _add_key(self, name: str) -> KeyState:
        if len(self._keys) >= self._forget_at:
            self._forget()
        k = KeyState(name)
        self._keys[name] = k
        self._set_weights(k)
        return k

    def _forget(self) -> None:
        """Drop every unnamed key that holds nothing and has nobody waiting: a key per
        tenant (a route's pool key) would otherwise stay for ever, one per caller ever seen.
        Such a key is what a new one is, but for its hold-time average, its adaptive limit
        and its counts (kept in the pool's totals): it starts from the default weights
        again when next seen. Keys in use are kept, so the next sweep waits until twice as
        many are known: the sweeps cost O(1) per key added, whatever is busy."""
        forgotten = [k for k in self._keys.values() if not (k.held or k.queue or k.configured)]
        for k in forgotten:
            del self._keys[k.name]
            self._forgotten_admitted += k.admitted
            for reason, n in k.rejected.items():
                self._forgotten_rejected[reason] += n
        self._forgotten += len(forgotten)
        self._forget_at = max(self._config.max_keys, 2 * len(self._keys))

    def _set_weights(self, k: KeyState) -> None:
        cfg = self._config
        w = cfg.weights(k.name)
        k.weights = w
        k.configured = k.name in cfg.keys
        k.reserve = w.reserve
        k.wait_timeout = w.wait_timeout if w.wait_timeout is not None else cfg.wait_timeout
        if w.adaptive is None:
            k.aimd = None
        else:
            high = w.adaptive.max_limit
            if high is None:
                high = w.limit if w.limit is not None else cfg.max_workers
            high = max(high, w.adaptive.min_limit)
            old = k.aimd
            k.aimd = _Aimd(w.adaptive, w.adaptive.min_limit, high)
            if old is not None:  # keep what was learnt, within the new bounds
                k.aimd.limit = min(float(high), max(float(k.aimd.low), old.limit))
                k.aimd.fast, k.aimd.slow, k.aimd.samples = old.fast, old.slow, old.samples
                k.aimd.last_cut = old.last_cut
        k.effective = effective_limit_of(k)

    def _fits(self, k: KeyState) -> bool:
        held = k.held
        if held >= k.effective or self._in_use >= self._max_workers:
            return False
        return held < k.reserve or self._shared_in_use < self._shared_pool

    def _grant(self, k: KeyState, ticket: Ticket, now: float) -> None:
        self._take(k)
        ticket.state = TicketState.GRANTED
        ticket.granted_at = now

    def _take(self, k: KeyState) -> None:
        if k.held >= k.reserve:
            self._shared_in_use += 1
        k.held += 1
        k.admitted += 1
        self._in_use += 1


def effective_limit_of(k: KeyState) -> int:
    """The most ``k`` may hold now: its static limit, or its adaptive one below it."""
    static = k.weights.limit if k.weights.limit is not None else UNLIMITED
    return static if k.aimd is None else min(static, int(k.aimd.limit))
