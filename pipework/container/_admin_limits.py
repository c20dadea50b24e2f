"""The admin API's rate limits: read them and set their rates live, as the pool's weights.

- ``GET /admin/rate_limits``: every limit in force: its rate, period and burst (live values
  included), key, the routes that meet it, the keys this process holds and the live values.
- ``PUT /admin/rate_limits/{name}``: set any of ``rate``, ``period``, ``burst``; fields left
  out keep their values. The limit's state stays (a TAT means the same under any rate).
- ``DELETE /admin/rate_limits/{name}``: clear the live values: the file's come back.

A live value stands until the file's value of that field of that limit changes (a reload
then takes the file's: someone edited it on purpose) or the limit leaves the file, as
:class:`~pipework.container._admin.LiveWeights` does for weights. It is this process's: with
``serve --workers N`` each worker holds its own (a reload of the file reaches them all).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Final

from .._http._problems import Problem
from .._http._ratelimit import Limit, RateLimits
from .._http._ratelimit_core import Rate

__all__ = ["LIMIT_FIELDS", "LiveLimits", "check_limit_fields", "find_limit", "limits_document"]

LIMIT_FIELDS: Final = ("rate", "period", "burst")
_MAX_COUNT: Final = 1_000_000_000


class LiveLimits:
    """Rates set live and how a reload treats them (sans-IO: it sets ``Limit.rate``)."""

    def __init__(self) -> None:
        # limit -> field -> (the live value, the file's value when it was set)
        self._live: dict[str, dict[str, tuple[Any, Any]]] = {}

    def overrides(self) -> dict[str, dict[str, Any]]:
        return {
            name: {f: live for f, (live, _) in sorted(fields.items())}
            for name, fields in sorted(self._live.items())
        }

    def set(self, limit: Limit, fields: Mapping[str, Any]) -> None:
        """Set ``fields`` of ``limit`` live (ValueError for a rate the core refuses)."""
        limit.rate = replace(limit.rate, **fields)
        live = self._live.setdefault(limit.name, {})
        for name, value in fields.items():
            live[name] = (value, getattr(limit.spec.rate, name))

    def clear(self, limit: Limit) -> dict[str, Any]:
        limit.rate = limit.spec.rate
        return {f: live for f, (live, _) in self._live.pop(limit.name, {}).items()}

    def rebase(self, limits: RateLimits | None) -> list[str]:
        """Apply the live values that still stand to a reloaded plan's limits; a sentence
        for each one dropped."""
        dropped: list[str] = []
        found = {} if limits is None else limits.limits
        for name in list(self._live):
            fields = self._live[name]
            limit = found.get(name)
            if limit is None:
                dropped.append(
                    f"{name}: the file no longer declares the limit; live values dropped"
                )
                del self._live[name]
                continue
            kept: dict[str, Any] = {}
            for field, (live, was) in list(fields.items()):
                now = getattr(limit.spec.rate, field)
                if now == was:
                    kept[field] = live
                else:
                    dropped.append(
                        f"{name}.{field}: the file changed it from {was!r} to {now!r}; "
                        f"the live value {live!r} is dropped"
                    )
                    del fields[field]
            if kept:
                try:
                    limit.rate = replace(limit.spec.rate, **kept)
                except ValueError as exc:
                    dropped.append(f"{name}: the live values no longer fit ({exc}); dropped")
                    fields.clear()
            if not fields:
                del self._live[name]
        return dropped


def check_limit_fields(body: Any) -> dict[str, Any]:
    """The fields of a ``PUT``, each of the right type and size, or a 400 naming it."""
    if not isinstance(body, dict) or not body or set(body) - set(LIMIT_FIELDS):
        unknown = sorted(map(str, set(body) - set(LIMIT_FIELDS))) if isinstance(body, dict) else []
        hints = [
            f"{name!r}: did you mean {close[0]!r}?"
            for name in unknown
            if (close := difflib.get_close_matches(name, LIMIT_FIELDS, n=1))
        ]
        got = f"unknown field(s) {', '.join(map(repr, unknown))}" if unknown else "none"
        raise _bad(
            f"send a JSON object with any of {', '.join(LIMIT_FIELDS)}; got {got}"
            + ("; " + "; ".join(hints) if hints else "")
        )
    for name, value in body.items():
        if name == "period":
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise _bad(f"period must be a number of seconds, got {value!r}")
            if not (math.isfinite(value) and 0 < value <= 86_400 * 366):
                raise _bad(f"period must be above 0 and at most a year, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, int):
            raise _bad(f"{name} must be a whole number, got {value!r}")
        elif not 1 <= value <= _MAX_COUNT:
            raise _bad(f"{name} must be between 1 and {_MAX_COUNT}, got {value}")
    return dict(body)


def find_limit(limits: RateLimits | None, name: str) -> Limit:
    found = {} if limits is None else limits.limits
    limit = found.get(name)
    if limit is None:
        close = difflib.get_close_matches(name, sorted(found), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise Problem(
            404,
            "Not Found",
            f"no rate limit {name!r}{hint} (declared: {', '.join(sorted(found)) or 'none'})",
            slug="admin-unknown-limit",
        )
    return limit


def limit_document(limits: RateLimits, limit: Limit, live: Mapping[str, Any]) -> dict[str, Any]:
    rate: Rate = limit.rate
    spec = limit.spec
    return {
        "rate": rate.rate,
        "period": rate.period,
        "burst": rate.burst,
        "key": spec.key,
        "missing": spec.missing,
        "max_keys": spec.max_keys,
        "keys_held": len(limit.table),
        "keys_evicted": limit.table.evicted,
        "routes": sorted(r for r, met in limits.routes.items() if limit in met),
        "file": {"rate": spec.rate.rate, "period": spec.rate.period, "burst": spec.rate.burst},
        "live": dict(live),
    }


def limits_document(limits: RateLimits | None, live: LiveLimits) -> dict[str, Any]:
    overrides = live.overrides()
    found: dict[str, dict[str, Any]] = {}
    if limits is not None:
        for name, limit in sorted(limits.limits.items()):
            found[name] = limit_document(limits, limit, overrides.get(name, {}))
    return {"limits": found, "overrides": overrides}


def _bad(detail: str) -> Problem:
    return Problem(400, "Bad Request", detail, slug="admin-bad-limit")
