"""Structured logs: one line per job transition and per pipe or stage end.

Every line is a stdlib ``logging`` record on the ``pipework.job`` logger whose ``extra``
fields name the job: ``correlation_id``, ``job_id``, ``route`` (the chain), ``pipe``,
``key``, ``duration`` (seconds) and ``outcome``. So one correlation id finds everything
about a request, whatever handler the application uses. :class:`JsonFormatter` writes each
record as one JSON object per line (``pipework serve --log-format json``).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

__all__ = ["FIELDS", "JsonFormatter", "job_logger", "log_job"]

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
