"""The join of a parallel stage, as a pure state machine: branch events in, decisions out.

The engine reports each branch's end with :meth:`Join.branch_done`; the :class:`Decision` it
gets back says which branches to start, which to cancel, and whether the stage is resolved.
Branches run as tasks in the parent's step when they can (``dispatcher/_instep.py``: the join
stays in memory) and as child jobs otherwise (``dispatcher/_forked.py``). A join that must
outlive the step (a forked stage, or an in-step one whose branch suspended) is stored in the
parent's job record between events, so it round-trips through msgpack (:meth:`Join.to_wire`
/ :meth:`Join.from_wire`).

Each branch moves ``waiting -> running -> ok | error | cancelled | timed_out``, or
``waiting -> not_started`` when the stage resolves before it was started. Any outcome but
``ok`` is a failure. The rules, with ``need`` successes required:

=========  ====  ==========================================  ================================
kind       need  resolved ok                                  resolved failed
=========  ====  ==========================================  ================================
all_of     n     every branch ok                              first failure (``settle``: once
                                                              every branch has ended)
any_of     1     first ok; its delta alone is merged          every branch failed
quorum     k     k-th ok; those k are merged                  the moment k cannot be reached
graph      core  every non-detached node ok                   first non-detached failure
=========  ====  ==========================================  ================================

On resolution, running branches are cancelled and waiting ones become ``not_started``.
``max_concurrency`` caps running branches; the others start, in declaration order, as running
ones end. In a graph a node is ready once all its parents are ok.

Detached graph nodes are fire-and-forget. Their failure never fails the join, nothing may wait
for them, and the join does not wait for them: it resolves when the last non-detached node
succeeds, even while detached nodes run. Resolving ok starts every detached node not yet
started (past ``max_concurrency``: the stage is over, so its cap no longer applies); resolving
failed leaves running detached nodes alone. A detached node's delta is never merged, since
whether it finished before the join would depend on timing.

The join also says what the parent's state takes (:attr:`Join.to_merge`, once it
:attr:`~Join.continues`): the resolving branches' deltas; under ``settle``, every ok branch's
(the stage goes on and records each outcome instead of failing); in a graph, only the
*frontier* of the ok nodes. A graph node starts from its ancestors' results
(:meth:`Join.start_from`), so its delta already holds theirs: merging the nodes none of whose
descendants is merged counts each change exactly once, also under ``extend`` or ``sum``.

After resolution a report is recorded in :attr:`Join.outcomes` (so the merge step and logs see
how every branch ended) but changes nothing else and returns an empty decision; a second report
for the same branch is ignored.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias, get_args

from .._errors import RegistrationError
from ._graph import find_cycle

__all__ = ["Decision", "Join", "JoinKind", "Outcome", "Resolution"]

JoinKind: TypeAlias = Literal["all_of", "any_of", "quorum", "graph"]
Outcome: TypeAlias = Literal["ok", "error", "cancelled", "timed_out"]
Resolution: TypeAlias = Literal["ok", "failed"]

_KINDS: Final = frozenset(get_args(JoinKind))
_OUTCOMES: Final = frozenset(get_args(Outcome))
_FAILURES: Final = _OUTCOMES - {"ok"}
_WAITING, _RUNNING, _NOT_STARTED = "waiting", "running", "not_started"
_WIRE_VERSION: Final = 1


@dataclass(frozen=True, slots=True)
class Decision:
    """What the engine must do after an event. Indices are branch positions in declaration
    order; every tuple is sorted.

    ``merge`` (set when resolved ok) lists the branches whose deltas to merge; ``failures``
    (set when resolved failed) lists the failed branches whose errors the stage raises.
    """

    start: tuple[int, ...] = ()
    cancel: tuple[int, ...] = ()
    resolved: Resolution | None = None
    merge: tuple[int, ...] = ()
    failures: tuple[int, ...] = ()


#: An event that asks for nothing (frozen, so one instance serves every such answer).
_NOTHING: Final = Decision()


class Join:
    """The bookkeeping of one parallel stage run. Build one with :meth:`all_of`,
    :meth:`any_of`, :meth:`quorum` or :meth:`graph`, call :meth:`start` once, then
    :meth:`branch_done` for each branch that ends."""

    __slots__ = (
        "_core",
        "_detach",
        "_failed",
        "_failures",
        "_graph",
        "_merge",
        "_ok",
        "_parents",
        "_resolved",
        "_started",
        "_status",
        "_waiting",
        "kind",
        "max_concurrency",
        "need",
        "settle",
    )

    def __init__(
        self,
        kind: JoinKind,
        n: int,
        *,
        need: int,
        settle: bool = False,
        max_concurrency: int | None = None,
        parents: Sequence[Sequence[int]] = (),
        detach: Sequence[bool] = (),
    ) -> None:
        if kind not in _KINDS:
            raise RegistrationError(f"unknown join kind {kind!r}; use one of {sorted(_KINDS)}")
        if n < 1:
            raise RegistrationError(f"a {kind} stage needs at least one branch, got {n}")
        if not 0 <= need <= n:
            raise RegistrationError(f"a {kind} stage of {n} branches cannot need {need} successes")
        if max_concurrency is not None and max_concurrency < 1:
            raise RegistrationError(f"max_concurrency must be at least 1, got {max_concurrency}")
        self.kind: JoinKind = kind
        self.need = need
        self.settle = settle
        self.max_concurrency = max_concurrency
        # The stage's shape never changes once built: fresh runs share it (see fresh()).
        self._parents = tuple(tuple(p) for p in parents) or ((),) * n
        self._detach = tuple(detach) or (False,) * n
        self._core = tuple(i for i in range(n) if not self._detach[i])
        self._graph = any(self._parents)
        self._reset()

    def _reset(self) -> None:
        n = len(self._parents)
        self._status = [_WAITING] * n
        self._started = False
        self._resolved: Resolution | None = None
        self._merge: list[int] = []
        self._failures: list[int] = []
        # Counts kept as branches move, so that an event needs no scan of every branch:
        # core branches ok and failed, and branches of any kind still waiting.
        self._ok = self._failed = 0
        self._waiting = n

    def fresh(self) -> Join:
        """A new, unstarted run of the same stage: its shape (kind, parents, detached nodes)
        is shared, already checked, and only the per-run bookkeeping is new."""
        join = Join.__new__(Join)
        join.kind = self.kind
        join.need = self.need
        join.settle = self.settle
        join.max_concurrency = self.max_concurrency
        join._parents = self._parents
        join._detach = self._detach
        join._core = self._core
        join._graph = self._graph
        join._reset()
        return join

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def all_of(cls, n: int, *, settle: bool = False, max_concurrency: int | None = None) -> Join:
        return cls("all_of", n, need=n, settle=settle, max_concurrency=max_concurrency)

    @classmethod
    def any_of(cls, n: int, *, max_concurrency: int | None = None) -> Join:
        return cls("any_of", n, need=1, max_concurrency=max_concurrency)

    @classmethod
    def quorum(cls, k: int, n: int, *, max_concurrency: int | None = None) -> Join:
        if not 1 <= k <= n:
            raise RegistrationError(f"quorum needs 1 <= k <= {n} branches, got k={k}")
        return cls("quorum", n, need=k, max_concurrency=max_concurrency)

    @classmethod
    def graph(
        cls,
        parents: Sequence[Sequence[int]],
        detach: Sequence[bool] | None = None,
        *,
        max_concurrency: int | None = None,
    ) -> Join:
        """``parents[i]`` lists the nodes node ``i`` waits for; ``detach[i]`` marks node ``i``
        fire-and-forget. Raises :class:`RegistrationError` for a graph that could deadlock."""
        n = len(parents)
        flags = [False] * n if detach is None else list(detach)
        if len(flags) != n:
            raise RegistrationError(f"graph has {n} nodes but {len(flags)} detach flags")
        for node, its_parents in enumerate(parents):
            for parent in its_parents:
                if not 0 <= parent < n or parent == node:
                    raise RegistrationError(f"graph node {node} names bad parent {parent}")
                if flags[parent]:
                    raise RegistrationError(
                        f"graph node {node} waits for detached node {parent}; nothing may wait "
                        "for a detached node"
                    )
        cycle = find_cycle({i: list(p) for i, p in enumerate(parents)})
        if cycle is not None:
            raise RegistrationError(f"graph cycle {' -> '.join(map(str, cycle))}")
        need = flags.count(False)
        return cls(
            "graph", n, need=need, max_concurrency=max_concurrency, parents=parents, detach=flags
        )

    # -- what the engine reads -----------------------------------------------------------------

    @property
    def n(self) -> int:
        return len(self._status)

    @property
    def parents(self) -> tuple[tuple[int, ...], ...]:
        """Each branch's parents (empty unless this is a graph)."""
        return self._parents

    @property
    def detached(self) -> tuple[bool, ...]:
        """Which branches are fire-and-forget (none unless this is a graph)."""
        return self._detach

    @property
    def outcomes(self) -> tuple[str, ...]:
        """Each branch's label: ``waiting``, ``running``, an outcome, or ``not_started``."""
        return tuple(self._status)

    @property
    def resolved(self) -> Resolution | None:
        return self._resolved

    @property
    def merge(self) -> tuple[int, ...]:
        """The branches whose deltas to merge, once resolved ok."""
        return tuple(self._merge)

    @property
    def failures(self) -> tuple[int, ...]:
        """The failures that failed the join, once resolved failed."""
        return tuple(self._failures)

    @property
    def continues(self) -> bool:
        """Whether the parent goes on past the stage: resolved ok, or resolved at all under
        ``settle`` (which records each branch's outcome instead of failing)."""
        return self._resolved == "ok" or (self._resolved is not None and self.settle)

    @property
    def to_merge(self) -> tuple[int, ...]:
        """Whose deltas the parent's state merges when it goes on (see :attr:`continues`),
        in declaration order; empty otherwise.

        That is the resolving decision's ``merge``, except that ``settle`` merges every
        branch that succeeded (also when the stage resolved failed), and that a graph merges
        only the :meth:`frontier` of its ok nodes: a node starts from its ancestors' results
        (:meth:`start_from`), so its delta already holds theirs, and merging an ancestor too
        would count its changes twice (under ``extend`` or ``sum``, say)."""
        if not self.continues:
            return ()
        if self.settle:
            return tuple(i for i in self._core if self._status[i] == "ok")
        if self.kind == "graph":
            return self.frontier(self._merge)
        return tuple(sorted(self._merge))

    def start_from(self, i: int) -> tuple[int, ...]:
        """Whose deltas branch ``i``'s start state merges onto the parent's snapshot, in
        declaration order: for a graph node, the :meth:`frontier` of its ancestors (all of
        which succeeded before it could start), so that it reads what they wrote, each change
        once. Empty for a root and for every other kind of stage."""
        if not self._parents[i]:
            return ()
        return self.frontier(self.ancestors(i))

    def ancestors(self, i: int) -> frozenset[int]:
        """The nodes branch ``i`` waits for, directly or through others."""
        found: set[int] = set()
        pending = list(self._parents[i])
        while pending:
            node = pending.pop()
            if node not in found:
                found.add(node)
                pending.extend(self._parents[node])
        return frozenset(found)

    def frontier(self, nodes: Iterable[int]) -> tuple[int, ...]:
        """The nodes of ``nodes`` that are no ancestor of another of them, in declaration
        order. Every node of ``nodes`` is one of them or an ancestor of one."""
        wanted = set(nodes)
        covered: set[int] = set()
        for node in wanted:
            covered |= self.ancestors(node)
        return tuple(sorted(wanted - covered))

    @property
    def running(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self._status) if s == _RUNNING)

    @property
    def finished(self) -> bool:
        """Resolved, and every started branch (detached ones too) has reported its end."""
        return self._resolved is not None and _RUNNING not in self._status

    def __repr__(self) -> str:
        return f"<Join {self.kind} need={self.need} resolved={self._resolved} {self._status}>"

    # -- events --------------------------------------------------------------------------------

    def start(self) -> Decision:
        """The branches to start first. Call exactly once."""
        if self._started:
            raise RuntimeError(f"{self!r} was already started")
        self._started = True
        return self._step()

    def branch_done(self, i: int, outcome: Outcome) -> Decision:
        """Record that branch ``i`` ended with ``outcome``; say what to do next."""
        if outcome not in _OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}; use one of {sorted(_OUTCOMES)}")
        if not 0 <= i < self.n:
            raise IndexError(f"branch {i} out of range for a join of {self.n} branches")
        if self._status[i] == _WAITING:
            raise RuntimeError(f"branch {i} reported {outcome!r} but was never started: {self!r}")
        if self._status[i] != _RUNNING:
            return _NOTHING  # a second report, or one for a branch withdrawn unstarted
        self._status[i] = outcome
        if not self._detach[i]:
            if outcome == "ok":
                self._ok += 1
            else:
                self._failed += 1
        if self._resolved is not None:
            return _NOTHING  # late: recorded for the merge step, decides nothing
        return self._step()

    def _step(self) -> Decision:
        ok, failed = self._ok, self._failed
        still_open = len(self._core) - ok - failed
        if ok >= self.need and not (self.settle and still_open):
            return self._resolve("ok", merge=self._core_with(("ok",)))
        if failed and (
            (self.settle and not still_open) or (not self.settle and ok + still_open < self.need)
        ):
            return self._resolve("failed", failures=self._core_with(_FAILURES))
        if not self._waiting:
            return _NOTHING
        start = self._fill()
        return Decision(start=start) if start else _NOTHING

    def _core_with(self, outcomes: Iterable[str]) -> list[int]:
        status = self._status
        return [i for i in self._core if status[i] in outcomes]

    def _ready(self, i: int) -> bool:
        return self._status[i] == _WAITING and all(
            self._status[p] == "ok" for p in self._parents[i]
        )

    def _fill(self) -> tuple[int, ...]:
        status = self._status
        if self._graph:
            start = [i for i in range(len(status)) if self._ready(i)]
        else:  # no edges: every waiting branch is ready
            start = [i for i, s in enumerate(status) if s == _WAITING]
        if self.max_concurrency is not None:
            room = self.max_concurrency - status.count(_RUNNING)
            start = start[: max(room, 0)]
        for i in start:
            status[i] = _RUNNING
        self._waiting -= len(start)
        return tuple(start)

    def _resolve(
        self, resolution: Resolution, *, merge: Sequence[int] = (), failures: Sequence[int] = ()
    ) -> Decision:
        self._resolved = resolution
        self._merge = list(merge)
        self._failures = list(failures)
        start: list[int] = []
        if resolution == "ok" and True in self._detach:
            # Detached nodes still waiting are all ready now: no core node is left to wait for.
            start = [i for i in range(self.n) if self._detach[i] and self._ready(i)]
            for i in start:
                self._status[i] = _RUNNING
        cancel = [i for i, s in enumerate(self._status) if s == _RUNNING and not self._detach[i]]
        if self._waiting:
            self._status = [_NOT_STARTED if s == _WAITING else s for s in self._status]
            self._waiting = 0
        return Decision(
            start=tuple(start),
            cancel=tuple(cancel),
            resolved=resolution,
            merge=tuple(merge),
            failures=tuple(failures),
        )

    # -- wire ----------------------------------------------------------------------------------

    def to_wire(self) -> dict[str, Any]:
        """Plain lists, str, int, bool and None: safe to store with msgpack."""
        return {
            "version": _WIRE_VERSION,
            "kind": self.kind,
            "need": self.need,
            "settle": self.settle,
            "max_concurrency": self.max_concurrency,
            "parents": [list(p) for p in self._parents] if self.kind == "graph" else [],
            "detach": list(self._detach) if self.kind == "graph" else [],
            "status": list(self._status),
            "started": self._started,
            "resolved": self._resolved,
            "merge": list(self._merge),
            "failures": list(self._failures),
        }

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> Join:
        if wire.get("version") != _WIRE_VERSION:
            raise ValueError(f"unsupported join record version {wire.get('version')!r}")
        join = cls(
            wire["kind"],
            len(wire["status"]),
            need=wire["need"],
            settle=wire["settle"],
            max_concurrency=wire["max_concurrency"],
            parents=wire["parents"],
            detach=wire["detach"],
        )
        join._status = status = list(wire["status"])
        join._ok = sum(1 for i in join._core if status[i] == "ok")
        join._failed = sum(1 for i in join._core if status[i] in _FAILURES)
        join._waiting = status.count(_WAITING)
        join._started = wire["started"]
        join._resolved = wire["resolved"]
        join._merge = list(wire["merge"])
        join._failures = list(wire["failures"])
        return join
