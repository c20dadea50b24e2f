"""The weighted pool's admission core, driven step by step without trio (as h11 tests its
state machine): plain examples first, then a hypothesis state machine that checks every
invariant after every step."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pipework import Adaptive, PoolConfig, PoolConfigError, Rejected, Weights
from pipework.dispatcher._weighted_core import PAUSED_RETRY_AFTER, AdmissionCore
from pipework.dispatcher._weighted_ledger import Ticket, TicketState


def core(max_workers: int = 4, **keys: Weights) -> AdmissionCore:
    return AdmissionCore(PoolConfig(max_workers=max_workers, keys=keys, wait_timeout=5.0))


def granted(c: AdmissionCore, key: str, now: float = 0.0) -> Ticket:
    ticket = c.acquire(key, now)
    assert ticket.granted, ticket
    return ticket


def waiting(c: AdmissionCore, key: str, now: float = 0.0, deadline: float = math.inf) -> Ticket:
    ticket = c.acquire(key, now, deadline=deadline)
    assert ticket.state is TicketState.WAITING, ticket
    return ticket


def rejected(c: AdmissionCore, key: str, now: float = 0.0, deadline: float = math.inf) -> Rejected:
    with pytest.raises(Rejected) as info:
        c.acquire(key, now, deadline=deadline)
    return info.value


# -- configuration ---------------------------------------------------------------------------


def test_reserves_above_max_workers_are_refused_naming_the_numbers() -> None:
    with pytest.raises(PoolConfigError, match=r"add up to 10 \(a=6, b=4\).*max_workers is 8"):
        PoolConfig(max_workers=8, keys={"a": Weights(reserve=6), "b": Weights(reserve=4)})
    assert issubclass(PoolConfigError, ValueError)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: Weights(reserve=-1), "reserve must be 0 or more"),
        (lambda: Weights(limit=-1), "limit must be 0"),
        (lambda: Weights(reserve=3, limit=2), "reserve 3 is above limit 2"),
        (lambda: Weights(wait_timeout=0), "wait_timeout must be above 0"),
        (lambda: Adaptive(min_limit=0), "min_limit must be at least 1"),
        (lambda: Adaptive(min_limit=3, max_limit=2), "below min_limit"),
        (lambda: Adaptive(backoff=1.0), r"backoff must be in \(0, 1\)"),
        (lambda: Adaptive(increase=0), "increase must be above 0"),
        (lambda: Adaptive(latency_tolerance=1.0), "latency_tolerance must be above 1"),
        (lambda: Weights(max_waiting=-1), "max_waiting must be 0 or more"),
        (lambda: PoolConfig(wait_timeout=-1.0), "wait_timeout must be above 0"),
        (lambda: PoolConfig(max_passed_over=0), "max_passed_over must be at least 1"),
        (lambda: PoolConfig(default=Weights(reserve=1)), "default weights cannot reserve"),
        (lambda: PoolConfig(max_workers=0), "max_workers must be at least 1"),
    ],
)
def test_invalid_settings_are_refused(build: Any, match: str) -> None:
    with pytest.raises(PoolConfigError, match=match):
        build()


def test_paused_key_keeps_its_reserve() -> None:
    config = PoolConfig(max_workers=4, keys={"a": Weights(reserve=2, limit=0)})
    assert config.shared_pool == 2


def test_config_is_a_private_copy() -> None:
    keys = {"a": Weights(reserve=1)}
    config = PoolConfig(max_workers=2, keys=keys)
    keys["b"] = Weights(reserve=5)
    assert "b" not in config.keys
    assert config.with_weights("b", Weights(limit=1)).keys["b"] == Weights(limit=1)


# -- admission -------------------------------------------------------------------------------


def test_reserved_slots_then_shared_then_wait() -> None:
    c = core(4, a=Weights(reserve=2))
    for _ in range(4):
        granted(c, "a")
    waiting(c, "a")
    stats = c.statistics(0.0).keys["a"]
    assert (stats.in_use_reserved, stats.in_use_shared, stats.waiting) == (2, 2, 1)


def test_reserved_slot_is_only_for_its_owner() -> None:
    c = core(3, a=Weights(reserve=2))
    granted(c, "b")
    waiting(c, "b")  # two slots are free, but both are a's
    granted(c, "a")
    granted(c, "a")


def test_waiters_are_fifo_per_key() -> None:
    c = core(1)
    holder = granted(c, "a")
    first, second = waiting(c, "a"), waiting(c, "a")
    assert c.release(holder, 1.0) == [first]
    assert c.release(first, 2.0) == [second]


def test_a_freed_slot_goes_to_the_waiter_not_a_newcomer() -> None:
    c = core(1)
    holder = granted(c, "a")
    waiter = waiting(c, "b")
    assert c.release(holder, 1.0) == [waiter]
    waiting(c, "c", 1.0)


def test_a_key_at_its_limit_does_not_block_other_keys() -> None:
    c = core(4, a=Weights(limit=1))
    granted(c, "a")
    blocked = waiting(c, "a")
    granted(c, "b")
    granted(c, "b")
    assert blocked.state is TicketState.WAITING


def test_shared_slot_goes_to_the_key_with_least_shared_use() -> None:
    c = core(4)
    a1, a2, _, _ = granted(c, "a"), granted(c, "a"), granted(c, "a"), granted(c, "b")
    from_a = waiting(c, "a")
    from_b = waiting(c, "b")  # arrived later, but b uses less of the shared pool
    assert c.release(a1, 1.0) == [from_b]
    assert c.release(a2, 2.0) == [from_a]


def test_ties_in_shared_use_go_to_the_longest_waiting() -> None:
    c = core(3)
    _, _, c1 = granted(c, "a"), granted(c, "b"), granted(c, "c")
    from_b, from_a = waiting(c, "b"), waiting(c, "a")
    assert c.release(c1, 1.0) == [from_b]  # a and b hold one each: b has waited longer
    assert from_a.state is TicketState.WAITING


def test_a_head_waiter_is_passed_over_at_most_the_bound() -> None:
    c = AdmissionCore(PoolConfig(max_workers=4, max_passed_over=3, wait_timeout=None))
    hogs = [granted(c, "hog") for _ in range(3)]
    light = granted(c, "light")
    starving = waiting(c, "hog")
    now = 0.0
    for _ in range(3):  # each time a light slot frees, a new light waiter is preferred
        newcomer = waiting(c, "light", now)
        assert c.release(light, now) == [newcomer]
        light = newcomer
        now += 1.0
    assert starving.passed_over == 3
    rival = waiting(c, "light", now)
    assert c.release(light, now) == [starving]
    assert rival.state is TicketState.WAITING
    del hogs


def test_hold_times_predict_the_wait_and_refuse_a_short_deadline() -> None:
    c = core(1)
    for t in range(5):
        c.release(granted(c, "a", float(t)), t + 1.0)  # every hold lasts one second
    holder = granted(c, "a", 10.0)
    error = rejected(c, "a", 10.0, deadline=10.5)
    assert (error.reason, error.key) == ("deadline", "a")
    assert error.retry_after == pytest.approx(1.0)
    assert "predicted in about 1 s" in str(error)
    waiting(c, "a", 10.0, deadline=11.5)
    del holder


def test_no_prediction_without_history() -> None:
    c = core(1)
    granted(c, "a")
    ticket = waiting(c, "a", 0.0, deadline=0.1)
    assert (ticket.expires_at, ticket.expiry_reason) == (0.1, "deadline")
    assert rejected(c, "a", 1.0, deadline=1.0).reason == "deadline"  # nothing left at all


def test_queue_full_and_paused_rejections() -> None:
    c = core(1, a=Weights(max_waiting=1), p=Weights(limit=0))
    granted(c, "a")
    waiting(c, "a")
    error = rejected(c, "a")
    assert (error.reason, error.http_status) == ("queue_full", 503)
    paused = rejected(c, "p")
    assert (paused.reason, paused.retry_after) == ("paused", PAUSED_RETRY_AFTER)
    counts = c.statistics(0.0).rejected
    assert (counts["queue_full"], counts["paused"]) == (1, 1)


def test_expiry_rejects_with_its_reason_and_counts_it() -> None:
    c = core(1, a=Weights(wait_timeout=2.0))
    granted(c, "a")
    by_timeout = waiting(c, "a", 0.0)
    by_deadline = waiting(c, "a", 0.0, deadline=1.0)
    assert (by_timeout.expires_at, by_timeout.expiry_reason) == (2.0, "wait_timeout")
    assert c.expire(by_deadline, 1.0).reason == "deadline"
    error = c.expire(by_timeout, 2.0)
    assert error.reason == "wait_timeout"
    assert "within its wait timeout (2 s)" in str(error)
    assert by_timeout.rejection is error
    stats = c.statistics(2.0).keys["a"]
    assert (stats.waiting, stats.rejected["wait_timeout"], stats.rejected["deadline"]) == (0, 1, 1)
    with pytest.raises(RuntimeError, match="not waiting"):
        c.expire(by_timeout, 3.0)


def test_an_uncontended_grant_given_back_unused_is_no_hold_sample() -> None:
    c = core(1)
    used = c.grant_nowait("a")
    assert used is not None
    c.release_nowait(used, 0.0, 1.0)  # held one second: a sample
    unused = c.grant_nowait("a")
    assert unused is not None
    assert c.grant_nowait("a") is None  # the one slot is held
    waiter = waiting(c, "a")
    assert c.withdraw_nowait(unused, 5.0) == [waiter]  # given back: the waiter has it
    assert c.statistics(5.0).keys["a"].mean_hold == 1.0  # and no sample of five seconds


def test_cancel_withdraws_a_waiter_or_frees_an_unused_grant() -> None:
    c = core(1)
    holder = granted(c, "a")
    gone, next_one = waiting(c, "a"), waiting(c, "a")
    assert c.cancel(gone, 0.5) == []
    assert c.release(holder, 1.0) == [next_one]
    assert c.cancel(next_one, 1.0) == []  # granted, never used: given back
    assert c.statistics(1.0).in_use == 0
    assert c.statistics(1.0).keys["a"].mean_hold == 1.0  # the unused grant is no sample
    with pytest.raises(RuntimeError, match="does not hold a slot"):
        c.release(next_one, 2.0)
    assert c.cancel(next_one, 2.0) == []  # already given back: nothing to do


def test_the_worked_example_in_the_docs() -> None:
    keys = {
        "users": Weights(reserve=3),
        "search": Weights(reserve=2, limit=4),
        "reports": Weights(limit=2),
    }
    c = AdmissionCore(PoolConfig(max_workers=10, keys=keys))
    users = [granted(c, "users", 0.0) for _ in range(6)]
    reports = [granted(c, "reports", 1.0) for _ in range(2)]
    reports_head = waiting(c, "reports", 1.0)
    for _ in range(2):
        granted(c, "search", 2.0)
    search_head, misc = waiting(c, "search", 2.0), waiting(c, "misc", 2.0)
    stats = c.statistics(2.0)
    assert (stats.in_use, stats.in_use_shared, stats.waiting) == (10, 5, 3)
    assert c.release(users[0], 3.0) == [search_head]  # ties with misc, but waited longer
    assert c.release(reports[0], 4.0) == [misc]  # misc holds no shared slot, reports one
    assert reports_head.passed_over == 1


# -- reconfiguration -------------------------------------------------------------------------


def test_shrinking_a_limit_revokes_nothing_and_reports_debt() -> None:
    c = core(3)
    held = [granted(c, "a") for _ in range(3)]
    blocked = waiting(c, "a")
    assert c.reconfigure(c.config.with_weights("a", Weights(limit=1)), 1.0) == []
    stats = c.statistics(1.0)
    assert (stats.keys["a"].in_use, stats.keys["a"].debt, stats.config_generation) == (3, 2, 2)
    assert c.release(held[0], 2.0) == []
    assert c.release(held[1], 2.0) == []
    assert c.release(held[2], 2.0) == [blocked]


def test_raising_a_limit_grants_waiters_at_once() -> None:
    c = core(4, a=Weights(limit=1))
    granted(c, "a")
    w1, w2 = waiting(c, "a"), waiting(c, "a")
    assert c.reconfigure(c.config.with_weights("a", Weights(limit=3)), 1.0) == [w1, w2]


def test_shrinking_max_workers_leaves_pool_debt_until_drained() -> None:
    c = core(4, a=Weights(reserve=2))
    held = [granted(c, "b") for _ in range(2)]
    c.reconfigure(PoolConfig(max_workers=2, keys={"a": Weights(reserve=1)}), 1.0)
    stats = c.statistics(1.0)
    assert (stats.in_use, stats.debt, stats.shared_pool, stats.shared_debt) == (2, 0, 1, 1)
    reserved_wait = waiting(c, "a", 1.0)  # its reserve is free but the pool is full
    assert c.release(held[0], 2.0) == [reserved_wait]


def test_pausing_rejects_waiters_and_unpausing_admits_again() -> None:
    c = core(1)
    holder = granted(c, "a")
    w = waiting(c, "a")
    settled = c.reconfigure(c.config.with_weights("a", Weights(limit=0)), 1.0)
    assert settled == [w]
    assert w.rejection is not None
    assert w.rejection.reason == "paused"
    assert rejected(c, "a", 1.0).reason == "paused"
    c.release(holder, 2.0)  # admitted before the pause: never revoked
    c.reconfigure(c.config.with_weights("a", Weights()), 3.0)
    granted(c, "a", 3.0)


def test_a_pause_rejects_new_waiters_but_not_steps_of_accepted_work() -> None:
    c = core(1)
    holder = granted(c, "a")
    new = waiting(c, "a")
    accepted = c.acquire("a", 0.0, deadline=100.0, continuing=True)
    settled = c.reconfigure(c.config.with_weights("a", Weights(limit=0)), 1.0)
    assert settled == [new]
    assert accepted.state is TicketState.WAITING  # waits the pause out, up to its deadline
    c.release(holder, 2.0)
    assert accepted.state is TicketState.WAITING  # a paused key grants nothing
    settled = c.reconfigure(c.config.with_weights("a", Weights()), 3.0)
    assert settled == [accepted]
    assert _state(accepted) is TicketState.GRANTED


def _state(ticket: Ticket) -> TicketState:
    """Read afresh (the type checker keeps what an earlier assert narrowed it to)."""
    return ticket.state


def test_removing_a_key_falls_back_to_the_default() -> None:
    c = core(4, a=Weights(reserve=2, limit=2))
    c.reconfigure(PoolConfig(max_workers=4, default=Weights(limit=1)), 1.0)
    stats = c.statistics(1.0).keys["a"]
    assert (stats.configured, stats.reserve, stats.limit) == (False, 0, 1)


# -- adaptive limit --------------------------------------------------------------------------


def test_failures_halve_the_adaptive_limit_once_per_latency() -> None:
    spec = Adaptive(min_limit=2, max_limit=16)
    c = core(32, a=Weights(limit=10, adaptive=spec))
    assert c.statistics(0.0).keys["a"].effective_limit == 10  # min(static, adaptive)
    c.record("a", 0.0, ok=True, latency=0.1)
    c.record("a", 1.0, ok=False, latency=0.1)
    c.record("a", 1.05, ok=False, latency=0.1)  # same episode: no second cut
    assert c.statistics(1.05).keys["a"].adaptive_limit == 8.0
    for t in range(2, 6):
        c.record("a", float(t), ok=False, latency=0.1)
    stats = c.statistics(6.0).keys["a"]
    assert (stats.adaptive_limit, stats.effective_limit) == (2.0, 2)  # floored at min_limit


def test_successes_grow_the_adaptive_limit_only_while_it_is_used() -> None:
    c = core(32, a=Weights(adaptive=Adaptive(max_limit=8, latency_tolerance=None)))
    c.record("a", 0.0, ok=False, latency=0.1)
    assert c.statistics(0.0).keys["a"].effective_limit == 4
    for _ in range(20):
        c.record("a", 1.0, ok=True, latency=0.1)  # idle: says nothing about capacity
    assert c.statistics(1.0).keys["a"].effective_limit == 4
    for _ in range(4):
        granted(c, "a")
    blocked = waiting(c, "a")
    woken: list[Ticket] = []
    for _ in range(5):  # about one slot per round of `limit` successes: 4 -> 5.12
        woken += c.record("a", 1.0, ok=True, latency=0.1)
    assert woken == [blocked]
    assert c.statistics(1.0).keys["a"].effective_limit == 5


def test_rising_latency_counts_as_congestion() -> None:
    c = core(32, a=Weights(adaptive=Adaptive(max_limit=16, latency_tolerance=2.0)))
    now = 0.0
    for _ in range(20):
        c.record("a", now, ok=True, latency=0.1)
        now += 0.1
    assert c.statistics(now).keys["a"].adaptive_limit == 16.0
    c.record("a", now, ok=True, latency=1.0)  # ten times slower than the baseline
    assert c.statistics(now).keys["a"].effective_limit == 8
    for _ in range(4):  # and it stays slow, one latency apart: a cut each time
        now += 1.0
        c.record("a", now, ok=True, latency=1.0)
    assert c.statistics(now).keys["a"].effective_limit == 1


def test_reconfigure_keeps_what_the_adaptive_limit_learnt() -> None:
    c = core(32, a=Weights(adaptive=Adaptive(max_limit=16)))
    c.record("a", 0.0, ok=False, latency=0.1)
    c.reconfigure(c.config.with_weights("a", Weights(adaptive=Adaptive(max_limit=4))), 1.0)
    assert c.statistics(1.0).keys["a"].adaptive_limit == 4.0
    with pytest.raises(ValueError, match="latency must be"):
        c.record("a", 1.0, ok=True, latency=-1.0)


# -- property test ---------------------------------------------------------------------------

KEYS = ("a", "b", "c", "d")  # "d" is never named: it always runs on the default weights
BOUND = 2


def _weights(
    reserve: int, limit: int | None, max_waiting: int, wait: float | None, adaptive: Adaptive | None
) -> Weights:
    if limit and limit < reserve:
        limit = reserve
    return Weights(reserve, limit, max_waiting, wait, adaptive)


# Built once at import: building strategies inside a composite dominated the run time.
_ADAPTIVE = st.none() | st.builds(
    Adaptive,
    min_limit=st.integers(1, 2),
    max_limit=st.none() | st.integers(2, 4),
    latency_tolerance=st.none() | st.just(1.5),
)
_LIMIT = st.none() | st.integers(0, 4)
_WAIT = st.none() | st.sampled_from([0.5, 2.0])
WEIGHTS = st.builds(_weights, st.integers(0, 2), _LIMIT, st.integers(0, 3), _WAIT, _ADAPTIVE)
DEFAULTS = st.builds(_weights, st.just(0), _LIMIT, st.integers(0, 3), _WAIT, _ADAPTIVE)
CONFIGS = st.fixed_dictionaries(
    {
        "max_workers": st.integers(1, 6),
        "keys": st.dictionaries(st.sampled_from(KEYS[:3]), WEIGHTS, max_size=3),
        "default": DEFAULTS,
        "wait_timeout": st.none() | st.sampled_from([1.0, 3.0]),
        "max_passed_over": st.just(BOUND),
        # Small bounds: idle unnamed keys are forgotten (and found again) within a run.
        "max_keys": st.integers(1, 4),
    }
)


class AdmissionMachine(RuleBasedStateMachine):
    """Random acquire / release / cancel / expire / record / reconfigure sequences."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.held: list[Ticket] = []
        self.waiting: list[Ticket] = []
        self.generation = 1

    @initialize(raw=CONFIGS)
    def start(self, raw: dict[str, Any]) -> None:
        try:
            config = PoolConfig(**raw)
        except PoolConfigError:
            assume(False)
            raise
        self.core = AdmissionCore(config)
        self.remember(config)

    def remember(self, config: PoolConfig) -> None:
        """What the next step may not exceed where a bound is already exceeded (debt)."""
        stats = self.core.statistics(self.now)
        self.base_total = stats.in_use
        self.base_held = {k: s.in_use for k, s in stats.keys.items()}
        # A new config may turn reserved holds into shared ones: that is debt, not admission.
        self.base_shared = sum(
            max(0, held - config.weights(k).reserve) for k, held in self.base_held.items()
        )

    def settle(self, tickets: list[Ticket]) -> None:
        """Move the tickets a step settled out of the waiting list, checking FIFO per key."""
        for ticket in tickets:
            assert ticket in self.waiting
            self.waiting.remove(ticket)
            earlier = [w for w in self.waiting if w.key == ticket.key and w.seq < ticket.seq]
            if ticket.granted:
                assert not earlier, f"{ticket} overtook {earlier}"
                self.held.append(ticket)
            else:
                assert ticket.rejection is not None
                assert ticket.rejection.reason == "paused"

    @rule(key=st.sampled_from(KEYS), patience=st.none() | st.sampled_from([0.0, 0.5, 4.0]))
    def acquire(self, key: str, patience: float | None) -> None:
        before = self.core.statistics(self.now).keys.get(key)
        deadline = math.inf if patience is None else self.now + patience
        try:
            ticket = self.core.acquire(key, self.now, deadline=deadline)
        except Rejected as error:
            rejection = error
        else:
            if ticket.granted:
                assert before is None or before.waiting == 0, "a newcomer jumped the queue"
                self.held.append(ticket)
            else:
                self.waiting.append(ticket)
            return
        assert rejection.key == key
        assert rejection.retry_after >= 0
        weights = self.core.config.weights(key)
        if rejection.reason == "paused":
            assert weights.limit == 0
        elif rejection.reason == "queue_full":
            assert (before.waiting if before else 0) >= weights.max_waiting
        else:
            assert rejection.reason == "deadline"
            assert patience is not None

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 50), unused=st.booleans(), dt=st.sampled_from([0.0, 0.1, 1.0]))
    def release(self, i: int, unused: bool, dt: float) -> None:
        ticket = self.held.pop(i % len(self.held))
        self.now += dt
        step = self.core.cancel if unused else self.core.release
        self.settle(step(ticket, self.now))
        assert ticket.state is TicketState.RELEASED

    @precondition(lambda self: self.waiting)
    @rule(i=st.integers(0, 50))
    def cancel(self, i: int) -> None:
        ticket = self.waiting.pop(i % len(self.waiting))
        assert self.core.cancel(ticket, self.now) == []
        assert ticket.state is TicketState.WITHDRAWN

    @rule(dt=st.sampled_from([0.1, 0.5, 1.0, 5.0]))
    def advance(self, dt: float) -> None:
        self.now += dt
        for ticket in sorted(self.waiting, key=lambda t: t.expires_at):
            if ticket.expires_at <= self.now:
                self.waiting.remove(ticket)
                assert self.core.expire(ticket, self.now).reason == ticket.expiry_reason

    @rule(key=st.sampled_from(KEYS), ok=st.booleans(), latency=st.sampled_from([0.05, 0.5]))
    def record(self, key: str, ok: bool, latency: float) -> None:
        self.settle(self.core.record(key, self.now, ok=ok, latency=latency))

    @rule(raw=CONFIGS)
    def reconfigure(self, raw: dict[str, Any]) -> None:
        try:
            config = PoolConfig(**raw)
        except PoolConfigError:
            assert sum(w.reserve for w in raw["keys"].values()) > raw["max_workers"]
            return
        self.generation += 1
        self.remember(config)
        self.settle(self.core.reconfigure(config, self.now))

    @invariant()
    def bounds_hold_or_debt_only_shrinks(self) -> None:
        if not hasattr(self, "core"):
            return
        stats = self.core.statistics(self.now)
        assert stats.config_generation == self.generation
        assert stats.in_use == len(self.held) == sum(s.in_use for s in stats.keys.values())
        assert stats.waiting == len(self.waiting)
        assert stats.in_use_shared == sum(s.in_use_shared for s in stats.keys.values())
        assert stats.in_use <= stats.max_workers or stats.in_use <= self.base_total
        assert stats.in_use_shared <= stats.shared_pool or stats.in_use_shared <= self.base_shared
        for key, s in stats.keys.items():
            assert s.in_use == sum(1 for t in self.held if t.key == key)
            assert s.waiting == sum(1 for t in self.waiting if t.key == key)
            assert s.in_use_reserved <= s.reserve
            assert s.in_use_shared == 0 or s.in_use_reserved == s.reserve
            limit = math.inf if s.effective_limit is None else s.effective_limit
            assert s.in_use <= limit or s.in_use <= self.base_held.get(key, 0)
            if s.waiting:  # greedy: no head could take a free slot
                fits = s.in_use < limit and stats.in_use < stats.max_workers
                fits = fits and (s.in_use < s.reserve or stats.in_use_shared < stats.shared_pool)
                assert not fits, f"{key} waits although a slot fits it"
        for ticket in self.waiting:
            assert ticket.passed_over <= BOUND + len(KEYS) - 1
        self.remember(self.core.config)

    def teardown(self) -> None:
        """Liveness: with all work released, every waiter is admitted unless its key can
        never run under this config; those leave at their expiry."""
        if not hasattr(self, "core"):
            return
        while self.held:
            self.settle(self.core.release(self.held.pop(), self.now))
        stats = self.core.statistics(self.now)
        assert stats.in_use == 0
        for ticket in self.waiting:
            s = stats.keys[ticket.key]
            assert s.reserve == 0
            assert stats.shared_pool == 0
            if ticket.expires_at < math.inf:
                assert self.core.expire(ticket, ticket.expires_at).reason in Rejected.REASONS


TestAdmissionMachine = AdmissionMachine.TestCase
# Fewer, longer runs than the profile's default keep this file at a few seconds.
TestAdmissionMachine.settings = settings(max_examples=60, stateful_step_count=40)


def test_continuing_steps_are_never_refused_for_load() -> None:
    core = AdmissionCore(
        PoolConfig(
            max_workers=2,
            keys={"s": Weights(limit=1, max_waiting=1, wait_timeout=1), "p": Weights(limit=0)},
        )
    )
    held = core.acquire("s", 0.0)
    assert held.state is TicketState.GRANTED
    core.acquire("s", 0.0)  # fills s's queue of one
    with pytest.raises(Rejected) as info:
        core.acquire("s", 0.0)
    assert info.value.reason == "queue_full"
    late = core.acquire("s", 0.0, deadline=100.0, continuing=True)
    assert late.state is TicketState.WAITING
    assert late.expires_at == 100.0  # its deadline, not the 1 s wait timeout
    paused = core.acquire("p", 0.0, deadline=50.0, continuing=True)
    assert paused.state is TicketState.WAITING  # waits for an unpause, up to its deadline
    with pytest.raises(Rejected) as info:
        core.acquire("s", 5.0, deadline=5.0, continuing=True)
    assert info.value.reason == "deadline"


# -- how many keys the pool remembers ---------------------------------------------------------


def test_idle_unnamed_keys_are_forgotten_past_max_keys_and_totals_stay() -> None:
    """A key per tenant: a flood of callers leaves at most ``max_keys`` idle keys (and
    twice the keys in use), never a named key or one holding or waiting; the pool's
    totals keep what the forgotten keys were granted and refused."""
    c = AdmissionCore(
        PoolConfig(
            max_workers=4,
            keys={"named": Weights(limit=1)},
            default=Weights(limit=1, max_waiting=1),
            max_keys=8,
            wait_timeout=5,
        )
    )
    busy = granted(c, "tenant:busy")
    late = waiting(c, "tenant:busy")  # at its limit of one: it waits
    rejected(c, "tenant:busy")  # and its queue is full
    gone = granted(c, "tenant:gone")
    assert rejected(c, "tenant:gone", deadline=0.0).reason == "deadline"
    c.release(gone, 0.5)
    for i in range(1000):
        c.release(granted(c, f"tenant:{i}", float(i)), float(i) + 0.5)
        assert len(c.statistics(0.0).keys) <= 16
    stats = c.statistics(1000.0)
    assert {"named", "tenant:busy"} <= set(stats.keys)
    assert stats.keys_forgotten > 900
    # Everything ever granted or refused is still counted, by the pool if not by a key.
    assert stats.admitted == 1002
    assert "tenant:gone" not in stats.keys
    assert stats.forgotten_rejected["deadline"] == stats.rejected["deadline"] == 1
    assert stats.admitted == stats.forgotten_admitted + sum(s.admitted for s in stats.keys.values())
    assert stats.rejected["queue_full"] == 1
    # A forgotten key comes back as a new one, on the default weights.
    c.release(busy, 1000.0)
    assert late.granted
    again = granted(c, "tenant:3", 1000.0)
    assert c.statistics(1000.0).keys["tenant:3"].limit == 1
    c.release(again, 1001.0)
    c.release(late, 1001.0)


def test_max_keys_must_be_positive() -> None:
    with pytest.raises(PoolConfigError, match="max_keys"):
        PoolConfig(max_keys=0)
