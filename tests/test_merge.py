"""Snapshot and merge: independent copies, deltas, declaration order, conflicts, reducers."""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Sequence
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipework import MISSING, MergeConflict, MergePolicy, RegistrationError, StateError
from pipework.dispatcher._instep import _packed_unless_scalar
from pipework.pipes._merge import (
    Delta,
    delta,
    merge,
    merge_strict,
    packed_state,
    same_value,
    snapshot,
    unpacked_state,
)

# -- strategies ----------------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=5)
    | st.binary(max_size=5)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=4)
    ),
    max_leaves=8,
)
KEYS = ["a", "b", "c", "d", "e"]
states = st.dictionaries(st.sampled_from(KEYS), values, max_size=5)
# What branches write: a small pool, so that equal and nearly equal values meet often.
TRICKY: list[Any] = [0, 1, True, 1.0, math.nan, "x", None, [1], [True], (1,), {"k": 1}]
writes = st.sampled_from(TRICKY) | scalars


# A branch's edits: (key, remove it if present, else the value to write).
Edits = list[tuple[str, bool, Any]]
edits = st.lists(st.tuples(st.sampled_from(KEYS), st.booleans(), writes), max_size=3)


def run_branch(parent: dict[str, Any], branch_edits: Edits) -> dict[str, Any]:
    """A branch's state after it ran: its snapshot with some keys set and some removed."""
    after = snapshot(parent)
    for key, remove, value in branch_edits:
        if remove and key in after:
            del after[key]
        else:
            after[key] = value
    return after


Stage = tuple[dict[str, Any], list[tuple[str, Delta]]]


@st.composite
def stages(draw: st.DrawFn) -> Stage:
    """A parent state and its branches' deltas, in declaration order."""
    parent = draw(states)
    afters = [run_branch(parent, e) for e in draw(st.lists(edits, min_size=1, max_size=4))]
    return parent, [(f"b{i}", delta(parent, after)) for i, after in enumerate(afters)]


def wire(obj: Any) -> Any:
    return msgpack.unpackb(msgpack.packb(obj), strict_map_key=False)


def conflicting(deltas: Sequence[tuple[str, Delta]]) -> dict[str, tuple[str, ...]]:
    """Brute force: key -> branches that changed it, for keys changed to different values."""
    found: dict[str, tuple[str, ...]] = {}
    for key in KEYS:
        changes = [(name, d.value(key)) for name, d in deltas if key in d.touched]
        if any(not same_value(changes[0][1], v) for _, v in changes):
            found[key] = tuple(name for name, _ in changes)
    return found


# -- snapshot ------------------------------------------------------------------------------------


def test_a_branch_never_observes_a_siblings_write() -> None:
    parent: dict[str, Any] = {"user": {"tags": ["a"], "n": 1}, "items": [[1, 2]]}
    before = copy.deepcopy(parent)
    left, right = snapshot(parent), snapshot(parent)
    left["user"]["tags"].append("mine")
    left["items"][0].append(3)
    left["new"] = True
    assert right == before
    assert parent == before
    assert snapshot(parent) == before


@given(states, st.data())
def test_snapshots_are_equal_and_independent_all_the_way_down(
    state: dict[str, Any], data: Any
) -> None:
    copies = [snapshot(state) for _ in range(3)]
    assert all(same_value(c, state) for c in copies)
    victim = copies[data.draw(st.integers(0, 2))]
    # Mutate every container reachable from the victim.
    stack: list[Any] = [victim]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
            node["__touched__"] = 1
        elif isinstance(node, list):
            stack.extend(node)
            node.append("__touched__")
    for other in copies:
        if other is not victim:
            assert same_value(other, state)


def test_snapshot_names_the_value_it_cannot_store() -> None:
    with pytest.raises(StateError, match=r"state\.user\.tags\[1\]") as info:
        snapshot({"user": {"tags": ["ok", {1, 2}]}})
    assert info.value.path == "state.user.tags[1]"


# -- values and deltas ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b", "equal"),
    [
        (1, 1, True),
        (1, True, False),
        (1, 1.0, False),
        (math.nan, math.nan, True),
        ((1, [2]), [1, [2]], True),
        (b"x", bytearray(b"x"), True),
        ({"k": 1}, {"k": 1.0}, False),
        ({"k": 1}, {"j": 1}, False),
        ([1, 2], [1, 2, 3], False),
    ],
)
def test_same_value_compares_as_stored(a: Any, b: Any, equal: bool) -> None:
    assert same_value(a, b) is equal


def stored_equal(a: Any, b: Any) -> bool:
    """Equality as a msgpack round trip leaves the two values: the same type, NaN equal to
    NaN, and containers compared item by item (the reference for ``same_value``)."""
    a = msgpack.unpackb(msgpack.packb(a), strict_map_key=False)
    b = msgpack.unpackb(msgpack.packb(b), strict_map_key=False)

    def equal(x: Any, y: Any) -> bool:
        if type(x) is not type(y):
            return False
        if isinstance(x, float):
            return x == y or (math.isnan(x) and math.isnan(y))
        if isinstance(x, list):
            return len(x) == len(y) and all(map(equal, x, y))
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(equal(v, y[k]) for k, v in x.items())
        return bool(x == y)

    return equal(a, b)


@given(values | st.sampled_from(TRICKY), values | st.sampled_from(TRICKY))
def test_same_value_agrees_with_a_round_trip_through_msgpack(a: Any, b: Any) -> None:
    assert same_value(a, b) is stored_equal(a, b)
    assert same_value(a, a)
    assert same_value(b, b)


def test_delta_lists_added_changed_and_removed_keys() -> None:
    before = {"keep": 1, "change": [1], "drop": "x", "flag": 1}
    after = {"keep": 1, "change": [1, 2], "flag": True, "add": None}
    d = delta(before, after)
    assert d.changed == {"change": [1, 2], "flag": True, "add": None}
    assert d.removed == ("drop",)
    assert d.value("drop") is MISSING
    assert bool(d)
    assert not delta(after, snapshot(after))


@given(states, edits)
def test_merging_one_delta_reproduces_the_branch_state(
    state: dict[str, Any], branch_edits: Edits
) -> None:
    after = run_branch(state, branch_edits)
    d = delta(state, after)
    back = Delta.from_wire(wire(d.to_wire()))
    assert same_value(back.to_wire(), d.to_wire())
    assert back.removed == d.removed
    assert same_value(merge(state, [("only", d)]), after)


# -- declaration order and conflicts -------------------------------------------------------------

POLICIES: list[MergePolicy] = [
    MergePolicy("first"),
    MergePolicy("last"),
    MergePolicy(keys=dict.fromkeys(KEYS, "last")),
]


@given(stages(), st.randoms(use_true_random=False), st.sampled_from(POLICIES))
def test_merged_state_does_not_depend_on_completion_order(
    stage: Stage, rng: random.Random, policy: MergePolicy
) -> None:
    parent, declared = stage
    # Branches finish in any order; the engine files each result under its declaration index.
    finished = list(enumerate(declared))
    rng.shuffle(finished)
    arrived = dict(finished)
    in_order = [arrived[i] for i in sorted(arrived)]
    assert same_value(merge(parent, in_order, policy), merge(parent, declared, policy))


@given(stages(), st.randoms(use_true_random=False))
def test_strict_detects_every_conflict_and_is_otherwise_order_free(
    stage: Stage, rng: random.Random
) -> None:
    parent, declared = stage
    expected = conflicting(declared)
    if expected:
        with pytest.raises(MergeConflict) as info:
            merge(parent, declared, where="chain 'c' > all_of[0]")
        assert expected[info.value.key] == info.value.branches
        assert "chain 'c' > all_of[0]" in str(info.value)
        return
    merged = merge(parent, declared)
    shuffled = list(declared)
    rng.shuffle(shuffled)
    assert same_value(merge(parent, shuffled), merged)
    for _, d in declared:
        for key in d.touched:
            assert same_value(merged.get(key, MISSING), d.value(key))


@given(stages())
def test_the_strict_shortcut_agrees_with_the_general_path(stage: Stage) -> None:
    parent, declared = stage
    general = MergePolicy(keys={"unused": "strict"})  # strict for every key, the long way
    quick = merge_strict(parent, declared)
    try:
        expected = merge(parent, declared, general)
    except MergeConflict:
        assert quick is None  # the general path raises it, with the stage path
        return
    if quick is None:
        assert any(d.removed for _, d in declared)
        return
    assert list(quick) == list(expected)
    assert all(quick[key] is expected[key] for key in quick)


@given(st.dictionaries(st.text(max_size=3), scalars, max_size=5), values)
def test_a_state_of_scalars_is_copied_as_its_unpacking_would_be(
    state: dict[str, Any], value: Any
) -> None:
    assert _packed_unless_scalar(state) == b""
    copied, unpacked = dict(state), unpacked_state(packed_state(state))
    assert list(copied) == list(unpacked)
    assert all(
        type(copied[k]) is type(unpacked[k]) and same_value(copied[k], unpacked[k]) for k in copied
    )
    mixed = {**state, "nested": value}
    if not isinstance(value, list | dict):
        return
    assert same_value(unpacked_state(_packed_unless_scalar(mixed)), wire(mixed))  # packed


def test_equal_values_from_two_branches_are_not_a_conflict() -> None:
    parent = {"x": 1}
    d = delta(parent, {"x": 2, "y": [1]})
    assert merge(parent, [("a", d), ("b", d)]) == {"x": 2, "y": [1]}
    gone = delta(parent, {})
    assert merge(parent, [("a", gone), ("b", gone)]) == {}


def test_a_removal_against_a_change_is_a_conflict() -> None:
    parent = {"x": 1}
    with pytest.raises(MergeConflict) as info:
        merge(parent, [("a", delta(parent, {})), ("b", delta(parent, {"x": 2}))])
    assert (info.value.key, info.value.branches) == ("x", ("a", "b"))


def test_true_and_one_conflict() -> None:
    with pytest.raises(MergeConflict):
        merge({}, [("a", Delta({"x": 1})), ("b", Delta({"x": True}))])


def test_merge_does_not_modify_its_inputs() -> None:
    parent: dict[str, Any] = {"items": [1], "cfg": {"a": 1}, "n": 1}
    deltas = [
        ("a", delta(parent, {"items": [1, 2], "cfg": {"a": 1, "b": 2}, "n": 1})),
        ("b", delta(parent, {"items": [1, 3], "cfg": {"a": 2}, "n": 1})),
    ]
    before = copy.deepcopy((parent, deltas))
    merge(parent, deltas, MergePolicy(keys={"items": "extend", "cfg": "update"}))
    assert (parent, deltas) == before


# -- first, last and reducers --------------------------------------------------------------------


def branches(parent: dict[str, Any], *afters: dict[str, Any]) -> list[tuple[str, Delta]]:
    return [(f"b{i}", delta(parent, after)) for i, after in enumerate(afters)]


def test_first_and_last_pick_by_declaration_order() -> None:
    parent = {"x": 0, "y": 0}
    ds = branches(parent, {"x": 1, "y": 0}, {"x": 2}, {"x": 3, "y": 0})
    assert merge(parent, ds, "first") == {"x": 1}
    assert merge(parent, ds, "last") == {"x": 3}


def test_append_collects_one_value_per_branch() -> None:
    parent: dict[str, Any] = {"prices": [10]}
    ds = branches(parent, {"prices": 12}, {"prices": [10]}, {"prices": 13})
    assert merge(parent, ds, MergePolicy(keys={"prices": "append"})) == {"prices": [10, 12, 13]}
    assert merge({}, branches({}, {"p": 1}, {"p": 2}), MergePolicy(keys={"p": "append"})) == {
        "p": [1, 2]
    }


def test_extend_adds_each_branchs_additions_after_the_parent_list() -> None:
    parent: dict[str, Any] = {"items": ["p"]}
    ds = branches(parent, {"items": ["p", "a1", "a2"]}, {"items": ["p"]}, {"items": ["p", "c"]})
    policy = MergePolicy(keys={"items": "extend"})
    assert merge(parent, ds, policy) == {"items": ["p", "a1", "a2", "c"]}
    fresh = branches({}, {"items": [1]}, {"items": [2, 3]})
    assert merge({}, fresh, policy) == {"items": [1, 2, 3]}


def test_extend_refuses_a_branch_that_rewrote_the_list() -> None:
    parent: dict[str, Any] = {"items": ["p"]}
    ds = branches(parent, {"items": ["p", "a"]}, {"items": ["q", "b"]})
    with pytest.raises(MergeConflict) as info:
        merge(parent, ds, MergePolicy(keys={"items": "extend"}))
    assert info.value.branches == ("b1",)
    assert "only add items" in "".join(info.value.__notes__)


def test_sum_adds_each_branchs_change() -> None:
    parent: dict[str, Any] = {"n": 10, "t": 0.5}
    ds = branches(parent, {"n": 11, "t": 1.0}, {"n": 10, "t": 0.5}, {"n": 15, "t": 0.75})
    policy = MergePolicy(default="sum")
    assert merge(parent, ds, policy) == {"n": 16, "t": 1.25}
    assert merge({}, branches({}, {"n": 2}, {"n": 3}), policy) == {"n": 5}
    with pytest.raises(MergeConflict, match="'n'"):
        merge(parent, branches(parent, {"n": "eleven", "t": 0.5}), policy)
    with pytest.raises(MergeConflict, match="'n'"):
        merge({"n": True}, branches({"n": True}, {"n": 2}), policy)


def test_update_applies_sub_key_changes_and_later_branches_win() -> None:
    parent: dict[str, Any] = {"cfg": {"keep": 1, "drop": 2, "shared": 0}}
    ds = branches(
        parent,
        {"cfg": {"keep": 1, "shared": "a", "x": 1}},  # removes "drop"
        {"cfg": {"keep": 1, "drop": 2, "shared": "b", "y": 2}},
    )
    merged = merge(parent, ds, MergePolicy(keys={"cfg": "update"}))
    assert merged == {"cfg": {"keep": 1, "shared": "b", "x": 1, "y": 2}}
    with pytest.raises(MergeConflict):
        merge(parent, branches(parent, {"cfg": [1]}), MergePolicy(keys={"cfg": "update"}))


def test_reducers_refuse_a_removed_key_and_a_parent_of_the_wrong_type() -> None:
    for rule in ("append", "extend", "sum", "update"):
        policy = MergePolicy(default=rule)
        with pytest.raises(MergeConflict):
            merge({"k": 0}, [("b", Delta(removed=("k",)))], policy)
        with pytest.raises(MergeConflict, match="'k'"):
            merge({"k": "text"}, [("b", Delta({"k": 1}))], policy)


def test_a_function_sees_the_parent_value_and_every_change() -> None:
    seen: list[tuple[str, Any, list[tuple[str, Any]]]] = []

    def longest(key: str, parent: Any, changes: Sequence[tuple[str, Any]]) -> Any:
        seen.append((key, parent, list(changes)))
        values = [v for _, v in changes if v is not MISSING]
        return max(values, key=len) if values else MISSING

    parent: dict[str, Any] = {"name": "ab", "gone": "x"}
    ds = branches(
        parent, {"name": "abc", "gone": "x"}, {"name": "a"}, {"name": "ab", "gone": "x", "new": "z"}
    )
    merged = merge(parent, ds, MergePolicy(keys={"name": longest, "gone": longest}))
    assert merged == {"name": "abc", "new": "z"}
    assert ("name", "ab", [("b0", "abc"), ("b1", "a")]) in seen
    assert ("gone", "x", [("b1", MISSING)]) in seen


def test_policy_refuses_unknown_rules_and_accepts_shorthands() -> None:
    with pytest.raises(RegistrationError, match="unknown merge rule 'concat' for 'items'"):
        MergePolicy(keys={"items": "concat"})  # type: ignore[dict-item]  # the point: unknown rule
    assert MergePolicy.of(None) == MergePolicy()
    assert MergePolicy.of("last") == MergePolicy(default="last")
    policy = MergePolicy(keys={"a": "sum"})
    assert MergePolicy.of(policy) is policy
    assert policy.rule("a") == "sum"
    assert policy.rule("b") == "strict"
