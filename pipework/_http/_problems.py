"""Every error the container answers with is an RFC 9457 problem (application/problem+json).

A :class:`Problem` is raised anywhere in a handler and rendered by one error handler (the
container's ``_middleware``), which adds the correlation id and the request path. Errors are
mapped to problems here, in one place: pipework errors by their ``http_status`` and failures
recorded on a job by its :class:`~pipework.ErrorInfo` (werkzeug's HTTP errors, by their
code, in ``_middleware.problem_for_http``). Nothing here knows Quart: a problem is a value.

What a client learns about a failure: pipework's own messages (written to be shown, they
say what happened and where) and any error whose status is below 500 (a pipe rejecting
its input on purpose) are shown; for any other exception a pipe raised, only its type and
stage path are, unless the container is configured to expose error messages. Tracebacks
are never sent; they are in the log under the correlation id.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, Final

from .. import _errors
from ..dispatcher._job import ErrorInfo
from ..dispatcher._store import JobGone

__all__ = [
    "PROBLEM_JSON",
    "PROBLEM_TYPE_PREFIX",
    "Problem",
    "encode_problem",
    "problem_for_error",
    "problem_for_exception",
    "retry_after_header",
]

PROBLEM_JSON: Final = "application/problem+json"
#: Problems specific to pipework have a type of this prefix plus a slug (see the HTTP docs);
#: plain HTTP errors use ``about:blank`` as RFC 9457 suggests.
PROBLEM_TYPE_PREFIX: Final = "urn:pipework:problem:"

# Errors whose messages pipework writes itself, so they are safe to show.
_OWN_ERRORS: Final = frozenset({*_errors.__all__, JobGone.__name__})

# Recorded error type -> (slug, title).
_KINDS: Final[Mapping[str, tuple[str, str]]] = {
    "Overloaded": ("overloaded", "Overloaded"),
    "Rejected": ("rejected", "Rejected by the worker pool"),
    "StoreUnavailable": ("store-unavailable", "Job store unavailable"),
    "DeadlineExceeded": ("deadline-exceeded", "Deadline exceeded"),
    "BackendError": ("backend-failed", "Backend failed"),
    "BackendUnreachable": ("backend-failed", "Backend failed"),
    "JobGone": ("job-gone", "Job gone"),
    "JobNotFound": ("job-not-found", "Job not found"),
    "JobCancelled": ("job-cancelled", "Job cancelled"),
    "SignalError": ("signal-refused", "Signal refused"),
    "StateError": ("invalid-state", "Invalid job state"),
    # The job's input cannot make a valid backend request (refused before sending).
    "TemplateError": ("backend-request-refused", "Backend request refused"),
}


# Refusals by the queue or the pool: their messages are operators' business.
_REFUSALS: Final = frozenset({"Overloaded", "Rejected", "StoreUnavailable"})


def _refusal_detail(
    retry_after: float | None, error_type: str = "Overloaded", maybe_done: bool = False
) -> str:
    when = f"after {max(1, math.ceil(retry_after))} s" if retry_after is not None else "later"
    if maybe_done:  # the store was lost while it was being written: said only if not
        return (
            "the server lost its job store while writing this request's change, which may "
            f"or may not have been made: look before you retry {when} (see Retry-After)"
        )
    why = (
        "the server cannot reach its job store now"  # where it is: the operators' log
        if error_type == "StoreUnavailable"
        else "the server is too busy to take this request now"
    )
    return f"{why}; nothing was done: retry {when} (see Retry-After)"


class Problem(Exception):
    """An error answer: ``status``, a ``slug`` naming its type (None: a plain HTTP error),
    a ``title`` and a ``detail``; ``extensions`` become extra members of the body."""

    def __init__(
        self,
        status: int,
        title: str,
        detail: str = "",
        *,
        slug: str | None = None,
        headers: Mapping[str, str] | None = None,
        instance: str | None = None,
        **extensions: Any,
    ) -> None:
        super().__init__(f"{status} {title}: {detail}" if detail else f"{status} {title}")
        self.status = status
        self.title = title
        self.detail = detail
        self.slug = slug
        self.headers = dict(headers or {})
        self.instance = instance
        self.extensions = extensions

    @property
    def type(self) -> str:
        return "about:blank" if self.slug is None else PROBLEM_TYPE_PREFIX + self.slug

    def document(self, *, correlation_id: str, instance: str) -> dict[str, Any]:
        doc: dict[str, Any] = {"type": self.type, "title": self.title, "status": self.status}
        if self.detail:
            doc["detail"] = self.detail
        doc["instance"] = self.instance or instance
        doc["correlation_id"] = correlation_id
        for name, value in self.extensions.items():
            if value is not None and name not in doc:
                doc[name] = value
        return doc


def encode_problem(problem: Problem, *, correlation_id: str, instance: str) -> bytes:
    """The problem's JSON document, as every answer of the container writes it."""
    return json.dumps(
        problem.document(correlation_id=correlation_id, instance=instance),
        separators=(",", ":"),
        ensure_ascii=False,
        default=str,
    ).encode()


def retry_after_header(seconds: float) -> dict[str, str]:
    """``Retry-After`` in whole seconds, rounded up (the header takes no fractions)."""
    return {"Retry-After": str(max(0, math.ceil(seconds)))}


def problem_for_error(
    error: ErrorInfo,
    *,
    expose: bool = False,
    retry_after: float | None = None,
    job_id: str | None = None,
) -> Problem:
    """The problem for a failure recorded on a job."""
    status = error.status if 400 <= error.status <= 599 else 500
    slug, title = _KINDS.get(error.type, ("pipe-failed", "Pipe failed"))
    if error.type not in _OWN_ERRORS and status < 500:
        # A pipe refused its input on purpose (its exception carries a 4xx http_status).
        slug, title = "pipe-refused", "Refused by a pipe"
    shown = expose or error.type in _OWN_ERRORS or status < 500
    if error.type in _REFUSALS and not expose:
        # The pool's and the queue's messages are for operators (their numbers, "raise the
        # key's limit"): they are in the log and /admin. The client learns what it can do.
        detail = _refusal_detail(retry_after, error.type)
    elif shown:
        detail = error.message
    else:
        where = f" in {error.where}" if error.where else ""
        detail = f"{error.type}{where}; the server log has the details under this correlation id"
    headers = retry_after_header(retry_after) if retry_after is not None else None
    return Problem(
        status,
        title,
        detail,
        slug=slug,
        headers=headers,
        error_type=error.type,
        where=error.where or None,
        job_id=job_id,
        retry_after=retry_after,
    )


def problem_for_exception(
    exc: BaseException, *, expose: bool = False, job_id: str | None = None, where: str = ""
) -> Problem:
    """The problem for an exception: raised by a handler, or the one a job ended with."""
    if isinstance(exc, Problem):
        return exc
    status = getattr(exc, "http_status", 500)
    if not isinstance(status, int):
        status = 500
    where = where or getattr(exc, "where", "") or ""
    # A job that failed elsewhere carries the original error's type name, not its class.
    name = exc.error_type if isinstance(exc, _errors.JobFailed) else type(exc).__name__
    info = ErrorInfo(name, str(exc), where, status)
    retry_after = exc.retry_after if isinstance(exc, _errors.Overloaded) else None
    problem = problem_for_error(info, expose=expose, retry_after=retry_after, job_id=job_id)
    if isinstance(exc, _errors.StoreUnavailable) and exc.maybe_done and not expose:
        problem.detail = _refusal_detail(retry_after, name, maybe_done=True)
    if isinstance(exc, _errors.Overloaded):
        problem.extensions["reason"] = exc.reason
    if isinstance(exc, _errors.Rejected):
        problem.extensions["key"] = exc.key
    if isinstance(exc, _errors.BackendError):
        problem.extensions["service"] = exc.service
        problem.extensions["backend_status"] = exc.status
    if isinstance(exc, _errors.StateError):
        problem.extensions["path"] = exc.path
    return problem
