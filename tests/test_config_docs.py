"""The examples in docs/configuration.md are valid. A snippet may name pipes, services or
modules it does not show; those are stubbed in, and then every snippet must load."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, Final

import pytest
import trustme

from pipework import ConfigError, GatewayConfig, config_from_dict

DOC = Path(__file__).parent.parent / "docs" / "configuration.md"
BLOCKS = re.findall(r"```toml\n(.*?)```", DOC.read_text(encoding="utf-8"), re.DOTALL)
UNKNOWN = re.compile(r"unknown (pipe|service) '([^']+)'")
#: The PEM file a snippet's TLS key names stands for: one made for the test.
PEM_KIND: Final = {
    "tls_cert": "cert",
    "client_cert": "cert",
    "tls_key": "key",
    "client_key": "key",
    "tls_client_ca": "ca",
    "ca_bundle": "ca",
}


@pytest.fixture(scope="module")
def pem_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A certificate, its key and its CA, for the files the snippets name."""
    directory = tmp_path_factory.mktemp("pem")
    ca = trustme.CA()
    leaf = ca.issue_cert("gateway.example.com")
    files = {
        "cert": directory / "cert.pem",
        "key": directory / "key.pem",
        "ca": directory / "ca.pem",
    }
    leaf.cert_chain_pems[0].write_to_path(str(files["cert"]))
    leaf.private_key_pem.write_to_path(str(files["key"]))
    ca.cert_pem.write_to_path(str(files["ca"]))
    return {kind: str(path) for kind, path in files.items()}


def with_stubs(data: dict[str, Any], pem: dict[str, str] | None = None) -> GatewayConfig:
    """Load ``data``, declaring whatever it names but does not declare (and, with ``pem``,
    putting real files in place of the TLS files it names)."""
    for table in [data.get("server", {}), *data.get("services", {}).values()]:
        for key, kind in PEM_KIND.items():
            if pem is not None and isinstance(table, dict) and key in table:
                table[key] = pem[kind]
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
def test_each_example_loads(block: str, pem_files: dict[str, str]) -> None:
    config = with_stubs(tomllib.loads(block), pem_files)
    assert isinstance(config, GatewayConfig)
