"""Sorting out what a pipe raised, and naming where: no I/O.

trio and the libraries on it raise exception groups, so what a pipe raised is sorted the
trio way: the cancellation from outside it (the step's, the engine's) travels on; a
suspension raised from a child task is a contract error; anything else that is not an
error a job can end with is wrapped in one. Only trouble with the backend (not a pipe's own
bug, not a cancel) may shrink a key's adaptive limit.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from types import CoroutineType

import trio

from .._errors import BackendError, DeadlineExceeded, Overloaded, PipeContractError
from ..pipes._pipe import Context, Pipe, Suspend
from ..pipes._stages import Chain
from ._cursor import path_of, stage_path
from ._job import Frame, Job

__all__ = [
    "PipeTimeout",
    "backend_trouble",
    "cancellation_in",
    "frame_timeout",
    "invoke",
    "is_job_timeout",
    "note",
    "pipe_error",
    "refused_by_service",
    "timeout_of",
    "where_in",
]

_log = logging.getLogger("pipework.dispatcher")


class PipeTimeout(Exception):
    """The pipe's deadline (its own, a stage's or the job's) ran out."""


def invoke(pipe: Pipe, ctx: Context) -> Awaitable[None]:
    """The pipe's awaitable, for the runner to await directly: one coroutine frame fewer on
    every resume."""
    if pipe.blocking:
        return pipe.run(ctx)
    awaitable = pipe.fn(ctx)
    if type(awaitable) is not CoroutineType and not inspect.isawaitable(awaitable):
        raise PipeContractError(
            f"pipe {pipe.name!r} returned {type(awaitable).__name__}, not an awaitable; "
            "a pipe is an `async def` (or declared blocking=True)"
        )
    return awaitable


def cancellation_in(raised: BaseException, describe: Callable[[], str]) -> BaseException | None:
    """The part of a pipe's exception that is a cancellation from outside the pipe (the
    step's or the engine's), to travel on; None when there is none. Errors raised alongside
    a cancellation are logged: the cancellation decides the job's end."""
    if isinstance(raised, trio.Cancelled | KeyboardInterrupt):
        return raised
    if not isinstance(raised, BaseExceptionGroup):
        return None
    if raised.split(Suspend)[0] is not None:
        return None  # a contract error, whatever else is in the group
    cancelled, errors = raised.split((trio.Cancelled, KeyboardInterrupt))
    if cancelled is not None and errors is not None:
        _log.warning("errors while %s was being cancelled", describe(), exc_info=errors)
    return cancelled


def pipe_error(raised: BaseException, path: str) -> BaseException:
    """What a pipe's exception (not a cancellation) fails its job with: the exception
    itself, or a PipeContractError caused by it when a job cannot end with it."""
    if isinstance(raised, BaseExceptionGroup) and raised.split(Suspend)[0] is not None:
        exc: BaseException = PipeContractError(
            f"ctx.suspend() was called from a child task inside {path}; a pipe suspends "
            "from its own task (close the nursery first, then suspend)"
        )
    elif isinstance(raised, Exception):
        return raised
    else:
        exc = PipeContractError(
            f"{path} raised {type(raised).__name__}, which is not an error a job can end "
            "with; raise an Exception subclass"
        )
    exc.__cause__ = raised
    return exc


def is_job_timeout(exc: BaseException) -> bool:
    """The job's own deadline (it ends the job ``expired``)."""
    return isinstance(exc, DeadlineExceeded) and exc.scope == "job"


def backend_trouble(exc: BaseException) -> bool:
    """Whether ``exc`` points at the key's backend (it failed, could not be reached or was
    too slow), as opposed to a bug in the pipe: only such trouble may shrink an adaptive
    limit. Only pipework's errors and the standard library's are known here: the backends
    layer turns its clients' failures into pipework's, and a pipe that calls a backend
    through a client of its own raises ``BackendError`` to count (docs/design.md)."""
    if isinstance(exc, BaseExceptionGroup):
        return any(backend_trouble(e) for e in exc.exceptions)
    if isinstance(exc, BackendError):
        return exc.status is None or exc.status >= 500
    if isinstance(exc, TimeoutError | ConnectionError):
        return True
    # A bare OSError: trio's "all attempts to connect failed", socket errors. Anything
    # else, an HTTP client's own exception too, is the pipe's.
    return type(exc) is OSError


def refused_by_service(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a backend service's refusal of a call (its circuit breaker open
    or probing, every host drained): an expected state, logged once when the breaker
    changed and counted by ``pipework_backend_refused_total``, so a job it ends is logged
    without a traceback and below WARNING (docs/resilience.md). Not the backend's trouble
    either: nothing was sent."""
    return isinstance(exc, Overloaded) and exc.service is not None


def note(exc: BaseException, job: Job, where: str) -> None:
    """Add where it happened to ``exc`` (once): the stage path, the job, its correlation id."""
    line = f"pipework: in {where} (job {job.id}, correlation id {job.correlation_id})"
    if line not in getattr(exc, "__notes__", ()):
        exc.add_note(line)


def where_in(chain: Chain | None, job: Job) -> str:
    """The job's place in its chain, for an error already raised (never raises itself)."""
    try:
        if chain is not None:
            return chain.describe(path_of(job))
    except Exception:  # only a description: a broken cursor must not hide the error
        pass
    return f"chain {job.chain!r}"


def timeout_of(
    job: Job, chain: Chain, pipe_deadline: float, top: Frame, path: str
) -> DeadlineExceeded:
    """The DeadlineExceeded of the limit that fired: the pipe's, a stage's or the job's."""
    if pipe_deadline < top.deadline:
        return DeadlineExceeded(
            f"the pipe's timeout ran out in {path}",
            scope="pipe",
            where=path,
            deadline=pipe_deadline,
        )
    return frame_timeout(job, chain, top, path)


def frame_timeout(
    job: Job, chain: Chain, top: Frame, path: str, while_: str = ""
) -> DeadlineExceeded:
    """The DeadlineExceeded of the limit the cursor's top frame carries: a stage's (the
    one that set it) or the job's own."""
    if top.bound < 0:
        return DeadlineExceeded(
            f"job {job.id} passed its deadline{while_} in {path}",
            scope="job",
            where=path,
            deadline=top.deadline,
        )
    stage = chain.describe(stage_path(job, top.bound))
    return DeadlineExceeded(
        f"the stage timeout of {stage} ran out{while_} (in {path})",
        scope="stage",
        where=stage,
        deadline=top.deadline,
    )
