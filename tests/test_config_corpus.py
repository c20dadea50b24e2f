"""The corpus in tests/configs: every file loads, or fails, with exactly the problems its
``# expect:`` lines list (line: severity: key path: message), in order."""

from __future__ import annotations

from pathlib import Path

import pytest

import pipework as pw
from pipework import ConfigError, load_config
from pipework.registry._config_problems import Problem

CONFIGS = Path(__file__).parent / "configs"


async def enrich(ctx: pw.Context) -> None:
    """A Python pipe the corpus names (``tests.test_config_corpus:enrich``)."""
    ctx.state.setdefault("notes", []).append("enriched")


def render(ctx: pw.Context) -> None:
    """A blocking Python pipe the corpus names."""
    ctx.state["rendered"] = True


not_a_function = 42


def expected(path: Path) -> list[str]:
    prefix = "# expect: "
    lines = path.read_text(encoding="utf-8").splitlines()
    return [line.removeprefix(prefix) for line in lines if line.startswith(prefix)]


def shown(problem: Problem) -> str:
    where = f"{problem.path}: " if problem.path else ""
    return f"{problem.line or '-'}: {problem.severity}: {where}{problem.message}"


def corpus(kind: str) -> list[Path]:
    return sorted((CONFIGS / kind).glob("*.toml"))


@pytest.mark.parametrize("path", corpus("valid"), ids=lambda p: p.stem)
def test_valid_files_load_with_exactly_their_warnings(path: Path) -> None:
    config = load_config(path)
    assert [shown(p) for p in config.warnings] == expected(path)
    assert all(p.severity == "warning" for p in config.warnings)


@pytest.mark.parametrize("path", corpus("invalid"), ids=lambda p: p.stem)
def test_invalid_files_fail_with_exactly_their_problems(path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert [shown(p) for p in info.value.problems] == expected(path)
    assert info.value.errors, "an invalid file must have at least one error"


def test_the_corpus_is_not_empty() -> None:
    assert len(corpus("valid")) >= 4
    assert len(corpus("invalid")) >= 10
