"""The job record, and the frozen view of it that the public API hands out.

A :class:`JobRecord` is everything a stateless worker needs to continue a chain: which
chain, the state, the cursor (a stack of frames), the admission key of its next step, its
deadline and its status. It round-trips through msgpack (:meth:`JobRecord.to_wire`), which
is what a shared (Redis) store keeps. A :class:`Job` is the record as the process running it
holds it, with what only that process knows (a cancel asked of its step, the exception
object it failed with). A parent waiting at a parallel stage holds a :class:`JoinRecord`,
plain data too.
"""

from __future__ import annotations

import hashlib
import math
import os
import secrets
import time
from binascii import b2a_base64
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final, Self

from ..pipes._join import Join
from ..pipes._merge import Delta
from ..pipes._pipe import DEGRADED_KEY
from ._status import QUEUED, TRANSITIONS, Status, check_transition

__all__ = [
    "ErrorInfo",
    "Frame",
    "Job",
    "JobView",
    "JoinRecord",
    "Progress",
    "degraded_of",
    "new_ids",
    "new_job_id",
]

_JOIN_RECORD_VERSION: Final = 1
_new_object = object.__new__


def new_job_id() -> str:
    """128 random bits, URL-safe: unguessable, so an id alone reveals nothing."""
    return secrets.token_urlsafe(16)


#: Random bytes read ahead for :func:`new_ids`, 32 per job: one read of the system's random
#: source per ``_IDS_AHEAD`` jobs instead of a system call per job. A deque's ``popleft`` is
#: atomic, so threads never share a chunk; a forked child empties it, so no two processes
#: hand out the same ids.
_IDS_AHEAD: Final = 64
_URLSAFE: Final = bytes.maketrans(b"+/", b"-_")
_ahead: deque[bytes] = deque()
os.register_at_fork(after_in_child=_ahead.clear)


def new_ids() -> tuple[str, str]:
    """A job id (as :func:`new_job_id`) and a correlation id (as :func:`new_correlation_id`):
    32 bytes from :mod:`secrets`, read ahead in batches."""
    try:
        raw = _ahead.popleft()
    except IndexError:
        block = secrets.token_bytes(32 * _IDS_AHEAD)
        _ahead.extend(block[i : i + 32] for i in range(32, len(block), 32))
        raw = block[:32]
    # base64.urlsafe_b64encode(...).rstrip(b"=") in one call: 16 bytes are 22 digits (then
    # "==" and a newline).
    return b2a_base64(raw[:16])[:22].translate(_URLSAFE).decode(), raw[16:].hex()


def new_correlation_id() -> str:
    return secrets.token_hex(16)


def hash_token(token: str) -> str:
    # surrogatepass: any text hashes (text no token can be is then simply a wrong token);
    # for every other text the bytes, and so the hash, are plain UTF-8's.
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(slots=True)
class Frame:
    """One level of the cursor: the position inside one serial sequence of the chain.

    ``index`` is the next child to run; ``deadline`` (absolute trio time) is the tightest of
    this stage's timeout and every enclosing one, the job's deadline included, counted from
    when the cursor entered the stage. ``bound`` says whose limit that is: the depth of the
    frame whose own stage set it, or -1 for the job's deadline (so a timeout names the limit
    that fired).
    """

    index: int
    deadline: float
    bound: int = -1


@dataclass(frozen=True, slots=True)
class Progress:
    """How far a job is. ``branch`` is the stage path of the pipe that reported it when that
    pipe runs inside a parallel branch (None for the job's own pipes)."""

    done: float
    total: float | None = None
    message: str | None = None
    branch: str | None = None


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """What is recorded about a failure: enough to answer without the exception object."""

    type: str
    message: str
    where: str = ""
    status: int = 500

    def to_wire(self) -> tuple[str, str, str, int]:
        return (self.type, self.message, self.where, self.status)


@dataclass(slots=True, eq=False)
class JoinRecord:
    """A parent waiting at a parallel stage: what its join keeps between branch events.

    ``id`` tells this join from an earlier run of the same stage (a late ``BranchDone``
    names the join it was sent to); ``path`` is the stage's position in the chain and
    ``deadline`` the absolute trio time bounding its branches. By branch index: ``children``
    holds the child job of each started branch, ``deltas`` what each ok branch changed, and
    ``errors`` what each failed branch's error was. The exception objects themselves cannot
    be stored: they stay in the dispatcher of the process where the branch ended.

    Everything round-trips through msgpack (:meth:`to_wire`), so a store may hand back a
    fresh copy on every read; branch indices become ``[index, value]`` pairs on the wire,
    since the wire's map keys are strings.
    """

    id: str
    path: tuple[int, ...]
    join: Join
    deadline: float = math.inf
    children: dict[int, str] = field(default_factory=dict)
    deltas: dict[int, Delta] = field(default_factory=dict)
    errors: dict[int, ErrorInfo] = field(default_factory=dict)

    def settled_outcomes(self, names: Sequence[str]) -> dict[str, dict[str, Any]]:
        """How each branch ended, by name, with the error of each one that failed: what a
        ``settle`` stage writes to ``state["outcomes"]``."""
        outcomes: dict[str, dict[str, Any]] = {}
        for i, outcome in enumerate(self.join.outcomes):
            info: dict[str, Any] = {"outcome": outcome}
            error = self.errors.get(i)
            if error is not None and outcome not in ("ok", "not_started"):
                info["error"] = {"type": error.type, "message": error.message}
            outcomes[names[i]] = info
        return outcomes

    def to_wire(self) -> dict[str, Any]:
        """Plain lists, str, int, float, bool and None: safe to store with msgpack."""
        return {
            "version": _JOIN_RECORD_VERSION,
            "id": self.id,
            "path": list(self.path),
            "deadline": self.deadline,
            "join": self.join.to_wire(),
            "children": [[i, child] for i, child in sorted(self.children.items())],
            "deltas": [[i, d.to_wire()] for i, d in sorted(self.deltas.items())],
            "errors": [[i, _error_tuple(e)] for i, e in sorted(self.errors.items())],
        }

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> JoinRecord:
        if wire.get("version") != _JOIN_RECORD_VERSION:
            raise ValueError(f"unsupported join record version {wire.get('version')!r}")
        return cls(
            id=wire["id"],
            path=tuple(wire["path"]),
            join=Join.from_wire(wire["join"]),
            deadline=float(wire["deadline"]),
            children={int(i): child for i, child in wire["children"]},
            deltas={int(i): Delta.from_wire(d) for i, d in wire["deltas"]},
            errors={int(i): ErrorInfo(*e) for i, e in wire["errors"]},
        )


@dataclass(slots=True, eq=False)
class JobRecord:
    """What is stored of a job, and so what any process can continue it from: its wire
    form is :meth:`to_wire` / :meth:`from_wire` (a shared store writes these fields, in
    this order, as a msgpack array). What only the process running it knows is
    :class:`Job`'s."""

    id: str
    chain: str
    state: dict[str, Any]
    correlation_id: str
    deadline: float = math.inf
    key: str = "default"
    status: Status = Status.QUEUED
    #: The W3C ``traceparent`` the request that started the job came with (backend calls
    #: pass it on).
    traceparent: str | None = None
    frames: list[Frame] = field(default_factory=list)
    #: Path from the chain's root to the sequence this job runs (branches start deeper).
    root: tuple[int, ...] = ()
    progress: Progress | None = None
    result: Any = None
    error: ErrorInfo | None = None
    token_hash: str | None = None
    waiting_for: str | None = None
    suspend_into: str | None = None
    suspend_deadline: float | None = None
    signals: dict[str, Any] = field(default_factory=dict)
    #: Chunks a pipe emitted with no stream reading them: none until the first (an empty
    #: tuple, not a list per job: every object a record holds is one more for the collector).
    output: list[Any] | tuple[()] = ()
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    #: The plan generation (registry) the job runs on; a reload never changes it.
    plan: int = 1
    #: The trio clock when the job was accepted (durations and metrics).
    accepted_at: float = 0.0
    #: Its admission was decided when it was accepted (an async job's 202): every step
    #: then waits for its slot up to the deadline instead of being refused for load.
    admitted: bool = False
    #: Absolute trio time after which a finished job is dropped (None while active).
    retain_until: float | None = None
    #: A branch of a parallel stage: its parent job, its index there, and which join.
    parent: str | None = None
    branch: int | None = None
    join_id: str | None = None
    #: A parent waiting at a parallel stage: its join's record (see _forked.py).
    join: JoinRecord | None = None
    #: The names of the signals the job took: delivered to it (or, sent to it, to one of
    #: its branches), or taken from its mailbox by a suspend. Another of one of these names
    #: is refused unless the job suspends for it again (Engine.signal). Last of the stored
    #: fields, so a record written before it existed reads as having taken none.
    delivered: tuple[str, ...] = ()
    #: The W3C ``tracestate`` and ``baggage`` the request that started the job came with
    #: (backend calls pass them on, as ``traceparent``). Stored after ``delivered``, so a
    #: record written before them reads as having neither.
    tracestate: str | None = None
    baggage: str | None = None
    #: The admission key of the steps that would run under the chain's own key, chosen
    #: for the job when it was accepted (a route's ``pool_key``: its caller's tenant, see
    #: docs/edge-policy.md); None: the chain's key. Branches inherit it. Stored after
    #: ``baggage``, so a record written before it reads as having none.
    pool_key: str | None = None
    #: Who owns the job, when the route that started it authenticated its caller: the
    #: identity's owner string (``AUTH:SUBJECT``, see ``Identity.owner``), by which the
    #: store indexes its jobs for the download centre's listing. None for a job started
    #: without an identity, and for a branch. Stored after ``pool_key``, so a record
    #: written before it reads as having none.
    owner: str | None = None
    #: The store's count of writes (a shared store compares it to refuse a stale write).
    version: int = 0

    def took(self, signal: str) -> None:
        """Remember that the job took ``signal`` (see ``delivered``)."""
        if signal not in self.delivered:
            self.delivered = (*self.delivered, signal)

    def transition(self, target: Status) -> None:
        if target not in TRANSITIONS[self.status]:  # check_transition's test, inline
            check_transition(self.status, target, self.id)  # raises InvalidTransition
        self.status = target
        self.updated_at = time.time()

    def view(self) -> JobView:
        return JobView(
            id=self.id,
            chain=self.chain,
            status=self.status,
            correlation_id=self.correlation_id,
            key=self.key,
            progress=self.progress,
            error=self.error,
            result=self.result if self.status is Status.DONE else None,
            waiting_for=self.waiting_for,
            deadline=self.deadline,
            created_at=self.created_at,
            updated_at=self.updated_at,
            finished_at=self.finished_at,
            retain_until=self.retain_until,
            degraded=degraded_of(self.state),
        )

    def to_wire(self) -> dict[str, Any]:
        """The record as plain msgpack-able data (for a shared store)."""
        return {
            "id": self.id,
            "chain": self.chain,
            "state": self.state,
            "correlation_id": self.correlation_id,
            "traceparent": self.traceparent,
            "deadline": self.deadline,
            "key": self.key,
            "status": self.status.value,
            "frames": [[f.index, f.deadline, f.bound] for f in self.frames],
            "root": list(self.root),
            "progress": None if self.progress is None else list(_progress_tuple(self.progress)),
            "result": self.result,
            "error": None if self.error is None else _error_tuple(self.error),
            "token_hash": self.token_hash,
            "waiting_for": self.waiting_for,
            "suspend_into": self.suspend_into,
            "suspend_deadline": self.suspend_deadline,
            "signals": self.signals,
            "output": list(self.output),
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "finished_at": self.finished_at,
            "retain_until": self.retain_until,
            "accepted_at": self.accepted_at,
            "admitted": self.admitted,
            "plan": self.plan,
            "parent": self.parent,
            "branch": self.branch,
            "join_id": self.join_id,
            "join": None if self.join is None else self.join.to_wire(),
            "delivered": list(self.delivered),
            "tracestate": self.tracestate,
            "baggage": self.baggage,
            "pool_key": self.pool_key,
            "owner": self.owner,
            "version": self.version,
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Self:
        fields = dict(data)
        fields.pop("cancel_requested", None)  # written by an earlier pipework: not stored now
        fields["status"] = Status(fields["status"])
        fields["frames"] = [Frame(int(i), float(d), int(b)) for i, d, b in fields["frames"]]
        fields["root"] = tuple(fields["root"])
        if fields["progress"] is not None:
            fields["progress"] = Progress(*fields["progress"])
        if fields["error"] is not None:
            fields["error"] = ErrorInfo(*fields["error"])
        if fields["join"] is not None:
            fields["join"] = JoinRecord.from_wire(fields["join"])
        fields["delivered"] = tuple(fields.get("delivered", ()))
        return cls(**fields)


@dataclass(slots=True, eq=False)
class Job(JobRecord):
    """A job as this process holds it: its stored record, and what only this process
    knows of it, which no store keeps and no other process needs."""

    #: A cancel was asked of the step running it here: how the step tells its scope's
    #: cancellation from a pipe's deadline riding on the same scope.
    cancel_requested: bool = False
    #: The exception it failed with, traceback intact (a store keeps only ``error``).
    exception: BaseException | None = None

    @classmethod
    def accepted(
        cls,
        id: str,
        chain: str,
        state: dict[str, Any],
        correlation_id: str,
        deadline: float,
        token_hash: str | None,
        traceparent: str | None,
        plan: int,
        accepted_at: float,
        admitted: bool,
        wall: float,
        tracestate: str | None = None,
        baggage: str | None = None,
        pool_key: str | None = None,
        owner: str | None = None,
    ) -> Job:
        """A new top-level job, as ``Job(...)`` with these fields and every other at its
        default (``created_at`` and ``updated_at`` both ``wall``), built for the submission
        path: the generated ``__init__`` called with a dozen keywords costs twice this."""
        job = _new_object(cls)
        job.id = id
        job.chain = chain
        job.state = state
        job.correlation_id = correlation_id
        job.deadline = deadline
        job.key = "default"
        job.status = QUEUED
        job.traceparent = traceparent
        job.frames = []
        job.root = ()
        job.progress = None
        job.result = None
        job.error = None
        job.token_hash = token_hash
        job.waiting_for = None
        job.suspend_into = None
        job.suspend_deadline = None
        job.signals = {}
        job.output = ()
        job.cancel_requested = False
        job.created_at = wall
        job.updated_at = wall
        job.finished_at = None
        job.plan = plan
        job.accepted_at = accepted_at
        job.admitted = admitted
        job.retain_until = None
        job.parent = None
        job.branch = None
        job.join_id = None
        job.join = None
        job.delivered = ()
        job.tracestate = tracestate
        job.baggage = baggage
        job.pool_key = pool_key
        job.owner = owner
        job.version = 0
        job.exception = None
        return job


#: What a job that degraded nothing shows (read-only, shared).
_NOTHING_DEGRADED: Final[Mapping[str, str]] = MappingProxyType({})


def degraded_of(state: Mapping[str, Any]) -> Mapping[str, str]:
    """What a job's ``state`` records it degraded: ``{pipe: reason}`` (see
    docs/degradation.md), its string entries only; empty when nothing."""
    found = state.get(DEGRADED_KEY)
    if not found or not isinstance(found, dict):
        return _NOTHING_DEGRADED
    return {k: v for k, v in found.items() if isinstance(k, str) and isinstance(v, str)}


def _progress_tuple(p: Progress) -> tuple[float, float | None, str | None, str | None]:
    return (p.done, p.total, p.message, p.branch)


def _error_tuple(e: ErrorInfo) -> list[Any]:
    return [e.type, e.message, e.where, e.status]


@dataclass(frozen=True, slots=True)
class JobView:
    """A frozen snapshot of a job, as :meth:`Engine.status` returns it."""

    id: str
    chain: str
    status: Status
    correlation_id: str
    key: str
    progress: Progress | None
    error: ErrorInfo | None
    result: Any
    waiting_for: str | None
    deadline: float
    created_at: float
    updated_at: float
    finished_at: float | None
    retain_until: float | None
    #: What the job degraded so far: ``{pipe: reason}`` (see docs/degradation.md).
    degraded: Mapping[str, str] = field(default_factory=lambda: _NOTHING_DEGRADED)
