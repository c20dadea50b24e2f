"""Degradation's decisions, without trio: why a pipe is degraded, what it usually takes,
how the job records it, how a pipe declares it, how its branches merge it, and how an
answer's header says it."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import pipework as pw
from pipework._http._jobs import degraded_header
from pipework.dispatcher._degrade_core import (
    ALPHA,
    REASONS,
    Estimates,
    degraded_delta,
    mark,
    reason_after,
    reason_before,
)
from pipework.dispatcher._job import degraded_of
from pipework.pipes._merge import Delta, merge


async def noop(ctx: pw.Context) -> None:
    pass


# -- why ---------------------------------------------------------------------------------------


def test_a_refusing_key_comes_first_then_too_little_time() -> None:
    assert reason_before(True, math.inf, None) == "refused"
    assert reason_before(True, 0.1, 1.0) == "refused"
    assert reason_before(False, 0.5, 1.0) == "deadline"
    assert reason_before(False, 1.0, 1.0) is None  # exactly the usual time: it may run
    assert reason_before(False, 0.5, None) is None  # never ran: nothing is known of it
    assert reason_before(False, math.inf, 1e9) is None


def test_the_reasons_are_the_documented_five() -> None:
    assert REASONS == ("refused", "deadline", "no_slot", "error", "timeout")


def test_what_a_pipe_usually_takes_is_a_weighted_mean_of_its_runs() -> None:
    estimates = Estimates()
    assert estimates.usual("p") is None
    estimates.observe("p", 1.0)
    assert estimates.usual("p") == 1.0  # the first run is the estimate
    estimates.observe("p", 2.0)
    assert estimates.usual("p") == pytest.approx(1.0 + ALPHA * 1.0)
    assert estimates.usual("q") is None  # per pipe


def test_each_skip_for_time_decays_the_estimate_so_the_pipe_is_tried_again() -> None:
    estimates = Estimates()
    estimates.observe("p", 10.0)
    skips = 0
    while reason_before(False, 2.0, estimates.usual("p")) == "deadline":
        estimates.skipped("p")
        skips += 1
    assert skips == 8  # 10 * 0.8**8 < 2 <= 10 * 0.8**7
    estimates.skipped("unknown")  # nothing to decay
    assert estimates.usual("unknown") is None


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan])
def test_a_duration_is_a_finite_number_of_seconds(bad: float) -> None:
    with pytest.raises(ValueError, match="finite number of seconds"):
        Estimates().observe("p", bad)


# -- the record --------------------------------------------------------------------------------


def test_marks_go_to_a_new_dict_each_time() -> None:
    shared: dict[str, str] = {"a": "no_slot"}
    state: dict[str, Any] = {"degraded": shared}
    mark(state, "b", "refused")
    assert state["degraded"] == {"a": "no_slot", "b": "refused"}
    assert shared == {"a": "no_slot"}  # a snapshot sharing it is left alone
    other: dict[str, Any] = {"degraded": "not the engine's"}
    mark(other, "c", "error")
    assert other["degraded"] == {"c": "error"}


def test_what_a_state_records_as_degraded() -> None:
    assert degraded_of({}) == {}
    assert degraded_of({"degraded": {"a": "no_slot", 1: "x", "b": 2}}) == {"a": "no_slot"}
    assert degraded_of({"degraded": ["a"]}) == {}


# -- declaring it ------------------------------------------------------------------------------


def test_a_pipe_is_degradable_when_optional_or_with_a_fallback() -> None:
    assert not pw.Pipe(noop, "p").degradable
    assert pw.Pipe(noop, "p", optional=True).degradable
    assert pw.Pipe(noop, "p", fallback={}).degradable
    assert pw.Pipe(noop, "p", fallback=pw.Pipe(noop, "q")).degradable


def test_a_fallback_mapping_is_copied_each_time() -> None:
    pipe = pw.Pipe(noop, "p", fallback={"items": [1, 2], "note": "cached"})
    first = pipe.fallback_state()
    first["items"].append(3)
    assert pipe.fallback_state() == {"items": [1, 2], "note": "cached"}
    assert pw.Pipe(noop, "q", optional=True).fallback_state() == {}


@pytest.mark.parametrize(
    ("fallback", "message"),
    [
        ({"when": object()}, r"pipe 'p': fallback: fallback\.when holds object"),
        ({1: "x"}, r"pipe 'p': fallback: state keys must be strings, got 1"),
        ({"degraded": {}}, r"fallback sets 'degraded', where the engine records"),
        ("cached", r"fallback must be a mapping of state keys .* or a pipe"),
        (
            pw.Pipe(noop, "q", optional=True),
            r"fallback 'q' is optional or has a fallback itself",
        ),
    ],
)
def test_a_bad_fallback_is_refused_when_declared(fallback: Any, message: str) -> None:
    with pytest.raises(pw.RegistrationError, match=message):
        pw.Pipe(noop, "p", fallback=fallback)


def test_optional_is_a_boolean() -> None:
    with pytest.raises(pw.RegistrationError, match="optional must be True or False"):
        pw.Pipe(noop, "p", optional="yes")  # type: ignore[arg-type]  # the mistake tested


def test_the_decorator_takes_both() -> None:
    engine = pw.Engine()
    cached = pw.Pipe(noop, "cached")

    @engine.pipe(key="recs", optional=True)
    async def recommend(ctx: pw.Context) -> None:
        pass

    @engine.pipe(fallback=cached)
    async def price(ctx: pw.Context) -> None:
        pass

    assert recommend.optional
    assert recommend.key == "recs"
    assert price.fallback is cached


def test_a_chain_reads_what_its_fallback_pipes_read_of_the_request() -> None:
    reads = pw.Pipe(noop, "cached", request_use=pw.RequestUse(headers=frozenset({"x-tenant"})))
    engine = pw.Engine()
    chain = engine.chain("c", pw.Pipe(noop, "price", fallback=reads))
    assert chain.request_use == pw.RequestUse(headers=frozenset({"x-tenant"}))


# -- merging what branches record --------------------------------------------------------------


def test_branches_degraded_apart_merge_their_records_whatever_the_policy() -> None:
    parent = {"degraded": {"early": "refused"}}
    a = Delta(changed={"degraded": {"early": "refused", "a": "no_slot"}, "x": 1})
    b = Delta(changed={"degraded": {"early": "refused", "b": "error"}})
    for policy in (None, "last", pw.MergePolicy(keys={"x": "sum"})):
        stage = pw.all_of(pw.Pipe(noop, "a"), pw.Pipe(noop, "b"), merge=policy)
        merged = merge(parent, [("a", a), ("b", b)], stage.merge_rules)
        assert merged["degraded"] == {"early": "refused", "a": "no_slot", "b": "error"}
    named = pw.all_of(noop, merge=pw.MergePolicy(keys={"degraded": "last"}))
    assert named.merge_rules.rule("degraded") == "last"  # the policy's own word wins


# -- the header --------------------------------------------------------------------------------


def test_the_header_is_a_structured_field_list() -> None:
    assert degraded_header({"recommend": "no_slot"}) == "recommend;reason=no_slot"
    assert (
        degraded_header({"recs": "no_slot", "ads v2": "refused", 'say "hi"\\': "error"})
        == 'recs;reason=no_slot, "ads v2";reason=refused, "say \\"hi\\"\\\\";reason=error'
    )
    # Beyond printable ASCII: a display string (RFC 9651), UTF-8 percent-encoded.
    assert degraded_header({"préférences": "timeout"}) == '%"pr%c3%a9f%c3%a9rences";reason=timeout'
    assert degraded_header({"50%": "deadline"}) == '"50%";reason=deadline'


@given(st.dictionaries(st.text(min_size=1), st.sampled_from(REASONS), min_size=1))
def test_the_header_is_always_one_line_of_visible_ascii(degraded: dict[str, str]) -> None:
    value = degraded_header(degraded)
    assert all(" " <= c <= "~" for c in value)
    assert value.count(";reason=") >= len(degraded)


# -- a branch, as a whole ----------------------------------------------------------------------


def test_a_branch_that_ended_is_degraded_only_when_it_failed() -> None:
    assert reason_after(False, False) is None
    assert reason_after(False, True) is None  # a stage's or job's time: not the branch's
    assert reason_after(True, False) == "error"
    assert reason_after(True, True) == "timeout"


_values = st.one_of(st.integers(), st.text(max_size=3), st.lists(st.integers(), max_size=2))
_states = st.dictionaries(st.sampled_from(["a", "b", "c", "recs"]), _values, max_size=4)


@given(
    parent=_states,
    marks=st.dictionaries(st.sampled_from(["x", "y", "recs"]), st.sampled_from(REASONS)),
    ancestors=_states,
    fallback=_states,
    name=st.sampled_from(["x", "recs", "fetch+rank"]),
    reason=st.sampled_from(REASONS),
)
def test_a_degraded_branch_hands_its_stage_its_fallback_and_its_mark_only(
    parent: dict[str, Any],
    marks: dict[str, str],
    ancestors: dict[str, Any],
    fallback: dict[str, Any],
    name: str,
    reason: Any,
) -> None:
    if marks:
        parent = {**parent, "degraded": marks}
    start = {**parent, **ancestors}  # a graph node starts from its ancestors' results too
    change = degraded_delta(parent, start, fallback, name, reason)
    # Nothing but what it started from, its fallback's keys and the record; nothing removed.
    assert set(change.touched) <= {*ancestors, *fallback, "degraded"}
    assert change.removed == ()
    # Merged as a stage merges it, the parent's state holds the fallback and every mark.
    merged = merge(dict(parent), [(name, change)], pw.all_of(noop).merge_rules, where="test")
    assert merged["degraded"] == {**marks, name: reason}
    for key, value in fallback.items():
        assert merged[key] == value
    for key in start.keys() - fallback.keys() - {"degraded"}:
        assert merged[key] == start[key]
    assert parent.get("degraded", {}) == marks  # the parent's record is not changed in place
