"""How a route's request is answered, decided from values: the sans-IO core of ``_modes``.

:class:`~._modes.Submissions` reads the request, the route and trio's clock, and asks here
what to do; nothing here reads Quart's request, a clock or a socket. Each decision is a
function of its arguments, tested synchronously (``tests/test_container_decisions.py``),
as h11 decides from events and hypercorn's protocol from values.

- **What the client prefers** (``Prefer``, RFC 7240): ``respond-async`` and ``wait=N``,
  the first of a repeated preference counting; anything else is ignored
  (:func:`parse_prefer`).
- **What the job gets**: its state, from the body's members, the query and the path
  (:func:`build_state`), with what its chain's pipes read of the request beyond them (the
  headers they pass on, a raw route's body: :func:`request_record`, :func:`check_unencoded`)
  under ``request`` (:func:`add_request`); its time limit, the first set of the route's,
  the chain's, the engine's and the container's (:func:`job_timeout`); an owner token only
  when the answer may hand one out (:func:`needs_token`: never for stream, nor for sync on
  an in-process store); and its
  admission decided before the answer when the answer promises that it will run
  (:func:`admits_now`: async).
- **How long a sync or auto request waits** (:func:`wait_terms`): sync until the job's
  deadline plus a slack (the engine ends the job at its deadline and records why); auto for
  the route's ``sync_wait``, shortened by ``wait=N`` (then applied) or to nothing by
  ``respond-async`` alone.
- **What a wait that ran out answers** (:func:`ran_out`): 503 once a shutdown's grace is
  over, 202 when the request's own wait ended before the job's deadline, else 504. A job
  whose outcome cannot be read (a shared store away) is named, never said undone
  (:func:`outcome_unknown`).
- **Idempotency-Key**: the key a request is remembered by, per route; a malformed one is a
  400 (:func:`idempotency_key`). A key already claimed (:func:`key_step`) by a different
  request is a 422; by a submission still in flight, the request waits for it; else the
  claim's job is looked up, and replayed unless it was cancelled or is gone, which frees
  the key for a fresh submission (:func:`frees_key`). A stream's first request is the only
  one that can read it (:func:`stream_taken`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final, Protocol

from .._headers import passed
from .._http._auth import IDENTITY_STATE_KEY
from .._http._problems import Problem
from ..dispatcher._status import Status
from ..pipes._pipe import REQUEST_KEY, RequestUse
from ._routes import Mode

__all__ = [
    "NO_PREFERENCES",
    "SLACK",
    "KeyStep",
    "Preferences",
    "RanOut",
    "add_request",
    "admits_now",
    "build_state",
    "check_key",
    "check_unencoded",
    "deadline_passed",
    "frees_key",
    "idempotency_key",
    "job_timeout",
    "key_busy",
    "key_step",
    "needs_token",
    "outcome_unknown",
    "owner_of",
    "parse_prefer",
    "preference_applied",
    "ran_out",
    "request_record",
    "shutting_down",
    "stream_taken",
    "wait_terms",
]

#: The engine itself ends a job at its deadline and records why; a parked request gives it
#: this long to do so before answering 504 on its own.
SLACK: Final = 0.5

_WAIT: Final = re.compile(r"[0-9]{1,9}\Z")
_KEY: Final = re.compile(r"[\x21-\x7e]{1,255}\Z")

# -- Prefer ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Preferences:
    """What a client asked for in ``Prefer`` (RFC 7240) that the container acts on."""

    respond_async: bool = False
    wait: float | None = None


NO_PREFERENCES: Final = Preferences()


def parse_prefer(headers: Iterable[str]) -> Preferences:
    """Read ``respond-async`` and ``wait=N``; the first of a repeated preference counts."""
    respond_async = False
    wait: float | None = None
    for header in headers:
        for item in header.split(","):
            name, _, value = item.split(";", 1)[0].partition("=")
            name, value = name.strip().lower(), value.strip().strip('"')
            if name == "respond-async":
                respond_async = True
            elif name == "wait" and wait is None and _WAIT.match(value):
                wait = float(value)  # ASCII digits only: anything else is ignored (RFC 7240)
    return Preferences(respond_async, wait)


# -- the job -----------------------------------------------------------------------------


class Query(Protocol):
    """A query string's values by name (werkzeug's ``MultiDict`` is one)."""

    def lists(self) -> Iterable[tuple[str, list[str]]]: ...


def build_state(body: Any, query: Query, params: Mapping[str, str]) -> dict[str, Any]:
    """The job's state: the body's members, then query and path parameters, all top-level.

    A repeated query parameter becomes a list of strings. A name given twice with different
    values (say in the body and the path) is refused rather than silently overridden.
    """
    if body is None:
        state: dict[str, Any] = {}
    elif isinstance(body, dict):
        state = dict(body)
    else:
        raise Problem(
            400,
            "Malformed body",
            f"the request body must be a JSON object or msgpack map, not {type(body).__name__}: "
            "its members become the job's state",
            slug="body-not-an-object",
        )
    args = {key: values[0] if len(values) == 1 else values for key, values in query.lists()}
    for source, values in (("query parameter", args), ("path parameter", params)):
        for key, value in values.items():
            if key in state and state[key] != value:
                raise Problem(
                    400,
                    "Conflicting input",
                    f"{source} {key!r} differs from the value given for it elsewhere",
                    slug="conflicting-input",
                    key=key,
                )
            state[key] = value
    return state


def request_record(
    use: RequestUse | None,
    headers: Iterable[tuple[bytes, bytes]],
    body: dict[str, Any] | None,
) -> dict[str, Any]:
    """What the job keeps of its request beyond the state (``state["request"]``): the
    headers its chain's pipes may pass on (``use``), as ``[name, value]`` pairs in the
    order they came, names lower-case; and a raw route's ``body`` (a raw value)."""
    record: dict[str, Any] = {}
    if use is not None and use.headers:
        decoded = ((name.decode("latin-1"), value.decode("latin-1")) for name, value in headers)
        record["headers"] = [[name, value] for name, value in passed(decoded, use.headers)]
    if body is not None:
        record["body"] = body
    return record


def add_request(state: dict[str, Any], record: dict[str, Any]) -> None:
    """Put the request's ``record`` in ``state``, under a key the request itself may not
    set (its body, query or path would otherwise pass for the client's headers)."""
    if REQUEST_KEY in state:
        raise Problem(
            400,
            "Conflicting input",
            f"{REQUEST_KEY!r} holds what this route keeps of the request (the headers its "
            "pipes pass on, a raw body); the body, query and path may not set it",
            slug="conflicting-input",
            key=REQUEST_KEY,
        )
    state[REQUEST_KEY] = record


def add_identity(state: dict[str, Any], identity: dict[str, Any]) -> None:
    """Put the identity the route's auth accepted in ``state``, under a key the request
    itself may not set (a body naming its own identity would pass for a proven one)."""
    if IDENTITY_STATE_KEY in state:
        raise Problem(
            400,
            "Conflicting input",
            f"{IDENTITY_STATE_KEY!r} holds who this route's authentication says the caller is; "
            "the body, query and path may not set it",
            slug="conflicting-input",
            key=IDENTITY_STATE_KEY,
        )
    state[IDENTITY_STATE_KEY] = identity


def owner_of(mode: Mode, owner: str) -> str | None:
    """The owner a job of a route in ``mode`` records, for an authenticated caller whose
    owner string is ``owner``: the download centre lists the jobs an answer may leave to be
    followed later (async, and auto's 202), not those answered in full (sync, stream)."""
    return owner if mode in ("async", "auto") else None


def check_unencoded(content_encoding: str | None) -> None:
    """A raw route's body must come unencoded: a content coding other than ``identity`` is
    a 415 (RFC 9110 §15.5.16), since the body is kept and passed on with its type alone,
    which must say what it is."""
    if content_encoding is not None and content_encoding.strip(" \t").lower() != "identity":
        raise Problem(
            415,
            "Unsupported Media Type",
            f"the request body is {content_encoding.strip()}-encoded; this route keeps bodies "
            "as they come and passes them on with their Content-Type only: send it unencoded",
            slug="unsupported-media-type",
        )


def job_timeout(
    route: float | None, chain: float | None, engine: float | None, container: float
) -> float:
    """The job's time limit: the route's, else its chain's, else the engine's default, else
    the container's."""
    # Tested one by one, not looped over: this is on every submission's path.
    if route is not None:
        return route
    if chain is not None:
        return chain
    return container if engine is None else engine


def needs_token(mode: Mode, shared_store: bool = False) -> bool:
    """Whether the job gets an owner token: a stream answer never hands one out, so none is
    made for it; nor a sync one on an in-process store. On a shared store (Redis) a sync
    request whose job's outcome cannot be read is answered with the job's id and token
    (:func:`outcome_unknown`), for its client to follow it rather than submit it again."""
    return mode not in ("sync", "stream") or (mode == "sync" and shared_store)


def admits_now(mode: Mode) -> bool:
    """Whether the job's admission is decided before the answer (503 + Retry-After if the
    pool would refuse it): an async 202 promises the job will run."""
    return mode == "async"


# -- waiting -----------------------------------------------------------------------------


def wait_terms(
    mode: Mode, sync_wait: float, prefs: Preferences, job_deadline: float, now: float
) -> tuple[float, float, tuple[str, ...]]:
    """How a sync or auto request waits for its job, at ``now``: until when, the job's
    deadline with the slack, and the preferences applied (for ``Preference-Applied``).

    A tuple, taken apart at once: the caller's frame is what a parked request keeps."""
    wait: float | None = None
    applied: tuple[str, ...] = ()  # a tuple: an empty one is shared, not kept per request
    if mode == "auto":
        wait = sync_wait
        if prefs.wait is not None and prefs.wait <= sync_wait:
            wait = prefs.wait
            applied = (f"wait={prefs.wait:g}",)
        elif prefs.respond_async and prefs.wait is None:
            wait = 0.0
    deadline = job_deadline + SLACK
    until = deadline if wait is None else min(deadline, now + wait)
    return until, deadline, applied


class RanOut(Enum):
    """What a parked request answers once its wait ran out without the job's end."""

    #: The shutdown's grace is over: 503, the job cancelled.
    SHUTTING_DOWN = "shutting-down"
    #: Its own wait (auto's) ended first: 202 with the job's document, the job goes on.
    ACCEPTED = "accepted"
    #: The job's deadline passed: 504, the job cancelled.
    DEADLINE_PASSED = "deadline-passed"


def ran_out(until: float, deadline: float, *, drained: bool) -> RanOut:
    """What a wait that ran out at ``until`` answers (``deadline``: the job's, with the
    slack; ``drained``: a shutdown's grace is over)."""
    if drained:
        return RanOut.SHUTTING_DOWN
    if until < deadline:
        return RanOut.ACCEPTED
    return RanOut.DEADLINE_PASSED


def preference_applied(respond_async: bool, applied: Iterable[str]) -> str | None:
    """A 202's ``Preference-Applied``: ``respond-async`` when asked for, and what else was
    applied; None when nothing was."""
    preferences = ["respond-async", *applied] if respond_async else list(applied)
    return ", ".join(preferences) if preferences else None


# -- Idempotency-Key ---------------------------------------------------------------------


def check_key(value: str) -> str:
    """The header's value if it is 1-255 visible ASCII characters, else a 400 problem."""
    value = value.strip()
    if not _KEY.match(value):
        raise Problem(
            400,
            "Bad Idempotency-Key",
            "an Idempotency-Key must be 1 to 255 visible ASCII characters (use a UUID)",
            slug="bad-idempotency-key",
        )
    return value


def idempotency_key(route: str, header: str | None) -> str | None:
    """The key a request is remembered by (None: no ``Idempotency-Key``): the header's
    value, scoped to the route, so two routes may use the same one."""
    return None if header is None else f"{route}\n{check_key(header)}"


class Claimed(Protocol):
    """A key's claim as the table holds it (``_idempotency.Claim``)."""

    @property
    def fingerprint(self) -> str: ...

    @property
    def job_id(self) -> str | None: ...


class KeyStep(Enum):
    """What a request with an Idempotency-Key does next."""

    #: Nobody holds the key: claim it and submit.
    SUBMIT = "submit"
    #: Its first request is still submitting: wait until it settles, then ask again.
    WAIT = "wait"
    #: It names a job: look it up, and replay it unless :func:`frees_key`.
    LOOK_UP = "look-up"


def key_step(claim: Claimed | None, fingerprint: str) -> KeyStep:
    """The next step for a request of ``fingerprint`` whose key holds ``claim``; a key used
    for a different request is a 422 (never another request's job and token)."""
    if claim is None:
        return KeyStep.SUBMIT
    if claim.fingerprint != fingerprint:
        raise Problem(
            422,
            "Idempotency-Key reused",
            "this Idempotency-Key was used for a different request",
            slug="idempotency-key-reused",
        )
    return KeyStep.WAIT if claim.job_id is None else KeyStep.LOOK_UP


def frees_key(status: Status | None) -> bool:
    """Whether a claim's job, found in ``status`` (None: gone), frees its key: a cancelled
    or dropped job does, and the retry starts afresh."""
    return status is None or status is Status.CANCELLED


def key_busy() -> Problem:
    return Problem(
        409,
        "Idempotency-Key in use",
        "a request with this Idempotency-Key is still being submitted; retry shortly",
        slug="idempotency-key-busy",
        headers={"Retry-After": "1"},
    )


def stream_taken(job_id: str) -> Problem:
    """A retry of a stream's request: only its first request can read a stream."""
    return Problem(
        409,
        "Stream already taken",
        "this Idempotency-Key started a stream, which only its first request can read",
        slug="stream-taken",
        headers={"Location": f"/jobs/{job_id}"},
    )


# -- refusals ----------------------------------------------------------------------------


def shutting_down() -> Problem:
    return Problem(
        503,
        "Shutting down",
        "the server is shutting down; try again (another instance may answer)",
        slug="shutting-down",
        headers={"Retry-After": "1"},
    )


def outcome_unknown(job_id: str, token: str | None) -> Problem:
    """The job store could not be read (a shared store away) after the job was accepted:
    the job may have run, may be running, or may run still. The answer names it — its
    status's ``Location``, its id and, when it has one, its token — so the client follows
    it rather than submitting it again (which could run it twice); never "nothing was
    done"."""
    detail = (
        f"the server cannot reach its job store now, after it accepted job {job_id}: the "
        "job may have run or may still run; follow its status at Location (with its "
        "token) rather than submitting it again"
    )
    # No Retry-After: the request is not to be sent again (a client that retries a 503 on
    # its own would run the job twice); its job is followed at Location.
    headers = {"Location": f"/jobs/{job_id}", "X-Job-Id": job_id}
    if token is not None:
        headers["X-Job-Token"] = token
    return Problem(
        503,
        "Job store unavailable",
        detail,
        slug="store-unavailable",
        headers=headers,
        job_id=job_id,
        token=token,
        reason="store_unavailable",
    )


def deadline_passed(job_id: str) -> Problem:
    return Problem(
        504,
        "Deadline exceeded",
        f"job {job_id} did not finish before its deadline",
        slug="deadline-exceeded",
        job_id=job_id,
    )
