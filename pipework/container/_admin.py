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
import os
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from quart import Response, request

from .._errors import PipeworkError
from ..dispatcher._engine import Engine
from ..dispatcher._weighted import WeightedPool
from ..dispatcher._weighted_core import PoolConfigError, PoolStatistics, Weights
from ._bodies import JSON, decode, dumps_json, read_body
from ._problems import Problem

__all__ = ["AdminApi", "Reload", "admin_token"]

#: What ``POST /admin/reload`` calls: returns a summary of the new config, or raises a
#: PipeworkError (the config error) whose ``str`` lists every problem.
Reload = Callable[[], Awaitable[dict[str, Any]]]

_FIELDS = ("reserve", "limit", "max_waiting", "wait_timeout")


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
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip(), self._token):
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
        data = await read_body(request, limit=self._max_body, time_limit=self._time_limit)
        body = decode(data, request.mimetype or None)
        if not isinstance(body, dict) or not body or set(body) - set(_FIELDS):
            raise Problem(
                400,
                "Bad Request",
                f"send a JSON object with any of {', '.join(_FIELDS)}; got {body!r}",
                slug="admin-bad-weights",
            )
        config = pool.config
        current = config.keys.get(key, config.default)
        try:
            weights = replace(current, **body)
            generation = pool.reconfigure(config.with_weights(key, Weights(**_as_fields(weights))))
        except (PoolConfigError, TypeError, ValueError) as exc:
            raise Problem(400, "Bad Request", str(exc), slug="admin-bad-weights") from None
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
