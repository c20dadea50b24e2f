"""Checks for a graph stage's declaration: every node names its parents.

A graph is given as ``{node: [parent, ...]}``; a parent runs before its children. These
functions are pure and run when the stage is registered, so a bad graph is refused before any
job can deadlock on it. Nodes are usually names (``str``), but any hashable works: the join
state machine reuses :func:`find_cycle` on branch indices.

Cycles are reported in running order, each node a parent of the next, closing on the first:
``a -> b -> c -> a`` means ``b`` waits for ``a``, ``c`` for ``b`` and ``a`` for ``c``.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Hashable, Mapping, Sequence
from typing import TypeVar

from .._errors import RegistrationError

__all__ = ["find_cycle", "topological_order", "validate_graph"]

N = TypeVar("N", bound=Hashable)

_WHITE, _GREY, _BLACK = 0, 1, 2


def find_cycle(parents: Mapping[N, Sequence[N]]) -> list[N] | None:
    """Return one cycle as ``[a, b, ..., a]`` in running order, or ``None`` if there is none.

    The search follows declaration order, so the same graph always reports the same cycle.
    Parents that are not keys of ``parents`` count as nodes without parents.
    """
    colour: dict[N, int] = {}
    for root in parents:
        if colour.get(root, _WHITE) != _WHITE:
            continue
        # Iterative depth-first search along parent links: path[j + 1] is a parent of path[j].
        path: list[N] = [root]
        todo = [iter(parents.get(root, ()))]
        colour[root] = _GREY
        while todo:
            for parent in todo[-1]:
                seen = colour.get(parent, _WHITE)
                if seen == _GREY:
                    loop = path[path.index(parent) :]
                    return _running_order(loop, parents)
                if seen == _WHITE:
                    colour[parent] = _GREY
                    path.append(parent)
                    todo.append(iter(parents.get(parent, ())))
                    break
            else:
                colour[path.pop()] = _BLACK
                todo.pop()
    return None


def _running_order(loop: list[N], parents: Mapping[N, Sequence[N]]) -> list[N]:
    """Turn a chain of parent links into running order, starting at its first-declared node."""
    forward = loop[::-1]
    position = {node: i for i, node in enumerate(parents)}
    start = min(range(len(forward)), key=lambda i: position[forward[i]])
    forward = forward[start:] + forward[:start]
    return [*forward, forward[0]]


def _arrow(cycle: Sequence[object]) -> str:
    return " -> ".join(str(node) for node in cycle)


def topological_order(parents: Mapping[N, Sequence[N]]) -> list[N]:
    """Return the nodes so that every node comes after all its parents.

    Among nodes that are ready at the same time, declaration order decides, so the order is
    stable. Raises :class:`RegistrationError` naming a cycle or an unknown parent.
    """
    for node, its_parents in parents.items():
        for parent in its_parents:
            if parent not in parents:
                raise RegistrationError(f"node {node!r} names unknown parent {parent!r}")
    cycle = find_cycle(parents)
    if cycle is not None:
        raise RegistrationError(f"cycle {_arrow(cycle)}")
    waiting = {node: len(set(its_parents)) for node, its_parents in parents.items()}
    children: dict[N, list[N]] = {node: [] for node in parents}
    for node, its_parents in parents.items():
        for parent in dict.fromkeys(its_parents):
            children[parent].append(node)
    position = {node: i for i, node in enumerate(parents)}
    # A heap of declaration positions: among ready nodes, the first declared goes first.
    ready = [position[node] for node, count in waiting.items() if count == 0]
    nodes = list(parents)
    order: list[N] = []
    while ready:
        node = nodes[heapq.heappop(ready)]
        order.append(node)
        for child in children[node]:
            waiting[child] -= 1
            if waiting[child] == 0:
                heapq.heappush(ready, position[child])
    return order


def validate_graph(
    name: str, parents: Mapping[str, Sequence[str]], detached: Collection[str] = ()
) -> list[str]:
    """Check a graph stage's declaration and return its nodes in topological order.

    Raises :class:`RegistrationError`, naming the graph and the offending nodes, for a node
    that names itself, an unknown node, the same parent twice, or a detached node as a parent
    (a detached node is fire-and-forget: nothing may wait for it), and for a cycle.
    """
    where = f"graph {name!r}"
    known = ", ".join(map(repr, parents)) or "none"
    for node in detached:
        if node not in parents:
            raise RegistrationError(
                f"{where}: detached node {node!r} is not a node of the graph; known: {known}"
            )
    for node, its_parents in parents.items():
        seen: set[str] = set()
        for parent in its_parents:
            if parent == node:
                raise RegistrationError(f"{where}: node {node!r} names itself as a parent")
            if parent not in parents:
                raise RegistrationError(
                    f"{where}: node {node!r} names unknown parent {parent!r}; known: {known}"
                )
            if parent in seen:
                raise RegistrationError(f"{where}: node {node!r} names parent {parent!r} twice")
            if parent in detached:
                raise RegistrationError(
                    f"{where}: node {node!r} names detached node {parent!r} as a parent; a "
                    "detached node is fire-and-forget, so nothing may wait for it"
                )
            seen.add(parent)
    cycle = find_cycle(parents)
    if cycle is not None:
        raise RegistrationError(f"{where}: cycle {_arrow(cycle)}; remove one of these parent links")
    return topological_order(parents)
