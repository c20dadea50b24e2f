"""The ``[rate_limits.NAME]`` sections of a gateway file, ``[rate_limits]``' own keys (the
store that keeps the limits' state) and the ``rate_limits`` a route or a service names.

::

    [rate_limits]
    store = "redis"              # or "memory" (the default): each process counts alone
    url_env = "REDIS_URL"

    [rate_limits.per-client]
    rate = 100                   # requests per period, sustained
    period = 60                  # seconds (default 1)
    burst = 20                   # at once (default: rate)
    key = "client"               # or "header:X-Api-Key", "identity", "claim:tenant"

    [routes.search]
    rate_limits = ["per-client"]

A limit is one budget: every route that names it (or reaches a service that names it)
counts in the same buckets. See docs/configuration.md#rate-limits and docs/edge-policy.md.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, cast, get_args

from .._http._ratelimit import KEY_KINDS, LimitSpec, LimitStore, Missing
from .._http._ratelimit_core import Rate
from ._config_problems import Collector, KeyPath, close_match, describe_value
from ._config_read import Table, check_name, open_table
from ._config_redis import read_redis_target, redis_url

__all__ = [
    "LIMIT_KEYS",
    "LIMIT_STORE_KEYS",
    "LimitSettings",
    "read_limit_names",
    "read_rate_limits",
]

#: ``[rate_limits]``' own keys (a limit is a table, ``[rate_limits.NAME]``).
LIMIT_STORE_KEYS: Final = ("store", "url", "url_env", "prefix", "timeout", "fail_open")
LIMIT_KEYS: Final = ("rate", "period", "burst", "key", "missing", "max_keys")
#: An HTTP field name (a token).
_HEADER: Final = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")


@dataclass(frozen=True, slots=True)
class LimitSettings:
    """``[rate_limits]``: the limits by name and where their state lives. ``store =
    "memory"`` (the default) keeps it in each process; ``"redis"`` shares it between every
    process on the same server and ``prefix`` (one round trip per limited request, ``timeout``
    seconds at most). ``fail_open``: a request the store cannot decide passes (else 503)."""

    limits: Mapping[str, LimitSpec] = field(default_factory=dict)
    store: str = "memory"
    url: str | None = None
    url_env: str | None = None
    prefix: str = "pipework"
    timeout: float = 0.5
    fail_open: bool = True

    def url_value(self, environ: Mapping[str, str] | None = None) -> str:
        return redis_url("rate_limits", self.url, self.url_env, environ)

    def build_store(self, environ: Mapping[str, str] | None = None) -> LimitStore | None:
        """The store a plan's limits decide through (None: the memory store)."""
        if self.store == "memory":
            return None
        from ..redis._ratelimit import RedisLimitStore  # the optional extra

        env = os.environ if environ is None else environ
        return RedisLimitStore(self.url_value(env), prefix=self.prefix, timeout=self.timeout)

    def same_store(self, other: LimitSettings) -> bool:
        return (self.store, self.url, self.url_env, self.prefix, self.timeout) == (
            other.store,
            other.url,
            other.url_env,
            other.prefix,
            other.timeout,
        )


def read_rate_limits(c: Collector, value: Any) -> LimitSettings:
    path: KeyPath = ("rate_limits",)
    if value is None:
        return LimitSettings()
    if not isinstance(value, dict):
        c.error(path, "expected a table of rate limits, one [rate_limits.NAME] each")
        return LimitSettings()
    own = {k: v for k, v in value.items() if k in LIMIT_STORE_KEYS and not isinstance(v, dict)}
    t = Table(c, path, own)
    d = LimitSettings()
    store = t.string("store", d.store, choices=("memory", "redis"))
    target = read_redis_target(c, t, switch="store", chosen=store, default_prefix=d.prefix)
    timeout = t.number("timeout", d.timeout)
    fail_open = t.boolean("fail_open", d.fail_open)
    limits: dict[str, LimitSpec] = {}
    for name, spec in value.items():
        where: KeyPath = (*path, name)
        if name in own:
            continue
        if name in LIMIT_STORE_KEYS:
            c.error(
                where,
                f"{name!r} is one of [rate_limits]' own keys ({', '.join(LIMIT_STORE_KEYS)}), "
                "not a limit's name; name the limit otherwise",
            )
            continue
        if not isinstance(spec, dict):
            guess = close_match(name, LIMIT_STORE_KEYS)
            also = f"; did you mean {guess!r}?" if guess else ""
            c.error(
                where,
                f"expected a limit's table ([rate_limits.{name}]) or one of [rate_limits]' "
                f"own keys ({', '.join(LIMIT_STORE_KEYS)}){also}",
            )
            continue
        limit = _limit(c, where, name, spec)
        if limit is not None:
            limits[name] = limit
    return LimitSettings(
        limits,
        store,
        target.url,
        target.url_env,
        target.prefix,
        timeout,
        fail_open,
    )


def _limit(c: Collector, where: KeyPath, name: str, spec: dict[str, Any]) -> LimitSpec | None:
    t = open_table(c, where, spec, LIMIT_KEYS)
    if t is None or not check_name(c, where, name, "rate limit"):
        return None
    rate = t.integer("rate", None, minimum=1, required=True)
    period = t.number("period", 1.0)
    burst = t.integer("burst", rate, minimum=1)
    key = _key(t)
    missing = t.string("missing", "client", choices=get_args(Missing))
    max_keys = t.integer("max_keys", 100_000, minimum=1)
    if rate is not None and period * 1_000_000 / rate < 1:
        c.error(t.at("rate"), f"{rate} per {period:g}s is more than one per microsecond")
    if t.data.get("key", "client") == "client" and "missing" in t:
        c.warn(t.at("missing"), "a request always has a client address: used only with other keys")
    if c.failed(where) or rate is None or burst is None:
        return None
    return LimitSpec(name, Rate(rate, period, burst), key, cast(Missing, missing), max_keys)


def _key(t: Table) -> str:
    key = t.string("key", "client")
    kind, colon, argument = key.partition(":")
    forms = 'expected "client", "header:NAME", "identity" or "claim:NAME"'
    if kind not in KEY_KINDS:
        guess = close_match(kind, KEY_KINDS)
        also = f"did you mean {guess!r}? " if guess else ""
        t.c.error(t.at("key"), f"unknown key {key!r}; {also}{forms}")
        return "client"
    named = kind in ("header", "claim")
    if named and not argument:
        t.c.error(t.at("key"), f'"{kind}" needs the name after a colon: "{kind}:NAME"')
        return "client"
    if not named and colon:
        t.c.error(t.at("key"), f'"{kind}" takes no name after it; {forms}')
        return "client"
    if kind == "header" and not _HEADER.match(argument):
        t.c.error(t.at("key"), f"{argument!r} is not an HTTP header name")
        return "client"
    return key


def read_limit_names(
    c: Collector, t: Table, limits: Collection[str], declared: Collection[str]
) -> tuple[str, ...]:
    """A route's or a service's ``rate_limits``: a name or an array of names, each of a
    declared limit (``limits``: those that read without errors; ``declared``: every name
    in the file, so a broken limit is reported once, where it is)."""
    if "rate_limits" not in t:
        return ()
    value = t.data["rate_limits"]
    items: Sequence[Any] = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        c.error(
            t.at("rate_limits"),
            f"expected a limit's name or an array of them, got {describe_value(value)}",
        )
        return ()
    names: list[str] = []
    for i, item in enumerate(items):
        where = t.at("rate_limits") if isinstance(value, str) else (*t.at("rate_limits"), i)
        if not isinstance(item, str):
            c.error(where, f"expected a limit's name, got {describe_value(item)}")
        elif item not in declared:
            guess = close_match(item, declared)
            also = f"did you mean {guess!r}?" if guess else _declared(declared)
            c.error(where, f"unknown rate limit {item!r}; {also}")
        elif item in limits:
            names.append(item)
    return tuple(dict.fromkeys(names))


def _declared(declared: Collection[str]) -> str:
    if not declared:
        return "declare it as [rate_limits.NAME]"
    return f"declared: {', '.join(sorted(declared))}"
