"""One run of a parallel stage, decided: the sans-IO core both of its drivers act on.

The :class:`~pipework.pipes._join.Join` decides which branches start, which are cancelled
and when the stage resolves. Around it, a run of a stage decides the rest, with no I/O:

- the state a branch starts from (:meth:`StageRun.start_state`): a snapshot of the
  parent's, plus, for a graph node, what the nodes it depends on produced;
- a branch's end as the join hears it (:func:`branch_outcome`, :func:`told_of`,
  :meth:`StageRun.heard`): its outcome, its delta against the parent's state, its error;
- the callback a graph node's end calls (:func:`graph_callback`);
- the stage's resolution (:meth:`StageRun.resolution`): the parent's state with the deltas
  the join names merged in declaration order (and each outcome under ``settle``), or the
  error the stage fails with — the branch's own exception, a group where the kind calls
  for one, or the stage's (or the job's) ``DeadlineExceeded`` when its time ran out.

Its drivers only act: ``_forked.py`` runs branches as child jobs and hears their ends as
events; ``_instep.py`` runs them as tasks in the parent's step and hears them in memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Final

from .._errors import DeadlineExceeded, JobCancelled, JobFailed, MergeConflict, Rejected
from ..pipes._join import Decision, Outcome
from ..pipes._merge import Delta, delta, merge, merge_strict
from ..pipes._stages import BranchEnd, Callback, Chain, Parallel
from ._job import ErrorInfo, Job, JoinRecord
from ._outcomes import is_job_timeout
from ._status import Status

__all__ = [
    "Continue",
    "Fail",
    "StageRun",
    "branch_outcome",
    "error_of",
    "graph_callback",
    "told_of",
]


@dataclass(frozen=True, slots=True)
class Continue:
    """The stage resolved ok: the parent goes on with ``state``."""

    state: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Fail:
    """The stage failed: the parent ends with ``error`` and ``status``."""

    error: BaseException
    status: Status


def branch_outcome(branch: Job) -> Outcome:
    """How an ended branch ended, as the join counts it."""
    if branch.status is Status.DONE:
        return "ok"
    if branch.status is Status.CANCELLED:
        return "cancelled"
    exc = branch.exception
    if branch.status is Status.EXPIRED or isinstance(exc, DeadlineExceeded):
        return "timed_out"
    if isinstance(exc, Rejected) and exc.reason == "deadline":
        return "timed_out"
    return "error"


def told_of(branch: Job, parent_state: dict[str, Any]) -> tuple[Delta | None, ErrorInfo | None]:
    """What the join is told of an ended branch beside its outcome: its delta against the
    parent's state (when it ended ok), its recorded error."""
    change = delta(parent_state, branch.state) if branch.status is Status.DONE else None
    return change, branch.error


def graph_callback(
    stage: Parallel, parent_id: str, index: int, outcome: Outcome, error: BaseException | None
) -> tuple[Callback, BranchEnd] | None:
    """A graph node's callback for its end, and what it is called with (None: none). Every
    started node gets exactly one call, from its own end, whatever became of the stage."""
    if stage.kind != "graph":
        return None
    callback = (stage.on_success if outcome == "ok" else stage.on_error)[index]
    if callback is None:
        return None
    shown = None if outcome == "ok" else error
    return callback, BranchEnd(parent_id, stage.names[index], outcome, shown)


def error_of(exception: BaseException | None, record: JoinRecord, index: int) -> BaseException:
    """A failed branch's error: its own exception when this process has it (traceback
    intact), else what its record says."""
    if exception is not None:
        return exception
    error = record.errors.get(index)
    if error is None:
        return JobCancelled(f"branch {index} was cancelled")
    return JobFailed(error.message, error_type=error.type, where=error.where)


class StageRun:
    """The decisions of one run of ``stage`` (at ``record.path`` in ``chain``), on its
    join record: the join, and the deltas and errors of the branches heard of so far."""

    __slots__ = ("__dict__", "chain", "record", "stage")

    def __init__(self, stage: Parallel, chain: Chain, record: JoinRecord) -> None:
        self.stage = stage
        self.chain = chain
        self.record = record

    @cached_property
    def where(self) -> str:
        """The stage's path, for errors (formatted only when one needs it)."""
        return self.chain.describe(self.record.path)

    def start(self) -> Decision:
        return self.record.join.start()

    def start_state(self, index: int, snapshot: dict[str, Any]) -> dict[str, Any]:
        """The state branch ``index`` starts from: ``snapshot`` (a copy of the parent's
        state, the caller's to give) and, for a graph node, what the nodes it depends on
        produced, merged under the stage's policy (MergeConflict if they disagree)."""
        record = self.record
        sources = record.join.start_from(index)
        if not sources:
            return snapshot
        pairs = [(self.stage.names[i], record.deltas[i]) for i in sources]
        where = f"graph node {self.stage.names[index]!r}"
        return merge(snapshot, pairs, self.stage.merge_rules, where=where)

    def heard(
        self, index: int, outcome: Outcome, change: Delta | None, error: ErrorInfo | None
    ) -> Decision:
        """Branch ``index`` ended so: recorded, and what the join decides now."""
        record = self.record
        decision = record.join.branch_done(index, outcome)
        if outcome == "ok" and change is not None:
            record.deltas[index] = change
        if error is not None:
            record.errors[index] = error
        return decision

    def resolution(
        self, parent: Job, decision: Decision, errors: Callable[[int], BaseException]
    ) -> Continue | Fail:
        """The resolved stage's outcome for ``parent``; ``errors(i)``: branch i's error."""
        stage, record = self.stage, self.record
        if record.join.continues:
            pairs = [(stage.names[i], record.deltas[i]) for i in record.join.to_merge]
            try:
                # The common merge first: it needs no stage path (formatted only for errors).
                policy = stage.merge
                strict = policy.default == "strict" and not policy.keys
                state = merge_strict(parent.state, pairs) if strict else None
                if state is None:
                    state = merge(parent.state, pairs, stage.merge_rules, where=self.where)
            except MergeConflict as conflict:
                return Fail(conflict, Status.FAILED)
            if stage.settle:
                state["outcomes"] = record.settled_outcomes(stage.names)
            return Continue(state)
        failure = self._error([errors(i) for i in decision.failures], parent)
        return Fail(failure, Status.EXPIRED if is_job_timeout(failure) else Status.FAILED)

    def _error(self, errors: list[BaseException], parent: Job) -> BaseException:
        where, stage = self.where, self.stage
        errors = [_as_stage_timeout(e, where, parent) for e in errors]
        # The stage's own time ran out (its timeout, or the job's deadline): that is why it
        # failed, whatever else its branches met before (docs/stages.md). The job's deadline
        # first: it makes the job expired.
        ran_out = [e for e in errors if isinstance(e, DeadlineExceeded) and e.scope in _OWN_TIME]
        if ran_out:
            return min(ran_out, key=lambda e: _OWN_TIME.index(e.scope))
        if stage.kind == "any_of" and len(errors) > 1:
            return ExceptionGroup(f"every branch of {where} failed", _exceptions(errors))
        if stage.kind == "quorum" and len(errors) > 1:
            return ExceptionGroup(
                f"{where} can no longer reach {stage.k} successes", _exceptions(errors)
            )
        return errors[0]


#: The limits that are the stage's own time, the job's first.
_OWN_TIME: Final = ("job", "stage")


def _exceptions(errors: list[BaseException]) -> list[Exception]:
    return [e if isinstance(e, Exception) else RuntimeError(repr(e)) for e in errors]


def _as_stage_timeout(exc: BaseException, where: str, parent: Job) -> BaseException:
    """A branch that hit its own deadline hit the stage's (or the parent job's) limit."""
    if not is_job_timeout(exc):
        return exc
    assert isinstance(exc, DeadlineExceeded)
    if exc.deadline >= parent.deadline:
        return DeadlineExceeded(
            f"job {parent.id} passed its deadline in {where}",
            scope="job",
            where=where,
            deadline=exc.deadline,
        )
    return DeadlineExceeded(
        f"the stage timeout of {where} ran out", scope="stage", where=where, deadline=exc.deadline
    )
