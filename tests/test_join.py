"""The join state machine: every kind, the concurrency cap, late reports, the wire format."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipework import RegistrationError
from pipework.pipes._join import Decision, Join, Outcome

OUTCOMES: list[Outcome] = ["ok", "error", "cancelled", "timed_out"]


def rewire(join: Join) -> Join:
    """The join as the engine gets it back from the job record."""
    return Join.from_wire(msgpack.unpackb(msgpack.packb(join.to_wire())))


# -- all_of --------------------------------------------------------------------------------------


def test_all_of_resolves_ok_when_every_branch_succeeds() -> None:
    join = Join.all_of(3)
    assert join.start() == Decision(start=(0, 1, 2))
    assert join.branch_done(2, "ok") == Decision()
    assert join.branch_done(0, "ok") == Decision()
    assert join.branch_done(1, "ok") == Decision(resolved="ok", merge=(0, 1, 2))
    assert join.finished


def test_all_of_fails_on_the_first_failure_and_cancels_the_rest() -> None:
    join = Join.all_of(3)
    join.start()
    join.branch_done(0, "ok")
    assert join.branch_done(2, "timed_out") == Decision(
        cancel=(1,), resolved="failed", failures=(2,)
    )
    assert not join.finished
    # The cancelled branch reports later: recorded, nothing decided.
    assert join.branch_done(1, "cancelled") == Decision()
    assert join.outcomes == ("ok", "cancelled", "timed_out")
    assert join.finished


def test_all_of_settle_waits_for_every_branch_and_keeps_each_outcome() -> None:
    join = Join.all_of(3, settle=True)
    join.start()
    assert join.branch_done(1, "error") == Decision()
    assert join.branch_done(0, "ok") == Decision()
    assert join.branch_done(2, "timed_out") == Decision(resolved="failed", failures=(1, 2))
    assert join.outcomes == ("ok", "error", "timed_out")


def test_all_of_settle_resolves_ok_when_all_succeed() -> None:
    join = Join.all_of(2, settle=True)
    join.start()
    join.branch_done(1, "ok")
    assert join.branch_done(0, "ok") == Decision(resolved="ok", merge=(0, 1))


# -- any_of --------------------------------------------------------------------------------------


def test_any_of_first_success_wins_and_the_losers_are_cancelled() -> None:
    join = Join.any_of(3)
    join.start()
    assert join.branch_done(0, "error") == Decision()
    assert join.branch_done(2, "ok") == Decision(cancel=(1,), resolved="ok", merge=(2,))
    # A loser that succeeded too late is recorded but never merged.
    assert join.branch_done(1, "ok") == Decision()
    assert join.merge == (2,)
    assert join.outcomes == ("error", "ok", "ok")


def test_any_of_fails_with_every_error_when_all_branches_fail() -> None:
    join = Join.any_of(3)
    join.start()
    join.branch_done(1, "error")
    join.branch_done(0, "timed_out")
    assert join.branch_done(2, "cancelled") == Decision(resolved="failed", failures=(0, 1, 2))


def test_any_of_with_a_cap_of_one_tries_branches_in_order() -> None:
    join = Join.any_of(3, max_concurrency=1)
    assert join.start() == Decision(start=(0,))
    assert join.branch_done(0, "error") == Decision(start=(1,))
    assert join.branch_done(1, "ok") == Decision(resolved="ok", merge=(1,))
    assert join.outcomes == ("error", "ok", "not_started")


# -- quorum --------------------------------------------------------------------------------------


def test_quorum_resolves_at_the_kth_success() -> None:
    join = Join.quorum(2, 4)
    join.start()
    join.branch_done(3, "ok")
    join.branch_done(0, "error")
    assert join.branch_done(1, "ok") == Decision(cancel=(2,), resolved="ok", merge=(1, 3))


def test_quorum_fails_the_moment_k_becomes_unreachable() -> None:
    join = Join.quorum(3, 5)
    join.start()
    join.branch_done(0, "ok")
    assert join.branch_done(1, "error") == Decision()
    # 1 ok + 2 still open: 3 is still reachable.
    assert join.branch_done(2, "error") == Decision()
    assert join.branch_done(3, "timed_out") == Decision(
        cancel=(4,), resolved="failed", failures=(1, 2, 3)
    )


def test_quorum_refuses_impossible_k() -> None:
    with pytest.raises(RegistrationError, match="k=4"):
        Join.quorum(4, 3)
    with pytest.raises(RegistrationError, match="k=0"):
        Join.quorum(0, 3)


# -- graph ---------------------------------------------------------------------------------------

# The seed-002 shape: A, B, C roots; C detached; D after A; E after B and D.
A, B, C, D, E = range(5)
SEED_PARENTS = [[], [], [], [A], [B, D]]
SEED_DETACH = [False, False, True, False, False]


def test_graph_runs_the_seed_shape() -> None:
    join = Join.graph(SEED_PARENTS, SEED_DETACH)
    assert join.start() == Decision(start=(A, B, C))
    assert join.branch_done(C, "error") == Decision()  # detached: not fatal
    assert join.branch_done(B, "ok") == Decision()  # E still waits for D
    assert join.branch_done(A, "ok") == Decision(start=(D,))
    assert join.branch_done(D, "ok") == Decision(start=(E,))
    assert join.branch_done(E, "ok") == Decision(resolved="ok", merge=(A, B, D, E))
    assert join.outcomes == ("ok", "ok", "error", "ok", "ok")


def test_graph_resolves_without_waiting_for_a_detached_node() -> None:
    join = Join.graph(SEED_PARENTS, SEED_DETACH)
    join.start()
    for node in (A, B, D, E):
        join.branch_done(node, "ok")
    assert join.resolved == "ok"
    assert join.running == (C,)
    assert not join.finished
    assert join.branch_done(C, "ok") == Decision()
    assert join.finished


def test_graph_fails_on_a_core_node_and_leaves_detached_nodes_alone() -> None:
    join = Join.graph(SEED_PARENTS, SEED_DETACH)
    join.start()
    assert join.branch_done(A, "error") == Decision(cancel=(B,), resolved="failed", failures=(A,))
    assert join.outcomes == ("error", "running", "running", "not_started", "not_started")


def test_graph_starts_queued_detached_nodes_when_it_resolves() -> None:
    # Root 0; detached 1 and 2 after it; core 3 after it. Cap 1 keeps the detached queued.
    join = Join.graph([[], [0], [0], [0]], [False, True, True, False], max_concurrency=1)
    assert join.start() == Decision(start=(0,))
    assert join.branch_done(0, "ok") == Decision(start=(1,))
    assert join.branch_done(1, "error") == Decision(start=(2,))
    assert join.branch_done(2, "ok") == Decision(start=(3,))
    join = Join.graph([[], [0], [0]], [False, False, True], max_concurrency=1)
    join.start()
    assert join.branch_done(0, "ok") == Decision(start=(1,))
    assert join.branch_done(1, "ok") == Decision(start=(2,), resolved="ok", merge=(0, 1))


def test_graph_of_detached_nodes_only_resolves_at_start() -> None:
    join = Join.graph([[], []], [True, True])
    assert join.start() == Decision(start=(0, 1), resolved="ok")


@pytest.mark.parametrize(
    ("parents", "detach", "message"),
    [
        ([[1], [0]], None, r"graph cycle 0 -> 1 -> 0"),
        ([[], [5]], None, r"node 1 names bad parent 5"),
        ([[0]], None, r"node 0 names bad parent 0"),
        ([[], [0]], [True, False], r"node 1 waits for detached node 0"),
        ([[], []], [False], r"2 nodes but 1 detach flags"),
    ],
)
def test_graph_refuses_a_graph_that_could_deadlock(
    parents: list[list[int]], detach: list[bool] | None, message: str
) -> None:
    with pytest.raises(RegistrationError, match=message):
        Join.graph(parents, detach)


# -- max_concurrency, misuse, wire ---------------------------------------------------------------


def test_max_concurrency_starts_the_rest_as_others_end() -> None:
    join = Join.all_of(5, max_concurrency=2)
    assert join.start() == Decision(start=(0, 1))
    assert join.branch_done(1, "ok") == Decision(start=(2,))
    assert join.branch_done(0, "ok") == Decision(start=(3,))
    assert join.branch_done(3, "ok") == Decision(start=(4,))
    assert join.branch_done(2, "error") == Decision(cancel=(4,), resolved="failed", failures=(2,))


def test_late_and_duplicate_reports_are_ignored() -> None:
    join = Join.any_of(3, max_concurrency=2)
    join.start()
    assert join.branch_done(0, "error") == Decision(start=(2,))
    assert join.branch_done(0, "ok") == Decision()  # duplicate, even with another outcome
    assert join.branch_done(1, "ok") == Decision(cancel=(2,), resolved="ok", merge=(1,))
    assert join.branch_done(1, "ok") == Decision()
    assert join.branch_done(2, "timed_out") == Decision()
    assert join.branch_done(2, "ok") == Decision()
    assert join.outcomes == ("error", "ok", "timed_out")


def test_misuse_is_refused() -> None:
    join = Join.all_of(2, max_concurrency=1)
    with pytest.raises(RuntimeError, match="never started"):
        join.branch_done(0, "ok")
    join.start()
    with pytest.raises(RuntimeError, match="already started"):
        join.start()
    with pytest.raises(RuntimeError, match="never started"):
        join.branch_done(1, "ok")
    with pytest.raises(ValueError, match="unknown outcome 'fine'"):
        join.branch_done(0, "fine")  # type: ignore[arg-type]  # the point: a bad outcome label
    with pytest.raises(IndexError):
        join.branch_done(2, "ok")
    with pytest.raises(RegistrationError, match="at least one branch"):
        Join.all_of(0)
    with pytest.raises(RegistrationError, match="max_concurrency"):
        Join.any_of(2, max_concurrency=0)
    with pytest.raises(ValueError, match="version"):
        Join.from_wire({**join.to_wire(), "version": 99})


def test_wire_form_is_plain_data() -> None:
    join = Join.graph(SEED_PARENTS, SEED_DETACH, max_concurrency=2)
    join.start()
    wire = join.to_wire()
    assert msgpack.unpackb(msgpack.packb(wire)) == wire
    assert rewire(join).to_wire() == wire


@st.composite
def joins(draw: st.DrawFn) -> Join:
    n = draw(st.integers(1, 6))
    cap = draw(st.none() | st.integers(1, n))
    kind = draw(st.sampled_from(["all_of", "any_of", "quorum", "graph"]))
    if kind == "all_of":
        return Join.all_of(n, settle=draw(st.booleans()), max_concurrency=cap)
    if kind == "any_of":
        return Join.any_of(n, max_concurrency=cap)
    if kind == "quorum":
        return Join.quorum(draw(st.integers(1, n)), n, max_concurrency=cap)
    # A random DAG over a shuffled declaration order; detached nodes are never parents.
    detach = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    order = draw(st.permutations(range(n)))
    parents: list[list[int]] = [[] for _ in range(n)]
    for pos, node in enumerate(order):
        earlier = [p for p in order[:pos] if not detach[p]]
        parents[node] = draw(st.lists(st.sampled_from(earlier), unique=True)) if earlier else []
    return Join.graph(parents, detach, max_concurrency=cap)


def check(join: Join, before: tuple[str, ...], decision: Decision) -> None:
    """Invariants of one decision, given the branch labels before it."""
    assert set(decision.start) <= {i for i, s in enumerate(before) if s == "waiting"}
    assert set(decision.cancel) <= {i for i, s in enumerate(before) if s == "running"}
    assert all(join.outcomes[i] == "ok" for i in decision.merge)
    if join.resolved is None:
        assert join.max_concurrency is None or len(join.running) <= join.max_concurrency
        assert "not_started" not in join.outcomes
    core = [s for s, detached in zip(join.outcomes, join.detached, strict=True) if not detached]
    ok = core.count("ok")
    still_open = sum(s in ("waiting", "running", "not_started") for s in core)
    if decision.resolved == "ok":
        assert len(decision.merge) == ok == join.need
    elif decision.resolved == "failed":
        assert decision.failures
        assert decision.merge == ()
        assert not still_open if join.settle else ok + still_open < join.need
    elif join.resolved is None:  # neither too late nor too early
        assert ok < join.need
        assert still_open if join.settle else ok + still_open >= join.need
    for i in decision.start:
        assert all(join.outcomes[p] == "ok" for p in join.parents[i])


@given(joins(), st.data())
def test_random_runs_decide_the_same_after_every_wire_round_trip(
    join: Join, data: st.DataObject
) -> None:
    wired = rewire(join)
    decision = join.start()
    assert wired.start() == decision
    check(join, ("waiting",) * join.n, decision)
    resolutions = [decision.resolved] if decision.resolved else []
    for _ in range(4 * join.n):
        wired = rewire(wired)
        started = [i for i, s in enumerate(join.outcomes) if s not in ("waiting", "not_started")]
        if not join.running:
            break
        i = data.draw(st.sampled_from(started))  # includes finished ones: duplicate reports
        outcome = data.draw(st.sampled_from(OUTCOMES))
        before = join.outcomes
        decision = join.branch_done(i, outcome)
        assert wired.branch_done(i, outcome) == decision
        assert wired.to_wire() == join.to_wire()
        check(join, before, decision)
        if decision.resolved:
            resolutions.append(decision.resolved)
    while join.running:  # the engine reports every branch it started, eventually
        before = join.outcomes
        decision = join.branch_done(join.running[0], "cancelled")
        check(join, before, decision)
        if decision.resolved:
            resolutions.append(decision.resolved)
    # Never stuck: once every started branch has reported, the join has resolved exactly once.
    assert join.finished
    assert resolutions == [join.resolved]
    assert all(s not in ("waiting", "running") for s in join.outcomes)


# -- what the parent merges, what a graph node starts from ---------------------------------------


def test_graph_merges_only_the_frontier_and_nodes_start_from_their_ancestors() -> None:
    join = Join.graph(SEED_PARENTS, SEED_DETACH)
    assert join.ancestors(E) == {A, B, D}
    assert join.start_from(A) == ()
    assert join.start_from(D) == (A,)
    assert join.start_from(E) == (B, D)  # A's changes reach E through D, counted once
    assert join.frontier([A, B, D]) == (B, D)
    assert join.frontier([]) == ()
    join.start()
    assert not join.continues
    assert join.to_merge == ()
    for node in (C, A, B, D, E):
        join.branch_done(node, "ok")
    assert join.merge == (A, B, D, E)
    assert join.continues
    assert join.to_merge == (E,)  # E's delta holds A's, B's and D's; C is detached


def test_a_graph_that_resolves_before_a_node_ran_merges_the_nodes_that_did() -> None:
    # Two chains 0 -> 1 and 2 -> 3: the frontier is 1 and 3, never 0 or 2.
    join = Join.graph([[], [0], [], [2]])
    join.start()
    for node in (0, 2, 1, 3):
        join.branch_done(node, "ok")
    assert join.to_merge == (1, 3)


def test_settle_merges_whatever_succeeded_even_when_it_resolved_failed() -> None:
    join = Join.all_of(4, settle=True)
    join.start()
    join.branch_done(3, "ok")
    join.branch_done(1, "error")
    join.branch_done(0, "ok")
    assert not join.continues
    assert join.branch_done(2, "timed_out") == Decision(resolved="failed", failures=(1, 2))
    assert join.continues  # settle goes on and records each outcome instead of failing
    assert join.to_merge == (0, 3)
    assert join.outcomes == ("ok", "error", "timed_out", "ok")


def test_without_settle_a_failed_join_merges_nothing() -> None:
    join = Join.all_of(2)
    join.start()
    join.branch_done(0, "ok")
    join.branch_done(1, "error")
    assert join.resolved == "failed"
    assert not join.continues
    assert join.to_merge == ()


@pytest.mark.parametrize(
    ("join", "reports", "merged"),
    [
        (Join.any_of(3), [(2, "error"), (1, "ok")], (1,)),
        (Join.quorum(2, 4), [(3, "ok"), (0, "error"), (1, "ok")], (1, 3)),
        (Join.all_of(3), [(2, "ok"), (0, "ok"), (1, "ok")], (0, 1, 2)),
    ],
)
def test_other_kinds_merge_what_resolved_them(
    join: Join, reports: list[tuple[int, Outcome]], merged: tuple[int, ...]
) -> None:
    join.start()
    for i, outcome in reports:
        join.branch_done(i, outcome)
    assert join.continues
    assert join.to_merge == merged == join.merge
    assert all(join.start_from(i) == () for i in range(join.n))


@given(joins(), st.data())
def test_merged_and_start_deltas_count_every_change_exactly_once(
    join: Join, data: st.DataObject
) -> None:
    """For any join and completion order: what a node starts from and what the parent
    merges hold no node together with one of its ancestors (a change counted twice), and
    leave no ok node out (a change lost)."""

    def check_cover(chosen: tuple[int, ...], must_cover: set[int]) -> None:
        assert list(chosen) == sorted(set(chosen))
        for node in chosen:
            assert not join.ancestors(node) & set(chosen)
        covered = set(chosen).union(*(join.ancestors(node) for node in chosen))
        assert covered == must_cover

    def started(decision: Decision) -> None:
        for i in decision.start:
            ancestors = set(join.ancestors(i))
            assert all(join.outcomes[a] == "ok" for a in ancestors)
            check_cover(join.start_from(i), ancestors)

    started(join.start())
    while join.running:
        i = data.draw(st.sampled_from(join.running))
        started(join.branch_done(i, data.draw(st.sampled_from(OUTCOMES))))
    if not join.continues:
        assert join.to_merge == ()
        return
    ok_core = {i for i, s in enumerate(join.outcomes) if s == "ok" and not join.detached[i]}
    if join.kind == "graph" or join.settle:
        check_cover(join.to_merge, ok_core)
    else:
        assert set(join.to_merge) <= ok_core
        assert len(join.to_merge) == join.need
    assert join.to_merge == rewire(join).to_merge


@given(joins(), st.data())
def test_fresh_runs_of_one_shape_are_independent(join: Join, data: st.DataObject) -> None:
    """A stage builds its join's shape once and starts each run from ``fresh()``: a run
    decides as a join built anew does, whatever an earlier run of the same shape did."""
    unstarted = join.to_wire()
    for _ in range(2):
        run, anew = join.fresh(), Join.from_wire(unstarted)
        assert run.to_wire() == unstarted
        decision = run.start()
        assert anew.start() == decision
        while run.running:
            i = data.draw(st.sampled_from(run.running))
            outcome = data.draw(st.sampled_from(OUTCOMES))
            before = run.outcomes
            decision = run.branch_done(i, outcome)
            assert anew.branch_done(i, outcome) == decision
            check(run, before, decision)
        assert run.to_wire() == anew.to_wire()
        assert run.to_merge == anew.to_merge
    assert join.to_wire() == unstarted  # the shape itself never runs
