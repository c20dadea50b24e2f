"""The paths the container serves itself, known below it.

Routes (``container``) and proxy routes (``proxy``) may not shadow them; both check a
declared path against these prefixes, and neither imports the other to learn them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

__all__ = ["PROXY_RESERVED_PREFIXES", "RESERVED_PREFIXES", "covering_prefix", "under"]

#: Paths the container serves itself, the boards' (their ``/boards`` API and the ``/ui``
#: jobs page) included; a route may not shadow them: the container's exact rules there win
#: over the routes' catch-all, so a route under one would never run. docs/http-api.md and
#: docs/configuration.md list them all (tests/test_docs_lists.py holds them to it).
RESERVED_PREFIXES: Final = (
    "/jobs",
    "/callbacks",
    "/healthz",
    "/readyz",
    "/metrics",
    "/admin",
    "/boards",
    "/ui",
)

#: What a proxy route may not shadow: the same paths (a proxy layer in front of Quart
#: would win over everything there).
PROXY_RESERVED_PREFIXES: Final = RESERVED_PREFIXES


def under(path: str, prefix: str) -> bool:
    """Whether ``path`` is ``prefix`` or below it, on a segment boundary: ``/jobs`` and
    ``/jobs/x`` are under ``/jobs``, ``/jobsx`` is not."""
    return path == prefix or path.startswith(prefix + "/")


def covering_prefix(path: str, prefixes: Iterable[str]) -> str | None:
    """The first of ``prefixes`` that ``path`` is under, if any."""
    for prefix in prefixes:
        if under(path, prefix):
            return prefix
    return None
