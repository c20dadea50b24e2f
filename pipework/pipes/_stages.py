"""Stages compose pipes: what a chain is. Immutable trees; the dispatcher walks them.

A chain is a :class:`Serial` at its root. Every node has ``children`` (a pipe has none), and
a position in the tree is a path of child indices, which is what a job's cursor records.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Union

from .._errors import RegistrationError
from ._graph import validate_graph
from ._join import Join, Outcome
from ._merge import MergePolicy, MergeRule, snapshot
from ._pipe import (
    DEGRADED_KEY,
    Pipe,
    PipeFunction,
    RequestUse,
    as_pipe,
    check_fallback,
    is_seconds,
)

__all__ = [
    "BranchEnd",
    "Callback",
    "Chain",
    "GraphNode",
    "Node",
    "Parallel",
    "Serial",
    "StageItem",
    "all_of",
    "any_of",
    "branch",
    "check_unmarked",
    "graph",
    "node",
    "quorum",
    "resolve",
    "serial",
]

# What stage constructors accept: pipes, stages, bare async functions, or registered names.
StageItem = Union[Pipe, "Serial", "Parallel", PipeFunction, str]


@dataclass(frozen=True, eq=False)
class Serial:
    """Children run one after another; the first error fails the stage."""

    items: tuple[StageItem, ...]
    timeout: float | None = None
    #: As a branch of a parallel stage (:func:`branch`): its name, and whether its job can
    #: do without it as a whole (``optional``, or the state its ``fallback`` sets instead).
    name: str | None = None
    optional: bool = False
    fallback: Mapping[str, Any] | None = None

    kind = "serial"

    @cached_property
    def degradable(self) -> bool:
        """Whether the job can do without this sequence as a branch (docs/degradation.md):
        read at each start and end of a branch, so computed once."""
        return self.optional or self.fallback is not None

    def fallback_state(self) -> dict[str, Any]:
        """A fresh copy of the state its fallback sets (empty for none)."""
        return {} if self.fallback is None else snapshot(dict(self.fallback))

    def first_pipe(self) -> Pipe | None:
        """The pipe it starts with (None until names are resolved)."""
        node: object = self
        while isinstance(node, Serial | Parallel):
            node = node.children[0]
        return node if isinstance(node, Pipe) else None

    @property
    def children(self) -> tuple[Node, ...]:
        return self.items  # type: ignore[return-value]  # resolved trees hold only nodes

    @cached_property
    def flat(self) -> tuple[Pipe, ...] | None:
        """The children when every one is a pipe (most chains and branches): the engine
        then walks them as a list instead of through the cursor's frames."""
        items = self.items
        return items if all(isinstance(i, Pipe) for i in items) else None  # type: ignore[return-value]  # all() checked every item is a Pipe


@dataclass(frozen=True, slots=True)
class BranchEnd:
    """What a graph node's ``on_success`` / ``on_error`` callback receives: the parent job's
    id, the node's name, how it ended (``ok``, ``error``, ``timed_out`` or ``cancelled``) and,
    unless it ended ok, its exception when this process has it."""

    job_id: str
    node: str
    outcome: Outcome
    error: BaseException | None


Callback = Callable[[BranchEnd], Awaitable[None] | None]


@dataclass(frozen=True, eq=False)
class Parallel:
    """Branches that run at once, each on a snapshot of the state, joined by ``kind``.

    Each branch is a :class:`Serial` (a lone pipe is wrapped), named for merge conflicts,
    errors and graph edges. ``parents``/``detach``/callbacks are for graphs only.
    """

    kind: str
    branches: tuple[Serial, ...]
    names: tuple[str, ...]
    k: int = 1
    settle: bool = False
    merge: MergePolicy = field(default_factory=MergePolicy)
    timeout: float | None = None
    max_concurrency: int | None = None
    parents: tuple[tuple[int, ...], ...] = ()
    detach: tuple[bool, ...] = ()
    on_success: tuple[Callback | None, ...] = ()
    on_error: tuple[Callback | None, ...] = ()

    @property
    def children(self) -> tuple[Serial, ...]:
        return self.branches

    @cached_property
    def in_step(self) -> bool:
        """Whether the engine runs this stage inside its parent's step: unless a branch
        nests another parallel stage or a graph node is detached (see dispatcher/_instep.py)."""
        return not any(self.detach) and not any(_nests_parallel(b) for b in self.branches)

    @cached_property
    def merge_rules(self) -> MergePolicy:
        """``merge``, with what the engine records of degraded pipes (``"degraded"``, a dict
        of pipe names) merged as a dict update, unless the policy names that key: each
        branch adds its own names (docs/degradation.md)."""
        policy = self.merge
        if DEGRADED_KEY in policy.keys:
            return policy
        return MergePolicy(policy.default, {**policy.keys, DEGRADED_KEY: "update"})

    @cached_property
    def branch_keys(self) -> frozenset[str | None]:
        """The admission keys the branches' pipes name (None: the chain's key)."""
        return frozenset(_pipe_keys(self.branches))

    def new_join(self) -> Join:
        """A fresh join for one run of this stage (its shape built and checked once)."""
        return self._join_shape.fresh()

    @cached_property
    def _join_shape(self) -> Join:
        n = len(self.branches)
        if self.kind == "all_of":
            return Join.all_of(n, settle=self.settle, max_concurrency=self.max_concurrency)
        if self.kind == "any_of":
            return Join.any_of(n, max_concurrency=self.max_concurrency)
        if self.kind == "quorum":
            return Join.quorum(self.k, n, max_concurrency=self.max_concurrency)
        return Join.graph(self.parents, self.detach, max_concurrency=self.max_concurrency)


Node = Pipe | Serial | Parallel


def _pipe_keys(nodes: Sequence[object]) -> set[str | None]:
    keys: set[str | None] = set()
    for node in nodes:
        if isinstance(node, Pipe):
            keys.add(node.key)
        elif isinstance(node, Serial | Parallel):
            keys |= _pipe_keys(node.children)
    return keys


def _nests_parallel(node: object) -> bool:
    if isinstance(node, Parallel):
        return True
    return isinstance(node, Serial) and any(_nests_parallel(c) for c in node.items)


def serial(*items: StageItem, timeout: float | None = None) -> Serial:
    """Run ``items`` in order. ``timeout`` bounds the whole stage (within the job's)."""
    if not items:
        raise RegistrationError("serial() needs at least one pipe or stage")
    for index, item in enumerate(items):
        _check_item("serial", f"item {index}", item)
        check_unmarked("serial()", f"item {index}", item)
    _check_timeout("serial", timeout)
    return Serial(tuple(items), timeout)


def branch(
    *items: StageItem,
    name: str | None = None,
    optional: bool = False,
    fallback: Mapping[str, Any] | None = None,
    timeout: float | None = None,
) -> Serial:
    """A branch of several pipes (or stages) for a parallel stage, run in order, that its
    job can do without as a whole: ``optional`` (skipped when degraded) or with a
    ``fallback``, the state it sets instead. Degraded as a pipe is (docs/degradation.md):
    before it runs (its first pipe's key refuses, too little time is left for what it
    usually takes, no slot of that key is free at once), or when anything in it fails or
    its own ``timeout`` runs out; then nothing it wrote reaches the job. ``name`` (default:
    its pipes' names joined by ``+``) is what ``state["degraded"]`` records."""
    stage = serial(*items, timeout=timeout)
    where = f"branch {name!r}" if name is not None else "branch()"
    if name is not None and (not isinstance(name, str) or not name):
        raise RegistrationError(f"branch(): name must be a non-empty string, got {name!r}")
    if not isinstance(optional, bool):
        raise RegistrationError(f"{where}: optional must be True or False, got {optional!r}")
    if fallback is not None:
        if isinstance(fallback, Pipe):
            raise RegistrationError(
                f"{where}: fallback must be a mapping of state keys to values (the state it "
                "sets); a fallback pipe is for a pipe, not a branch"
            )
        check_fallback(f"{where}: fallback", fallback)
        fallback = dict(fallback)
    if not optional and fallback is None:
        raise RegistrationError(
            f"{where}: mark it optional=True or give it a fallback (else use serial())"
        )
    return Serial(stage.items, timeout, name or _derived_name(items), optional, fallback)


def _derived_name(items: Sequence[StageItem]) -> str:
    names = []
    for item in items:
        if isinstance(item, str):
            names.append(item)
        elif isinstance(item, Pipe):
            names.append(item.name)
        elif isinstance(item, Serial | Parallel):
            names.append(item.name if isinstance(item, Serial) and item.name else item.kind)
        else:
            names.append(getattr(item, "__name__", "pipe"))
    return "+".join(names)


def check_unmarked(where: str, what: str, item: object) -> None:
    """A :func:`branch` is a parallel stage's: in a sequence its marks would mean nothing."""
    if isinstance(item, Serial) and item.degradable:
        raise RegistrationError(
            f"{where}: {what} is branch {item.name!r}, marked optional or with a fallback; only "
            "a branch of all_of, any_of, quorum or a graph node can be: put it in one, or "
            "mark the pipes it can do without"
        )


def _check_timeout(kind: str, timeout: float | None) -> None:
    if timeout is not None and not is_seconds(timeout):
        raise RegistrationError(
            f"{kind}(): timeout must be a positive number of seconds or None, got {timeout!r}"
        )


def _check_item(kind: str, what: str, item: object) -> None:
    if isinstance(item, Pipe | Serial | Parallel | str) or callable(item):
        return
    raise RegistrationError(
        f"{kind}(): {what} is {item!r}; expected a pipe, a stage, an async function or the "
        "name of a registered pipe"
    )


def _branches(kind: str, items: Sequence[StageItem]) -> tuple[tuple[Serial, ...], tuple[str, ...]]:
    branches, names = [], []
    for index, item in enumerate(items):
        _check_item(kind, f"branch {index}", item)
        branches.append(item if isinstance(item, Serial) else Serial((item,)))
        if isinstance(item, str):
            names.append(item)
        elif isinstance(item, Pipe):
            names.append(item.name)
        elif isinstance(item, Serial | Parallel):
            named = item.name if isinstance(item, Serial) else None
            names.append(named if named is not None else f"branch[{index}]")
        else:
            names.append(getattr(item, "__name__", f"branch[{index}]"))
    return tuple(branches), tuple(names)


def _parallel(
    kind: str,
    items: Sequence[StageItem],
    *,
    timeout: float | None,
    max_concurrency: int | None,
    merge: MergePolicy | MergeRule | None,
    **options: Any,
) -> Parallel:
    if not items:
        raise RegistrationError(f"{kind}() needs at least one branch")
    _check_timeout(kind, timeout)
    if max_concurrency is not None and not (
        isinstance(max_concurrency, int) and not isinstance(max_concurrency, bool)
    ):
        raise RegistrationError(
            f"{kind}(): max_concurrency must be a whole number of branches or None, "
            f"got {max_concurrency!r}"
        )
    for option in ("settle",):
        if option in options and not isinstance(options[option], bool):
            raise RegistrationError(
                f"{kind}(): {option} must be True or False, got {options[option]!r}"
            )
    if "k" in options and not (
        isinstance(options["k"], int) and not isinstance(options["k"], bool)
    ):
        raise RegistrationError(
            f"{kind}(): k (the successes needed) must be a whole number, got {options['k']!r}"
        )
    branches, names = _branches(kind, items)
    stage = Parallel(
        kind,
        branches,
        names,
        timeout=timeout,
        max_concurrency=max_concurrency,
        merge=MergePolicy.of(merge),
        **options,
    )
    stage.new_join()  # validates counts and options now, at registration
    return stage


def any_of(
    *branches: StageItem,
    timeout: float | None = None,
    max_concurrency: int | None = None,
) -> Parallel:
    """Start every branch; the first to **succeed** wins and only its changes are merged.
    The others are cancelled (or withdrawn while waiting for a slot); if all fail, the stage
    fails with every error in an ExceptionGroup."""
    return _parallel(
        "any_of", branches, timeout=timeout, max_concurrency=max_concurrency, merge="last"
    )


def all_of(
    *branches: StageItem,
    settle: bool = False,
    merge: MergePolicy | MergeRule | None = None,
    timeout: float | None = None,
    max_concurrency: int | None = None,
) -> Parallel:
    """Every branch must succeed; their changes are merged in declaration order. The first
    failure cancels the rest and fails the stage with that exception. ``settle=True`` waits
    for every branch, merges the ones that succeeded and records each outcome in
    ``state["outcomes"]`` instead of failing."""
    return _parallel(
        "all_of",
        branches,
        timeout=timeout,
        max_concurrency=max_concurrency,
        merge=merge,
        settle=settle,
    )


def quorum(
    k: int,
    *branches: StageItem,
    merge: MergePolicy | MergeRule | None = None,
    timeout: float | None = None,
    max_concurrency: int | None = None,
) -> Parallel:
    """Succeed at the k-th success (those k are merged, the rest cancelled); fail as soon as
    k successes can no longer be reached."""
    return _parallel(
        "quorum", branches, timeout=timeout, max_concurrency=max_concurrency, merge=merge, k=k
    )


@dataclass(frozen=True)
class GraphNode:
    """One node of a :func:`graph`: ``item`` runs once every node in ``after`` succeeded."""

    name: str
    item: StageItem
    after: tuple[str, ...] = ()
    detach: bool = False
    on_success: Callback | None = None
    on_error: Callback | None = None


def node(
    name: str,
    item: StageItem,
    *,
    after: Sequence[str] = (),
    detach: bool = False,
    on_success: Callback | None = None,
    on_error: Callback | None = None,
) -> GraphNode:
    """Declare a graph node. ``detach=True`` makes it fire-and-forget: its failure is logged
    and counted, never fatal, and no node may name it in ``after``. Once a node has started,
    exactly one of its callbacks runs when it ends, however it ends: ``on_success`` when it
    ended ok, ``on_error`` when it failed, timed out or was cancelled (a sibling's failure,
    the stage's timeout, the job cancelled); :attr:`BranchEnd.outcome` says which. A node
    the stage never started gets no call."""
    if not isinstance(name, str) or not name:
        raise RegistrationError(f"node(): name must be a non-empty string, got {name!r}")
    _check_item(f"node {name!r}", "item", item)
    if isinstance(after, str) or not all(isinstance(p, str) for p in after):
        raise RegistrationError(
            f"node {name!r}: after must be a list of node names, got {after!r} "
            f"(for one parent write after=[{after!r}])"
        )
    if not isinstance(detach, bool):
        raise RegistrationError(f"node {name!r}: detach must be True or False, got {detach!r}")
    for option, callback in (("on_success", on_success), ("on_error", on_error)):
        if callback is not None and not callable(callback):
            raise RegistrationError(
                f"node {name!r}: {option} must be a function taking a BranchEnd, got {callback!r}"
            )
    return GraphNode(name, item, tuple(after), detach, on_success, on_error)


def graph(
    *nodes: GraphNode,
    name: str = "graph",
    merge: MergePolicy | MergeRule | None = None,
    timeout: float | None = None,
    max_concurrency: int | None = None,
) -> Parallel:
    """A dependency graph: roots start together, a node starts when all its parents
    succeeded. Checked when declared: unknown parents, detached parents and cycles are
    refused with the nodes named."""
    if not nodes:
        raise RegistrationError("graph() needs at least one node")
    for position, declared in enumerate(nodes):
        if not isinstance(declared, GraphNode):
            raise RegistrationError(
                f"graph {name!r}: node {position} is {declared!r}; declare each node with "
                "pw.node(name, item, after=[...])"
            )
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise RegistrationError(f"graph {name!r}: node names must be unique, got {names}")
    parents: Mapping[str, Sequence[str]] = {n.name: n.after for n in nodes}
    validate_graph(name, parents, [n.name for n in nodes if n.detach])
    index = {n: i for i, n in enumerate(names)}
    stage = _parallel(
        "graph",
        [n.item for n in nodes],
        timeout=timeout,
        max_concurrency=max_concurrency,
        merge=merge,
        parents=tuple(tuple(index[p] for p in n.after) for n in nodes),
        detach=tuple(n.detach for n in nodes),
        on_success=tuple(n.on_success for n in nodes),
        on_error=tuple(n.on_error for n in nodes),
    )
    return _renamed(stage, tuple(names))


def _renamed(stage: Parallel, names: tuple[str, ...]) -> Parallel:
    return Parallel(
        stage.kind,
        stage.branches,
        names,
        stage.k,
        stage.settle,
        stage.merge,
        stage.timeout,
        stage.max_concurrency,
        stage.parents,
        stage.detach,
        stage.on_success,
        stage.on_error,
    )


def resolve(item: StageItem, lookup: Callable[[str], Pipe]) -> Node:
    """Return ``item`` as a tree of nodes: names looked up, bare functions made pipes."""
    if isinstance(item, str):
        return lookup(item)
    if isinstance(item, Serial):
        return _resolve_serial(item, lookup)
    if isinstance(item, Parallel):
        branches = tuple(_resolve_serial(b, lookup) for b in item.branches)
        return Parallel(
            item.kind,
            branches,
            item.names,
            item.k,
            item.settle,
            item.merge,
            item.timeout,
            item.max_concurrency,
            item.parents,
            item.detach,
            item.on_success,
            item.on_error,
        )
    return as_pipe(item)


def _resolve_serial(item: Serial, lookup: Callable[[str], Pipe]) -> Serial:
    return Serial(
        tuple(resolve(child, lookup) for child in item.items),
        item.timeout,
        item.name,
        item.optional,
        item.fallback,
    )


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

    @cached_property
    def request_use(self) -> RequestUse | None:
        """What the chain's pipes read of the request that starts a job (None: nothing but
        the state): every pipe's, together."""
        found: RequestUse | None = None
        pending: list[Node] = [self.root]
        while pending:
            node = pending.pop()
            if isinstance(node, Pipe):
                if node.request_use is not None:
                    found = node.request_use if found is None else found | node.request_use
                if isinstance(node.fallback, Pipe):  # it runs in the pipe's place
                    pending.append(node.fallback)
            else:
                pending.extend(node.children)
        return found

    def describe(self, path: tuple[int, ...] | list[int], pipe: Pipe | None = None) -> str:
        """The stage path as people read it: ``chain 'order' > all_of[1] > pipe 'quote'``."""
        parts = [f"chain {self.name!r}"]
        node: Any = self.root
        for index in path:
            child = node.children[index]
            if isinstance(node, Parallel):
                parts.append(f"branch {node.names[index]!r}")
            elif not isinstance(child, Pipe):
                parts.append(f"{child.kind}[{index}]")
            node = child
        if pipe is not None:
            parts.append(f"pipe {pipe.name!r}")
        return " > ".join(parts)
