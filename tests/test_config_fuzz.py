"""Whatever the file holds, loading it never crashes: it loads, or it raises ConfigError.

Two generators: configurations shaped like the schema (known section and key names, random
values, chains of random stages), and random mutations of a valid configuration. Each is
checked both as data and as TOML text; both routes must report the same problems.
"""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from pipework import ConfigError, GatewayConfig, build_registry, config_from_dict, loads_config
from pipework.registry._config_pipes import HTTP_KEYS, PYTHON_KEYS
from pipework.registry._config_routes import NODE_KEYS, PROXY_KEYS, ROUTE_KEYS, STAGE_OPTIONS
from pipework.registry._config_sections import (
    ADAPTIVE_KEYS,
    POOL_KEYS,
    SERVER_KEYS,
    SERVICE_KEYS,
)

from .test_config_emit import emit

FULL = tomllib.loads((Path(__file__).parent / "configs" / "valid" / "full.toml").read_text())
NAMES = ["users", "pricing", "a", "b", "get_user", "quote", "A", "B"]
WORDS = [
    "",
    "users",
    "get_user",
    "GET",
    "post",
    "/users/{user_id}",
    "/a/../b",
    "/api/",
    "*",
    "keep",
    "{x}",
    "{",
    "http://127.0.0.1:9",
    "https://pricing.internal/api",
    "2xx",
    "sync",
    "auto",
    "continue",
    "strict",
    "extend",
    "tests.test_config_corpus:enrich",
    "tests.test_config_corpus:render",
]
# No ':' in generated text: random text is never an import path, so nothing is imported.
text = st.text(alphabet=st.characters(blacklist_characters=":\x00"), max_size=10)
scalars = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(),
    text,
    st.sampled_from(WORDS),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)


def table(keys: tuple[str, ...] | list[str], value: st.SearchStrategy[Any] = values) -> Any:
    return st.dictionaries(st.sampled_from(keys) | text, value, max_size=6)


stage_keys = [*STAGE_OPTIONS, "k", "settle", "merge", "timeout", "max_concurrency"]
chains = st.recursive(
    st.sampled_from(NAMES) | scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(stage_keys), inner, max_size=3)
        | st.dictionaries(
            st.just("graph"),
            st.dictionaries(st.sampled_from(NAMES), table(NODE_KEYS, inner), max_size=3),
        )
    ),
    max_leaves=10,
)
route_values = st.one_of(values, chains)


def section(keys: tuple[str, ...], value: st.SearchStrategy[Any] = values) -> Any:
    named = st.dictionaries(st.sampled_from(NAMES), table(keys, value), max_size=3)
    return named | values


shaped = st.fixed_dictionaries(
    {},
    optional={
        "server": table(SERVER_KEYS) | values,
        "pool": table([*POOL_KEYS, *ADAPTIVE_KEYS]) | values,
        "services": section(SERVICE_KEYS),
        "pipes": section((*HTTP_KEYS, *PYTHON_KEYS)),
        "routes": section((*ROUTE_KEYS, *PROXY_KEYS), route_values),
        "extra": values,
    },
)


def outcome(load: Any) -> GatewayConfig | list[tuple[str, str, str]]:
    try:
        config = load()
    except ConfigError as exc:
        error = exc
    else:
        assert isinstance(config, GatewayConfig)
        build_registry(config, config.backends())
        return config
    assert error.errors
    assert str(error).count("\n") == len(error.problems)  # one line per problem
    return [(p.path, p.severity, p.message) for p in error.problems]


def check(data: dict[str, Any]) -> None:
    outcome(lambda: config_from_dict(data))
    written, _ = emit(data)
    # The writer may reorder keys (values before sub-tables), so compare with what it wrote.
    from_data = outcome(lambda: config_from_dict(tomllib.loads(written)))
    from_text = outcome(lambda: loads_config(written))
    if isinstance(from_data, list):
        assert isinstance(from_text, list)
        assert sorted(from_text) == sorted(from_data)
    else:
        assert isinstance(from_text, GatewayConfig)
        assert from_text.routes.keys() == from_data.routes.keys()
        assert from_text.proxies.keys() == from_data.proxies.keys()


@settings(max_examples=150)
@given(shaped)
def test_schema_shaped_configs_load_or_raise_config_error(data: dict[str, Any]) -> None:
    check(data)


@st.composite
def mutations(draw: st.DrawFn) -> dict[str, Any]:
    data = copy.deepcopy(FULL)
    for _ in range(draw(st.integers(1, 3))):
        node: Any = data
        while True:  # walk down to a random table or array
            children = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
            containers = [(k, v) for k, v in children if isinstance(v, dict | list) and v]
            if not containers or draw(st.integers(0, 3)) == 0:
                break
            node = draw(st.sampled_from(containers))[1]
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        slots = list(node) if isinstance(node, dict) else list(range(len(node)))
        if action == "add" or not slots:
            if isinstance(node, dict):
                node[draw(st.sampled_from(NAMES) | text)] = draw(route_values)
            else:
                node.append(draw(route_values))
        elif action == "delete":
            del node[draw(st.sampled_from(slots))]
        else:
            node[draw(st.sampled_from(slots))] = draw(route_values)
    return data


@settings(max_examples=150)
@given(mutations())
def test_mutated_configs_load_or_raise_config_error(data: dict[str, Any]) -> None:
    check(data)


def test_the_unmutated_config_loads() -> None:
    config = outcome(lambda: config_from_dict(copy.deepcopy(FULL)))
    assert isinstance(config, GatewayConfig)


def test_a_name_with_a_line_break_keeps_each_problem_on_one_line() -> None:
    data = copy.deepcopy(FULL)
    data["services"] = {"\n": []}
    problems = outcome(lambda: config_from_dict(data))
    assert isinstance(problems, list)
    assert any("declared: \\n" in message for _, _, message in problems)
