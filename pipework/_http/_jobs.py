"""A job as HTTP shows it: its document, its links, and who may see it.

Every ``/jobs/{id}`` endpoint, the container's and the board's job streams alike, needs the
job's token (``Authorization: Bearer <token>`` or ``X-Job-Token``). A wrong or missing token
is answered exactly like an unknown id, 404, so no answer confirms that an id exists to
someone without its token. A job dropped after its retention answers 410 Gone.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final, Protocol

import trio

from .._errors import JobNotFound
from ..dispatcher._engine import Engine
from ..dispatcher._job import JobView, Progress
from ..dispatcher._status import TERMINAL, Status
from ..dispatcher._store import JobGone
from ._credentials import bearer_token
from ._problems import Problem, problem_for_error

__all__ = [
    "DEGRADED_HEADER",
    "authorize",
    "degraded_header",
    "job_document",
    "job_links",
    "job_token",
]

#: The header of an answer whose job degraded pipes on its way (see docs/degradation.md).
DEGRADED_HEADER: Final = "Pipework-Degraded"
#: What a Structured Field token may be (RFC 9651 section 3.3.4).
_TOKEN: Final = re.compile(r"[A-Za-z*][!#$%&'*+\-.^_`|~:/A-Za-z0-9]*\Z")


def _iso(unix: float | None) -> str | None:
    if unix is None:
        return None
    return (
        datetime.fromtimestamp(unix, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )


def _wall(trio_time: float | None) -> str | None:
    """A time on trio's clock (deadlines, retention) as a UTC timestamp."""
    if trio_time is None or trio_time == float("inf"):
        return None
    return _iso(time.time() + (trio_time - trio.current_time()))


def job_links(view: JobView) -> dict[str, str]:
    base = f"/jobs/{view.id}"
    links = {"self": base}
    if view.status in TERMINAL:
        links["result"] = f"{base}/result"
    else:
        links["cancel"] = base
    if view.status is Status.SUSPENDED and view.waiting_for is not None:
        links["signal"] = f"{base}/signals/{view.waiting_for}"
    return links


def degraded_header(degraded: Mapping[str, str]) -> str:
    """``Pipework-Degraded``'s value: a Structured Field list (RFC 9651), one item per
    degraded pipe, its name (a token, else a string, else a display string) with its
    ``reason``: ``recommend;reason=no_slot, "ads v2";reason=refused``."""
    return ", ".join(f"{_sf_item(name)};reason={_sf_item(r)}" for name, r in degraded.items())


def _sf_item(text: str) -> str:
    if _TOKEN.match(text):
        return text
    if all(" " <= c <= "~" for c in text):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    # A display string: UTF-8, with %, " and anything but printable ASCII percent-encoded.
    encoded = "".join(
        c if " " <= c <= "~" and c not in '%"' else "".join(f"%{b:02x}" for b in c.encode())
        for c in text
    )
    return f'%"{encoded}"'


def _progress_document(progress: Progress) -> dict[str, Any]:
    document: dict[str, Any] = {
        "done": progress.done,
        "total": progress.total,
        "message": progress.message,
    }
    if progress.branch is not None:  # reported from inside a parallel branch
        document["branch"] = progress.branch
    return document


def job_document(view: JobView, *, expose: bool = False) -> dict[str, Any]:
    """What ``GET /jobs/{id}`` answers: the job's status, without its result."""
    progress = view.progress
    error = None
    if view.error is not None:
        problem = problem_for_error(view.error, expose=expose)
        error = {
            "type": problem.type,
            "title": problem.title,
            "status": problem.status,
            "detail": problem.detail,
            "error_type": view.error.type,
            "where": view.error.where or None,
        }
    finished = view.status in TERMINAL
    return {
        "id": view.id,
        "chain": view.chain,
        "status": view.status.value,
        "correlation_id": view.correlation_id,
        "progress": None if progress is None else _progress_document(progress),
        "waiting_for": view.waiting_for,
        "error": error,
        "created_at": _iso(view.created_at),
        "updated_at": _iso(view.updated_at),
        "finished_at": _iso(view.finished_at),
        "expires_at": None if finished else _wall(view.deadline),
        "retain_until": _wall(view.retain_until) if finished else None,
        "degraded": dict(view.degraded),
        "links": job_links(view),
    }


class Headers(Protocol):
    """A request's headers, looked up by name (werkzeug's ``Headers`` is one)."""

    def get(self, key: str, /) -> str | None: ...


def job_token(headers: Headers) -> str | None:
    """The job token a request's ``headers`` bring: the bearer token, else ``X-Job-Token``."""
    token = bearer_token(headers.get("Authorization"))
    return token if token is not None else headers.get("X-Job-Token")


def _not_found() -> Problem:
    # One answer for an unknown id and a wrong token: nothing to tell them apart by.
    return Problem(
        404,
        "Job not found",
        "no job with this id, or the token does not match",
        slug="job-not-found",
    )


async def authorize(engine: Engine, job_id: str, token: str | None) -> JobView:
    """The job, if ``token`` is its owner token; else the 404 an unknown id gets. A job
    dropped after its retention raises :class:`JobGone` (answered 410)."""
    try:
        return await engine.authorize(job_id, token)
    except JobGone:
        raise
    except JobNotFound:
        raise _not_found() from None
