"""From a checked configuration to running objects: the registry, the pool configuration,
the services' connection settings, and chains that really run on an Engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

import pipework as pw
from pipework import (
    Adaptive,
    ConfigError,
    Parallel,
    Serial,
    WeightedPool,
    Weights,
    build_registry,
    config_from_dict,
    load_config,
    loads_config,
)
from pipework.registry._config_problems import Problem

CONFIGS = Path(__file__).parent / "configs"


def test_full_config_builds_registry_routes_and_pool() -> None:
    config = load_config(CONFIGS / "valid" / "full.toml")
    registry = build_registry(config, config.backends())
    assert set(registry.routes) == {"order", "report"}
    route = registry.routes["order"]
    assert (route.method, route.path, route.mode, route.timeout) == (
        "POST",
        "/orders/{user_id}",
        "auto",
        5.0,
    )
    assert (route.sync_wait, route.on_disconnect, route.max_body) == (1.5, "continue", 65536)
    chain = registry.get_chain("order")
    assert (chain.key, chain.result, chain.timeout) == ("orders", "order", 5.0)
    kinds = [getattr(child, "kind", None) for child in chain.root.children]
    assert kinds == ["pipe", "all_of", "any_of", "quorum", "graph", "serial"]
    all_of, any_of, quorum, graph = chain.root.children[1:5]
    assert isinstance(all_of, Parallel)
    assert isinstance(any_of, Parallel)
    assert isinstance(quorum, Parallel)
    assert isinstance(graph, Parallel)
    assert all_of.merge == pw.MergePolicy(default="strict", keys={"notes": "extend"})
    assert (any_of.timeout, any_of.max_concurrency) == (0.8, 2)
    assert (quorum.k, quorum.merge.default) == (2, "first")
    assert graph.names == ("A", "B", "C")
    assert graph.parents == ((), (0,), ())
    assert graph.detach == (False, False, True)
    render, inner = graph.branches[1].children  # node B: chain = ["render", {serial...}]
    assert isinstance(render, pw.Pipe)
    assert render.name == "render"
    assert isinstance(inner, Serial)
    assert inner.timeout == 1.0
    report = registry.get_chain("report").root.children[0]
    assert isinstance(report, Parallel)
    assert report.settle


def test_pipe_keys_default_to_their_service() -> None:
    config = load_config(CONFIGS / "valid" / "full.toml")
    pipes = build_registry(config, config.backends()).pipes
    assert pipes["get_user"].key == "users"
    assert pipes["price_a"].key == "pricing-a"  # set explicitly
    assert pipes["enrich"].key == "enrich"
    assert pipes["render"].key is None  # a Python pipe runs under its chain's key
    assert pipes["render"].blocking
    assert pipes["get_user"].timeout == 1.0


def test_pool_config_holds_every_weight() -> None:
    config = load_config(CONFIGS / "valid" / "full.toml")
    pool = config.pool_config()
    assert pool.max_workers == 32
    assert pool.wait_timeout == 2.5
    assert pool.max_passed_over == 4
    assert pool.default == Weights(max_waiting=200)
    assert dict(pool.keys) == {
        "users": Weights(reserve=8, max_waiting=200),
        "pricing": Weights(
            limit=12,
            max_waiting=200,
            wait_timeout=0.5,
            adaptive=Adaptive(min_limit=2, max_limit=12, backoff=0.7, latency_tolerance=1.5),
        ),
        "audit": Weights(reserve=2, limit=4, max_waiting=200),
        "enrich": Weights(limit=4, max_waiting=200),
    }
    assert config.pool.queue_capacity == 5000
    assert WeightedPool.from_config(pool).config == pool


def test_service_settings_and_connection_pools() -> None:
    config = load_config(CONFIGS / "valid" / "full.toml")
    users, pricing, audit = (config.services[n] for n in ("users", "pricing", "audit"))
    assert users.base_url == "http://users.internal:8080/api/v2"
    assert (users.timeout, users.connect_timeout, users.keepalive_expiry) == (1.5, 0.5, 30.0)
    assert users.headers == {"Authorization": "Bearer service-token", "X-Caller": "pipework"}
    # users: reserve 8, no limit -> the shared pool (32 - 10 reserved) plus its reserve,
    # capped at 32 by default; max_keepalive as set.
    assert (users.max_connections, users.max_keepalive) == (30, 4)
    assert (pricing.max_connections, pricing.max_response_bytes) == (16, 65536)
    assert audit.max_connections == 4  # its limit


@pytest.mark.parametrize(
    ("weights", "expected"),
    [
        ("", 32),  # no weights: modest by default
        ("reserve = 3", 32),
        ("limit = 5", 5),
        ("limit = 100", 64),  # the most it could ever hold
        ("limit = 0", 32),  # paused now; sized for when it resumes without a limit
    ],
)
def test_default_max_connections_cover_the_weights(weights: str, expected: int) -> None:
    text = f'[pool]\nmax_workers = 64\n[services.s]\nbase_url = "http://s"\n{weights}\n'
    assert loads_config(text).services["s"].max_connections == expected


def test_small_pools_give_small_connection_pools() -> None:
    text = '[pool]\nmax_workers = 4\n[services.s]\nbase_url = "http://s"\n'
    assert loads_config(text).services["s"].max_connections == 4


def test_server_settings_and_secrets_from_the_environment() -> None:
    server = load_config(CONFIGS / "valid" / "full.toml").server
    assert (server.host, server.port, server.shutdown_grace) == ("0.0.0.0", 8080, 5.5)
    assert (server.max_body, server.max_header_bytes) == (262144, 8192)
    assert server.public_url == "https://gateway.example.com"
    environ = {"PIPEWORK_ADMIN_TOKEN": "t0k", "PIPEWORK_CALLBACK_SECRET": "s3c"}
    assert server.admin_token_value(environ) == "t0k"
    assert server.callback_secret_value(environ) == "s3c"
    assert server.admin_token_value({}) is None  # unset: the admin API stays closed
    literal = load_config(CONFIGS / "valid" / "warnings.toml").server
    assert literal.admin_token_value({}) == "s3cret-admin-token"


def test_summary() -> None:
    summary = load_config(CONFIGS / "valid" / "warnings.toml").summary()
    assert summary["source"].endswith("warnings.toml")
    assert (summary["services"], summary["pipes"], summary["routes"]) == (2, 2, 0)
    assert (summary["max_workers"], summary["reserved"]) == (64, 0)
    assert summary["warnings"][0] == (
        "line 4: warning: server.admin_token: a token written in the file is readable by "
        "whoever reads the file; prefer admin_token_env"
    )


def test_defaults_of_an_empty_file() -> None:
    config = loads_config("")
    assert config.server.port == 8000
    assert config.pool_config().max_workers == 64
    assert (config.services, config.pipes, config.routes) == ({}, {}, {})


def test_config_error_lists_every_problem_readably() -> None:
    text = '[server]\nport = "x"\n\n[pool]\nmax_worker = 3\n\n[pipes.p]\nkey = "k"\n'
    with pytest.raises(ConfigError) as info:
        loads_config(text, source="gateway.toml")
    assert str(info.value) == (
        "gateway.toml: 3 errors, 1 warning\n"
        '  gateway.toml:2: error: server.port: expected an integer, got a string ("x")\n'
        "  gateway.toml:5: error: pool.max_worker: unknown key; did you mean 'max_workers'?\n"
        "  gateway.toml:7: error: pipes.p: set service (a built-in HTTP call) or python "
        "(a function)\n"
        "  gateway.toml: warning: routes: no routes: the gateway would serve only its own "
        "endpoints"
    )
    assert info.value.source == "gateway.toml"
    assert [p.line for p in info.value.errors] == [2, 5, 7]
    assert isinstance(info.value, pw.PipeworkError)


def test_problem_formats() -> None:
    problem = Problem("pool.max_workers", "must be at least 1, got 0", 3)
    assert str(problem) == "line 3: error: pool.max_workers: must be at least 1, got 0"
    assert (
        problem.format("g.toml") == "g.toml:3: error: pool.max_workers: must be at least 1, got 0"
    )
    assert str(Problem("", "bad", None, "warning")) == "warning: bad"


def test_unreadable_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the file: No such file or directory"):
        load_config(tmp_path / "missing.toml")
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"a = '\xff'\n")
    with pytest.raises(ConfigError, match="the file is not UTF-8 text: invalid start byte"):
        load_config(binary)


def test_data_that_is_not_a_table_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict([1, 2])  # type: ignore[arg-type]  # the point: not a table
    assert [str(p) for p in info.value.problems] == ["error: expected a table, got an array"]


def test_build_into_an_existing_registry() -> None:
    registry = pw.Registry()

    @registry.pipe
    async def from_code(ctx: pw.Context) -> None:
        ctx.state["code"] = True

    config = load_config(CONFIGS / "valid" / "minimal.toml")
    assert build_registry(config, config.backends(), registry) is registry
    assert set(registry.pipes) == {"from_code", "get_user"}
    assert set(registry.routes) == {"user"}


PYTHON_GATEWAY = """
[pool]
max_workers = 4

[pipes.enrich]
python = "tests.test_config_corpus:enrich"

[pipes.render]
python = "tests.test_config_corpus:render"
blocking = true

[pipes.stamp]
python = "tests.test_config_build:stamp"

[routes.page]
path = "/page"
timeout = 5
chain = [
  { all_of = ["enrich", "stamp"], merge = { keys = { notes = "extend" } } },
  { graph = { A = "render", B = { chain = ["enrich"], after = ["A"] } } },
]
"""


async def stamp(ctx: pw.Context) -> None:
    ctx.state.setdefault("notes", []).append("stamped")
    ctx.state["stamped_by"] = ctx.pipe.name


async def test_a_configured_chain_runs_on_an_engine() -> None:
    config = loads_config(PYTHON_GATEWAY)
    engine = pw.Engine(
        registry=build_registry(config, config.backends()),
        pool=WeightedPool.from_config(config.pool_config()),
    )
    with trio.fail_after(10):
        async with config.backends(), engine:
            result: dict[str, Any] = await engine.run("page", {"notes": []})
    assert result == {
        "notes": ["enriched", "stamped", "enriched"],
        "stamped_by": "stamp",
        "rendered": True,
    }
