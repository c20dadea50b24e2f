"""The request's id (``X-Request-ID``): the client's when it is well-formed, else a new one.

One rule for every request the server answers, through Quart or in front of it (proxy
routes), so that logs stay parseable whatever a client sends.
"""

from __future__ import annotations

import re
from typing import Final

from ..dispatcher._job import new_correlation_id

__all__ = ["REQUEST_ID", "request_id"]

#: Accepted X-Request-ID values; anything else is replaced.
REQUEST_ID: Final = re.compile(r"[A-Za-z0-9._~:/+=@-]{1,128}\Z")


def request_id(given: str | None) -> str:
    """``given`` when it is a well-formed request id, else a new one."""
    return given if given is not None and REQUEST_ID.match(given) else new_correlation_id()
