"""Stages compose pipes: what a chain is. Immutable trees; the dispatcher walks them.

A chain is a :class:`Serial` at its root. Every node has ``children`` (a pipe has none), and
a position in the tree is a path of child indices, which is what a job's cursor records.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

from .._errors import RegistrationError
from ._pipe import Pipe, PipeFunction, as_pipe

__all__ = ["Chain", "Node", "Serial", "StageItem", "resolve", "serial"]

# What stage constructors accept: pipes, stages, bare async functions, or registered names.
StageItem = Union[Pipe, "Serial", PipeFunction, str]


@dataclass(frozen=True, eq=False)
class Serial:
    """Children run one after another; the first error fails the stage."""

    items: tuple[StageItem, ...]
    timeout: float | None = None

    kind = "serial"

    @property
    def children(self) -> tuple[Node, ...]:
        return self.items  # type: ignore[return-value]  # resolved trees hold only nodes


Node = Pipe | Serial


def serial(*items: StageItem, timeout: float | None = None) -> Serial:
    """Run ``items`` in order. ``timeout`` bounds the whole stage (within the job's)."""
    if not items:
        raise RegistrationError("serial() needs at least one pipe or stage")
    _check_timeout("serial", timeout)
    return Serial(tuple(items), timeout)


def _check_timeout(kind: str, timeout: float | None) -> None:
    if timeout is not None and not timeout > 0:
        raise RegistrationError(f"{kind}(): timeout must be positive, got {timeout}")


def resolve(item: StageItem, lookup: Callable[[str], Pipe]) -> Node:
    """Return ``item`` as a tree of nodes: names looked up, bare functions made pipes."""
    if isinstance(item, str):
        return lookup(item)
    if isinstance(item, Serial):
        return Serial(tuple(resolve(child, lookup) for child in item.items), item.timeout)
    return as_pipe(item)


@dataclass(frozen=True, eq=False)
class Chain:
    """A registered chain: ``root`` runs under ``key`` (for pipes with no key of their own),
    within ``timeout``; ``result`` names the state key to return (None: the whole state)."""

    name: str
    root: Serial
    timeout: float | None = None
    key: str = "default"
    result: str | None = None

    def node_at(self, path: tuple[int, ...] | list[int]) -> Node:
        node: Node = self.root
        for index in path:
            node = node.children[index]  # type: ignore[union-attr]  # pipes have no path below
        return node

    def describe(self, path: tuple[int, ...] | list[int], pipe: Pipe | None = None) -> str:
        """The stage path as people read it: ``chain 'order' > all_of[1] > pipe 'quote'``."""
        parts = [f"chain {self.name!r}"]
        node: Any = self.root
        for index in path:
            child = node.children[index]
            if not isinstance(child, Pipe):
                parts.append(f"{child.kind}[{index}]")
            node = child
        if pipe is not None:
            parts.append(f"pipe {pipe.name!r}")
        return " > ".join(parts)
