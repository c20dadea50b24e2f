"""Retries and hedges' arithmetic in ``_budget_core``, without trio: what may be retried,
the backoff, Envoy's retry budget (a property: never above its share, with the minimum),
and the latency window's quantiles (a property: equal to sorting the recent samples)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
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


def test_the_budget_is_a_share_of_active_calls_with_a_minimum() -> None:
    budget = RetryBudget(RetrySpec(budget_percent=20, min_concurrency=3))
    budget.active = 5
    assert [budget.acquire() for _ in range(4)] == [True, True, True, False]
    assert budget.exhausted == 1
    budget.active = 100
    assert all(budget.acquire() for _ in range(17))  # 20 in flight: 20 % of 100
    assert not budget.acquire(hedge=True)
    budget.release()
    assert budget.acquire(hedge=True)
    stats = budget.statistics()
    assert (stats.retries_in_flight, stats.allowed, stats.retries, stats.hedges) == (20, 20, 20, 1)


def test_a_budget_of_zero_with_no_minimum_allows_nothing() -> None:
    budget = RetryBudget(RetrySpec(budget_percent=0, min_concurrency=0))
    budget.active = 1000
    assert not budget.acquire()


def test_releasing_more_than_acquired_is_a_bug() -> None:
    with pytest.raises(RuntimeError, match="released more often"):
        RetryBudget(SPEC).release()


@given(
    st.floats(0, 100),
    st.integers(0, 5),
    st.lists(st.sampled_from(["begin", "end", "retry", "hedge", "release"]), max_size=300),
)
def test_retries_in_flight_never_pass_the_budget(
    percent: float, minimum: int, steps: list[str]
) -> None:
    budget = RetryBudget(RetrySpec(budget_percent=percent, min_concurrency=minimum))
    for step in steps:
        if step == "begin":
            budget.active += 1
        elif step == "end" and budget.active:
            budget.active -= 1
        elif step in ("retry", "hedge"):
            before = budget.in_flight
            if budget.acquire(hedge=step == "hedge"):
                assert budget.in_flight == before + 1
                assert budget.in_flight <= max(minimum, percent * budget.active / 100)
            else:
                assert budget.in_flight >= max(minimum, math.floor(percent * budget.active / 100))
        elif step == "release" and budget.in_flight:
            budget.release()


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
