"""The command-line tools for gateway files: ``check``, ``routes`` and ``graph``.

Each takes the file's path, prints to stdout (results) and stderr (problems), and returns
the exit status: 0 when the file is valid, 1 when it is not (every problem printed).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import trio

from ._errors import ConfigProblem
from ._http._auth import fetch_url, jwks_keys
from .pipes._pipe import Pipe
from .registry._config import GatewayConfig, ProxyConfig, build_registry, load_config
from .registry._config_draw import chain_text, mermaid
from .registry._config_problems import ConfigError
from .registry._registry import Registry

__all__ = ["check", "graph", "routes"]

#: Seconds ``check --fetch`` gives each JWKS URL.
_FETCH_TIMEOUT = 10.0


def _load(
    path: str | os.PathLike[str], *, quiet: bool = False
) -> tuple[GatewayConfig, Registry] | None:
    try:
        config = load_config(path, environ=os.environ)
    except ConfigError as exc:
        if not quiet:
            print(exc, file=sys.stderr)
        return None
    if not quiet:
        for warning in config.warnings:
            print(warning.format(config.source), file=sys.stderr)
    return config, build_registry(config, config.backends())


def check(path: str | os.PathLike[str], *, format: str = "text", fetch: bool = False) -> int:
    """Validate the file: a one-line summary (and any warnings) when it is valid, every
    problem otherwise. ``format="json"`` prints one JSON document on stdout instead (for
    CI pipelines): ``valid``, ``source``, ``errors`` and ``warnings`` (each with ``path``,
    ``line``, ``message``), and the summary's counts when the file is valid. ``fetch``:
    also fetch every ``jwks_url`` the file names (never fetched otherwise: a check runs
    where the identity provider may be out of reach) and report one that fails or serves
    no usable key as an error."""
    if format == "json":
        return _check_json(path, fetch)
    loaded = _load(path)
    if loaded is None:
        return 1
    fetched = _fetch_jwks(loaded[0]) if fetch else []
    for problem in fetched:
        print(problem.format(loaded[0].source), file=sys.stderr)
    if fetched:
        return 1
    s = loaded[0].summary()
    warned = len(s["warnings"])
    proxies = f", {_count(s['proxy_routes'], 'proxy route')}" if s["proxy_routes"] else ""
    if s["rate_limits"]:
        proxies += f", {_count(s['rate_limits'], 'rate limit')}"
    print(
        f"{s['source']}: valid: {_count(s['services'], 'service')}, "
        f"{_count(s['pipes'], 'pipe')}, {_count(s['routes'], 'route')}{proxies}; "
        f"{s['max_workers']} workers ({s['reserved']} reserved)"
        + (f"; {_count(warned, 'warning')}" if warned else "")
    )
    return 0


def _fetch_jwks(config: GatewayConfig) -> list[ConfigProblem]:
    """Fetch every JWKS URL of the file, each once; the problems, as errors at its key."""
    found: list[ConfigProblem] = []

    async def fetch_all() -> None:
        for name, source in config.edge.jwks_urls.items():
            try:
                with trio.fail_after(_FETCH_TIMEOUT):
                    jwks_keys(await fetch_url(source.url), source.url)
            except (OSError, ValueError, trio.TooSlowError) as exc:
                why = str(exc) or type(exc).__name__
                found.append(ConfigProblem(f"auth.{name}.jwks_url", f"cannot use the JWKS: {why}"))

    trio.run(fetch_all)
    return found


def _check_json(path: str | os.PathLike[str], fetch: bool = False) -> int:
    source = os.fspath(path)
    try:
        config = load_config(path, environ=os.environ)
    except ConfigError as exc:
        problems: tuple[ConfigProblem, ...] = exc.problems
        document: dict[str, Any] = {"source": exc.source or source, "valid": False}
    else:
        fetched = tuple(_fetch_jwks(config)) if fetch else ()
        problems = (*fetched, *config.warnings)
        summary = config.summary()
        del summary["warnings"]
        document = {**summary, "valid": not fetched}
    document["errors"] = [_problem(p) for p in problems if p.severity == "error"]
    document["warnings"] = [_problem(p) for p in problems if p.severity == "warning"]
    print(json.dumps(document, indent=2))
    return 0 if document["valid"] else 1


def _problem(problem: ConfigProblem) -> dict[str, Any]:
    return {"path": problem.path, "line": problem.line, "message": problem.message}


def routes(path: str | os.PathLike[str]) -> int:
    """List the routes with their resolved chains, as a table."""
    loaded = _load(path)
    if loaded is None:
        return 1
    config, registry = loaded
    rows = [("ROUTE", "METHOD", "PATH", "MODE", "TIMEOUT", "CHAIN")]
    for name, rc in config.routes.items():
        route = rc.route
        # The job's time limit as a request gets it: the route's, else the server's
        # default_timeout.
        if route.timeout is not None:
            timeout = f"{route.timeout:g}s"
        else:
            timeout = f"{config.server.default_timeout:g}s (default)"
        chain = chain_text(registry.get_chain(name).root)
        rows.append((name, route.method, route.path, route.mode, timeout, chain))
    for name, pc in config.proxies.items():
        rows.append(_proxy_row(name, pc, registry))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        print("  ".join([*cells, row[-1]]))
    return 0


def _proxy_row(
    name: str, pc: ProxyConfig, registry: Registry
) -> tuple[str, str, str, str, str, str]:
    """A proxy route's line: its methods, prefix, and what it passes to (and runs)."""
    route = pc.route
    methods = ",".join(sorted(route.methods)) if route.methods is not None else "*"
    path = route.prefix.rstrip("/") + "/..."
    timeout = "none" if route.timeout is None else f"{route.timeout:g}s"
    what = f"proxy to {route.service}"
    if route.rewrite is not None:
        what += f" ({route.prefix} -> {route.rewrite})"
    elif route.strip_prefix:
        what += " (prefix stripped)"
    if route.chain is not None:  # the names its chains are registered under
        what = f"{chain_text(registry.get_chain(route.chain).root)} > {what}"
    if route.after is not None:
        what += f" > after: {chain_text(registry.get_chain(route.after).root)}"
    return name, methods, path, "proxy", timeout, what


def graph(path: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None) -> int:
    """Draw each route's chain as a Mermaid flowchart: to stdout, or one ``ROUTE.md`` per
    route in ``out_dir`` (created if needed)."""
    loaded = _load(path)
    if loaded is None:
        return 1
    config, registry = loaded

    def describe(pipe: Pipe) -> str:
        spec = config.pipes.get(pipe.name)
        return spec.describe() if spec is not None else ""

    target = None if out_dir is None else Path(out_dir)
    if target is not None:
        target.mkdir(parents=True, exist_ok=True)
    for name, rc in config.routes.items():
        chain = registry.get_chain(name)
        page = (
            f"# Route `{name}`\n\n"
            f"`{rc.route.method} {rc.route.path}` ({rc.route.mode}) runs "
            f"`{chain_text(chain.root)}`.\n\n"
            f"```mermaid\n{mermaid(rc.route, chain, describe)}\n```\n"
        )
        if target is None:
            print(page)
        else:
            file = target / f"{name}.md"
            file.write_text(page, encoding="utf-8")
            print(file)
    return 0


def _count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
