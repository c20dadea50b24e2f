"""The ``[routes.NAME]`` section: each chain route and the chain it runs (a table holding
``proxy`` is a proxy route, read by ``_config_proxy``).

A chain is an array whose items are pipe names, nested arrays (run in order) and stage
tables: ``{serial = [...]}``, ``{any_of = [...]}``, ``{all_of = [...], settle = true,
merge = ...}``, ``{quorum = [...], k = 2}`` and ``{graph = {NODE = {pipe = "p", after =
[...], detach = false}}}``. Stages are built with the same constructors as in Python, so
a chain means exactly what the code version would.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Final, cast, get_args

from .._errors import RegistrationError, StateError
from ..container._routes import (
    BodyKind,
    Mode,
    OnDisconnect,
    Route,
    RouteTable,
    pool_key_problem,
)
from ..pipes._merge import MergePolicy, MergeRule, ReducerName
from ..pipes._pipe import DEGRADED_KEY
from ..pipes._stages import (
    GraphNode,
    Serial,
    StageItem,
    all_of,
    any_of,
    branch,
    graph,
    node,
    quorum,
    serial,
)
from ..pipes._state import check_value
from ._config_edge import EDGE_ROUTE_KEYS
from ._config_problems import Collector, KeyPath, close_match, describe_value
from ._config_read import Table, check_name, open_table, report_unknown

__all__ = ["PROXY_KEYS", "ROUTE_KEYS", "ChainReader", "RouteConfig", "is_proxy", "read_routes"]

ROUTE_KEYS: Final = (
    "method",
    "path",
    "chain",
    "mode",
    "timeout",
    "sync_wait",
    "on_disconnect",
    "key",
    "result",
    "max_body",
    "body",
    *EDGE_ROUTE_KEYS,
    "rate_limits",
    "pool_key",
)
#: A table holding ``proxy`` is a proxy route (read by ``_config_proxy``), with these keys.
PROXY_KEYS: Final = (
    "proxy",
    "prefix",
    "methods",
    "strip_prefix",
    "rewrite",
    "host",
    "key",
    "timeout",
    "connect_timeout",
    "first_byte_timeout",
    "idle_timeout",
    "max_body",
    "chain",
    "after",
    "websocket",
    *EDGE_ROUTE_KEYS,
    "rate_limits",
)
_PROXY_ONLY: Final = tuple(k for k in PROXY_KEYS if k not in ROUTE_KEYS and k != "proxy")
_ROUTE_HINT: Final = "expected one of: " + ", ".join(sorted(ROUTE_KEYS))
ROUTE_METHODS: Final = ("GET", "POST", "PUT", "PATCH", "DELETE")
STAGE_OPTIONS: Final[dict[str, tuple[str, ...]]] = {
    "serial": ("timeout", "name", "optional", "fallback"),
    "any_of": ("timeout", "max_concurrency"),
    "all_of": ("settle", "merge", "timeout", "max_concurrency"),
    "quorum": ("k", "merge", "timeout", "max_concurrency"),
    "graph": ("merge", "timeout", "max_concurrency"),
}
_ALL_OPTIONS: Final = frozenset(o for options in STAGE_OPTIONS.values() for o in options)
NODE_KEYS: Final = ("pipe", "chain", "after", "detach", "optional", "fallback")
#: A branch's marks (docs/degradation.md): on a ``serial`` table that is a parallel
#: stage's branch, or on a graph node that runs a ``chain``.
BRANCH_MARKS: Final = ("name", "optional", "fallback")
MERGE_RULES: Final = get_args(ReducerName)
#: Deeper nesting than this is almost surely a generated mistake, and recursion has limits.
MAX_DEPTH: Final = 32


@dataclass(frozen=True, slots=True)
class RouteConfig:
    """A route, the chain it runs (pipes by name), and the pipes it uses, in order."""

    route: Route
    chain: Serial
    key: str = "default"
    result: str | None = None
    pipes: tuple[str, ...] = ()
    #: ``pool_key``: put on the route with its auth (``Route`` refuses one without).
    pool_key: str | None = None


def read_routes(
    c: Collector, value: Any, pipes: Collection[str]
) -> tuple[dict[str, RouteConfig], set[str]]:
    """Every route that reads without errors, and the names of every pipe a route uses."""
    path: KeyPath = ("routes",)
    used: set[str] = set()
    if value is None:
        return {}, used
    if not isinstance(value, dict):
        c.error(path, "expected a table of routes, one [routes.NAME] each")
        return {}, used
    table = RouteTable()
    routes: dict[str, RouteConfig] = {}
    for name, spec in value.items():
        if is_proxy(spec):
            continue
        where = (*path, name)
        # A proxy route's keys are known, to say so below; the list shown is this kind's.
        t = open_table(c, where, spec, (*ROUTE_KEYS, *_PROXY_ONLY), hint=_ROUTE_HINT)
        if t is None or not check_name(c, where, name, "route"):
            continue
        for key in _PROXY_ONLY:
            if key in t:
                c.error(
                    t.at(key),
                    "a proxy route's key, not a chain route's: add proxy = \"SERVICE\" to "
                    "pass this route's requests through to a service",
                )
        reader = ChainReader(c, pipes, name)
        config = _route(name, t, reader)
        used.update(reader.used)
        if config is None or c.failed(where):
            continue
        try:
            table.add(config.route)
        except RegistrationError as exc:
            c.error(t.at("path"), str(exc))
            continue
        routes[name] = config
    return routes, used


def is_proxy(spec: Any) -> bool:
    """Whether a ``[routes.NAME]`` table declares a proxy route."""
    return isinstance(spec, dict) and "proxy" in spec


def _route(name: str, t: Table, reader: ChainReader) -> RouteConfig | None:
    c = t.c
    method = t.string("method", "POST").upper()
    if method not in ROUTE_METHODS:
        c.error(
            t.at("method"),
            f"unknown method {method!r}; expected one of: {', '.join(ROUTE_METHODS)}",
        )
    path = t.string("path", None, required=True)
    if path is not None:
        try:
            Route(name, "GET", path, "chain")  # checks the path alone, to report it there
        except RegistrationError as exc:
            c.error(t.at("path"), str(exc).removeprefix(f"route {name!r}: "))
            path = None
    mode = t.string("mode", "sync", choices=get_args(Mode))
    on_disconnect = t.string("on_disconnect", "cancel", choices=get_args(OnDisconnect))
    timeout = t.number("timeout", None)
    sync_wait = t.number("sync_wait", 10.0, positive=False)
    key = t.string("key", "default")
    result = t.string("result", None)
    max_body = t.integer("max_body", None, minimum=0)
    body = t.string("body", "object", choices=get_args(BodyKind))
    pool_key = t.string("pool_key", None)
    if pool_key is not None:
        problem = pool_key_problem(pool_key)
        if problem is not None:
            c.error(t.at("pool_key"), problem.removeprefix("pool_key "))
        elif "auth" not in t:
            c.error(
                t.at("pool_key"),
                f'{pool_key!r} needs auth = "NAME": only an authenticated caller has an '
                "identity or claims to choose a key by",
            )
    chain: Serial | None = None
    if "chain" not in t:
        c.error(t.at("chain"), "required key is missing: list the pipes and stages to run")
    else:
        items = reader.items(t.at("chain"), t.data["chain"], 0)
        chain = Serial(tuple(items)) if items is not None else None
    if path is None or chain is None or c.failed(t.path):
        return None
    try:
        route = Route(
            name,
            method,
            path,
            name,
            cast(Mode, mode),
            timeout,
            sync_wait,
            cast(OnDisconnect, on_disconnect),
            max_body,
            cast(BodyKind, body),
        )
    except RegistrationError as exc:
        c.error(t.path, str(exc).removeprefix(f"route {name!r}: "))
        return None
    return RouteConfig(route, chain, key, result, tuple(dict.fromkeys(reader.used)), pool_key)


class ChainReader:
    """Reads one route's chain into stage objects, reporting every problem on the way."""

    def __init__(self, c: Collector, pipes: Collection[str], route: str) -> None:
        self.c = c
        self.pipes = pipes
        self.route = route
        self.used: list[str] = []  # every pipe named, in order, repeats included

    def items(
        self, path: KeyPath, value: Any, depth: int, *, branches: bool = False
    ) -> list[StageItem] | None:
        """The items of an array; ``branches``: they are a parallel stage's branches."""
        if not isinstance(value, list):
            self.c.error(
                path, f"expected an array of pipes and stages, got {describe_value(value)}"
            )
            return None
        if not value:
            self.c.error(path, "must name at least one pipe or stage")
            return None
        items = [
            self.item((*path, i), v, depth + 1, in_parallel=branches) for i, v in enumerate(value)
        ]
        if any(item is None for item in items):
            return None
        return cast(list[StageItem], items)

    def item(
        self, path: KeyPath, value: Any, depth: int, *, in_parallel: bool = False
    ) -> StageItem | None:
        if depth > MAX_DEPTH:
            self.c.error(path, f"stages nest deeper than {MAX_DEPTH} levels")
            return None
        if isinstance(value, str):
            return self.pipe(path, value)
        if isinstance(value, list):
            items = self.items(path, value, depth)
            return serial(*items) if items is not None else None
        if isinstance(value, dict):
            return self.stage(path, value, depth, in_parallel=in_parallel)
        self.c.error(
            path, f"expected a pipe name, an array or a stage table, got {describe_value(value)}"
        )
        return None

    def pipe(self, path: KeyPath, name: str) -> str | None:
        if name not in self.pipes:
            guess = close_match(name, self.pipes)
            self.c.error(
                path, f"unknown pipe {name!r}" + (f"; did you mean {guess!r}?" if guess else "")
            )
            return None
        self.used.append(name)
        return name

    def stage(
        self, path: KeyPath, table: dict[str, Any], depth: int, *, in_parallel: bool = False
    ) -> StageItem | None:
        """A stage table; ``in_parallel``: it is a parallel stage's branch (it may be
        marked)."""
        c = self.c
        kinds = [k for k in STAGE_OPTIONS if k in table]
        if len(kinds) != 1:
            for key in table:
                if key not in STAGE_OPTIONS and key not in _ALL_OPTIONS:
                    report_unknown(c, (*path, key), key, STAGE_OPTIONS)
            what = ", ".join(kinds) if kinds else "none"
            c.error(
                path, f"a stage table needs exactly one of {', '.join(STAGE_OPTIONS)}; found {what}"
            )
            return None
        kind = kinds[0]
        options = STAGE_OPTIONS[kind]
        for key in table:
            if key == kind or key in options:
                continue
            if key in BRANCH_MARKS:
                c.error(
                    (*path, key),
                    f"marks a branch of several pipes, not the {kind} stage: write the branch "
                    f"as {{serial = [...], {key} = ...}}",
                )
            elif key in _ALL_OPTIONS:
                c.error(
                    (*path, key), f"not an option of {kind} (its options: {', '.join(options)})"
                )
            else:
                report_unknown(c, (*path, key), key, (kind, *options))
        t = Table(c, path, table)
        timeout = t.number("timeout", None)
        max_concurrency = (
            t.integer("max_concurrency", None, minimum=1) if kind != "serial" else None
        )
        merge = self.merge(t) if "merge" in options and "merge" in t else None
        k = t.integer("k", 1, minimum=1, required=True) if kind == "quorum" else 1
        settle = t.boolean("settle", False) if kind == "all_of" else False
        marked = kind == "serial" and any(mark in table for mark in BRANCH_MARKS)
        if marked and not in_parallel:
            first = next(mark for mark in BRANCH_MARKS if mark in table)
            c.error(
                (*path, first),
                "only a branch of an all_of, any_of or quorum stage (or a graph node's chain) "
                "can be marked; here its chain needs it: mark the pipes it can do without",
            )
        marks = self.marks(t) if marked else None
        if kind == "graph":
            nodes = self.graph(t.at("graph"), table["graph"], depth)
            items: list[StageItem] | None = None
        else:
            items = self.items(t.at(kind), table[kind], depth, branches=kind != "serial")
        if c.failed(path):
            return None
        try:
            if kind == "graph":
                assert nodes is not None
                where = t.at("graph")
                return graph(
                    *nodes,
                    name=self.route,
                    merge=merge,
                    timeout=timeout,
                    max_concurrency=max_concurrency,
                )
            where = path
            assert items is not None
            if kind == "serial":
                if marks is not None:
                    name, optional, fallback = marks
                    return branch(
                        *items, name=name, optional=optional, fallback=fallback, timeout=timeout
                    )
                return serial(*items, timeout=timeout)
            if kind == "any_of":
                return any_of(*items, timeout=timeout, max_concurrency=max_concurrency)
            if kind == "all_of":
                return all_of(
                    *items,
                    settle=settle,
                    merge=merge,
                    timeout=timeout,
                    max_concurrency=max_concurrency,
                )
            if k > len(items):
                c.error(
                    t.at("k"), f"must be at most the number of branches ({len(items)}), got {k}"
                )
                return None
            return quorum(k, *items, merge=merge, timeout=timeout, max_concurrency=max_concurrency)
        except RegistrationError as exc:
            c.error(where, str(exc))
            return None

    def marks(self, t: Table) -> tuple[str | None, bool, dict[str, Any] | None]:
        """A branch's ``name``, ``optional`` and ``fallback`` (a table: the state it sets),
        each problem reported at its key path."""
        name = t.string("name", None)
        optional = t.boolean("optional", False)
        fallback = self.fallback(t)
        if not optional and fallback is None and not t.c.failed(t.path):
            t.c.error(
                t.path,
                "a branch with a name must also be marked: set optional = true or a fallback "
                "table (the state it sets in its place)",
            )
        return name, optional, fallback

    def fallback(self, t: Table) -> dict[str, Any] | None:
        if "fallback" not in t:
            return None
        value, where = t.data["fallback"], t.at("fallback")
        if not isinstance(value, dict):
            t.c.error(
                where,
                "expected a table (the state to set in the branch's place), got "
                f"{describe_value(value)}; a fallback pipe is for a pipe, not a branch",
            )
            return None
        for key, item in value.items():
            if key == DEGRADED_KEY:
                t.c.error(
                    (*where, key),
                    f"{DEGRADED_KEY!r} is where the engine records what it degraded; use "
                    "another key",
                )
                continue
            try:
                check_value(item, root=key)
            except StateError as exc:
                t.c.error((*where, key), str(exc))
        return value

    def merge(self, t: Table) -> MergePolicy | None:
        value = t.data["merge"]
        if isinstance(value, str):
            rule = self.rule(t.at("merge"), value)
            return MergePolicy(default=rule) if rule is not None else None
        m = open_table(t.c, t.at("merge"), value, ("default", "keys"))
        if m is None:
            return None
        default = self.rule(m.at("default"), m.data.get("default", "strict"))
        keys: dict[str, MergeRule] = {}
        for key, rule in (m.table("keys") or {}).items():
            checked = self.rule((*m.at("keys"), key), rule)
            if checked is not None:
                keys[key] = checked
        if default is None or t.c.failed(t.at("merge")):
            return None
        return MergePolicy(default=default, keys=keys)

    def rule(self, path: KeyPath, value: Any) -> MergeRule | None:
        if isinstance(value, str) and value in MERGE_RULES:
            return cast(ReducerName, value)
        rules = ", ".join(MERGE_RULES)
        if not isinstance(value, str):
            self.c.error(path, f"expected a merge rule ({rules}), got {describe_value(value)}")
            return None
        guess = close_match(value, MERGE_RULES)
        also = f"did you mean {guess!r}? " if guess else ""
        self.c.error(path, f"unknown merge rule {value!r}; {also}expected one of: {rules}")
        return None

    def graph(self, path: KeyPath, value: Any, depth: int) -> list[GraphNode] | None:
        c = self.c
        if not isinstance(value, dict):
            c.error(path, f"expected a table of nodes, got {describe_value(value)}")
            return None
        if not value:
            c.error(path, "a graph needs at least one node")
            return None
        nodes: list[GraphNode] = []
        for name, spec in value.items():
            where = (*path, name)
            check_name(c, where, name, "node")
            if isinstance(spec, str):
                item: StageItem | None = self.pipe(where, spec)
                after: list[str] = []
                detach = False
            else:
                n = open_table(c, where, spec, NODE_KEYS)
                if n is None:
                    continue
                item = self.node_item(n, depth, name)
                after = self.after(n, value)
                detach = n.boolean("detach", False)
            if item is not None and not c.failed(where):
                nodes.append(node(name, item, after=after, detach=detach))
        return nodes if not c.failed(path) else None

    def node_item(self, n: Table, depth: int, name: str) -> StageItem | None:
        if ("pipe" in n) == ("chain" in n):
            self.c.error(n.path, 'a graph node needs pipe = "name" or chain = [...], one of them')
            return None
        if "pipe" in n:
            for mark in ("optional", "fallback"):
                if mark in n:
                    self.c.error(
                        n.at(mark),
                        "marks a node's chain; a node's single pipe is marked on the pipe, "
                        "under [pipes]",
                    )
            pipe = n.string("pipe", None)
            return self.pipe(n.at("pipe"), pipe) if pipe is not None else None
        optional = n.boolean("optional", False)
        fallback = self.fallback(n)
        items = self.items(n.at("chain"), n.data["chain"], depth + 1)
        if items is None or self.c.failed(n.path):
            return None
        if optional or fallback is not None:
            return branch(*items, name=name, optional=optional, fallback=fallback)
        return serial(*items)

    def after(self, n: Table, nodes: dict[str, Any]) -> list[str]:
        value = n.data.get("after", [])
        if not isinstance(value, list):
            self.c.error(
                n.at("after"), f"expected an array of node names, got {describe_value(value)}"
            )
            return []
        parents: list[str] = []
        for i, parent in enumerate(value):
            if not isinstance(parent, str):
                self.c.error(
                    (*n.at("after"), i), f"expected a node name, got {describe_value(parent)}"
                )
            elif parent not in nodes:
                guess = close_match(parent, nodes)
                also = f"did you mean {guess!r}?" if guess else f"nodes: {', '.join(nodes)}"
                self.c.error((*n.at("after"), i), f"unknown node {parent!r}; {also}")
            else:
                parents.append(parent)
        return parents
