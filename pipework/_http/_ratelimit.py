"""Rate limits at the edge: which limits a request meets, its key in each, the store that
keeps their state, and the ``429`` a refusal is.

A :class:`RateLimits` is built from a gateway file's ``[rate_limits]`` (one per plan, swapped
whole at a reload) and asked once per request of a limited route, before anything else is
done for it: for a chain route before its body is read and its job exists, for a proxy route
before its chain runs and before it waits for a slot of its service's key. A request meets
every limit its route names and every limit of the service it reaches; it passes when all
of them let it, and then counts in all of them; refused by one, it counts in none.

Keys (``key`` of a limit): ``"client"`` (the client's address: the connection's peer, or
for a peer in ``[server] trusted_proxies`` the nearest untrusted address its
``X-Forwarded-For`` names), ``"header:NAME"``, ``"identity"`` and ``"claim:NAME"`` (read from
the request's identity mapping, :mod:`._identity`). A request without the header, identity
or claim is keyed as ``missing`` says: by its client address (the default), in one bucket
shared by all such requests, or not limited at all.

The refusal (docs/edge-policy.md): ``429`` problem+json with ``Retry-After`` (whole seconds,
rounded up) and the ``RateLimit-Policy`` and ``RateLimit`` fields of
draft-ietf-httpapi-ratelimit-headers-10: ``"NAME";q=BURST;w=WINDOW`` per limit the route
meets, and ``"NAME";r=REMAINING;t=RESET``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address
from typing import Any, Final, Literal, Protocol, TypeAlias

import trio

from .._metrics import Metrics
from ._identity import claim_of, identity_of
from ._problems import Problem, retry_after_header
from ._ratelimit_core import Decision, LimitTable, Rate, decide_all, describe, to_micros

__all__ = [
    "KEY_KINDS",
    "Limit",
    "LimitSpec",
    "LimitStore",
    "LimitStoreUnavailable",
    "MemoryLimitStore",
    "Missing",
    "RateLimits",
    "client_address",
]

_log = logging.getLogger("pipework.ratelimit")

Missing: TypeAlias = Literal["client", "shared", "allow"]
Network: TypeAlias = IPv4Network | IPv6Network
#: What a limit may be keyed by; ``header`` and ``claim`` name theirs after a colon.
KEY_KINDS: Final = ("client", "header", "identity", "claim")
#: At most one warning this often while a limit store cannot be reached.
_WARN_EVERY: Final = 10.0


@dataclass(frozen=True, slots=True)
class LimitSpec:
    """A limit as the file declares it: ``rate`` (and ``burst`` within it), what it is
    keyed by (``key``: ``client``, ``header:NAME``, ``identity``, ``claim:NAME``), what a
    request without that key meets (``missing``), and how many keys one process keeps."""

    name: str
    rate: Rate
    key: str = "client"
    missing: Missing = "client"
    max_keys: int = 100_000

    @property
    def kind(self) -> str:
        return self.key.partition(":")[0]

    @property
    def argument(self) -> str:
        """The header's name (lowercase) or the claim's, after the colon."""
        argument = self.key.partition(":")[2]
        return argument.lower() if self.kind == "header" else argument


class LimitStoreUnavailable(Exception):
    """The store of a limit's state could not be asked (Redis away, too slow)."""


class LimitStore(Protocol):
    """Where the limits' TATs live: :class:`MemoryLimitStore` in this process, or one
    shared by processes (``pipework.redis.RedisLimitStore``)."""

    async def take(
        self, limits: Sequence[Limit], keys: Sequence[str]
    ) -> tuple[bool, int, list[int]]:
        """Decide one request on ``limits`` (its key in each): whether it passes, the time
        decided at (microseconds) and each limit's TAT after it (see ``decide_all``).
        Raises :class:`LimitStoreUnavailable`."""
        ...

    async def aclose(self) -> None: ...


class MemoryLimitStore:
    """Each limit's TATs in its :class:`LimitTable`, in this process, on trio's clock."""

    async def take(
        self, limits: Sequence[Limit], keys: Sequence[str]
    ) -> tuple[bool, int, list[int]]:
        now = to_micros(trio.current_time())
        tables = [limit.table for limit in limits]
        tats = [table.get(key) for table, key in zip(tables, keys, strict=True)]
        allowed, after = decide_all([limit.rate for limit in limits], tats, now)
        if allowed:
            for table, key, tat in zip(tables, keys, after, strict=True):
                table.put(key, tat, now)
        return allowed, now, after

    async def aclose(self) -> None:
        pass


class Limit:
    """One limit in force: its spec, its rate (which the admin API may set live), this
    process's table of its keys (the memory store's), and its counters."""

    __slots__ = ("_allowed", "_error", "_limited", "rate", "spec", "table")

    def __init__(self, spec: LimitSpec, metrics: Metrics | None) -> None:
        self.spec = spec
        self.rate = spec.rate
        self.table = LimitTable(spec.max_keys)
        family = None if metrics is None else metrics.rate_limit_decisions
        self._allowed = None if family is None else family.labels(spec.name, "allowed")
        self._limited = None if family is None else family.labels(spec.name, "limited")
        self._error = None if family is None else family.labels(spec.name, "error")

    @property
    def name(self) -> str:
        return self.spec.name

    def count(self, decision: str) -> None:
        child = (
            self._allowed
            if decision == "allowed"
            else self._limited
            if decision == "limited"
            else self._error
        )
        if child is not None:
            child.inc()

    def policy(self) -> str:
        """This limit's member of ``RateLimit-Policy``."""
        return f'"{self.name}";q={self.rate.burst};w={self.rate.window}'


@dataclass(slots=True)
class RateLimits:
    """The limits of one plan and which routes meet which (by route name, services'
    limits included), decided through ``store``. ``trusted``: the proxies whose
    ``X-Forwarded-For`` names the client; ``fail_open``: a request the store cannot
    decide passes (else it is refused with a 503)."""

    limits: dict[str, Limit]
    routes: dict[str, tuple[Limit, ...]]
    store: LimitStore = field(default_factory=MemoryLimitStore)
    trusted: tuple[Network, ...] = ()
    fail_open: bool = True
    _warned: float = -math.inf

    @classmethod
    def build(
        cls,
        specs: Iterable[LimitSpec],
        routes: Mapping[str, Sequence[str]],
        *,
        store: LimitStore | None = None,
        metrics: Metrics | None = None,
        trusted: tuple[Network, ...] = (),
        fail_open: bool = True,
    ) -> RateLimits:
        limits = {spec.name: Limit(spec, metrics) for spec in specs}
        by_route = {
            route: tuple(limits[name] for name in dict.fromkeys(names))
            for route, names in routes.items()
            if names
        }
        return cls(limits, by_route, store or MemoryLimitStore(), trusted, fail_open)

    def adopt(self, old: RateLimits | None) -> list[str]:
        """Keep ``old``'s state for every limit that stays the same (its name, key and
        what a request without it meets; its rate may change, a TAT is a time and means
        the same under any rate). Returns the names whose state was kept."""
        if old is None:
            return []
        kept = []
        for name, limit in self.limits.items():
            before = old.limits.get(name)
            if before is None:
                continue
            spec, was = limit.spec, before.spec
            if (spec.key, spec.missing, spec.max_keys) == (was.key, was.missing, was.max_keys):
                limit.table = before.table
                kept.append(name)
        return kept

    def applying(self, route: str) -> tuple[Limit, ...]:
        return self.routes.get(route, ())

    def key(self, limit: Limit, scope: Mapping[str, Any]) -> str | None:
        """``scope``'s key in ``limit`` (None: not limited by it)."""
        spec = limit.spec
        kind = spec.kind
        value: str | None
        if kind == "client":
            return "client:" + client_address(scope, self.trusted)
        if kind == "header":
            value = _header(scope, spec.argument)
        elif kind == "identity":
            value = identity_of(scope)
        else:
            value = claim_of(scope, spec.argument)
        if value is not None:
            return f"{kind}:{value}"
        if spec.missing == "client":
            return "client:" + client_address(scope, self.trusted)
        return "missing" if spec.missing == "shared" else None

    async def check(self, limits: Sequence[Limit], scope: Mapping[str, Any]) -> Problem | None:
        """None if the request of ``scope`` may go on (and counts in ``limits``), else the
        problem to answer."""
        keys: list[str] = []
        met: list[Limit] = []
        for limit in limits:
            key = self.key(limit, scope)
            if key is not None:
                keys.append(key)
                met.append(limit)
        if not met:
            return None
        try:
            allowed, now, tats = await self.store.take(met, keys)
        except LimitStoreUnavailable as exc:
            return self._unavailable(met, exc)
        if allowed:
            for limit in met:
                limit.count("allowed")
            return None
        decisions = [
            describe(limit.rate, tat, now, allowed=False)
            for limit, tat in zip(met, tats, strict=True)
        ]
        return self._refusal(met, decisions)

    def _refusal(self, met: list[Limit], decisions: list[Decision]) -> Problem:
        pairs = list(zip(met, decisions, strict=True))
        refusing = [(limit, d) for limit, d in pairs if d.retry_after > 0] or pairs
        for limit, _ in refusing:
            limit.count("limited")
        limit, decision = max(refusing, key=lambda pair: pair[1].retry_after)
        rate = limit.rate
        headers = retry_after_header(decision.retry_after)
        headers["RateLimit-Policy"] = ", ".join(limit.policy() for limit in met)
        headers["RateLimit"] = ", ".join(
            f'"{limit.name}";r={d.remaining};t={math.ceil(d.reset)}'
            for limit, d in zip(met, decisions, strict=True)
        )
        per = _seconds(rate.period)
        return Problem(
            429,
            "Too Many Requests",
            f"rate limit {limit.name!r} lets {rate.burst} requests through at once and "
            f"{rate.rate} every {per} per {_keyed(limit.spec)}; retry after "
            f"{headers['Retry-After']}s (RateLimit says what is left of each limit)",
            slug="rate-limited",
            headers=headers,
            limit=limit.name,
        )

    def _unavailable(self, met: list[Limit], exc: LimitStoreUnavailable) -> Problem | None:
        for limit in met:
            limit.count("error")
        now = trio.current_time()
        if now - self._warned >= _WARN_EVERY:
            self._warned = now
            what = "let through" if self.fail_open else "refused"
            _log.warning("rate limits: the store cannot be asked (%s); requests are %s", exc, what)
        if self.fail_open:
            return None
        return Problem(
            503,
            "Service Unavailable",
            "the rate limits' store cannot be reached, and this gateway refuses what it "
            "cannot count ([rate_limits] fail_open = false); retry shortly",
            slug="rate-limit-store-unavailable",
            headers=retry_after_header(1),
        )


def _seconds(period: float) -> str:
    return "second" if period == 1 else f"{period:g} seconds"


def _keyed(spec: LimitSpec) -> str:
    kind = spec.kind
    if kind == "client":
        return "client address"
    if kind == "identity":
        return "authenticated identity"
    return f"{kind} {spec.key.partition(':')[2]!r}"


def _header(scope: Mapping[str, Any], name: str) -> str | None:
    wanted = name.encode("latin-1")
    for raw, value in scope.get("headers", ()):
        if raw.lower() == wanted:
            return value.decode("latin-1") or None
    return None


def client_address(scope: Mapping[str, Any], trusted: tuple[Network, ...] = ()) -> str:
    """The client's address: the connection's peer, or, when the peer is a trusted proxy,
    the nearest address in ``X-Forwarded-For`` that is not one (``"unknown"``: none)."""
    client = scope.get("client")
    peer = str(client[0]) if client else "unknown"
    if not trusted or not _trusted(peer, trusted):
        return peer
    hops: list[str] = []
    for raw, value in scope.get("headers", ()):
        if raw.lower() == b"x-forwarded-for":
            hops.extend(part.strip() for part in value.decode("latin-1").split(","))
    for hop in reversed(hops):
        if not hop:
            continue
        if not _trusted(hop, trusted):
            return hop
        peer = hop
    return peer


def _trusted(address: str, trusted: tuple[Network, ...]) -> bool:
    try:
        found: IPv4Address | IPv6Address = ip_address(address)
    except ValueError:
        return False
    if isinstance(found, IPv6Address) and found.ipv4_mapped is not None:
        found = found.ipv4_mapped
    return any(found in network for network in trusted)
