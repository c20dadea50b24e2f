"""The circuit breaker of ``_breaker_core``, without trio: examples of each transition, then
a hypothesis state machine checking after every step that half open never lets more than
its probes through and that open refuses until its wait is over."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pipework import BreakerSpec
from pipework.backends._breaker_core import (
    BUSY_PROBING_RETRY_AFTER,
    TRANSITIONS,
    Breaker,
    BreakerState,
    Permit,
)

SPEC = BreakerSpec(failure_percent=50, minimum_calls=4, window=10, wait=5, half_open_calls=2)


def state(b: Breaker) -> BreakerState:
    """The state, read afresh (a comparison does not narrow what the next one sees)."""
    return b.state


def calls(b: Breaker, now: float, errors: list[bool]) -> None:
    for error in errors:
        permit = b.admit(now)
        assert permit.allowed
        b.record(permit, now, error=error)


def opened(now: float = 0.0) -> Breaker:
    b = Breaker(SPEC)
    calls(b, now, [True] * 4)
    assert state(b) is BreakerState.OPEN
    return b


def test_it_opens_at_the_failure_rate_once_there_are_enough_calls() -> None:
    b = Breaker(SPEC)
    calls(b, 0.0, [True, True, True])  # 100 %, but only three calls
    assert state(b) is BreakerState.CLOSED
    calls(b, 0.0, [False])  # 3 of 4 failed: 75 % >= 50 %
    assert state(b) is BreakerState.OPEN
    assert (b.reason, b.opened) == ("failure_rate", 1)


def test_the_rate_is_judged_on_the_recent_window_only() -> None:
    b = Breaker(SPEC)
    calls(b, 0.0, [False] * 5 + [True] * 3)  # 37.5 %
    assert state(b) is BreakerState.CLOSED
    calls(b, 11.0, [False, False, False])  # the first calls have left the window
    assert b.statistics(11.0).window_calls == 3
    calls(b, 11.5, [True, True])  # 2 of 5: 40 %
    assert state(b) is BreakerState.CLOSED
    calls(b, 11.5, [True])  # 3 of 6: 50 %
    assert state(b) is BreakerState.OPEN


def test_open_refuses_with_the_rest_of_the_wait() -> None:
    b = opened(0.0)
    permit = b.admit(3.0)
    assert not permit.allowed
    assert permit.retry_after == pytest.approx(2.0)


def test_after_the_wait_half_open_lets_its_probes_through_and_no_more() -> None:
    b = opened(0.0)
    first, second = b.admit(5.0), b.admit(5.0)
    assert first.probe
    assert second.probe
    assert state(b) is BreakerState.HALF_OPEN
    busy = b.admit(5.0)
    assert not busy.allowed
    assert busy.retry_after == BUSY_PROBING_RETRY_AFTER
    b.record(first, 5.1, error=False)
    assert not b.admit(5.1).allowed  # one passed, one out: the two permits are used
    b.record(second, 5.2, error=False)
    assert state(b) is BreakerState.CLOSED
    assert b.statistics(5.2).window_calls == 0  # it starts afresh


def test_its_statistics_read_half_open_once_the_wait_is_over_without_a_call() -> None:
    # A quiet service makes no call to move the breaker on: what it reports must not stay
    # "open" (an operator would read a refusal that no call would meet).
    b = opened(0.0)
    assert b.statistics(4.9).state == "open"
    after = b.statistics(5.0)
    assert (after.state, after.retry_after, after.probes_in_flight) == ("half_open", 0.0, 0)
    assert state(b) is BreakerState.OPEN  # reading changed nothing
    assert b.admit(5.0).probe


def test_a_failed_probe_opens_it_again_for_a_whole_wait() -> None:
    b = opened(0.0)
    probe = b.admit(6.0)
    b.record(probe, 6.5, error=True)
    assert state(b) is BreakerState.OPEN
    assert (b.reason, b.opened) == ("probe_failed", 2)
    assert b.admit(11.4).retry_after == pytest.approx(0.1)


def test_a_cancelled_probe_gives_its_permit_back() -> None:
    b = opened(0.0)
    probe, other = b.admit(5.0), b.admit(5.0)
    b.record(probe, 5.0, error=None)
    again = b.admit(5.0)
    assert again.allowed
    assert again.probe
    del other


def test_outcomes_of_calls_let_through_in_an_earlier_state_are_dropped() -> None:
    b = Breaker(SPEC)
    early = [b.admit(0.0) for _ in range(4)]
    calls(b, 0.0, [True] * 4)
    assert state(b) is BreakerState.OPEN
    probes = [b.admit(5.0), b.admit(5.0)]
    for permit in early:  # stale: they neither fail nor pass a probe
        b.record(permit, 5.0, error=True)
    assert state(b) is BreakerState.HALF_OPEN
    for permit in probes:
        b.record(permit, 5.0, error=False)
    assert state(b) is BreakerState.CLOSED


def test_no_host_opens_a_closed_breaker_only() -> None:
    b = Breaker(SPEC)
    b.no_host(1.0)
    assert (state(b), b.reason) == (BreakerState.OPEN, "no_host")
    b.admit(6.0)
    b.no_host(6.0)  # half open: its probes decide
    assert state(b) is BreakerState.HALF_OPEN


def test_a_disabled_breaker_never_opens() -> None:
    b = Breaker(BreakerSpec(enabled=False, minimum_calls=1))
    calls(b, 0.0, [True] * 50)
    b.no_host(0.0)
    assert state(b) is BreakerState.CLOSED


def test_only_the_transitions_of_the_table_happen() -> None:
    b = Breaker(SPEC)
    with pytest.raises(RuntimeError, match="cannot go from closed to half_open"):
        b._move(BreakerState.HALF_OPEN)
    assert len(TRANSITIONS) == 4


class BreakerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.spec = BreakerSpec(
            failure_percent=40, minimum_calls=2, window=4, wait=1, half_open_calls=3
        )
        self.b = Breaker(self.spec)
        self.now = 0.0
        self.out: list[Permit] = []

    @rule(dt=st.floats(0, 1.5))
    def tick(self, dt: float) -> None:
        self.now += dt

    @rule()
    def admit(self) -> None:
        state = self.b.state
        until = self.b._until
        # Asking first changes nothing, and says what admitting then does.
        before = (self.b.state, self.b._probes, self.b._passed)
        refusing = self.b.refusing(self.now)
        assert (self.b.state, self.b._probes, self.b._passed) == before
        permit = self.b.admit(self.now)
        assert refusing is not permit.allowed
        if state is BreakerState.OPEN and self.now < until:
            assert not permit.allowed
            assert permit.retry_after == pytest.approx(until - self.now)
        if permit.allowed:
            self.out.append(permit)

    @rule(data=st.data(), outcome=st.sampled_from([True, False, None]))
    def finish(self, data: st.DataObject, outcome: bool | None) -> None:
        if not self.out:
            return
        permit = self.out.pop(data.draw(st.integers(0, len(self.out) - 1)))
        self.b.record(permit, self.now, error=outcome)

    @rule(error=st.booleans())
    def finish_current(self, error: bool) -> None:
        # The newest permit: most often one of the state the breaker is in now.
        if self.out:
            self.b.record(self.out.pop(), self.now, error=error)

    @rule()
    def no_host(self) -> None:
        self.b.no_host(self.now)

    @invariant()
    def half_open_lets_through_its_probes_at_most(self) -> None:
        b = self.b
        live = [p for p in self.out if p.probe and p.epoch == b.epoch]
        if b.state is BreakerState.HALF_OPEN:
            assert b._probes == len(live)
            assert b._probes + b._passed <= self.spec.half_open_calls
        else:
            assert not live

    @invariant()
    def open_waits_no_longer_than_its_wait(self) -> None:
        if self.b.state is BreakerState.OPEN:
            assert self.b.retry_after(self.now) <= self.spec.wait


TestBreakerMachine = BreakerMachine.TestCase
TestBreakerMachine.settings = settings(max_examples=100)
