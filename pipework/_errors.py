"""The errors pipework raises, as one small tree.

    PipeworkError                     base of everything pipework raises itself
    ├── Overloaded                    refused at once: nothing was accepted (HTTP 503)
    │   └── Rejected                  refused by the worker pool, with a reason (HTTP 503)
    ├── DeadlineExceeded (TimeoutError) a pipe, stage, suspend or job ran out of time (504)
    ├── BackendError                  a backend answered badly or not at all (HTTP 502)
    ├── JobNotFound                   no such job, or it is past retention (HTTP 404 / 410)
    ├── JobCancelled                  the job was cancelled before it finished
    ├── JobFailed                     a job failed in another process (only its record is here)
    ├── SignalError                   a signal that cannot be delivered (wrong status or name)
    ├── InvalidTransition             a job status change the transition table forbids (a bug)
    ├── InternalError                 the engine's own bookkeeping failed for one job (a bug)
    ├── PipeContractError             a pipe broke the pipe contract (suspended from a child
    │                                 task, swallowed a cancellation, returned no awaitable)
    ├── StateError (TypeError)        a state value that cannot be serialized, with its key path
    ├── MergeConflict                 two branches changed one key differently
    ├── RegistrationError (ValueError) a pipe, chain or stage declared wrongly
    ├── ConfigError (ValueError)      a gateway file with problems, each with key path and line
    │                                 (pipework.registry._config_problems)
    ├── TemplateError                 job state cannot fill a backend call's template (HTTP 400)
    │                                 (pipework.pipes._http_template)
    └── PoolConfigError (ValueError)  a worker pool config that cannot work
                                      (pipework.dispatcher._weighted_core)

Errors raised *by pipes* are never wrapped: they reach the caller as the same exception
object, with notes naming the stage path, job id and correlation id.
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "DeadlineExceeded",
    "InternalError",
    "InvalidTransition",
    "JobCancelled",
    "JobFailed",
    "JobNotFound",
    "MergeConflict",
    "Overloaded",
    "PipeContractError",
    "PipeworkError",
    "RegistrationError",
    "Rejected",
    "SignalError",
    "StateError",
]


class PipeworkError(Exception):
    """Base class of every error pipework raises itself."""

    #: The HTTP status the container answers with when this error ends a request.
    http_status: int = 500


class Overloaded(PipeworkError):
    """Refused at once because a bounded queue is full; nothing was accepted.

    ``retry_after`` is an estimate in seconds of when trying again is likely to succeed.
    """

    http_status = 503

    def __init__(self, message: str, *, reason: str = "queue_full", retry_after: float = 1.0):
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after


class Rejected(Overloaded):
    """The worker pool refused a step: ``reason`` is one of ``queue_full``, ``wait_timeout``,
    ``deadline`` or ``paused``; ``key`` is the admission key that refused it."""

    REASONS = ("queue_full", "wait_timeout", "deadline", "paused")

    def __init__(self, message: str, *, key: str, reason: str, retry_after: float = 1.0):
        if reason not in self.REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}; expected one of {self.REASONS}")
        super().__init__(message, reason=reason, retry_after=retry_after)
        self.key = key


class DeadlineExceeded(PipeworkError, TimeoutError):
    """A time limit ran out. ``scope`` says which: ``pipe``, ``stage``, ``suspend`` or ``job``;
    ``where`` names the stage path; ``deadline`` is the absolute (trio clock) time it hit."""

    http_status = 504

    def __init__(self, message: str, *, scope: str, where: str = "", deadline: float = 0.0):
        super().__init__(message)
        self.scope = scope
        self.where = where
        self.deadline = deadline


class BackendError(PipeworkError):
    """A backend service failed: it answered with an unaccepted status, or the connection
    failed. ``service`` names it and ``status`` is its HTTP status (None: no answer)."""

    http_status = 502

    def __init__(self, message: str, *, service: str, status: int | None = None):
        super().__init__(message)
        self.service = service
        self.status = status


class JobNotFound(PipeworkError, LookupError):
    """No job has this id (it never existed, or it was dropped after retention)."""

    http_status = 404


class JobCancelled(PipeworkError):
    """The job was cancelled before it finished."""

    http_status = 409


class JobFailed(PipeworkError):
    """A job failed where its exception object is not available (another process, or after a
    restart): this carries the recorded type, message and stage path instead."""

    def __init__(self, message: str, *, error_type: str, where: str = ""):
        super().__init__(message)
        self.error_type = error_type
        self.where = where


class SignalError(PipeworkError):
    """A signal could not be delivered: the job is finished, or waits for another signal."""

    http_status = 409


class InvalidTransition(PipeworkError):
    """A job status change that the transition table does not allow."""

    def __init__(self, current: str, target: str, job_id: str = ""):
        where = f" for job {job_id}" if job_id else ""
        super().__init__(
            f"illegal job status transition {current!r} -> {target!r}{where}; "
            "see pipework.dispatcher._status.TRANSITIONS for the allowed ones"
        )
        self.current = current
        self.target = target


class StateError(PipeworkError, TypeError):
    """A value in job state cannot be stored: ``path`` is its key path (``state.user.tags[2]``)."""

    http_status = 400

    def __init__(self, message: str, *, path: str):
        super().__init__(message)
        self.path = path


class MergeConflict(PipeworkError):
    """Two branches of one parallel stage changed the same top-level key to different values
    and the stage has no merge policy for it."""

    def __init__(self, key: str, branches: tuple[str, ...], where: str = ""):
        names = ", ".join(branches)
        at = f" at {where}" if where else ""
        super().__init__(
            f"merge conflict{at}: branches {names} changed state key {key!r} to different "
            "values; set a merge policy on the stage (first, last, a reducer or a function)"
        )
        self.key = key
        self.branches = branches
        self.where = where


class RegistrationError(PipeworkError, ValueError):
    """A pipe, chain or stage was declared wrongly (unknown name, cycle, bad option)."""


class InternalError(PipeworkError):
    """The engine's own bookkeeping failed for one job (a bug in pipework or in a store): that
    job fails with this, the traceback is logged, and every other job runs on."""


class PipeContractError(PipeworkError):
    """A pipe broke the contract every pipe keeps: it called ``ctx.suspend()`` from a child
    task, swallowed a cancellation, raised a BaseException that is not an error, or returned
    something that is not awaitable. The original exceptions are kept as ``__cause__``."""
