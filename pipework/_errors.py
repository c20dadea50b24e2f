"""The errors pipework lets reach its users, as one small tree: each is defined here, once,
and exported as ``pipework.<Name>`` (``tests/test_exports.py`` keeps this tree equal to the
exported classes and their bases).

    PipeworkError                       base of everything pipework raises itself
    ├── Overloaded                      refused at once: nothing was accepted (HTTP 503)
    │   ├── Rejected                    refused by the worker pool, with a reason (HTTP 503)
    │   └── StoreUnavailable            the shared job store (Redis) cannot be reached (503)
    ├── DeadlineExceeded (TimeoutError) a pipe, stage, suspend or job ran out of time (504)
    ├── BackendError                    a backend answered badly or not at all (HTTP 502)
    │   └── BackendUnreachable          no connection to it could be made: nothing was sent
    ├── JobNotFound (LookupError)       no such job (HTTP 404)
    │   └── JobGone                     the job existed but is past retention (HTTP 410)
    ├── JobCancelled                    the job was cancelled before it finished (HTTP 409)
    ├── JobFailed                       a job failed in another process (only its record is here)
    ├── SignalError                     a signal that cannot be delivered (wrong status or name)
    ├── InvalidTransition               a job status change the transition table forbids (a bug)
    ├── InternalError                   the engine's own bookkeeping failed for one job (a bug)
    ├── PipeContractError               a pipe broke the pipe contract (suspended from a child
    │                                   task, swallowed a cancellation, returned no awaitable)
    ├── StateError (TypeError)          a state value that cannot be serialized, with its key path
    ├── MergeConflict                   two branches changed one key differently
    ├── RegistrationError (ValueError)  a pipe, chain, stage or route declared wrongly
    ├── PoolConfigError (ValueError)    a worker or resource pool config that cannot work
    ├── ResourcePoolError               a resource pool cannot lend a resource (HTTP 503)
    │   ├── BorrowTimeout (TimeoutError) no resource came free within ``borrow_timeout``
    │   ├── ResourcePoolClosed          the pool is not running (not started, or shut down)
    │   └── ResourceStartupError        making the pool's resources at start-up failed
    ├── TemplateSyntaxError (ValueError) a backend call template that cannot be parsed
    ├── TemplateError (ValueError)      job state cannot fill a backend call's template (HTTP 400)
    └── ConfigError (ValueError)        a gateway file with problems, each a ConfigProblem
                                        (key path, line, message, severity)

Errors raised *by pipes* are never wrapped: they reach the caller as the same exception
object, with notes naming the stage path, job id and correlation id.

Exceptions that never leave the layer raising them live with that layer, which turns each
into one of the errors above, or into an HTTP answer, at its edge:

- ``pipework.backends``: the lean HTTP client's failures (``_failures.py``:
  ``TransportFailure`` and its ``ConnectFailed``, ``ConnectionBroken``, ``BadAnswer`` and
  ``CallTimeout``; ``_h1.py``: ``BadEncoding``, ``ResponseTooLarge`` and
  ``StaleConnection``), which ``Backends`` turns into ``BackendError``,
  ``BackendUnreachable`` or ``DeadlineExceeded``;
- ``pipework.board``: the sans-IO core's refusals (``_core.py``: ``BoardFull``,
  ``ResourceNotFound``, ``ResourceExists``) and a write no backplane could make
  (``_driver.py``: ``BoardUnavailable``), which the board's HTTP face answers as problems;
- ``pipework.redis``: the wire's ``ReplyError`` and ``ConnectionLost`` (``_wire.py``): a
  Redis away or refusing for now is ``StoreUnavailable`` from the store and the queue, and
  ``BoardUnavailable`` from the backplane (an error reply that means a bug travels on as
  it is, as any bug does);
- ``pipework.proxy``: ``BadTarget`` (``_route.py``), a request path no target may be built
  from for its proxy route (a dot segment, an encoded slash right after a mapped prefix),
  which the proxy's handler answers as a 400 problem; and the ends of a relayed request
  body (``_relay.py``): ``ClientGone`` (the client left mid-exchange: nothing is answered)
  and ``BodyTooLarge`` (past the route's ``max_body``: a 413 problem);
- ``pipework.dispatcher``: ``PipeTimeout`` (``_outcomes.py``), a pipe's time running out
  inside its step, which becomes ``DeadlineExceeded`` naming the limit that fired;
- ``pipework._http``: ``Problem`` (``_problems.py``), an HTTP error *answer* raised inside
  a request handler and rendered there; a route's authentication (``_auth.py``):
  ``Refusal`` (a credential that is not good: a 401 problem with ``WWW-Authenticate``),
  ``JwksUnavailable`` (no keys to verify a token with: a 503 problem) and ``JwksError``
  (a JWKS document that is not one: a configuration problem, or a failed fetch logged and
  the known keys kept); ``PreflightRefused`` (``_cors.py``: a CORS preflight the policy
  does not allow, a 403 problem); ``LimitStoreUnavailable`` (``_ratelimit.py``: a rate
  limit's store that could not be asked, decided by the limit's ``fail_open``).
- ``pipework._tls``: ``TlsFileError``, a certificate, key or CA file that cannot be used,
  naming its setting: the gateway file's reader reports it as a ``ConfigError`` problem at
  that key (``pipework check``, a start, a reload refused).

One more is not an error at all: a pipe's ``Suspend`` (``pipework.pipes._pipe``), a
``BaseException`` the dispatcher catches to park a job, as trio's ``Cancelled`` is. Classes
private to one module (a leading underscore) are not listed.

This module imports nothing from pipework, so every layer may import it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, TypeAlias

__all__ = [
    "BackendError",
    "BackendUnreachable",
    "BorrowTimeout",
    "ConfigError",
    "ConfigProblem",
    "DeadlineExceeded",
    "InternalError",
    "InvalidTransition",
    "JobCancelled",
    "JobFailed",
    "JobGone",
    "JobNotFound",
    "MergeConflict",
    "Overloaded",
    "PipeContractError",
    "PipeworkError",
    "PoolConfigError",
    "RegistrationError",
    "Rejected",
    "ResourcePoolClosed",
    "ResourcePoolError",
    "ResourceStartupError",
    "SignalError",
    "StateError",
    "StoreUnavailable",
    "TemplateError",
    "TemplateSyntaxError",
]


class PipeworkError(Exception):
    """Base class of every error pipework raises itself."""

    #: The HTTP status the container answers with when this error ends a request.
    http_status: int = 500


class Overloaded(PipeworkError):
    """Refused at once because a bounded queue is full, or a backend service refuses its
    calls for now; nothing was accepted.

    ``retry_after`` is an estimate in seconds of when trying again is likely to succeed.
    ``service`` names the backend service whose resilience core refused the call (its
    circuit breaker open or probing, every host drained); None for pipework's own queues.
    """

    http_status = 503

    def __init__(
        self,
        message: str,
        *,
        reason: str = "queue_full",
        retry_after: float = 1.0,
        service: str | None = None,
    ):
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after
        self.service = service


class Rejected(Overloaded):
    """The worker pool refused a step: ``reason`` is one of ``queue_full``, ``wait_timeout``,
    ``deadline`` or ``paused``; ``key`` is the admission key that refused it."""

    REASONS = ("queue_full", "wait_timeout", "deadline", "paused")

    def __init__(self, message: str, *, key: str, reason: str, retry_after: float = 1.0):
        if reason not in self.REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}; expected one of {self.REASONS}")
        super().__init__(message, reason=reason, retry_after=retry_after)
        self.key = key


class StoreUnavailable(Overloaded):
    """The shared job store (Redis) cannot be reached, or did not answer in time: the work
    is refused (HTTP 503), not lost; retry once it is back.

    ``maybe_done``: what was sent may have reached the store and been done (its connection
    was lost, or no answer came, after it was sent); False only when it provably was not
    (no connection could be made, or the store refused it). ``job_id``: a job a submission
    may have created so (its client is told to follow it, not to submit it again)."""

    def __init__(
        self,
        message: str,
        *,
        retry_after: float = 1.0,
        maybe_done: bool = True,
        dependency: str | None = None,
    ) -> None:
        super().__init__(message, reason="store_unavailable", retry_after=retry_after)
        self.maybe_done = maybe_done
        self.job_id: str | None = None
        #: What could not be reached, as its outage is named in the log (``Redis at URL``).
        self.dependency = dependency


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
    """A backend service failed: it answered with an unaccepted status or an answer that
    cannot be read, or the connection failed. ``service`` names it and ``status`` is its HTTP
    status (None: no whole answer came). The HTTP client's own exception, if any, is
    ``__cause__``.

    A pipe that calls a backend through a client of its own raises this (``status=None``
    for a failed connection, else the status) to have the failure count as the backend's:
    only the backend's trouble lowers an adaptive limit."""

    http_status = 502

    def __init__(self, message: str, *, service: str, status: int | None = None):
        super().__init__(message)
        self.service = service
        self.status = status


class BackendUnreachable(BackendError):
    """No connection to the backend could be made (refused, unresolvable, unreachable):
    nothing of the request was sent, so it may be sent again whatever its method. Every
    other failed connection is a plain :class:`BackendError` without ``status``: the
    backend may have received the request."""

    def __init__(self, message: str, *, service: str):
        super().__init__(message, service=service)


class JobNotFound(PipeworkError, LookupError):
    """No job has this id (it never existed, or it was dropped after retention)."""

    http_status = 404


class JobGone(JobNotFound):
    """The job existed but was dropped after its retention time. ``token_hash`` is its owner
    token's hash, so an API can reveal "gone" only to the owner (others get "not found")."""

    http_status = 410

    def __init__(self, message: str, *, token_hash: str | None = None) -> None:
        super().__init__(message)
        self.token_hash = token_hash


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


class PoolConfigError(PipeworkError, ValueError):
    """A worker pool configuration that cannot work; the message names the numbers."""


class ResourcePoolError(PipeworkError):
    """A :class:`~pipework.ResourcePool` could not lend a resource. ``pool`` names the pool."""

    http_status = 503

    def __init__(self, message: str, *, pool: str):
        super().__init__(message)
        self.pool = pool


class BorrowTimeout(ResourcePoolError, TimeoutError):
    """No resource of the pool came free within its ``borrow_timeout`` (``timeout``, seconds).

    Every resource stayed borrowed (or some are being replaced) for that long: raise the
    pool's ``size``, shorten what is done with a resource, or allow a longer wait."""

    def __init__(self, message: str, *, pool: str, timeout: float):
        super().__init__(message, pool=pool)
        self.timeout = timeout


class ResourcePoolClosed(ResourcePoolError):
    """The pool is not running: borrowed before start-up, or after (or during) shutdown."""


class ResourceStartupError(ResourcePoolError):
    """Making one of the pool's resources at start-up failed or outlasted ``launch_timeout``.

    The resources already made were closed; the factory's own error is ``__cause__``."""


class TemplateSyntaxError(PipeworkError, ValueError):
    """A template that cannot be parsed; the message says where and how to fix it."""


class TemplateError(PipeworkError, ValueError):
    """The job state cannot fill a template: a key is missing or a value is unsafe there.

    Raised while a call is being prepared, before anything is sent (HTTP 400)."""

    http_status = 400


Severity: TypeAlias = Literal["error", "warning"]


@dataclass(frozen=True, slots=True)
class ConfigProblem:
    """One problem in a gateway configuration: where (``path``, ``line`` when known), what,
    and how bad."""

    path: str
    message: str
    line: int | None = None
    severity: Severity = "error"

    def format(self, source: str = "") -> str:
        """As a compiler would print it: ``gateway.toml:12: error: path: message``
        (``line 12: error: ...`` without a source)."""
        if source:
            where = source if self.line is None else f"{source}:{self.line}"
        else:
            where = "" if self.line is None else f"line {self.line}"
        what = f"{self.path}: {self.message}" if self.path else self.message
        return f"{where}: {self.severity}: {what}" if where else f"{self.severity}: {what}"

    def __str__(self) -> str:
        return self.format()


class ConfigError(PipeworkError, ValueError):
    """A configuration that cannot be served: ``problems`` lists every error (and the
    warnings found with them), in file order; ``source`` names the file."""

    def __init__(self, problems: Iterable[ConfigProblem], source: str = "") -> None:
        self.problems = tuple(problems)
        self.source = source
        errors = sum(p.severity == "error" for p in self.problems)
        warnings = len(self.problems) - errors
        counts = _plural(errors, "error") + (
            f", {_plural(warnings, 'warning')}" if warnings else ""
        )
        lines = [f"{source or 'configuration'}: {counts}"]
        lines.extend(f"  {p.format(source)}" for p in self.problems)
        super().__init__("\n".join(lines))

    @property
    def errors(self) -> tuple[ConfigProblem, ...]:
        return tuple(p for p in self.problems if p.severity == "error")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
