"""The examples in docs/configuration.md are valid. A snippet may name pipes, services or
modules it does not show; those are stubbed in, and then every snippet must load."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from pipework import ConfigError, GatewayConfig, config_from_dict

DOC = Path(__file__).parent.parent / "docs" / "configuration.md"
BLOCKS = re.findall(r"```toml\n(.*?)```", DOC.read_text(encoding="utf-8"), re.DOTALL)
UNKNOWN = re.compile(r"unknown (pipe|service) '([^']+)'")


def with_stubs(data: dict[str, Any]) -> GatewayConfig:
    """Load ``data``, declaring whatever it names but does not declare."""
    for _ in range(5):
        try:
            return config_from_dict(data)
        except ConfigError as exc:
            stubbed = False
            for problem in exc.errors:
                found = UNKNOWN.search(problem.message)
                if found and found.group(1) == "pipe":
                    stub = {"python": "tests.test_config_corpus:enrich"}
                    data.setdefault("pipes", {})[found.group(2)] = stub
                    stubbed = True
                elif found:
                    stub = {"base_url": "http://stub.internal"}
                    data.setdefault("services", {})[found.group(2)] = stub
                    stubbed = True
                elif "cannot import module 'shop." in problem.message:
                    name = problem.path.split(".")[1]
                    data["pipes"][name]["python"] = "tests.test_config_corpus:render"
                    stubbed = True
            if not stubbed:
                raise
    raise AssertionError("stubbing did not converge")


def test_the_reference_has_examples() -> None:
    assert len(BLOCKS) >= 8


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_each_example_loads(block: str) -> None:
    config = with_stubs(tomllib.loads(block))
    assert isinstance(config, GatewayConfig)
