"""Admission for the weighted worker pool, as a pure state machine: no I/O, no clock, no trio.

Every method takes the current time and returns what it decided, so the trio driver
(``_weighted.py``) only parks and wakes tasks, and the rules are tested step by step.

How slots are counted: a key *holds* slots; the first ``reserve`` it holds count as reserved,
any beyond as shared. The split is computed from the count, not tagged on each grant, so a key
always gives back a shared slot before a reserved one and a reserved slot is never held by
another key.

After every step (``tests/test_weighted_core.py`` checks it after each one):

* total in use <= ``max_workers``, shared use <= the shared pool, no key above its effective
  limit -- unless a reconfiguration or an adaptive cut lowered a bound below what was already
  admitted; admitted work is never revoked, so the overshoot is *debt* and only shrinks;
* no waiting head could take a free slot (grants are greedy). Hence no queue jumping: a
  newcomer is admitted at once only when its key has nobody waiting.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from types import MappingProxyType

from .._errors import PoolConfigError, Rejected

__all__ = [
    "Adaptive",
    "AdmissionCore",
    "KeyStatistics",
    "PoolConfig",
    "PoolConfigError",
    "PoolStatistics",
    "Ticket",
    "TicketState",
    "Weights",
]

_UNLIMITED = sys.maxsize
#: Retry-After for a paused key: an operator has to act, so a client should not spin.
PAUSED_RETRY_AFTER = 30.0
#: Retry-After when there are no hold times to predict from yet.
_FALLBACK_RETRY_AFTER = 1.0
_HOLD_ALPHA = 0.2  # hold-time EWMA: about the last ten holds
_FAST_ALPHA = 0.3  # adaptive: recent latency
_SLOW_ALPHA = 0.02  # adaptive: baseline latency, about the last fifty successes
_WARMUP = 10  # successes before latency can count as congestion


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

    def __init__(self, key: _Key, seq: int, now: float) -> None:
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


class _Key:
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
        self.effective = _UNLIMITED
        self.wait_timeout: float | None = None
        self.aimd: _Aimd | None = None
        self.held = 0
        self.queue: deque[Ticket] = deque()
        self.admitted = 0
        self.rejected = dict.fromkeys(Rejected.REASONS, 0)
        self.hold_avg: float | None = None


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


class AdmissionCore:
    """The admission decisions of a weighted pool; see the module docstring."""

    def __init__(self, config: PoolConfig) -> None:
        self._keys: dict[str, _Key] = {}
        self._queued: dict[_Key, None] = {}  # keys with waiters, as an ordered set
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

    # -- requests ---------------------------------------------------------------------------

    def acquire(
        self, key: str, now: float, *, deadline: float = math.inf, continuing: bool = False
    ) -> Ticket:
        """A granted ticket, or a waiting one; raises :class:`Rejected` if it cannot wait.

        ``continuing`` marks a step of work already accepted (a hand-off, a resume, a
        branch): it is never refused for a full queue, a pause or a predicted wait, and waits
        up to ``deadline`` whatever the wait timeout, since refusing it would drop accepted
        work; the bounds are for new work."""
        k = self._keys.get(key) or self._add_key(key)
        self._seq += 1
        ticket = Ticket(k, self._seq, now)
        # Nobody waits for this key, so no earlier waiter could take this slot (they would
        # have been granted already): taking it is not queue jumping.
        if not k.queue and self._fits(k):
            self._grant(k, ticket, now)
            return ticket
        if continuing:
            self._enqueue_continuing(k, ticket, now, deadline)
        else:
            self._enqueue(k, ticket, now, deadline)
        return ticket

    def grant_nowait(self, key: str) -> object | None:
        """Hold a slot under ``key`` if ``acquire`` would grant one at once, with no ticket;
        else None (nothing held, queued or refused: the caller then calls ``acquire``).
        Returns the handle :meth:`release_nowait` takes back."""
        k = self._keys.get(key) or self._add_key(key)
        if k.queue or not self._fits(k):
            return None
        self._take(k)
        return k

    def release_nowait(self, handle: object, granted_at: float, now: float) -> list[Ticket]:
        """Give back a slot :meth:`grant_nowait` granted at ``granted_at``; returns the
        waiters granted in its place."""
        assert isinstance(handle, _Key)
        self._hold_sample(handle, now - granted_at)
        return self._give_back(handle, now)

    def withdraw_nowait(self, handle: object, now: float) -> list[Ticket]:
        """Give back a slot :meth:`grant_nowait` granted that was never used (a new job's
        slot held while its record was written, see Dispatcher.hold_first): not a hold-time
        sample. Returns the waiters granted in its place."""
        assert isinstance(handle, _Key)
        return self._give_back(handle, now)

    def check_admission(self, key: str, now: float, *, deadline: float = math.inf) -> None:
        """Raise the :class:`Rejected` a new step under ``key`` would get now (paused, queue
        full, or a predicted wait past ``deadline``); return if it would be granted or queued.

        For work that is promised before it runs (an async job's 202): its admission is
        decided here, and its steps then ask with ``continuing=True``. Nothing is held."""
        k = self._keys.get(key) or self._add_key(key)
        if not k.queue and self._fits(k):
            return
        if k.weights.limit == 0:
            raise self._paused(k)
        position = len(k.queue) + 1
        if position > k.weights.max_waiting:
            raise self._reject(
                k,
                "queue_full",
                f"key {k.name!r} already has {len(k.queue)} waiting steps (its max_waiting); "
                "try again later, or raise its limit or max_waiting",
            )
        predicted = self._predict_wait(k, position)
        if predicted is not None and deadline - now < predicted:
            raise self._reject(
                k,
                "deadline",
                f"the job would have {deadline - now:.3g} s but a worker slot for key "
                f"{k.name!r} is predicted in about {predicted:.3g} s; try again later, or "
                "give the job more time or the key more workers",
                retry_after=predicted,
            )

    def release(self, ticket: Ticket, now: float) -> list[Ticket]:
        """Give a granted slot back; returns the waiters granted in its place."""
        if ticket.state is not TicketState.GRANTED:
            raise RuntimeError(f"cannot release {ticket!r}: it does not hold a slot")
        k = ticket._key
        self._hold_sample(k, now - ticket.granted_at)
        return self._free(k, ticket, now)

    @staticmethod
    def _hold_sample(k: _Key, hold: float) -> None:
        k.hold_avg = hold if k.hold_avg is None else k.hold_avg + _HOLD_ALPHA * (hold - k.hold_avg)

    def cancel(self, ticket: Ticket, now: float) -> list[Ticket]:
        """The requester went away: withdraw a waiter, or give back a grant it never used."""
        if ticket.state is TicketState.WAITING:
            # A non-eligible head leaving makes nobody eligible (its successor shares its key,
            # hence its eligibility), so there is nothing to dispatch.
            self._unqueue(ticket)
            ticket.state = TicketState.WITHDRAWN
            return []
        if ticket.state is TicketState.GRANTED:
            # Not a hold-time sample: the slot was never used.
            return self._free(ticket._key, ticket, now)
        return []

    def expire(self, ticket: Ticket, now: float) -> Rejected:
        """The waiter reached ``ticket.expires_at``: reject it with its expiry reason."""
        if ticket.state is not TicketState.WAITING:
            raise RuntimeError(f"cannot expire {ticket!r}: it is not waiting")
        self._unqueue(ticket)
        k = ticket._key
        waited = now - ticket.enqueued_at
        if ticket.expiry_reason == "deadline":
            message = f"no worker slot for key {k.name!r} before the job's deadline"
        else:
            message = f"no worker slot for key {k.name!r} within its wait timeout ({waited:.3g} s)"
        exc = self._reject(k, ticket.expiry_reason, self._state_note(k, message))
        ticket.state = TicketState.REJECTED
        ticket.rejection = exc
        return exc

    # -- outcomes and configuration ----------------------------------------------------------

    def record(self, key: str, now: float, *, ok: bool, latency: float) -> list[Ticket]:
        """Feed one outcome to the key's adaptive limit; returns the waiters it admits."""
        if not latency >= 0:
            raise ValueError(f"latency must be 0 or more seconds, got {latency}")
        k = self._keys.get(key)
        if k is None or k.aimd is None:
            return []
        a = k.aimd
        congested = not ok
        if ok:
            if a.fast is None:
                a.fast = a.slow = latency
            else:
                a.fast += _FAST_ALPHA * (latency - a.fast)
                a.slow += _SLOW_ALPHA * (latency - a.slow)
            a.samples += 1
            tol = a.spec.latency_tolerance
            congested = tol is not None and a.samples >= _WARMUP and a.fast > tol * a.slow
        if congested:
            # At most one cut per typical latency, as TCP cuts once per round trip: the
            # failures of one overload episode halve the limit once, not once each.
            if now - a.last_cut >= (a.fast if a.fast is not None else latency):
                a.limit = max(float(a.low), a.limit * a.spec.backoff)
                a.last_cut = now
        elif k.held * 2 >= a.limit:
            # Grow only while the limit is in use: idle time says nothing about capacity.
            a.limit = min(float(a.high), a.limit + a.spec.increase / a.limit)
        before = k.effective
        k.effective = _effective(k)
        if k.effective > before and k.queue:
            return self._dispatch(now)
        return []

    def limited(self, key: str) -> bool:
        """Whether ``key`` has a limit (static or adaptive; a pause is a limit of 0): only
        then must every piece of its work hold a slot of its own to be counted."""
        k = self._keys.get(key) or self._add_key(key)
        return k.weights.limit is not None or k.aimd is not None

    def adaptive(self, key: str) -> bool:
        """Whether ``key`` has an adaptive limit (only then does :meth:`record` do anything)."""
        k = self._keys.get(key)
        return k is not None and k.aimd is not None

    def reconfigure(self, config: PoolConfig, now: float) -> list[Ticket]:
        """Swap ``config`` in; returns the waiters it settles (granted, or rejected if their
        key is now paused and they are new work: a step of accepted work waits the pause
        out, up to its deadline). Admitted work is never revoked."""
        self._apply(config)
        settled: list[Ticket] = []
        for k in list(self._queued):
            if k.weights.limit == 0:
                for ticket in [t for t in k.queue if not t.continuing]:
                    self._unqueue(ticket)
                    ticket.state = TicketState.REJECTED
                    ticket.rejection = self._paused(k)
                    settled.append(ticket)
        settled += self._dispatch(now)
        return settled

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
                effective_limit=None if k.effective == _UNLIMITED else k.effective,
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

    # -- internals ---------------------------------------------------------------------------

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

    def _add_key(self, name: str) -> _Key:
        if len(self._keys) >= self._forget_at:
            self._forget()
        k = _Key(name)
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

    def _set_weights(self, k: _Key) -> None:
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
        k.effective = _effective(k)

    def _fits(self, k: _Key) -> bool:
        held = k.held
        if held >= k.effective or self._in_use >= self._max_workers:
            return False
        return held < k.reserve or self._shared_in_use < self._shared_pool

    def _grant(self, k: _Key, ticket: Ticket, now: float) -> None:
        self._take(k)
        ticket.state = TicketState.GRANTED
        ticket.granted_at = now

    def _take(self, k: _Key) -> None:
        if k.held >= k.reserve:
            self._shared_in_use += 1
        k.held += 1
        k.admitted += 1
        self._in_use += 1

    def _free(self, k: _Key, ticket: Ticket, now: float) -> list[Ticket]:
        ticket.state = TicketState.RELEASED
        return self._give_back(k, now)

    def _give_back(self, k: _Key, now: float) -> list[Ticket]:
        k.held -= 1
        self._in_use -= 1
        if k.held >= k.reserve:
            self._shared_in_use -= 1
        return self._dispatch(now) if self._waiting else []

    def _enqueue(self, k: _Key, ticket: Ticket, now: float, deadline: float) -> None:
        if k.weights.limit == 0:
            raise self._paused(k)
        position = len(k.queue) + 1
        if position > k.weights.max_waiting:
            raise self._reject(
                k,
                "queue_full",
                f"key {k.name!r} already has {len(k.queue)} waiting steps (its max_waiting); "
                "try again later, or raise its limit or max_waiting",
            )
        if deadline <= now:
            raise self._reject(
                k,
                "deadline",
                f"the job's deadline passed before key {k.name!r} could have a worker slot",
            )
        predicted = self._predict_wait(k, position)
        if predicted is not None and deadline - now < predicted:
            raise self._reject(
                k,
                "deadline",
                f"the job has {deadline - now:.3g} s left but a worker slot for key {k.name!r} "
                f"is predicted in about {predicted:.3g} s; give the job more time or the key "
                "more workers",
                retry_after=predicted,
            )
        if k.wait_timeout is not None:
            ticket.expires_at = now + k.wait_timeout
        if deadline <= ticket.expires_at:
            ticket.expires_at = deadline
            ticket.expiry_reason = "deadline"
        if not k.queue:
            self._queued[k] = None
        k.queue.append(ticket)
        self._waiting += 1

    def _enqueue_continuing(self, k: _Key, ticket: Ticket, now: float, deadline: float) -> None:
        ticket.continuing = True
        if deadline <= now:
            raise self._reject(
                k,
                "deadline",
                f"the job's deadline passed before key {k.name!r} could have a worker slot",
            )
        ticket.expires_at = deadline
        ticket.expiry_reason = "deadline"
        if not k.queue:
            self._queued[k] = None
        k.queue.append(ticket)
        self._waiting += 1

    def _unqueue(self, ticket: Ticket) -> None:
        k = ticket._key
        if k.queue[0] is ticket:
            k.queue.popleft()
        else:
            k.queue.remove(ticket)  # O(queue length), bounded by max_waiting
        if not k.queue:
            del self._queued[k]
        self._waiting -= 1

    def _dispatch(self, now: float) -> list[Ticket]:
        granted: list[Ticket] = []
        # Reserved capacity first: only its owner may use it, so serving it passes nobody over.
        if self._shared_pool < self._max_workers:
            for k in list(self._queued):
                while (
                    k.queue
                    and k.held < k.reserve
                    and k.held < k.effective
                    and self._in_use < self._max_workers
                ):
                    granted.append(self._grant_head(k, now))
        # Shared capacity: max-min fair -- least shared use first, then longest waiting -- but
        # a head passed over max_passed_over times goes first, in the order it got there.
        bound = self._config.max_passed_over
        while self._in_use < self._max_workers and self._shared_in_use < self._shared_pool:
            if len(self._queued) == 1:  # the common case: one key waits, nobody to rank
                k = next(iter(self._queued))
                if k.held >= k.effective:
                    break
                granted.append(self._grant_head(k, now))
                continue
            chosen: _Key | None = None
            best: tuple[int, int, int] = (2, 0, 0)
            eligible: list[Ticket] = []
            for k in self._queued:
                if k.held >= k.effective:
                    continue  # at its limit: skipped, so it never blocks another key
                head = k.queue[0]
                eligible.append(head)
                rank = (
                    (0, head._starved, 0)
                    if head._starved >= 0
                    else (1, k.held - k.reserve, head.seq)
                )
                if rank < best:
                    best, chosen = rank, k
            if chosen is None:
                break
            ticket = self._grant_head(chosen, now)
            for head in eligible:
                if head is not ticket:
                    head.passed_over += 1
                    if head.passed_over >= bound and head._starved < 0:
                        head._starved = self._starve_seq
                        self._starve_seq += 1
            granted.append(ticket)
        return granted

    def _grant_head(self, k: _Key, now: float) -> Ticket:
        ticket = k.queue.popleft()
        if not k.queue:
            del self._queued[k]
        self._waiting -= 1
        self._grant(k, ticket, now)
        return ticket

    def _predict_wait(self, k: _Key, position: int) -> float | None:
        # Optimistic on purpose (as if the key had every slot it may use): an early
        # rejection has to be likely right, and the wait stays bounded by the deadline anyway.
        if k.hold_avg is None:
            return None
        lanes = min(k.effective, k.reserve + self._shared_pool, self._max_workers)
        return position * k.hold_avg / max(lanes, 1)

    def _reject(
        self, k: _Key, reason: str, message: str, retry_after: float | None = None
    ) -> Rejected:
        k.rejected[reason] += 1
        if retry_after is None:
            retry_after = self._predict_wait(k, max(len(k.queue), 1))
        if retry_after is None:
            retry_after = _FALLBACK_RETRY_AFTER
        return Rejected(message, key=k.name, reason=reason, retry_after=retry_after)

    def _paused(self, k: _Key) -> Rejected:
        return self._reject(
            k,
            "paused",
            f"key {k.name!r} is paused (limit = 0); set its limit above 0 to resume it",
            retry_after=PAUSED_RETRY_AFTER,
        )

    def _state_note(self, k: _Key, message: str) -> str:
        limit = "no limit" if k.effective == _UNLIMITED else f"limit {k.effective}"
        return (
            f"{message}: it holds {k.held} ({limit}, reserve {k.reserve}), {len(k.queue)} "
            f"still wait, pool {self._in_use}/{self._max_workers} in use; raise the key's "
            "limit or wait_timeout, or add workers"
        )


def _effective(k: _Key) -> int:
    static = k.weights.limit if k.weights.limit is not None else _UNLIMITED
    return static if k.aimd is None else min(static, int(k.aimd.limit))
