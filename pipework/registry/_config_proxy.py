"""Proxy routes in the gateway file: ``[routes.NAME]`` with ``proxy = "SERVICE"``.

A route table holding ``proxy`` is a proxy route (requests under its ``prefix`` passed to the
service as they are); any other is a chain route (``_config_routes``). One file may hold
both kinds. A proxy route's ``chain`` runs on the request's head before it is passed on,
its ``after`` on the answer's head; they are read as a chain route's chain is and
registered as chains named ``NAME`` and ``NAME.after``.

Besides each key's own checks: a chain route's keys on a proxy route (and a proxy route's
on a chain route) say which kind they belong to; two proxy routes one method could reach
under one prefix clash; and a chain route under a proxy prefix is an error (the proxy
would take all its requests, so it would never run), or a warning when only some of them
(a ``{name}`` segment that can take the prefix's text).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Final, cast, get_args

from .._errors import RegistrationError
from ..pipes._stages import Serial
from ..proxy._route import (
    HostPolicy,
    ProxyRoute,
    ProxyTable,
    check_prefix,
    check_rewrite,
    is_method,
    shadowing,
)
from ._config_problems import Collector, KeyPath, close_match, describe_value
from ._config_read import Table, check_name, open_table
from ._config_routes import PROXY_KEYS, ChainReader, RouteConfig, is_proxy

__all__ = [
    "CHAIN_ROUTE_ONLY",
    "ProxyConfig",
    "after_chain_name",
    "read_proxies",
]

#: A chain route's keys that a proxy route has not, with what to write instead.
CHAIN_ROUTE_ONLY: Final = {
    "method": 'a proxy route takes methods = [...] (or "*", any)',
    "path": 'a proxy route matches prefix = "/..."',
    "mode": "a proxy route relays the answer as it comes",
    "sync_wait": "a proxy route relays the answer as it comes",
    "on_disconnect": "a proxy route always stops when its client goes",
    "result": "a proxy route relays the service's answer",
    "body": "a proxy route passes any body on as it comes",
}

_PROXY_HINT: Final = "a proxy route takes " + ", ".join(PROXY_KEYS)


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """A proxy route, the chains it runs around the proxy step (pipes by name; None:
    none) and the pipes they use, in order."""

    route: ProxyRoute
    chain: Serial | None = None
    after: Serial | None = None
    pipes: tuple[str, ...] = ()


def after_chain_name(route: str) -> str:
    """The name the ``after`` chain of proxy route ``route`` is registered under (no
    route's name holds a '.', so it clashes with no route's chain)."""
    return f"{route}.after"


def read_proxies(
    c: Collector,
    value: Any,
    pipes: Collection[str],
    services: Collection[str],
    routes: Mapping[str, RouteConfig],
) -> tuple[dict[str, ProxyConfig], set[str]]:
    """Every proxy route in the ``[routes]`` section ``value`` that reads without errors,
    and the names of every pipe they use; ``routes`` are the chain routes read, checked
    for a proxy prefix over their paths."""
    path: KeyPath = ("routes",)
    used: set[str] = set()
    if not isinstance(value, dict):
        return {}, used  # reported by read_routes
    table = ProxyTable()
    proxies: dict[str, ProxyConfig] = {}
    for name, spec in value.items():
        if not is_proxy(spec):
            continue
        where = (*path, name)
        t = open_table(c, where, spec, (*PROXY_KEYS, *CHAIN_ROUTE_ONLY), hint=_PROXY_HINT)
        if t is None or not check_name(c, where, name, "route"):
            continue
        for key, instead in CHAIN_ROUTE_ONLY.items():
            if key in t:
                c.error(t.at(key), f"a chain route's key, not a proxy route's: {instead}")
        reader = ChainReader(c, pipes, name)
        config = _proxy(name, t, reader, services)
        used.update(reader.used)
        if config is None or c.failed(where):
            continue
        try:
            table.add(config.route)
        except RegistrationError as exc:
            c.error(t.at("prefix"), str(exc))
            continue
        _check_shadows(t, config.route, routes)
        proxies[name] = config
    return proxies, used


def _proxy(
    name: str, t: Table, reader: ChainReader, services: Collection[str]
) -> ProxyConfig | None:
    c = t.c
    where = f"proxy route {name!r}"
    service = t.string("proxy", None, required=True)
    if service is not None and service not in services:
        guess = close_match(service, services)
        also = f"did you mean {guess!r}?" if guess else f"declared: {', '.join(services) or 'none'}"
        c.error(t.at("proxy"), f"unknown service {service!r}; {also}")
    prefix = t.string("prefix", None, required=True)
    if prefix is not None:
        try:
            check_prefix(prefix, where)
        except RegistrationError as exc:
            c.error(t.at("prefix"), str(exc).removeprefix(f"{where}: "))
    methods = _methods(t)
    strip_prefix = t.boolean("strip_prefix", False)
    rewrite = t.string("rewrite", None)
    if rewrite is not None:
        try:
            check_rewrite(rewrite, where)
        except RegistrationError as exc:
            c.error(t.at("rewrite"), str(exc).removeprefix(f"{where}: "))
    if strip_prefix and rewrite is not None:
        c.error(
            t.at("rewrite"),
            "strip_prefix and rewrite both replace the prefix; set one of them",
        )
    host = t.string("host", "service", choices=get_args(HostPolicy))
    key = t.string("key", None)
    timeouts = {
        k: t.number(k, None)
        for k in ("timeout", "connect_timeout", "first_byte_timeout", "idle_timeout")
    }
    max_body = t.integer("max_body", None, minimum=0)
    websocket = t.boolean("websocket", True)
    chain = _chain(t, reader, "chain")
    after = _chain(t, reader, "after")
    if c.failed(t.path):
        return None
    try:
        route = ProxyRoute(
            name,
            cast(str, service),
            cast(str, prefix),
            methods,
            strip_prefix,
            rewrite,
            cast(HostPolicy, host),
            key,
            max_body=max_body,
            chain=name if chain is not None else None,
            after=after_chain_name(name) if after is not None else None,
            websocket=websocket,
            **timeouts,
        )
    except RegistrationError as exc:  # what the reading above let through
        c.error(t.path, str(exc).removeprefix(f"{where}: "))
        return None
    return ProxyConfig(route, chain, after, tuple(dict.fromkeys(reader.used)))


def _methods(t: Table) -> frozenset[str] | None:
    """``methods``: ``"*"`` (or absent) for any, else an array of method names."""
    if "methods" not in t:
        return None
    value = t.data["methods"]
    if value == "*":
        return None
    if not isinstance(value, list):
        t.c.error(
            t.at("methods"),
            f'expected an array of method names or "*" (any), got {describe_value(value)}',
        )
        return None
    if not value:
        t.c.error(t.at("methods"), 'must name at least one method (or be "*", any)')
        return None
    found: list[str] = []
    for i, method in enumerate(value):
        where = (*t.at("methods"), i)
        if not isinstance(method, str):
            t.c.error(where, f"expected a method name, got {describe_value(method)}")
            continue
        if not is_method(method):
            t.c.error(where, f"{method!r} is not an HTTP method name (a token, as PROPFIND)")
            continue
        if method.upper() in found:
            t.c.error(where, f"{method.upper()} is listed twice")
            continue
        found.append(method.upper())
    return frozenset(found) if found else None


def _chain(t: Table, reader: ChainReader, key: str) -> Serial | None:
    if key not in t:
        return None
    items = reader.items(t.at(key), t.data[key], 0)
    return Serial(tuple(items)) if items is not None else None


def _check_shadows(t: Table, proxy: ProxyRoute, routes: Mapping[str, RouteConfig]) -> None:
    for name, rc in routes.items():
        shadow = shadowing(proxy.prefix, rc.route.path)
        if shadow == "all":
            t.c.error(
                t.at("prefix"),
                f"covers route {name!r} ({rc.route.method} {rc.route.path}): every request "
                "to it would be proxied, so it would never run; move one of them",
            )
        elif shadow == "some":
            t.c.warn(
                t.at("prefix"),
                f"covers some paths of route {name!r} ({rc.route.method} {rc.route.path}): "
                f"those under {proxy.prefix} are proxied instead",
            )
