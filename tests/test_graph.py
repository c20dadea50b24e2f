"""Graph declarations: cycles named in running order, bad parents refused with their names."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipework import RegistrationError
from pipework.pipes._graph import find_cycle, topological_order, validate_graph

# The seed-002 shape: A, B, C roots; C detached; D after A; E after B and D.
SEED = {"a": [], "b": [], "c": [], "d": ["a"], "e": ["b", "d"]}


def test_acyclic_graph_has_no_cycle() -> None:
    assert find_cycle(SEED) is None


def test_cycle_is_named_in_running_order_from_first_declared_node() -> None:
    # b waits for a, c for b, a for c.
    parents = {"a": ["c"], "b": ["a"], "c": ["b"]}
    assert find_cycle(parents) == ["a", "b", "c", "a"]


def test_cycle_not_reachable_from_the_first_node_is_found() -> None:
    parents = {"x": [], "y": ["x"], "p": ["r"], "q": ["p"], "r": ["q"]}
    assert find_cycle(parents) == ["p", "q", "r", "p"]


def test_self_loop_is_a_cycle_of_one() -> None:
    assert find_cycle({"a": [], "b": ["b"]}) == ["b", "b"]


def test_unknown_parents_count_as_roots_for_find_cycle() -> None:
    assert find_cycle({"a": ["ghost"]}) is None


def test_find_cycle_works_on_any_hashable_nodes() -> None:
    assert find_cycle({0: [1], 1: [0]}) == [0, 1, 0]


def test_topological_order_puts_parents_first_and_keeps_declaration_order() -> None:
    assert topological_order(SEED) == ["a", "b", "c", "d", "e"]
    assert topological_order({"late": ["early"], "early": []}) == ["early", "late"]


def test_topological_order_refuses_cycles_and_unknown_parents() -> None:
    with pytest.raises(RegistrationError, match=r"cycle a -> b -> a"):
        topological_order({"a": ["b"], "b": ["a"]})
    with pytest.raises(RegistrationError, match=r"node 'a' names unknown parent 'zz'"):
        topological_order({"a": ["zz"]})


def test_validate_graph_returns_the_running_order() -> None:
    assert validate_graph("g", SEED, detached={"c"}) == ["a", "b", "c", "d", "e"]


@pytest.mark.parametrize(
    ("parents", "detached", "message"),
    [
        ({"a": ["b", "c"], "b": ["c"], "c": ["a"]}, (), r"^graph 'g': cycle a -> c -> b -> a;"),
        ({"a": [], "b": ["a", "x"]}, (), r"^graph 'g': node 'b' names unknown parent 'x'"),
        ({"a": [], "b": ["a"], "c": ["b"]}, ("b",), r"node 'c' names detached node 'b'"),
        ({"a": ["a"]}, (), r"^graph 'g': node 'a' names itself as a parent$"),
        ({"a": [], "b": ["a", "a"]}, (), r"node 'b' names parent 'a' twice"),
        ({"a": []}, ("nope",), r"detached node 'nope' is not a node of the graph"),
    ],
)
def test_validate_graph_names_the_offending_nodes(
    parents: dict[str, list[str]], detached: tuple[str, ...], message: str
) -> None:
    with pytest.raises(RegistrationError, match=message):
        validate_graph("g", parents, detached)


@st.composite
def dags(draw: st.DrawFn) -> dict[str, list[str]]:
    """Random acyclic graphs, declared in a shuffled order."""
    n = draw(st.integers(1, 9))
    names = [f"n{i}" for i in range(n)]
    parents = {
        names[i]: draw(st.lists(st.sampled_from(names[:i]), unique=True)) if i else []
        for i in range(n)
    }
    order = draw(st.permutations(names))
    return {name: parents[name] for name in order}


@given(dags())
def test_random_dags_have_no_cycle_and_a_valid_order(parents: dict[str, list[str]]) -> None:
    assert find_cycle(parents) is None
    order = validate_graph("g", parents)
    assert sorted(order) == sorted(parents)
    position = {node: i for i, node in enumerate(order)}
    for node, its_parents in parents.items():
        assert all(position[p] < position[node] for p in its_parents)


@given(dags(), st.data())
def test_a_back_edge_makes_a_cycle_that_is_really_one(
    parents: dict[str, list[str]], data: st.DataObject
) -> None:
    order = topological_order(parents)
    i = data.draw(st.integers(0, len(order) - 1))
    j = data.draw(st.integers(i, len(order) - 1))
    # Making an earlier (or the same) node wait for a later one closes a loop if j reaches i.
    parents[order[i]] = [*parents[order[i]], order[j]]
    cycle = find_cycle(parents)
    if cycle is None:
        topological_order(parents)  # must not raise
        return
    assert cycle[0] == cycle[-1]
    assert len(set(cycle[:-1])) == len(cycle) - 1
    for parent, child in itertools.pairwise(cycle):
        assert parent in parents[child]
    with pytest.raises(RegistrationError, match=r"cycle|itself"):
        validate_graph("g", parents)
