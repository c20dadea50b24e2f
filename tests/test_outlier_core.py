"""Outcomes, passive outlier ejection (Envoy's rules) and active health thresholds, without
trio: examples, then properties (the ejection cap, ejection times growing and capped)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipework import HealthSpec, HostSpec, OutlierSpec
from pipework.backends._balance_core import Host
from pipework.backends._outlier_core import Failure, Outcome, OutlierDetector, apply_check

OK = Outcome.answer(200)
E500 = Outcome.answer(500)
E503 = Outcome.answer(503)
CONNECT = Outcome.failed(Failure.CONNECT)


def hosts(n: int) -> list[Host]:
    return [Host(HostSpec(f"http://h{i}.internal")) for i in range(n)]


def feed(
    d: OutlierDetector, host: Host, outcome: Outcome, n: int, now: float, pool: list[Host]
) -> list[str | None]:
    return [d.observe(host, outcome, now, pool) for _ in range(n)]


# -- outcomes --------------------------------------------------------------------------------


def test_an_outcome_is_exactly_one_thing() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        Outcome()
    with pytest.raises(ValueError, match="exactly one"):
        Outcome(status=200, failure=Failure.RESET)
    assert E503.is_error
    assert CONNECT.is_error
    assert not OK.is_error
    assert not Outcome.cancel().is_error
    assert [str(o) for o in (E503, CONNECT, Outcome.cancel())] == [
        "status 503",
        "connect",
        "cancelled",
    ]


# -- the rules -------------------------------------------------------------------------------


def test_five_5xx_in_a_row_eject_and_a_success_resets_the_count() -> None:
    pool = hosts(2)
    d = OutlierDetector(OutlierSpec(max_ejection_percent=50))
    h = pool[0]
    assert feed(d, h, E500, 4, 0.0, pool) == [None] * 4
    d.observe(h, OK, 0.0, pool)
    assert feed(d, h, E500, 4, 0.0, pool) == [None] * 4
    assert d.observe(h, E503, 1.0, pool) == "consecutive_5xx"
    assert h.ejected_until == 31.0
    assert h.ejections == 1


def test_gateway_failures_are_off_by_default_and_a_500_resets_them() -> None:
    pool = hosts(2)
    spec = OutlierSpec(consecutive_5xx=0, consecutive_gateway_failure=3, max_ejection_percent=50)
    d = OutlierDetector(spec)
    h = pool[0]
    feed(d, h, E503, 2, 0.0, pool)
    d.observe(h, E500, 0.0, pool)  # a 5xx, but not a gateway error
    assert feed(d, h, Outcome.answer(502), 2, 0.0, pool) == [None, None]
    assert d.observe(h, Outcome.answer(504), 0.0, pool) == "consecutive_gateway_failure"
    off = OutlierDetector(OutlierSpec(consecutive_5xx=0))
    assert feed(off, pool[1], E503, 50, 0.0, pool) == [None] * 50


def test_transport_failures_count_apart_from_answers() -> None:
    pool = hosts(2)
    d = OutlierDetector(OutlierSpec(max_ejection_percent=50))
    h = pool[0]
    feed(d, h, Outcome.failed(Failure.TIMEOUT), 4, 0.0, pool)
    d.observe(h, E500, 0.0, pool)  # an answer: the host was reached
    assert h.consecutive_local == 0
    assert h.consecutive_5xx == 1
    feed(d, h, Outcome.failed(Failure.RESET), 4, 0.0, pool)
    assert h.consecutive_5xx == 1  # transport failures leave the answers' count alone
    assert d.observe(h, CONNECT, 0.0, pool) == "consecutive_local_origin_failure"


def test_a_count_starts_again_after_it_fired_even_when_the_cap_refused() -> None:
    pool = hosts(3)
    d = OutlierDetector(OutlierSpec())  # 10 %: one host of three
    feed(d, pool[0], E500, 5, 0.0, pool)
    assert pool[0].ejected
    assert feed(d, pool[1], E500, 5, 0.0, pool) == [None] * 5  # the cap says no
    assert pool[1].consecutive_5xx == 0
    assert not pool[1].ejected


@pytest.mark.parametrize(
    ("n", "percent", "most"),
    [(3, 10, 1), (10, 10, 1), (11, 10, 2), (20, 10, 2), (20, 11, 3), (4, 50, 2), (1, 10, 1)],
)
def test_the_cap_is_envoys_rule(n: int, percent: float, most: int) -> None:
    pool = hosts(n)
    d = OutlierDetector(OutlierSpec(max_ejection_percent=percent))
    for h in pool:
        feed(d, h, E500, 5, 0.0, pool)
    assert sum(h.ejected for h in pool) == most


def test_a_zero_percent_cap_ejects_nothing() -> None:
    pool = hosts(3)
    d = OutlierDetector(OutlierSpec(max_ejection_percent=0))
    feed(d, pool[0], E500, 20, 0.0, pool)
    assert not pool[0].ejected


def test_ejection_time_grows_is_capped_and_shrinks_with_time_back_in_service() -> None:
    pool = hosts(1)
    h = pool[0]
    d = OutlierDetector(OutlierSpec(base_ejection_time=30, max_ejection_time=100, interval=10))
    now, times = 0.0, []
    for _ in range(5):
        feed(d, h, E500, 5, now, pool)
        assert h.ejected_until is not None
        times.append(h.ejected_until - now)
        now = h.ejected_until
        assert d.refresh(pool, now) == [h]  # back exactly when its time is up
    assert times == [30, 60, 90, 100, 100]
    assert h.ejection_multiplier == 4  # 30 * 4 >= 100: it stops growing
    # 25 s back in service: two intervals, so the multiplier drops by two before growing.
    feed(d, h, E500, 5, now + 25, pool)
    assert h.ejection_multiplier == 3
    assert h.ejected_until == now + 25 + 90


def test_refresh_returns_nothing_before_the_earliest_end() -> None:
    pool = hosts(2)
    d = OutlierDetector(OutlierSpec(max_ejection_percent=100))
    feed(d, pool[0], E500, 5, 0.0, pool)
    feed(d, pool[1], E500, 5, 10.0, pool)
    assert d.refresh(pool, 29.9) == []
    assert d.refresh(pool, 30.0) == [pool[0]]
    assert d.refresh(pool, 39.0) == []
    assert d.refresh(pool, 40.0) == [pool[1]]


outcomes = st.sampled_from(
    [OK, E500, E503, Outcome.answer(502), CONNECT, Outcome.failed(Failure.TIMEOUT)]
)


@given(
    st.integers(1, 12),
    st.floats(0, 100),
    st.lists(st.tuples(st.integers(0, 11), outcomes, st.floats(0, 5)), max_size=300),
)
def test_the_ejected_share_never_passes_the_cap_but_by_the_one_that_crossed_it(
    n: int, percent: float, steps: list[tuple[int, Outcome, float]]
) -> None:
    pool = hosts(n)
    spec = OutlierSpec(
        consecutive_5xx=2,
        consecutive_local_origin_failure=2,
        consecutive_gateway_failure=2,
        max_ejection_percent=percent,
        base_ejection_time=3,
        max_ejection_time=20,
        interval=1,
    )
    d = OutlierDetector(spec)
    now = 0.0
    for index, outcome, dt in steps:
        now += dt
        d.refresh(pool, now)
        d.observe(pool[index % n], outcome, now, pool)
        ejected = sum(h.ejected for h in pool)
        # Ejected only while the share already out was below the cap (Envoy's rule).
        assert ejected == 0 or 100 * (ejected - 1) / n < percent
        for h in pool:
            until = h.ejected_until
            assert until is None or 0 < until - now <= spec.max_ejection_time


@given(st.lists(st.floats(0, 50), min_size=1, max_size=30))
def test_ejection_times_grow_back_to_back_and_stay_capped(gaps: list[float]) -> None:
    pool = hosts(1)
    h = pool[0]
    spec = OutlierSpec(base_ejection_time=7, max_ejection_time=60, interval=10)
    d = OutlierDetector(spec)
    now, last, served = 0.0, 0.0, 0.0
    for gap in gaps:
        feed(d, h, E500, 5, now, pool)
        length = d.ejection_time(h.ejection_multiplier)
        assert h.ejected_until == pytest.approx(now + length)
        assert spec.base_ejection_time <= length <= spec.max_ejection_time
        if served < spec.interval:  # back in service less than an interval: no shrinking
            assert length >= last
        last, served = length, gap
        assert h.ejected_until is not None
        now = h.ejected_until
        d.refresh(pool, now)
        now += gap


# -- active health ---------------------------------------------------------------------------


def test_a_new_host_is_healthy_on_probation_and_one_failure_takes_it_out() -> None:
    (h,) = hosts(1)
    spec = HealthSpec("/health", healthy_threshold=2, unhealthy_threshold=3)
    assert h.healthy
    assert apply_check(h, spec, passed=False) is False
    assert not h.healthy
    assert apply_check(h, spec, passed=True) is None
    assert apply_check(h, spec, passed=True) is True


def test_after_probation_the_thresholds_apply_in_a_row() -> None:
    (h,) = hosts(1)
    spec = HealthSpec("/health", healthy_threshold=2, unhealthy_threshold=3)
    apply_check(h, spec, passed=True)  # probation over
    results = [apply_check(h, spec, passed=p) for p in (False, False, True, False, False)]
    assert results == [None] * 5  # never three failures in a row
    assert h.healthy
    assert apply_check(h, spec, passed=False) is False
    assert [apply_check(h, spec, passed=p) for p in (True, False, True)] == [None] * 3
    assert apply_check(h, spec, passed=True) is True
