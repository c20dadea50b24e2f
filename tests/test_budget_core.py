"""Retries and hedges' arithmetic in ``_budget_core``, without trio: what may be retried,
the backoff, the retry budget -- in flight, Envoy's (a property: never above its share,
with the minimum), and in volume (a property: in any window, retries at most their share of
the window's calls or the floor, whichever is larger; each decision the same as a
brute-force count's) -- and the latency window's quantiles (a property: equal to sorting
the recent samples)."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipework import RetrySpec
from pipework.backends._budget_core import (
    MIN_SAMPLES,
    LatencyWindow,
    RetryBudget,
    backoff,
    classify,
)
from pipework.backends._outlier_core import Failure, Outcome

SPEC = RetrySpec()


@pytest.mark.parametrize(
    ("outcome", "idempotent", "resendable"),
    [
        (Outcome.failed(Failure.CONNECT), "retry", "retry"),  # nothing was sent
        (Outcome.failed(Failure.RESET), "retry", "not_idempotent"),
        (Outcome.failed(Failure.TIMEOUT), "retry", "not_idempotent"),
        (Outcome.failed(Failure.BROKEN), "final", "final"),  # part of the answer came
        (Outcome.answer(503), "retry", "not_idempotent"),
        (Outcome.answer(500), "final", "final"),  # not in the default statuses
        (Outcome.answer(200), "final", "final"),
        (Outcome.answer(404), "final", "final"),
    ],
)
def test_what_may_be_retried(outcome: Outcome, idempotent: str, resendable: str) -> None:
    assert classify(outcome, SPEC, may_resend=True) == idempotent
    assert classify(outcome, SPEC, may_resend=False) == resendable


def test_configured_statuses_are_retried() -> None:
    spec = RetrySpec(statuses=frozenset({500, 429}))
    assert classify(Outcome.answer(429), spec, may_resend=True) == "retry"
    assert classify(Outcome.answer(503), spec, may_resend=True) == "final"


@given(st.integers(0, 100), st.integers(0, 2**32))
def test_backoff_is_full_jitter_under_its_cap(retry: int, seed: int) -> None:
    spec = RetrySpec(backoff_base=0.01, backoff_max=0.3)
    cap = min(0.3, 0.01 * 2.0**retry)
    delay = backoff(spec, retry, random.Random(seed))
    assert 0 <= delay <= cap
    assert delay == backoff(spec, retry, random.Random(seed))


def test_backoff_spreads_over_the_whole_range() -> None:
    rng = random.Random(3)
    delays = [backoff(SPEC, 10, rng) for _ in range(2000)]
    assert min(delays) < 0.01
    assert max(delays) > 0.24  # the cap, 0.25 s


#: A floor on the volume so high that only the bound in flight can refuse a retry.
UNBOUNDED = 1e6


def test_the_budget_is_a_share_of_active_calls_with_a_minimum() -> None:
    budget = RetryBudget(
        RetrySpec(budget_percent=20, min_concurrency=3, min_retries_per_second=UNBOUNDED)
    )
    budget.active = 5
    assert [budget.acquire(0.0) for _ in range(4)] == [True, True, True, False]
    assert budget.exhausted == 1
    budget.active = 100
    assert all(budget.acquire(0.0) for _ in range(17))  # 20 in flight: 20 % of 100
    assert not budget.acquire(0.0, hedge=True)
    budget.release()
    assert budget.acquire(0.0, hedge=True)
    stats = budget.statistics(0.0)
    assert (stats.retries_in_flight, stats.allowed, stats.retries, stats.hedges) == (20, 20, 20, 1)


def test_a_budget_of_zero_with_no_minimum_allows_nothing() -> None:
    budget = RetryBudget(
        RetrySpec(budget_percent=0, min_concurrency=0, min_retries_per_second=UNBOUNDED)
    )
    budget.active = 1000
    assert not budget.acquire(0.0)


def test_releasing_more_than_acquired_is_a_bug() -> None:
    with pytest.raises(RuntimeError, match="released more often"):
        RetryBudget(SPEC).release()
    with pytest.raises(RuntimeError, match="never began"):
        RetryBudget(SPEC).end()


@given(
    st.floats(0, 100),
    st.integers(0, 5),
    st.lists(st.sampled_from(["begin", "end", "retry", "hedge", "release"]), max_size=300),
)
def test_retries_in_flight_never_pass_the_budget(
    percent: float, minimum: int, steps: list[str]
) -> None:
    budget = RetryBudget(
        RetrySpec(budget_percent=percent, min_concurrency=minimum, min_retries_per_second=UNBOUNDED)
    )
    for step in steps:
        if step == "begin":
            budget.begin(0.0)
        elif step == "end" and budget.active:
            budget.end()
        elif step in ("retry", "hedge"):
            before = budget.in_flight
            if budget.acquire(0.0, hedge=step == "hedge"):
                assert budget.in_flight == before + 1
                assert budget.in_flight <= max(minimum, percent * budget.active / 100)
            else:
                assert budget.in_flight >= max(minimum, math.floor(percent * budget.active / 100))
        elif step == "release" and budget.in_flight:
            budget.release()


# -- the volume bound ------------------------------------------------------------------------


def volume(percent: float = 20, floor: float = 0.1, window: float = 10) -> RetryBudget:
    """A budget whose bound in flight never refuses: the volume bound alone."""
    spec = RetrySpec(
        budget_percent=percent,
        min_concurrency=10**9,
        min_retries_per_second=floor,
        budget_window=window,
    )
    return RetryBudget(spec)


def grants(budget: RetryBudget, now: float) -> int:
    """Retries granted at ``now`` until the budget refuses one (each released at once)."""
    count = 0
    while budget.acquire(now):
        budget.release()
        count += 1
    return count


def test_the_volume_is_a_share_of_the_calls_or_the_floor_whichever_is_larger() -> None:
    budget = volume(percent=20, floor=0.1)  # the floor: one retry per 10 s
    for _ in range(10):
        budget.begin(0.0)  # 2 tokens
    assert budget.statistics(0.0).volume_left == 3
    # 2 from the calls (more than the floor's 1), and 1 that finds the budget not yet spent.
    assert grants(budget, 0.0) == 3
    assert budget.exhausted == 1
    assert budget.statistics(0.0).volume_left == 0
    for _ in range(4):
        budget.begin(1.0)  # 0.8 of a token: still overspent
    assert grants(budget, 1.0) == 0
    budget.begin(1.0)  # a fifth call: no window has spent more than it was given
    assert grants(budget, 1.0) == 1


def test_a_window_without_calls_has_only_the_floor() -> None:
    budget = volume(percent=20, floor=0.2)  # two retries per 10 s
    for _ in range(100):
        budget.begin(0.0)
    # The window (0.5, 1] is a window too: its retries are paid by the floor alone, so a
    # burst long after the calls is no larger than the floor (and one).
    assert grants(budget, 1.0) == 3


def test_the_floor_is_not_added_to_the_share_when_everything_fails() -> None:
    # A busy service whose every call fails: the retries are a fifth of its calls, not a
    # fifth and the floor's 10 a window on top (Envoy's minimum is the larger of the two).
    budget = volume(percent=20, floor=1.0, window=10)
    granted = calls = 0
    for i in range(2000):  # 20 s at 100 calls a second, each wanting a retry
        now = i / 100
        budget.begin(now)
        calls += 1
        granted += grants(budget, now)
    assert granted <= 0.2 * calls + 1
    assert granted >= 0.2 * calls - 1  # and the share is granted


def test_what_calls_deposited_in_good_times_does_not_pay_for_a_burst_later() -> None:
    # Finagle's bucket would let the 900 calls of nine healthy seconds pay for 180
    # retries when every host starts failing; here the window that starts with the
    # failures holds its retries to its own calls' share.
    budget = volume(percent=20, floor=0.1)
    for i in range(900):
        budget.begin(i / 100)
    granted = 0
    for i in range(100):  # one second of calls, each wanting a retry
        now = 9.0 + i / 100
        budget.begin(now)
        granted += grants(budget, now)
    assert granted <= 0.2 * 100 + 1 + 1
    assert granted >= 0.2 * 100  # and the share is granted


def test_spent_retries_stop_counting_after_the_window() -> None:
    budget = volume(percent=0, floor=0.1, window=10)
    assert grants(budget, 0.0) == 2  # the floor's one, and one that finds it unspent
    assert grants(budget, 9.99) == 0
    assert grants(budget, 10.0) == 2  # the window (0, 10] holds none of them


def test_a_time_that_goes_back_counts_as_the_latest() -> None:
    budget = volume(percent=0, floor=0.1, window=10)
    assert grants(budget, 5.0) == 2
    assert grants(budget, 1.0) == 0
    assert grants(budget, 15.0) == 2


@settings(max_examples=300)
@given(
    st.sampled_from([0, 5, 20, 50, 100]),
    st.sampled_from([0.0, 0.1, 0.5, 2.0]),
    st.sampled_from([1.0, 2.5, 10.0]),
    st.lists(
        st.tuples(
            st.sampled_from([0.0, 0.0, 0.125, 0.25, 0.5, 1.0, 2.5, 10.0]),
            st.sampled_from(["call", "call", "call", "retry"]),
        ),
        max_size=200,
    ),
)
def test_retries_in_any_window_are_a_share_of_its_calls_or_the_floor(
    percent: int, floor: float, window: float, steps: list[tuple[float, str]]
) -> None:
    budget = volume(percent=percent, floor=floor, window=window)
    reserve = floor * window
    now = 0.0
    calls: list[float] = []
    retries: list[float] = []
    for dt, step in steps:
        now += dt
        if step == "call":
            budget.begin(now)
            calls.append(now)
            continue
        # The oracle: the least a window (a, now] of at most `window` seconds has left of
        # its calls' share, or the floor less the retries of the whole window.
        starts = [now - window] + [t for t in calls + retries if now - window < t < now]
        share = min(
            percent / 100 * sum(1 for t in calls if a < t <= now)
            - sum(1 for t in retries if a < t <= now)
            for a in starts
        )
        left = max(share, reserve - sum(1 for t in retries if now - window < t <= now))
        granted = budget.acquire(now)
        assert granted == (left >= 0), (left, granted)
        if granted:
            budget.release()
            retries.append(now)
    # Every window of `window` seconds: f(a) changes only where a or a + window passes an
    # event, so the breakpoints and a point between each two cover every window.
    times = sorted({*calls, *retries})
    points = sorted({p for t in times for p in (t, t - window)})
    starts = points + [(x + y) / 2 for x, y in itertools.pairwise(points)]
    for a in starts:
        spent = sum(1 for t in retries if a < t <= a + window)
        given = sum(1 for t in calls if a < t <= a + window)
        assert spent <= max(percent / 100 * given, reserve) + 1 + 1e-9, (a, spent, given)


# -- the latency window ----------------------------------------------------------------------


def test_the_window_answers_only_with_enough_samples() -> None:
    window = LatencyWindow()
    for i in range(MIN_SAMPLES - 1):
        window.add(i / 100)
    assert window.quantile(0.95) is None
    window.add(0.5)
    assert window.quantile(0.95) == 0.18  # nearest rank: the 19th of 20
    assert window.quantile(1.0) == 0.5


@given(
    st.integers(MIN_SAMPLES, 60),
    st.lists(st.floats(0, 10), max_size=300),
    st.floats(0.01, 1.0),
)
def test_quantiles_are_those_of_the_recent_samples(
    size: int, samples: list[float], q: float
) -> None:
    window = LatencyWindow(size)
    for sample in samples:
        window.add(sample)
    recent = sorted(samples[-size:])
    assert len(window) == len(recent)
    if len(recent) < MIN_SAMPLES:
        assert window.quantile(q) is None
    else:
        assert window.quantile(q) == recent[math.ceil(q * len(recent)) - 1]


def test_a_negative_latency_is_refused() -> None:
    with pytest.raises(ValueError, match="0 or more"):
        LatencyWindow().add(-1.0)
