"""How the container answers a submission, decided from values (``_modes_core``): plain
synchronous tests, no Quart, no clock, no sockets. The same decisions through a real server
are in tests/test_container_modes.py and tests/test_jobs.py."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipework import Status, StoreUnavailable
from pipework._http._problems import Problem, problem_for_exception
from pipework.container._modes_core import (
    NO_PREFERENCES,
    SLACK,
    KeyStep,
    Preferences,
    RanOut,
    admits_now,
    deadline_passed,
    frees_key,
    idempotency_key,
    job_timeout,
    key_busy,
    key_step,
    needs_token,
    outcome_unknown,
    parse_prefer,
    preference_applied,
    ran_out,
    shutting_down,
    stream_taken,
    wait_terms,
)
from pipework.container._routes import Mode

NOW = 100.0
DEADLINE = 130.0  # the job's, on the same clock


# -- Prefer --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        pytest.param(["respond-async; x=y"], Preferences(respond_async=True), id="parameters"),
        pytest.param(["wait=5, respond-async"], Preferences(True, 5.0), id="both"),
        pytest.param(["wait=", "wait=2"], Preferences(False, 2.0), id="empty-then-valid"),
        pytest.param(["wait=1.5"], Preferences(), id="fraction-ignored"),
        pytest.param(["wait=-1"], Preferences(), id="negative-ignored"),
        pytest.param(["wait=1234567890"], Preferences(), id="ten-digits-ignored"),
        pytest.param(["wait=\u0661"], Preferences(), id="non-ascii-digit-ignored"),
        pytest.param(["handling=strict"], Preferences(), id="other-preference"),
    ],
)
def test_prefer_reads_respond_async_and_whole_second_waits(
    headers: list[str], expected: Preferences
) -> None:
    assert parse_prefer(headers) == expected


# -- the job -------------------------------------------------------------------------------


def test_the_first_timeout_set_wins_route_chain_engine_then_container() -> None:
    assert job_timeout(1.0, 2.0, 3.0, 4.0) == 1.0
    assert job_timeout(None, 2.0, 3.0, 4.0) == 2.0
    assert job_timeout(None, None, 3.0, 4.0) == 3.0
    assert job_timeout(None, None, None, 4.0) == 4.0
    assert job_timeout(0.0, 2.0, 3.0, 4.0) == 0.0  # zero is set, not missing


@pytest.mark.parametrize(
    ("mode", "token", "admit"),
    [
        ("sync", False, False),
        ("stream", False, False),
        ("auto", True, False),
        ("async", True, True),
    ],
)
def test_only_answers_that_hand_out_a_token_make_one_and_only_async_admits_first(
    mode: Mode, token: bool, admit: bool
) -> None:
    assert needs_token(mode) is token
    assert admits_now(mode) is admit
    # On a shared store a sync job's outcome may be unreadable when its answer is due: it
    # gets a token, handed out with its id in that answer (outcome_unknown).
    assert needs_token(mode, shared_store=True) is (token or mode == "sync")


# -- waiting -------------------------------------------------------------------------------


def test_a_sync_request_waits_until_the_job_deadline_and_its_slack_whatever_it_prefers() -> None:
    for prefs in (NO_PREFERENCES, Preferences(True, None), Preferences(True, 1.0)):
        assert wait_terms("sync", 10.0, prefs, DEADLINE, NOW) == (
            DEADLINE + SLACK,
            DEADLINE + SLACK,
            (),
        )


@pytest.mark.parametrize(
    ("prefs", "until", "applied"),
    [
        pytest.param(NO_PREFERENCES, NOW + 10.0, (), id="sync_wait"),
        pytest.param(Preferences(wait=3.0), NOW + 3.0, ("wait=3",), id="shorter-wait"),
        pytest.param(Preferences(wait=10.0), NOW + 10.0, ("wait=10",), id="equal-wait"),
        pytest.param(Preferences(wait=60.0), NOW + 10.0, (), id="longer-wait-not-applied"),
        pytest.param(Preferences(respond_async=True), NOW, (), id="respond-async"),
        pytest.param(Preferences(True, 2.0), NOW + 2.0, ("wait=2",), id="async-and-wait"),
        pytest.param(Preferences(wait=0.0), NOW, ("wait=0",), id="wait-zero"),
    ],
)
def test_an_auto_request_waits_sync_wait_shortened_by_its_preferences(
    prefs: Preferences, until: float, applied: tuple[str, ...]
) -> None:
    assert wait_terms("auto", 10.0, prefs, DEADLINE, NOW) == (until, DEADLINE + SLACK, applied)


def test_an_auto_wait_never_outlasts_the_job() -> None:
    # The job's deadline comes first: the wait ends there, and the answer is a 504.
    until, deadline, _ = wait_terms("auto", 60.0, NO_PREFERENCES, DEADLINE, NOW)
    assert until == deadline == DEADLINE + SLACK
    assert ran_out(until, deadline, drained=False) is RanOut.DEADLINE_PASSED


@given(
    mode=st.sampled_from(["sync", "auto"]),
    sync_wait=st.floats(0, 1e6),
    respond_async=st.booleans(),
    wait=st.none() | st.integers(0, 999_999_999).map(float),
    left=st.floats(0, 1e6),
)
def test_a_wait_ends_by_the_job_deadline_and_applies_only_what_it_used(
    mode: Mode, sync_wait: float, respond_async: bool, wait: float | None, left: float
) -> None:
    prefs = Preferences(respond_async, wait)
    until, deadline, applied = wait_terms(mode, sync_wait, prefs, NOW + left, NOW)
    assert deadline == NOW + left + SLACK
    assert NOW <= until <= deadline
    if applied:
        assert mode == "auto"
        assert wait is not None
        assert applied == (f"wait={wait:g}",)
        assert until == min(deadline, NOW + wait)


def test_a_wait_that_ran_out_answers_503_after_a_drain_202_for_its_own_end_else_504() -> None:
    assert ran_out(NOW, DEADLINE, drained=True) is RanOut.SHUTTING_DOWN
    assert ran_out(DEADLINE, DEADLINE, drained=True) is RanOut.SHUTTING_DOWN
    assert ran_out(NOW, DEADLINE, drained=False) is RanOut.ACCEPTED
    assert ran_out(DEADLINE, DEADLINE, drained=False) is RanOut.DEADLINE_PASSED


def test_preference_applied_names_respond_async_first_and_nothing_when_none() -> None:
    assert preference_applied(False, ()) is None
    assert preference_applied(True, ()) == "respond-async"
    assert preference_applied(False, ("wait=3",)) == "wait=3"
    assert preference_applied(True, ("wait=3",)) == "respond-async, wait=3"


# -- Idempotency-Key -----------------------------------------------------------------------


@dataclass
class FakeClaim:
    fingerprint: str
    job_id: str | None = None


def test_a_key_is_scoped_to_its_route_and_a_malformed_one_is_a_400() -> None:
    assert idempotency_key("orders", None) is None
    assert idempotency_key("orders", "  k-1 ") == "orders\nk-1"
    assert idempotency_key("orders", "k-1") != idempotency_key("refunds", "k-1")
    for bad in ("", "   ", "with space", "é", "x" * 256):
        with pytest.raises(Problem) as info:
            idempotency_key("orders", bad)
        assert (info.value.status, info.value.slug) == (400, "bad-idempotency-key")


def test_a_claimed_key_is_submitted_waited_on_looked_up_or_refused() -> None:
    assert key_step(None, "abc") is KeyStep.SUBMIT
    assert key_step(FakeClaim("abc"), "abc") is KeyStep.WAIT
    assert key_step(FakeClaim("abc", "job-1"), "abc") is KeyStep.LOOK_UP
    for claim in (FakeClaim("other"), FakeClaim("other", "job-1")):
        with pytest.raises(Problem) as info:
            key_step(claim, "abc")
        assert (info.value.status, info.value.slug) == (422, "idempotency-key-reused")


def test_only_a_cancelled_or_dropped_job_frees_its_key() -> None:
    assert frees_key(None)
    assert frees_key(Status.CANCELLED)
    assert not any(frees_key(status) for status in Status if status is not Status.CANCELLED)


# -- what is refused -----------------------------------------------------------------------


def test_refusals_are_problems_a_client_can_act_on() -> None:
    cases = [
        (shutting_down(), 503, "shutting-down", {"Retry-After": "1"}),
        (deadline_passed("j1"), 504, "deadline-exceeded", {}),
        (key_busy(), 409, "idempotency-key-busy", {"Retry-After": "1"}),
        (stream_taken("j1"), 409, "stream-taken", {"Location": "/jobs/j1"}),
    ]
    for problem, status, slug, headers in cases:
        assert (problem.status, problem.slug, problem.headers) == (status, slug, headers)
        assert problem.detail
    assert deadline_passed("j1").extensions["job_id"] == "j1"


def test_a_job_whose_outcome_cannot_be_read_is_named_never_said_undone() -> None:
    problem = outcome_unknown("j1", "tok")
    assert (problem.status, problem.slug) == (503, "store-unavailable")
    assert "nothing was done" not in problem.detail
    # No Retry-After: the request is not to be sent again (its job is followed instead).
    assert problem.headers == {"Location": "/jobs/j1", "X-Job-Id": "j1", "X-Job-Token": "tok"}
    document = problem.document(correlation_id="c", instance="/held")
    assert (document["job_id"], document["token"]) == ("j1", "tok")
    assert "X-Job-Token" not in outcome_unknown("j1", None).headers


def test_the_store_away_says_nothing_was_done_only_when_nothing_reached_it() -> None:
    never_sent = StoreUnavailable("no connection", maybe_done=False)
    assert "nothing was done" in problem_for_exception(never_sent).detail
    lost = StoreUnavailable("connection lost after the write was sent")
    detail = problem_for_exception(lost).detail
    assert "nothing was done" not in detail
    assert "may or may not have been made" in detail
