"""The admin API: read and change the worker pool's weights live, and reload the config.

Off unless an admin token is configured (``ContainerConfig.admin_token`` or the
``PIPEWORK_ADMIN_TOKEN`` environment variable): an operator surface is never open by
default. Every call needs ``Authorization: Bearer <token>``; a missing or wrong one is 401.

- ``GET /admin/pool``: the pool's weights and live counters, per key.
- ``PUT /admin/pool/keys/{key}``: set the key's ``reserve``, ``limit`` (``null``: none,
  ``0``: paused), ``max_waiting``, ``wait_timeout``; fields left out keep their values. The
  new config is validated and swapped in one step; admitted work is never revoked.
- ``POST /admin/reload``: validate the config file again and, if it is good, swap it in;
  a bad file changes nothing and the answer lists every problem.
"""

from __future__ import annotations

import hmac
import math
import os
import re
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, Final

from quart import Response, request

from .._errors import PipeworkError
from ..dispatcher._engine import Engine
from ..dispatcher._weighted import WeightedPool
from ..dispatcher._weighted_core import PoolConfigError, PoolStatistics, Weights
from ._bodies import JSON, decode_object, dumps_json, read_body
from ._problems import Problem

__all__ = ["AdminApi", "Reload", "admin_token"]

#: What ``POST /admin/reload`` calls: returns a summary of the new config, or raises a
#: PipeworkError (the config error) whose ``str`` lists every problem.
Reload = Callable[[], Awaitable[dict[str, Any]]]

_FIELDS = ("reserve", "limit", "max_waiting", "wait_timeout")
# A key is named as in the config file's [pool.keys] tables.
_KEY_NAME: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}\Z")
# Counts above this are typing mistakes, not weights (no pool has a billion workers).
_MAX_COUNT: Final = 1_000_000_000


def admin_token(configured: str | None) -> str | None:
    """The admin token in force: the configured one, else the environment's, else none."""
    return configured or os.environ.get("PIPEWORK_ADMIN_TOKEN") or None


class AdminApi:
    def __init__(
        self,
        engine: Engine,
        token: str,
        reload: Reload | None,
        *,
        max_body: int,
        body_time_limit: float,
    ) -> None:
        self._engine = engine
        self._token = token
        self.reload_hook = reload
        self._max_body = max_body
        self._time_limit = body_time_limit

    def _authorize(self) -> None:
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        # Compared as bytes: compare_digest refuses str with non-ASCII characters, and any
        # credential that is not the token, however malformed, is the same 401.
        expected = self._token.encode("utf-8")
        offered = given.strip().encode("utf-8", "surrogatepass")
        if scheme.lower() != "bearer" or not hmac.compare_digest(offered, expected):
            raise Problem(
                401,
                "Unauthorized",
                "the admin API needs 'Authorization: Bearer <admin token>'",
                slug="admin-unauthorized",
                headers={"WWW-Authenticate": 'Bearer realm="pipework-admin"'},
            )

    def _pool(self) -> WeightedPool:
        pool = self._engine.pool
        if not isinstance(pool, WeightedPool):
            raise Problem(
                501,
                "Not Implemented",
                "this engine's pool has no weights to show",
                slug="admin-no-weights",
            )
        return pool

    async def pool(self) -> Response:
        self._authorize()
        return _json(pool_document(self._pool().statistics()))

    async def set_key(self, key: str) -> Response:
        self._authorize()
        pool = self._pool()
        if not _KEY_NAME.match(key):
            raise _bad_weights(
                f"{key!r} cannot name a key: use letters, digits, '_', '-' and '.' "
                "(up to 128, not starting with '-' or '.')"
            )
        data = await read_body(request, limit=self._max_body, time_limit=self._time_limit)
        body = decode_object(data, request.headers.get("Content-Type"))
        if not body or set(body) - set(_FIELDS):
            unknown = sorted(set(body or {}) - set(_FIELDS))
            got = f"unknown field(s) {', '.join(map(repr, unknown))}" if unknown else "none"
            raise _bad_weights(f"send a JSON object with any of {', '.join(_FIELDS)}; got {got}")
        for name, value in body.items():
            _check_field(name, value)
        config = pool.config
        current = config.keys.get(key, config.default)
        try:
            weights = replace(current, **body)
            generation = pool.reconfigure(config.with_weights(key, Weights(**_as_fields(weights))))
        except PoolConfigError as exc:
            raise _bad_weights(str(exc)) from None
        document = pool_document(pool.statistics())
        return _json({"config_generation": generation, "key": document["keys"].get(key)})

    async def reload(self) -> Response:
        self._authorize()
        if self.reload_hook is None:
            raise Problem(
                404,
                "Not Found",
                "this server was not started from a config file",
                slug="admin-no-config",
            )
        try:
            summary = await self.reload_hook()
        except PipeworkError as exc:
            raise Problem(
                400, "Bad Request", f"the config was not reloaded: {exc}", slug="config-invalid"
            ) from None
        return _json({"reloaded": True, **summary})


def _bad_weights(detail: str) -> Problem:
    return Problem(400, "Bad Request", detail, slug="admin-bad-weights")


def _check_field(name: str, value: Any) -> None:
    """Refuse a weight of the wrong type or size, naming the field (JSON has one number
    type: 1.5, true and 1e23 must not pass for counts)."""
    if value is None and name in ("limit", "wait_timeout"):
        return
    if name == "wait_timeout":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _bad_weights(
                f"wait_timeout must be a number of seconds or null, got {_kind(value)}"
            )
        if not (math.isfinite(value) and 0 < value <= 86_400):
            raise _bad_weights(f"wait_timeout must be above 0 and at most 86400, got {value!r}")
        return
    nullable = " or null" if name == "limit" else ""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad_weights(f"{name} must be a whole number{nullable}, got {_kind(value)}")
    if not 0 <= value <= _MAX_COUNT:
        raise _bad_weights(f"{name} must be between 0 and {_MAX_COUNT}, got {value}")


def _kind(value: Any) -> str:
    text = repr(value)
    shown = text if len(text) <= 40 else text[:37] + "..."
    names = {
        bool: "a boolean",
        str: "a string",
        float: "a decimal number",
        list: "a list",
        dict: "an object",
    }
    return f"{names.get(type(value), type(value).__name__)} ({shown})"


def _as_fields(weights: Weights) -> dict[str, Any]:
    return {name: getattr(weights, name) for name in (*_FIELDS, "adaptive")}


def pool_document(stats: PoolStatistics) -> dict[str, Any]:
    """The pool's statistics as JSON (what ``GET /admin/pool`` answers)."""
    return {
        "max_workers": stats.max_workers,
        "shared_pool": stats.shared_pool,
        "reserved": stats.reserved,
        "in_use": stats.in_use,
        "waiting": stats.waiting,
        "admitted": stats.admitted,
        "rejected": dict(stats.rejected),
        "debt": stats.debt,
        "config_generation": stats.config_generation,
        "keys": {
            name: {
                "configured": k.configured,
                "reserve": k.reserve,
                "limit": k.limit,
                "effective_limit": k.effective_limit,
                "adaptive_limit": k.adaptive_limit,
                "in_use_reserved": k.in_use_reserved,
                "in_use_shared": k.in_use_shared,
                "waiting": k.waiting,
                "oldest_wait": k.oldest_wait,
                "admitted": k.admitted,
                "rejected": dict(k.rejected),
                "debt": k.debt,
            }
            for name, k in sorted(stats.keys.items())
        },
    }


def _json(value: Any, status: int = 200) -> Response:
    return Response(dumps_json(value), status=status, content_type=JSON)
