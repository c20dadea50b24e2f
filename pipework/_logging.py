"""Structured logs: one line per event.

Every job line is a stdlib ``logging`` record on the ``pipework.job`` logger whose ``extra``
fields name the job: ``correlation_id``, ``job_id``, ``route`` (the chain), ``pipe``,
``key``, ``duration`` (seconds) and ``outcome``. So one correlation id finds everything
about a request, whatever handler the application uses. :class:`JsonFormatter` writes each
record as one JSON object per line (``pipework serve --log-format json``).

One line per event, at the level the event deserves:

- a job's life (accepted, handed off, suspended, a pipe's end, its end) is DEBUG: a request
  that succeeds says so in its access line alone;
- a failure is one WARNING where it happens (a backend call, a pipe's own bug); the lines
  of the same job that follow (its pipe's end, its branch's, its own) are DEBUG. The failure
  is marked (:func:`mark_reported`) so that those lines can tell (:func:`reported`);
- a dependency that stops answering (Redis) is an :class:`Outage`: one ERROR when it
  starts, one INFO when it ends with what failed meanwhile, DEBUG in between.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any, Final

__all__ = [
    "FIELDS",
    "JsonFormatter",
    "Outage",
    "job_logger",
    "log_job",
    "mark_reported",
    "note_upstream",
    "outage",
    "reported",
    "take_upstreams",
]

#: The structured fields a pipework log record may carry.
FIELDS = (
    "event",
    "correlation_id",
    "job_id",
    "route",
    "pipe",
    "key",
    "stage",
    "duration",
    "outcome",
    "status",
    "signal",
    "error",
    "service",
    "kind",
    "method",
    "path",
    "query",
    "client",
    "user_agent",
    "bytes_in",
    "bytes_out",
    "endpoint",
    "host",
    "retries",
    "upstream_status",
    "client_gone",
    "close_code",
    "cause",
    "trace_id",
    "pid",
    "dependency",
    "failed",
)

job_logger = logging.getLogger("pipework.job")
# A library logs; the application decides where to: no output until it configures logging.
logging.getLogger("pipework").addHandler(logging.NullHandler())


def log_job(
    event: str,
    level: int = logging.INFO,
    exc: BaseException | None = None,
    **fields: Any,
) -> None:
    """Log one structured line on ``pipework.job`` (cheap when the level is off); ``exc``
    attaches a traceback (a failure's details belong in the log, not the response)."""
    if job_logger.isEnabledFor(level):
        fields["event"] = event
        text = " ".join(
            f"{k}={_quoted(v)}" for k, v in fields.items() if v is not None and k != "event"
        )
        job_logger.log(level, "%s %s", event, text, extra=fields, exc_info=exc)


def _quoted(value: Any) -> str:
    text = str(value)
    return json.dumps(text) if not text or any(c.isspace() or c in '"=' for c in text) else text


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the structured fields."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                data[name] = value
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str)


# -- failures logged once ----------------------------------------------------------------

_REPORTED: Final = "_pipework_reported"


def mark_reported(exc: BaseException) -> None:
    """Note that ``exc`` was logged at WARNING where it happened: the lines that follow it
    (the pipe's end, the job's) log it at DEBUG."""
    # An exception class with slots takes no mark: it is logged again, no worse.
    with contextlib.suppress(AttributeError, TypeError):
        setattr(exc, _REPORTED, True)


def reported(exc: BaseException | None) -> bool:
    """Whether ``exc`` (every exception of a group) was logged where it happened, or is
    explained by an outage on now (an error naming its ``dependency``)."""
    if exc is None:
        return False
    if isinstance(exc, BaseExceptionGroup):
        return all(reported(e) for e in exc.exceptions)
    if getattr(exc, _REPORTED, False):
        return True
    dependency = getattr(exc, "dependency", None)
    found = _OUTAGES.get(dependency) if isinstance(dependency, str) else None
    return found is not None and found.on


# -- outages -------------------------------------------------------------------------------


class Outage:
    """A dependency (``name``: ``Redis at redis://host:6379/0``) that stopped answering,
    logged in two lines on ``logger``: one ERROR when a failure starts it, one INFO when it
    is reachable again, saying how long it lasted and what failed meanwhile (counts by
    what). Failures before it was ever reached are no outage: the start-up that needed it
    says so itself. While it is on (:attr:`on`), the failures it explains are logged by
    their callers at DEBUG."""

    __slots__ = ("failures", "logger", "name", "reached", "since")

    def __init__(self, name: str, logger: logging.Logger) -> None:
        self.name = name
        self.logger = logger
        self.reached = False  # once reached, a failure starts an outage
        self.since: float | None = None  # when the outage began (time.monotonic)
        self.failures: dict[str, int] = {}

    @property
    def on(self) -> bool:
        return self.since is not None

    def failed(self, why: BaseException | str, what: str) -> bool:
        """A failure to reach it (``what`` failed, counted): starts the outage (its ERROR
        line) unless one is on. Returns whether it is on: the caller logs its own line at
        DEBUG then, at its usual level otherwise."""
        if self.since is None:
            if not self.reached:
                return False
            self.since = time.monotonic()
            self.failures = {}
            self.logger.error(
                "%s cannot be reached (%s): what needs it fails until it is back (one line "
                "then, with what failed meanwhile)",
                self.name,
                why,
                extra={"event": "outage started", "dependency": self.name},
            )
        self.failures[what] = self.failures.get(what, 0) + 1
        return True

    def count(self, what: str) -> bool:
        """Count a failure the outage explains (a request refused): True while it is on."""
        if self.since is None:
            return False
        self.failures[what] = self.failures.get(what, 0) + 1
        return True

    def recovered(self) -> None:
        """It answered: the outage, if one is on, ends (its INFO line)."""
        self.reached = True
        since = self.since
        if since is None:
            return
        self.since = None
        duration = time.monotonic() - since
        failures, self.failures = self.failures, {}
        most = sorted(failures.items(), key=lambda item: -item[1])
        listed = ", ".join(f"{what} {n}" for what, n in most) or "nothing"
        self.logger.info(
            "%s is reachable again after %.1fs; failed meanwhile: %s",
            self.name,
            duration,
            listed,
            extra={
                "event": "outage ended",
                "dependency": self.name,
                "duration": round(duration, 3),
                "failed": failures,
            },
        )


_OUTAGES: dict[str, Outage] = {}


def outage(name: str, logger: str = "pipework") -> Outage:
    """The process's one :class:`Outage` record of the dependency ``name``."""
    found = _OUTAGES.get(name)
    if found is None:
        found = _OUTAGES[name] = Outage(name, logging.getLogger(logger))
    return found


# -- what a request's backend calls went to, for its access line -----------------------

#: How many requests' notes are kept at most: those of requests whose access line never
#: takes them (an async job's calls come after its 202) go, oldest first.
_MAX_NOTED: Final = 4096
_access_logger = logging.getLogger("pipework.access")
_noted: dict[str, list[tuple[str, str | None, int]]] = {}


def note_upstream(correlation_id: str, service: str, host: str | None, retries: int) -> None:
    """A backend call of the request ``correlation_id`` made in this process went to
    ``host`` of ``service`` and was retried ``retries`` times (nothing kept while the access
    log is off)."""
    if not _access_logger.isEnabledFor(logging.INFO):
        return
    calls = _noted.get(correlation_id)
    if calls is None:
        if len(_noted) >= _MAX_NOTED:
            del _noted[next(iter(_noted))]
        calls = _noted[correlation_id] = []
    calls.append((service, host, retries))


def take_upstreams(correlation_id: str) -> list[tuple[str, str | None, int]]:
    """The backend calls noted for ``correlation_id`` (service, host, retries), forgotten."""
    return _noted.pop(correlation_id, None) or []
