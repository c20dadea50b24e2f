"""The admin API: read and change the worker pool's weights live, and reload the config.

Off unless an admin token is configured (``ContainerConfig.admin_token`` or the
``PIPEWORK_ADMIN_TOKEN`` environment variable): an operator surface is never open by
default. Every call needs ``Authorization: Bearer <token>``; a missing or wrong one is 401.

- ``GET /admin/pool``: the pool's weights and live counters, per key.
- ``PUT /admin/pool/keys/{key}``: set the key's ``reserve``, ``limit`` (``null``: none,
  ``0``: paused), ``max_waiting``, ``wait_timeout``; fields left out keep their values. The
  new config is validated and swapped in one step; admitted work is never revoked.
- ``DELETE /admin/pool/keys/{key}``: clear the key's live values: the file's come back.
- ``POST /admin/reload``: validate the config file again and, if it is good, swap it in;
  a bad file changes nothing and the answer lists every problem. Live values survive it
  unless the file changed that field of that key (see :class:`LiveWeights`).
- ``GET /admin/services`` (and ``/admin/services/{name}``): each backend service's hosts
  with their state, weight, tries out and latency, and its breaker.
- ``POST /admin/services/{name}/hosts/{host}/drain`` and ``.../restore``: take a host out
  of rotation (no new tries; those out finish) and put it back. A drain lasts across
  reloads that keep the host (:mod:`._admin_services`).
- ``GET /admin/rate_limits``, ``PUT`` and ``DELETE /admin/rate_limits/{name}``: the rate
  limits, their rates set live and cleared (:mod:`._admin_limits`).
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any, Final

from quart import Response, request

from .._errors import PipeworkError
from .._http._bodies import JSON, decode_object, dumps_json, read_body
from .._http._credentials import bearer_token, same_secret
from .._http._identity import POOL_KEY_PREFIX
from .._http._problems import Problem
from .._http._ratelimit import RateLimits
from ..dispatcher._engine import Engine
from ..dispatcher._weighted import WeightedPool
from ..dispatcher._weighted_config import PoolConfig, PoolConfigError, Weights
from ..dispatcher._weighted_statistics import PoolStatistics
from ._admin_limits import (
    LiveLimits,
    check_limit_fields,
    find_limit,
    limit_document,
    limits_document,
)
from ._admin_services import (
    Upstreams,
    find_host,
    find_service,
    host_document,
    service_document,
    services_document,
)

__all__ = ["AdminApi", "LiveWeights", "Reload", "admin_token"]

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
        upstreams: Upstreams | None = None,
    ) -> None:
        self._engine = engine
        #: The backend services whose hosts ``/admin/services`` shows and drains (None:
        #: none); a reload swaps the new plan's in.
        self.upstreams = upstreams
        self._token = token
        self.reload_hook = reload
        self._max_body = max_body
        self._time_limit = body_time_limit
        pool = engine.pool
        #: The weights set live, kept across reloads (None: the pool has no weights).
        self.live = LiveWeights(pool.config) if isinstance(pool, WeightedPool) else None
        #: The rate limits in force (the container sets them) and their live rates.
        self.rate_limits: RateLimits | None = None
        self.live_limits = LiveLimits()

    def _authorize(self) -> None:
        # Any credential that is not the token, however malformed, is the same 401.
        if not same_secret(bearer_token(request.headers.get("Authorization")), self._token):
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

    def _document(self, pool: WeightedPool) -> dict[str, Any]:
        document = pool_document(pool.statistics())
        overrides = self.live.overrides() if self.live is not None else {}
        document["overrides"] = overrides
        for name, row in document["keys"].items():
            row["live"] = overrides.get(name, {})
        return document

    def _declared(self, pool: WeightedPool, key: str) -> None:
        keys = pool.config.keys
        if key not in keys:
            close = difflib.get_close_matches(key, sorted(keys), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise Problem(
                404,
                "Not Found",
                f"no pool key {key!r}{hint} (declared: {', '.join(sorted(keys)) or 'none'})",
                slug="admin-unknown-key",
            )

    async def pool(self) -> Response:
        self._authorize()
        return _json(self._document(self._pool()))

    async def set_key(self, key: str) -> Response:
        self._authorize()
        pool = self._pool()
        if not _KEY_NAME.match(key) and not _tenant_key(key):
            raise _bad_weights(
                f"{key!r} cannot name a key: use letters, digits, '_', '-' and '.' "
                "(up to 128, not starting with '-' or '.'), or a tenant's key "
                f"({POOL_KEY_PREFIX}VALUE)"
            )
        self._declared(pool, key)
        data = await read_body(request, limit=self._max_body, time_limit=self._time_limit)
        body = decode_object(data, request.headers.get("Content-Type"))
        if not body or set(body) - set(_FIELDS):
            unknown = sorted(set(body or {}) - set(_FIELDS))
            got = f"unknown field(s) {', '.join(map(repr, unknown))}" if unknown else "none"
            raise _bad_weights(
                f"send a JSON object with any of {', '.join(_FIELDS)}; got {got}"
                + _unknown_fields(body)
            )
        for name, value in body.items():
            _check_field(name, value)
        assert self.live is not None  # a WeightedPool has its live weights
        try:
            generation = pool.reconfigure(self.live.set(pool.config, key, body))
        except (PoolConfigError, TypeError, ValueError) as exc:
            raise _bad_weights(str(exc)) from None
        document = self._document(pool)
        return _json({"config_generation": generation, "key": document["keys"].get(key)})

    async def clear_key(self, key: str) -> Response:
        self._authorize()
        pool = self._pool()
        self._declared(pool, key)
        assert self.live is not None
        config, cleared = self.live.clear(pool.config, key)
        generation = pool.reconfigure(config)
        document = self._document(pool)
        return _json(
            {"config_generation": generation, "cleared": cleared, "key": document["keys"][key]}
        )

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
                400,
                "Invalid configuration",
                f"the config was not reloaded: {exc}",
                slug="config-invalid",
            ) from None
        return _json({"reloaded": True, **summary})

    async def services(self) -> Response:
        self._authorize()
        return _json(services_document(self.upstreams))

    async def service(self, name: str) -> Response:
        self._authorize()
        return _json({"service": name, **service_document(find_service(self.upstreams, name))})

    async def drain(self, name: str, host: str) -> Response:
        return self._turn(name, host, drain=True)

    async def restore(self, name: str, host: str) -> Response:
        return self._turn(name, host, drain=False)

    def _turn(self, name: str, host: str, *, drain: bool) -> Response:
        """Drain or restore the host; the answer shows the service after the change. No
        await between finding the host and changing it: a reload cannot come between."""
        self._authorize()
        found = find_host(name, find_service(self.upstreams, name), host)
        upstreams = self.upstreams
        assert upstreams is not None  # find_service found the service there
        turn = upstreams.drain if drain else upstreams.restore
        changed = turn(name, found.url)
        after = find_service(upstreams, name)
        return _json(
            {
                "service": name,
                "changed": changed,
                "host": host_document(find_host(name, after, host)),
                **service_document(after),
            }
        )

    async def rate_limits_view(self) -> Response:
        self._authorize()
        return _json(limits_document(self.rate_limits, self.live_limits))

    async def set_rate_limit(self, name: str) -> Response:
        self._authorize()
        limit = find_limit(self.rate_limits, name)
        data = await read_body(request, limit=self._max_body, time_limit=self._time_limit)
        fields = check_limit_fields(decode_object(data, request.headers.get("Content-Type")))
        try:
            self.live_limits.set(limit, fields)
        except ValueError as exc:
            raise Problem(400, "Bad Request", str(exc), slug="admin-bad-limit") from None
        return self._limit_answer(name)

    async def clear_rate_limit(self, name: str) -> Response:
        self._authorize()
        cleared = self.live_limits.clear(find_limit(self.rate_limits, name))
        return self._limit_answer(name, cleared=cleared)

    def _limit_answer(self, name: str, **extra: Any) -> Response:
        limits = self.rate_limits
        assert limits is not None  # find_limit found the limit there
        overrides = self.live_limits.overrides().get(name, {})
        document = limit_document(limits, limits.limits[name], overrides)
        return _json({"name": name, "limit": document, **extra})


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


class LiveWeights:
    """Weights set live (``PUT /admin/pool/keys/{key}``) and how a reload treats them.

    The rule: a live value stands until the file's value for that key and field changes
    (the file then wins: someone edited it on purpose), or until ``DELETE
    /admin/pool/keys/{key}`` clears the key's live values, which puts the file's back. A
    reload that leaves a field alone in the file keeps the live value; a key the new file
    no longer declares loses its live values. Sans-IO: it computes configs, the caller
    swaps them in.
    """

    def __init__(self, file: PoolConfig) -> None:
        #: The weights as the file (or the code) declares them, without live values.
        self.file = file
        # key -> field -> (the live value, the file's value when it was set)
        self._live: dict[str, dict[str, tuple[Any, Any]]] = {}

    def overrides(self) -> dict[str, dict[str, Any]]:
        """Every live value, by key and field."""
        return {
            key: {name: live for name, (live, _) in sorted(fields.items())}
            for key, fields in sorted(self._live.items())
        }

    def set(self, current: PoolConfig, key: str, fields: Mapping[str, Any]) -> PoolConfig:
        """The config with ``fields`` of ``key`` set live (raises PoolConfigError,
        TypeError or ValueError for weights the pool refuses, changing nothing)."""
        weights = replace(current.keys[key], **fields)
        config = current.with_weights(key, Weights(**_as_fields(weights)))
        file = self.file.keys.get(key, self.file.default)
        live = self._live.setdefault(key, {})
        for name, value in fields.items():
            live[name] = (value, getattr(file, name))
        return config

    def clear(self, current: PoolConfig, key: str) -> tuple[PoolConfig, dict[str, Any]]:
        """The config with ``key``'s file weights back, and the live values dropped."""
        dropped = {name: live for name, (live, _) in self._live.pop(key, {}).items()}
        return current.with_weights(key, self.file.keys.get(key, self.file.default)), dropped

    def rebase(self, file: PoolConfig) -> tuple[PoolConfig, list[str]]:
        """A reloaded file's config with the live values that still stand, and a sentence
        for each one the file overrode (for the log and the reload's answer)."""
        config = file
        dropped: list[str] = []
        for key in list(self._live):
            fields = self._live[key]
            if key not in file.keys:
                dropped.append(f"{key}: the file no longer declares the key; live values dropped")
                del self._live[key]
                continue
            declared = file.keys[key]
            kept = {}
            for name, (live, was) in list(fields.items()):
                now = getattr(declared, name)
                if now == was:
                    kept[name] = live
                else:
                    dropped.append(
                        f"{key}.{name}: the file changed it from {was!r} to {now!r}; "
                        f"the live value {live!r} is dropped"
                    )
                    del fields[name]
            if not fields:
                del self._live[key]
            if kept:
                try:
                    weights = Weights(**_as_fields(replace(declared, **kept)))
                    config = config.with_weights(key, weights)
                except (PoolConfigError, TypeError, ValueError) as exc:
                    dropped.append(
                        f"{key}: the live values no longer fit the file ({exc}); dropped"
                    )
                    self._live.pop(key, None)
        self.file = file
        return config, dropped


def _unknown_fields(body: object) -> str:
    if not isinstance(body, dict):
        return ""
    hints = []
    for name in sorted(set(body) - set(_FIELDS), key=str):
        close = difflib.get_close_matches(str(name), _FIELDS, n=1)
        if close:
            hints.append(f"{name!r}: did you mean {close[0]!r}?")
    return "; " + "; ".join(hints) if hints else ""


def _as_fields(weights: Weights) -> dict[str, Any]:
    return {name: getattr(weights, name) for name in (*_FIELDS, "adaptive")}


def _tenant_key(key: str) -> bool:
    """A tenant's key, as a route's pool_key makes them (``tenant:acme``)."""
    return (
        key.startswith(POOL_KEY_PREFIX)
        and 0 < len(key) - len(POOL_KEY_PREFIX) <= 256
        and (key.isprintable())
    )


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
        "keys_forgotten": stats.keys_forgotten,
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
