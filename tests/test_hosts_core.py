"""One service's resilience core (``_hosts_core.ServiceCore``) driven call by call without
trio, as the driver will drive it: examples of each decision, then a hypothesis state
machine that checks its promises after every step, and a replay of the same seed and
clock giving the same decisions."""

from __future__ import annotations

import heapq
import math
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pipework import (
    BreakerSpec,
    HealthSpec,
    HedgeSpec,
    HostSpec,
    OutlierSpec,
    RegistrationError,
    RetrySpec,
    Service,
)
from pipework.backends._hosts_core import (
    Attempt,
    BreakerChanged,
    Call,
    Failure,
    HealthChanged,
    HostEjected,
    HostReturned,
    Outcome,
    Refusal,
    ServiceCore,
)

OK = Outcome.answer(200)
E503 = Outcome.answer(503)
CONNECT = Outcome.failed(Failure.CONNECT)
RESET = Outcome.failed(Failure.RESET)


def make(n: int = 3, *, seed: int = 1, weights: list[int] | None = None, **kw: Any) -> ServiceCore:
    """A core over ``n`` hosts with every mechanism on (as with each table present and
    empty), unless ``kw`` says otherwise."""
    ws = weights or [1] * n
    hosts = tuple(HostSpec(f"http://h{i}.internal:800{i}", w) for i, w in enumerate(ws))
    kw.setdefault("outlier", OutlierSpec())
    kw.setdefault("breaker", BreakerSpec())
    kw.setdefault("retry", RetrySpec())
    service = Service("svc", hosts=hosts, **kw)
    return ServiceCore("svc", service.resilience, rng=random.Random(seed))


def plain(n: int) -> ServiceCore:
    """The core of a service of ``n`` hosts written without any resilience table."""
    hosts = tuple(HostSpec(f"http://h{i}.internal:800{i}") for i in range(n))
    service = Service("svc", hosts=hosts) if n > 1 else Service("svc", hosts[0].url)
    return ServiceCore("svc", service.resilience, rng=random.Random(1))


def begin(core: ServiceCore, now: float = 0.0, **kw: Any) -> Call:
    call = core.begin(now, **kw)
    assert isinstance(call, Call), call
    return call


def first(call: Call, now: float = 0.0) -> Attempt:
    attempt = call.attempt(now)
    assert attempt is not None
    return attempt


def one_call(core: ServiceCore, now: float, outcome: Outcome, **kw: Any) -> str:
    """A call whose tries all end with ``outcome``; returns the last verdict's reason."""
    call = begin(core, now, **kw)
    attempt = call.attempt(now)
    while attempt is not None:
        verdict = call.finish(attempt, now, outcome)
        if verdict.action != "retry":
            call.end(now)
            return verdict.reason
        attempt = call.attempt(now)
    call.end(now)
    return "no_host"


# -- hosts and settings ----------------------------------------------------------------------


def test_a_base_url_is_one_host_of_weight_one() -> None:
    service = Service("users", "http://users.internal:8080/api")
    core = ServiceCore("users", service.resilience)
    assert [(h.url, h.weight) for h in core.hosts] == [("http://users.internal:8080/api", 1)]


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: HostSpec("http://a", weight=0), "weight must be from 1 to 1000"),
        (lambda: HealthSpec("health"), "path must start with '/'"),
        (lambda: HealthSpec("/h", interval=1, timeout=2), "must not exceed interval"),
        (lambda: OutlierSpec(base_ejection_time=60, max_ejection_time=30), "at least base"),
        (lambda: OutlierSpec(max_ejection_percent=101), "from 0 to 100"),
        (lambda: BreakerSpec(failure_percent=0), "from above 0 to 100"),
        (lambda: BreakerSpec(half_open_calls=0), "at least 1"),
        (lambda: RetrySpec(attempts=0), "attempts must be at least 1"),
        (lambda: RetrySpec(statuses=frozenset({99})), "not a status"),
        (lambda: RetrySpec(backoff_base=1, backoff_max=0.5), "at least backoff_base"),
        (lambda: RetrySpec(per_try_timeout=0), "positive number"),
        (lambda: RetrySpec(min_retries_per_second=-1), "min_retries_per_second must be 0 or"),
        (lambda: RetrySpec(budget_window=math.inf), "budget_window must be a positive"),
        (lambda: HedgeSpec(delay="p99"), 'or "p95"'),  # type: ignore[arg-type]  # the mistake tested
        (lambda: HedgeSpec(max_extra=0), "at least 1"),
        (lambda: Service("s", "http://s", balance="fastest"), "balance must be one of"),  # type: ignore[arg-type]  # the mistake tested
    ],
)
def test_settings_that_cannot_work_are_refused(build: Any, match: str) -> None:
    with pytest.raises(RegistrationError, match=match):
        build()


# -- what a service without tables does ------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2])
def test_without_tables_only_a_failed_connection_is_retried_and_only_once(n: int) -> None:
    core = plain(n)
    for outcome in (E503, Outcome.answer(502), RESET, Outcome.failed(Failure.TIMEOUT)):
        assert one_call(core, 0.0, outcome) == "final", outcome
    assert one_call(core, 0.0, CONNECT) == "attempts"  # one retry, then its failure
    stats = core.statistics(0.0)
    assert stats.budget.retries == 1
    assert sum(h.requests for h in stats.hosts) == 4 + 2


def test_without_a_breaker_table_the_breaker_never_opens() -> None:
    core = plain(1)
    for i in range(200):
        assert one_call(core, i * 0.01, E503) == "final"
    stats = core.statistics(2.0)
    assert (stats.breaker.state, stats.breaker.opened) == ("closed", 0)
    assert isinstance(core.begin(2.0), Call)


def test_without_an_outlier_table_a_lone_host_is_never_ejected_but_one_of_two_is() -> None:
    lone, pair = plain(1), plain(2)
    for i in range(50):
        one_call(lone, i * 0.01, E503)
        one_call(pair, i * 0.01, E503)
    assert [h.state for h in lone.statistics(0.5).hosts] == ["available"]
    assert "ejected" in [h.state for h in pair.statistics(0.5).hosts]  # Envoy's 5 in a row


# -- a streamed answer and a streamed body ----------------------------------------------------


def test_a_held_answer_keeps_its_host_busy_until_the_call_ends() -> None:
    core = make(2)
    call = begin(core)
    attempt = first(call)
    verdict = call.finish(attempt, 0.1, OK, hold=True)
    assert verdict.action == "answer"
    assert attempt.host.outstanding == 1  # its body is still being read
    assert attempt.host.requests == 1
    assert attempt.host.latency(0.1) == pytest.approx(0.1)  # the try ended at its head
    call.end(5.0)
    assert attempt.host.outstanding == 0


def test_a_retried_try_is_never_held() -> None:
    core = make(2)
    call = begin(core)
    attempt = first(call)
    assert call.finish(attempt, 0.0, E503, hold=True).action == "retry"
    assert attempt.host.outstanding == 0
    call.end(0.0)


def test_once_part_of_the_request_went_out_only_a_failed_connection_retries() -> None:
    core = make(3, retry=RetrySpec(attempts=3))
    call = begin(core, method="PUT")
    call.sent()
    assert call.finish(first(call), 0.0, CONNECT).action == "retry"
    second = call.attempt(0.0)
    assert second is not None
    assert call.finish(second, 0.0, E503).reason == "not_idempotent"
    call.end(0.0)
    hedged = begin(make(2, hedge=HedgeSpec(delay=0.01)))
    first(hedged)
    hedged.sent()
    assert hedged.hedge_at() is None  # nothing is sent twice, hedges included
    hedged.end(0.0)


# -- balancing and retries -------------------------------------------------------------------


def test_a_retry_goes_to_another_host_after_a_jittered_pause() -> None:
    core = make(3)
    call = begin(core)
    a = first(call)
    verdict = call.finish(a, 0.01, E503)
    assert (verdict.action, verdict.reason) == ("retry", "retry")
    assert 0 <= verdict.delay <= core.resilience.retry.backoff_base
    b = call.attempt(0.02)
    assert b is not None
    assert b.host is not a.host
    assert b.kind == "retry"
    assert call.finish(b, 0.03, OK).reason == "success"
    call.end(0.03)
    stats = core.statistics(0.03)
    assert (stats.budget.retries, stats.budget.retries_in_flight, stats.budget.active_calls) == (
        1,
        0,
        0,
    )


def test_when_every_host_was_tried_a_retry_goes_to_one_again() -> None:
    core = make(1, retry=RetrySpec(attempts=3))
    call = begin(core)
    a = first(call)
    call.finish(a, 0.0, E503)
    b = call.attempt(0.0)
    assert b is not None
    assert b.host is a.host


def test_a_post_is_retried_only_when_nothing_was_sent_or_when_allowed() -> None:
    core = make(2)
    assert one_call(core, 0.0, E503, method="POST") == "not_idempotent"
    assert one_call(core, 0.0, RESET, method="POST") == "not_idempotent"
    call = begin(core, method="POST")
    assert call.finish(first(call), 0.0, CONNECT).action == "retry"
    call.end(0.0)
    assert one_call(core, 0.0, E503, method="POST", resend=True) == "attempts"
    lenient = make(2, retry=RetrySpec(idempotent_only=False))
    assert one_call(lenient, 0.0, RESET, method="PATCH") == "attempts"


def test_tries_stop_at_attempts_and_final_answers_are_not_retried() -> None:
    core = make(3, retry=RetrySpec(attempts=3))
    call = begin(core)
    reasons = []
    attempt = call.attempt(0.0)
    while attempt is not None:
        verdict = call.finish(attempt, 0.0, E503)
        reasons.append(verdict.reason)
        attempt = call.attempt(0.0) if verdict.action == "retry" else None
    assert reasons == ["retry", "retry", "attempts"]
    assert len({a.host for a in call.attempts}) == 3
    assert one_call(core, 0.0, Outcome.answer(500)) == "final"
    assert one_call(core, 0.0, Outcome.answer(404)) == "success"
    assert one_call(core, 0.0, Outcome.failed(Failure.BROKEN)) == "final"


def test_an_exhausted_budget_answers_with_the_failure() -> None:
    core = make(3, retry=RetrySpec(budget_percent=20, min_concurrency=1))
    holder = begin(core)
    holder.finish(first(holder), 0.0, E503)  # its retry takes the one place
    assert one_call(core, 0.0, E503) == "budget"
    stats = core.statistics(0.0).budget
    assert (stats.allowed, stats.retries_in_flight, stats.exhausted) == (1, 1, 1)
    holder.end(0.0)  # the retry it never began gives its place back
    assert core.statistics(0.0).budget.retries_in_flight == 0


def test_no_retry_that_could_not_finish_before_the_deadline() -> None:
    core = make(3)
    assert one_call(core, 0.0, E503, deadline=0.0) == "deadline"
    for i in range(30):  # calls usually take 0.2 s
        call = begin(core, float(i))
        call.finish(first(call, float(i)), i + 0.2, OK)
        call.end(i + 0.2)
    assert one_call(core, 40.0, E503, deadline=40.1) == "deadline"
    assert one_call(core, 50.0, E503, deadline=51.0) == "attempts"


def test_a_per_try_timeout_bounds_each_try_within_the_calls_deadline() -> None:
    core = make(2, retry=RetrySpec(per_try_timeout=0.5))
    assert first(begin(core, 1.0, deadline=10.0), 1.0).deadline == 1.5
    assert first(begin(core, 1.0, deadline=1.2), 1.0).deadline == 1.2
    assert first(begin(core, 1.0), 1.0).deadline == 1.5


def test_ending_a_call_cancels_what_is_still_out() -> None:
    core = make(2, hedge=HedgeSpec(delay=0.1))
    call = begin(core)
    first(call)
    assert call.hedge(0.1) is not None
    call.end(0.2)
    stats = core.statistics(0.2)
    assert [h.outstanding for h in stats.hosts] == [0, 0]
    assert stats.budget.retries_in_flight == 0
    assert [h.failures for h in stats.hosts] == [0, 0]  # a cancellation is no failure


def test_a_host_that_fails_fast_does_not_look_fast() -> None:
    core = make(2, seed=5)
    good, bad = core.hosts
    for i in range(20):  # both answer in 50 ms
        for host in (good, bad):
            host.observe(i * 0.1, 0.05)
    call = begin(core, 2.0)
    attempt = call.attempt(2.0)
    assert attempt is not None
    failing = attempt.host
    call.finish(attempt, 2.001, CONNECT)  # refused in a millisecond
    latency = failing.latency(2.001)
    assert latency is not None
    assert latency >= 0.09  # penalised, not 1 ms
    fresh = make(2)
    known, new = fresh.hosts
    known.observe(0.0, 0.2)
    call = begin(fresh)
    while (attempt := first(call)).host is not new:  # aim at the host with no sample
        call.finish(attempt, 0.0, OK)
        call.end(0.0)
        call = begin(fresh)
    call.finish(attempt, 0.001, CONNECT)
    assert new.latency(0.001) == pytest.approx(0.4, rel=0.01)  # twice the others' estimate


# -- hedging ---------------------------------------------------------------------------------


def test_a_hedge_goes_to_another_host_after_its_delay_and_the_first_answer_wins() -> None:
    core = make(3, hedge=HedgeSpec(delay=0.1))
    call = begin(core)
    a = first(call)
    assert call.hedge_at() == pytest.approx(0.1)
    assert call.hedge(0.05) is None  # not yet
    h = call.hedge(0.1)
    assert h is not None
    assert (h.kind, h.host is a.host) == ("hedge", False)
    assert call.hedge_at() is None  # max_extra = 1
    assert call.finish(h, 0.12, OK).action == "answer"
    assert call.finish(a, 0.13, Outcome.cancel()).reason == "cancelled"
    call.end(0.13)
    assert core.statistics(0.13).budget.hedges == 1


def test_a_failed_try_waits_for_the_hedge_still_out() -> None:
    core = make(3, hedge=HedgeSpec(delay=0.1), retry=RetrySpec(attempts=3))
    call = begin(core)
    a = first(call)
    h = call.hedge(0.1)
    assert h is not None
    assert call.finish(a, 0.15, E503).reason == "in_flight"
    verdict = call.finish(h, 0.2, E503)
    assert verdict.action == "retry"  # two tries of three: one more, to the third host
    c = call.attempt(0.2)
    assert c is not None
    assert c.host not in (a.host, h.host)


def test_p95_hedging_waits_for_enough_latencies() -> None:
    core = make(2, hedge=HedgeSpec())
    call = begin(core)
    first(call)
    assert call.hedge_at() is None
    call.end(0.0)
    for i in range(40):
        c = begin(core, float(i))
        c.finish(first(c, float(i)), i + (0.5 if i % 20 == 0 else 0.1), OK)
        c.end(float(i) + 1)
    call = begin(core, 100.0)
    first(call, 100.0)
    assert call.hedge_at() == pytest.approx(100.1)


def test_hedges_need_a_resendable_call_another_host_and_budget() -> None:
    core = make(2, hedge=HedgeSpec(delay=0.1), retry=RetrySpec(min_concurrency=0))
    post = begin(core, method="POST")
    first(post)
    assert post.hedge_at() is None
    quiet = begin(core, hedge=False)
    first(quiet)
    assert quiet.hedge_at() is None
    broke = begin(core)
    first(broke)
    assert broke.hedge(0.2) is None  # 3 calls, 0 % of them: no budget
    assert broke.hedge_at() is None  # and it hedges no more: a driver never spins on it
    lone = make(1, hedge=HedgeSpec(delay=0.1))
    call = begin(lone)
    first(call)
    assert call.hedge_at() == pytest.approx(0.1)
    assert call.hedge(0.2) is None  # no other host
    assert call.hedge_at() is None


# -- ejection, health, the breaker -----------------------------------------------------------


def test_an_ejected_host_is_skipped_until_its_time_is_up() -> None:
    core = make(2, outlier=OutlierSpec(max_ejection_percent=50))
    bad = core.hosts[0]
    for _ in range(5):
        call = begin(core)
        attempt = call.attempt(0.0)
        while attempt is not None and attempt.host is not bad:  # aim at the bad host
            call.finish(attempt, 0.0, OK)
            call.end(0.0)
            call = begin(core)
            attempt = call.attempt(0.0)
        assert attempt is not None
        call.finish(attempt, 0.0, Outcome.answer(500))
        call.end(0.0)
    assert core.pop_events() == [HostEjected(bad.url, "consecutive_5xx", 30.0, 1)]
    assert {core.pick(1.0) for _ in range(30)} == {core.hosts[1]}
    assert core.statistics(29.0).hosts[0].state == "ejected"
    assert core.pick(30.0) is not None
    assert core.pop_events() == [HostReturned(bad.url)]


def test_the_breaker_opens_on_the_failure_rate_and_refuses_calls() -> None:
    core = make(3, breaker=BreakerSpec(minimum_calls=4, wait=5), retry=RetrySpec(attempts=1))
    for _ in range(4):
        one_call(core, 1.0, E503)
    refusal = core.begin(2.0)
    assert isinstance(refusal, Refusal)
    assert (refusal.reason, refusal.retry_after) == ("circuit_open", 4.0)
    assert "circuit breaker is open" in refusal.message
    assert core.pop_events() == [BreakerChanged("open", "failure_rate", 5.0)]
    probe = begin(core, 6.0)
    assert probe.probe
    assert probe.hedge_at() is None
    assert probe.finish(first(probe, 6.0), 6.1, E503).reason == "probe"
    assert core.statistics(6.1).breaker.state == "open"
    assert core.statistics(6.1).refused["circuit_open"] == 1


def test_with_every_host_out_the_breaker_opens_and_probes_try_them_anyway() -> None:
    core = make(2, health=HealthSpec("/health"), breaker=BreakerSpec(wait=5, half_open_calls=1))
    for host in core.hosts:
        core.health_check(host.url, 1.0, passed=False)  # on probation: out at once
    events = core.pop_events()
    assert events[:2] == [HealthChanged(h.url, False) for h in core.hosts]
    assert events[2] == BreakerChanged("open", "no_host", 5.0)
    assert isinstance(core.begin(2.0), Refusal)
    assert core.statistics(2.0).panic
    probe = begin(core, 6.0)
    attempt = first(probe, 6.0)  # panic: an unhealthy host, as no host is healthy
    assert probe.finish(attempt, 6.1, OK).reason == "success"
    probe.end(6.1)
    assert core.statistics(6.1).breaker.state == "closed"


def test_a_drained_host_takes_no_new_tries_and_all_drained_refuses() -> None:
    core = make(2)
    a, b = core.hosts
    core.drain(a.url, 0.0)
    assert {core.pick(0.0) for _ in range(20)} == {b}
    assert core.statistics(0.0).hosts[0].state == "draining"
    core.drain(b.url, 0.0)
    refusal = core.begin(0.0)
    assert isinstance(refusal, Refusal)
    assert refusal.reason == "no_host"
    core.restore(a.url, 0.0)
    assert core.pick(0.0) is a
    with pytest.raises(KeyError, match="no host 'http://nowhere'"):
        core.drain("http://nowhere", 0.0)


def test_a_reload_keeps_what_unchanged_hosts_learnt() -> None:
    core = make(2, outlier=OutlierSpec(max_ejection_percent=50))
    kept, dropped = core.hosts
    kept.observe(0.0, 0.3)
    kept.draining = True
    service = Service(
        "svc",
        hosts=(HostSpec(kept.url, 5), HostSpec("http://h9.internal:8009")),
        balance="round_robin",
    )
    core.reconfigure(service.resilience, 1.0)
    assert core.hosts[0] is kept
    assert (kept.weight, kept.draining, kept.latency(0.0)) == (5, True, 0.3)
    assert core.hosts[1].url == "http://h9.internal:8009"
    assert dropped not in core.hosts
    assert core.balancer.name == "round_robin"


# -- properties ------------------------------------------------------------------------------

outcomes = st.sampled_from(
    [OK, OK, E503, Outcome.answer(500), CONNECT, RESET, Outcome.failed(Failure.TIMEOUT)]
)


class ServiceMachine(RuleBasedStateMachine):
    """Random calls, outcomes, health checks, drains and time against one core."""

    def __init__(self) -> None:
        super().__init__()
        self.core: ServiceCore | None = None
        self.now = 0.0
        self.calls: list[Call] = []
        self.launched: list[Attempt] = []
        self.sent: set[Call] = set()  # calls that sent part of their request

    @initialize(
        n=st.integers(1, 5),
        seed=st.integers(0, 2**16),
        balance=st.sampled_from(["p2c", "round_robin", "random"]),
        percent=st.sampled_from([0, 10, 50, 100]),
    )
    def build(self, n: int, seed: int, balance: str, percent: float) -> None:
        self.core = make(
            n,
            seed=seed,
            weights=[1 + (i * 7) % 4 for i in range(n)],
            balance=balance,
            health=HealthSpec("/health", healthy_threshold=1, unhealthy_threshold=2),
            outlier=OutlierSpec(
                consecutive_5xx=2,
                consecutive_local_origin_failure=2,
                max_ejection_percent=percent,
                base_ejection_time=1,
                max_ejection_time=4,
            ),
            breaker=BreakerSpec(minimum_calls=5, window=2, wait=1, half_open_calls=2),
            retry=RetrySpec(attempts=3, budget_percent=20, min_concurrency=1),
            hedge=HedgeSpec(delay=0.05, max_extra=2),
        )

    def _core(self) -> ServiceCore:
        assert self.core is not None
        return self.core

    def _launch(self, attempt: Attempt | None, before: list[bool]) -> None:
        core = self._core()
        if attempt is None:  # no host at all: every one is draining
            assert all(h.draining for h in core.hosts)
            return
        host = attempt.host
        assert not host.draining
        if any(before):  # an available host existed: the try went to one
            assert before[core.hosts.index(host)]
        tried = {a.host for a in attempt.call.attempts[:-1]}
        if any(ok and h not in tried for ok, h in zip(before, core.hosts, strict=True)):
            assert host not in tried  # and to one this call had not tried yet
        self.launched.append(attempt)
        budget = core.budget
        assert budget.in_flight <= budget.allowed() or attempt.kind == "first"

    def _availability(self) -> list[bool]:
        core = self._core()
        core._refresh(self.now)
        return [h.available for h in core.hosts]

    @rule(dt=st.floats(0, 0.7))
    def tick(self, dt: float) -> None:
        self.now += dt

    @rule(method=st.sampled_from(["GET", "POST"]), hedge=st.booleans())
    def begin(self, method: str, hedge: bool) -> None:
        call = self._core().begin(self.now, method=method, deadline=self.now + 3, hedge=hedge)
        if isinstance(call, Call):
            self.calls.append(call)
            before = self._availability()
            self._launch(call.attempt(self.now), before)

    @rule(method=st.sampled_from(["GET", "POST"]))
    def refuse_first(self, method: str) -> None:
        # Asked first (a proxied request before its slot): a refusal is begin's, counted
        # once; no refusal changes nothing, and begin then lets the call in.
        core = self._core()
        before = core.statistics(self.now)
        refusal = core.refuse(self.now)
        after = core.statistics(self.now)
        if refusal is None:
            assert after == before
            call = core.begin(self.now, method=method, deadline=self.now + 3)
            assert isinstance(call, Call)
            self.calls.append(call)
            self._launch(call.attempt(self.now), self._availability())
            return
        assert after.refused[refusal.reason] == before.refused[refusal.reason] + 1
        assert sum(after.refused.values()) == sum(before.refused.values()) + 1
        again = core.begin(self.now, method=method)
        assert isinstance(again, Refusal)
        assert (again.reason, again.retry_after) == (refusal.reason, refusal.retry_after)

    @rule(data=st.data(), outcome=outcomes, hold=st.booleans())
    def finish(self, data: st.DataObject, outcome: Outcome, hold: bool) -> None:
        out = [a for a in self.launched if not a.done]
        if not out:
            return
        attempt = data.draw(st.sampled_from(out))
        call = attempt.call
        verdict = call.finish(attempt, self.now, outcome, hold=hold)
        if verdict.action == "retry":
            # Part of a request that went out is never sent again: only no connection.
            assert call not in self.sent or outcome == CONNECT
            before = self._availability()
            self._launch(call.attempt(self.now), before)

    @rule(data=st.data())
    def send_part(self, data: st.DataObject) -> None:
        if self.calls:
            call = data.draw(st.sampled_from(self.calls))
            call.sent()
            self.sent.add(call)

    @rule(data=st.data())
    def hedge(self, data: st.DataObject) -> None:
        live = [c for c in self.calls if c.hedge_at() is not None]
        if live:
            call = data.draw(st.sampled_from(live))
            at = call.hedge_at()
            assert at is not None
            self.now = max(self.now, at)
            before = self._availability()
            hedge = call.hedge(self.now)
            if hedge is not None:
                assert hedge.host not in {a.host for a in call.attempts[:-1]}
                self._launch(hedge, before)

    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        if self.calls:
            call = self.calls.pop(data.draw(st.integers(0, len(self.calls) - 1)))
            call.end(self.now)

    @rule(index=st.integers(0, 4), passed=st.booleans())
    def health_check(self, index: int, passed: bool) -> None:
        core = self._core()
        core.health_check(core.hosts[index % len(core.hosts)].url, self.now, passed=passed)

    @rule(index=st.integers(0, 4), drain=st.booleans())
    def drain(self, index: int, drain: bool) -> None:
        core = self._core()
        url = core.hosts[index % len(core.hosts)].url
        (core.drain if drain else core.restore)(url, self.now)

    @invariant()
    def the_books_balance(self) -> None:
        if self.core is None:
            return
        core = self.core
        out = [a for a in self.launched if not a.done]
        for host in core.hosts:
            held = sum(1 for c in self.calls if c._held is host)  # answers being read
            assert host.outstanding == sum(1 for a in out if a.host is host) + held
        assert core.budget.active == len(self.calls)
        granted = sum(1 for c in self.calls if c._retry_granted)
        extra = sum(1 for a in out if a.kind != "first")
        assert core.budget.in_flight == granted + extra

    @invariant()
    def the_ejection_cap_holds(self) -> None:
        if self.core is None:
            return
        core = self.core
        ejected = sum(1 for h in core.hosts if h.ejected)
        limit = core.resilience.outlier.max_ejection_percent
        assert ejected == 0 or 100 * (ejected - 1) / len(core.hosts) < limit

    @invariant()
    def half_open_lets_through_its_probes_at_most(self) -> None:
        if self.core is None:
            return
        breaker = self.core.breaker
        probes = [
            c
            for c in self.calls
            if c.probe
            and c.permit.epoch == breaker.epoch
            and (not c.attempts or not c.attempts[0].done)
        ]
        assert breaker._probes == len(probes)
        assert len(probes) + breaker._passed <= breaker.spec.half_open_calls


TestServiceMachine = ServiceMachine.TestCase
TestServiceMachine.settings = settings(max_examples=60, stateful_step_count=60)


def scenario(seed: int) -> list[object]:
    """A mixed run driven by ``seed`` alone; returns everything the core decided."""
    script = random.Random(seed)
    core = make(
        4,
        seed=seed,
        weights=[1, 2, 3, 1],
        health=HealthSpec("/health"),
        outlier=OutlierSpec(max_ejection_percent=50, consecutive_5xx=2),
        retry=RetrySpec(attempts=3),
        hedge=HedgeSpec(delay=0.02),
    )
    trace: list[object] = []
    now = 0.0
    calls: list[Call] = []
    for _ in range(300):
        now += script.random() * 0.05
        roll = script.random()
        if roll < 0.4:
            call = core.begin(now, method=script.choice(["GET", "POST"]))
            trace.append(call if isinstance(call, Refusal) else "call")
            if isinstance(call, Call) and (attempt := call.attempt(now)):
                trace.append(attempt.host.url)
                calls.append(call)
        elif roll < 0.8 and calls:
            call = script.choice(calls)
            out = call.in_flight
            if out:
                outcome = script.choice([OK, E503, CONNECT, RESET])
                verdict = call.finish(out[0], now, outcome)
                trace.append(verdict)
                if verdict.action == "retry" and (attempt := call.attempt(now + verdict.delay)):
                    trace.append(attempt.host.url)
            else:
                call.end(now)
                calls.remove(call)
        elif roll < 0.9 and calls:
            hedge = script.choice(calls).hedge(now)
            trace.append(None if hedge is None else hedge.host.url)
        else:
            url = script.choice(core.hosts).url
            core.health_check(url, now, passed=script.random() < 0.7)
        trace.extend(core.pop_events())
    trace.append(core.statistics(now))
    return trace


@settings(max_examples=20)
@given(st.integers(0, 2**32))
def test_the_same_seed_and_clock_make_the_same_decisions(seed: int) -> None:
    assert scenario(seed) == scenario(seed)


def test_a_statistics_snapshot_says_everything_about_the_service() -> None:
    core = make(2, weights=[1, 3])
    call = begin(core)
    attempt = first(call)
    stats = core.statistics(0.5)
    assert stats.service == "svc"
    assert stats.balance == "p2c"
    assert stats.available == 2
    assert not stats.panic
    assert stats.calls == 1
    assert stats.breaker.state == "closed"
    assert stats.budget.active_calls == 1
    assert math.isclose(sum(h.outstanding for h in stats.hosts), 1)
    assert [h.weight for h in stats.hosts] == [1, 3]
    host = next(h for h in stats.hosts if h.url == attempt.host.url)
    assert (host.state, host.requests, host.latency) == ("available", 1, None)


# -- the retry budget's volume ---------------------------------------------------------------


def every_host_down(core: ServiceCore, seconds: float, clients: int = 16) -> tuple[int, int]:
    """``clients`` clients, each sending its next call 80 ms after its last answer, to a
    service whose every host answers 503 in a millisecond, for ``seconds`` of virtual time;
    returns the calls and the retries."""
    loop = [(i * 0.005, i) for i in range(clients)]  # (when, client), staggered
    heapq.heapify(loop)
    calls = 0
    while loop:
        now, client = heapq.heappop(loop)
        if now >= seconds:
            continue
        call = begin(core, now)
        calls += 1
        attempt = call.attempt(now)
        while attempt is not None:
            now += 0.001
            verdict = call.finish(attempt, now, E503)
            if verdict.action != "retry":
                break
            now += verdict.delay
            attempt = call.attempt(now)
        call.end(now)
        heapq.heappush(loop, (now + 0.08, client))
    return calls, core.statistics(seconds).budget.retries


def test_fast_failures_are_retried_within_a_share_of_the_calls() -> None:
    # Every host down and failing fast: few calls are ever in progress at once, so the
    # bound on retries in flight (3 at least) lets nearly every call retry. The bound on
    # their volume keeps them to budget_percent of the calls (its small floor is a minimum,
    # not added to the share).
    retry = RetrySpec()
    off = OutlierSpec(consecutive_5xx=0, consecutive_local_origin_failure=0)
    core = make(3, outlier=off, breaker=BreakerSpec(enabled=False), retry=retry)
    calls, retries = every_host_down(core, retry.budget_window)  # one window
    assert calls > 1000
    floor = retry.min_retries_per_second * retry.budget_window
    assert retries <= max(retry.budget_percent / 100 * calls, floor) + 1
    assert retries >= retry.budget_percent / 100 * calls  # and the share is used


# -- a try that lost to a hedge ------------------------------------------------------------


def test_a_try_that_lost_to_a_hedge_counts_its_time_on_its_host_and_nothing_else() -> None:
    core = make(2, hedge=HedgeSpec(delay=0.1))
    call = begin(core)
    slow = first(call)
    hedge = call.hedge(0.1)
    assert hedge is not None
    assert call.finish(hedge, 0.15, OK).action == "answer"
    assert call.finish(slow, 0.15, Outcome.cancel()).reason == "cancelled"
    call.end(0.15)
    host = core.statistics(0.15).hosts[core.hosts.index(slow.host)]
    # It took 0.15 s at least: a lower bound of its latency, as a slow answer would be...
    assert host.latency == pytest.approx(0.15)
    # ...but it did not fail: no failure, no outlier count, nothing for the breaker.
    assert (host.failures, host.consecutive_5xx, host.consecutive_local_origin_failure) == (0, 0, 0)
    breaker = core.statistics(0.15).breaker
    assert (breaker.window_calls, breaker.window_failures) == (1, 0)  # the winner only
    assert len(core.latencies) == 1  # the service's latencies are its answers'


def test_a_lower_bound_never_lowers_a_hosts_estimate() -> None:
    core = make(2, hedge=HedgeSpec(delay=0.1))
    a = core.hosts[0]
    a.observe(0.0, 2.0)
    call = begin(core)
    while (attempt := first(call)).host is not a:  # aim at the slow host
        call.finish(attempt, 0.0, OK)
        call.end(0.0)
        call = begin(core)
    hedge = call.hedge(0.1)
    assert hedge is not None
    call.finish(hedge, 0.12, OK)
    call.end(0.12)  # the slow try is cancelled: it lost
    assert a.latency(0.12) == pytest.approx(2.0 * math.exp(-0.012))  # decayed, not lowered


def test_a_try_cancelled_from_outside_counts_nowhere() -> None:
    core = make(2, hedge=HedgeSpec(delay=0.1))
    call = begin(core)
    first(call)
    assert call.hedge(0.1) is not None
    call.end(0.5)  # the caller gave up: no try answered
    stats = core.statistics(0.5)
    assert [h.latency for h in stats.hosts] == [None, None]
    assert [h.failures for h in stats.hosts] == [0, 0]


def test_a_slow_host_whose_tries_lose_to_hedges_loses_its_share() -> None:
    # Host 0 answers in 1 s, the others in 10 ms; every try to host 0 is hedged after
    # 50 ms and cancelled when the hedge answers. Were the cancelled tries counted
    # nowhere, host 0 would never show its slowness and keep a third of the calls.
    core = make(3, seed=3, hedge=HedgeSpec(delay=0.05))
    slow_host = core.hosts[0]
    slow = 0
    for i in range(600):
        now = i * 0.1
        call = begin(core, now)
        attempt = first(call, now)
        if attempt.host is slow_host:
            slow += 1
            hedge = call.hedge(now + 0.05)
            assert hedge is not None
            call.finish(hedge, now + 0.06, OK)
        else:
            call.finish(attempt, now + 0.01, OK)
        call.end(now + 0.06)
    assert slow < 0.05 * 600
    assert core.statistics(60.0).hosts[0].failures == 0
