"""``optional`` and ``fallback`` in the gateway file: what they build, and every bad value
reported at its key path."""

from __future__ import annotations

import pytest

import pipework as pw
from pipework import ConfigError, build_registry, loads_config

BASE = """
[services.recommender]
base_url = "http://recommender.internal"

[services.pricing]
base_url = "http://pricing.internal"

[pipes.load]
python = "tests.test_config_corpus:enrich"
"""

ROUTE = """
[routes.page]
path = "/page"
chain = ["load", { all_of = ["recommend", "price"] }]
"""


def problems(text: str) -> list[str]:
    """Every problem as ``severity: path: message``, in file order."""
    try:
        config = loads_config(text)
    except ConfigError as exc:
        found = exc.problems
    else:
        found = config.warnings
    return [f"{p.severity}: {p.path}: {p.message}" for p in found]


def test_optional_and_fallbacks_build_the_pipes_they_say() -> None:
    config = loads_config(
        BASE
        + """
[pipes.recommend]
service = "recommender"
path = "/top"
optional = true

[pipes.price]
service = "pricing"
path = "/prices"
fallback = "cached_price"

[pipes.cached_price]
python = "tests.test_config_corpus:enrich"

[pipes.reviews]
python = "tests.test_config_corpus:enrich"
fallback = { reviews = [], hidden = true, note = { why = "busy" } }

[routes.page]
path = "/page"
chain = ["load", { all_of = ["recommend", "price", "reviews"] }]
"""
    )
    assert config.warnings == ()  # cached_price, a fallback only, counts as used
    registry = build_registry(config, config.backends())
    pipes = registry.pipes
    assert pipes["recommend"].optional
    assert pipes["recommend"].fallback is None
    assert pipes["recommend"].key == "recommender"
    assert pipes["price"].fallback is pipes["cached_price"]
    assert pipes["reviews"].fallback_state() == {
        "reviews": [],
        "hidden": True,
        "note": {"why": "busy"},
    }
    assert not pipes["load"].degradable
    assert not pipes["cached_price"].degradable


def test_every_bad_value_is_reported_at_its_key_path() -> None:
    found = problems(
        BASE
        + """
[pipes.recommend]
service = "recommender"
path = "/top"
optional = "yes"
fallback = 3

[pipes.price]
service = "pricing"
path = "/prices"
fallback = "cached_prices"

[pipes.cached_price]
python = "tests.test_config_corpus:enrich"

[pipes.self]
python = "tests.test_config_corpus:enrich"
fallback = "self"

[pipes.dated]
python = "tests.test_config_corpus:enrich"
fallback = { when = 1979-05-27T07:32:00, degraded = {} }
"""
        + ROUTE
    )
    assert found == [  # in file order; no warning for pipes with errors of their own
        'error: pipes.recommend.optional: expected a boolean, got a string ("yes")',
        "error: pipes.recommend.fallback: expected a table (the state to set in the pipe's "
        "place) or a pipe's name (run in its place), got an integer (3)",
        "error: pipes.price.fallback: unknown pipe 'cached_prices'; did you mean 'cached_price'?",
        "warning: pipes.cached_price: no route uses this pipe",
        "error: pipes.self.fallback: a pipe cannot be its own fallback; name another pipe",
        "error: pipes.dated.fallback.when: when holds datetime datetime.datetime(1979, 5, 27, "
        "7, 32), which job state cannot store (use str, bytes, int, float, bool, None, list "
        "or dict)",
        "error: pipes.dated.fallback.degraded: 'degraded' is where the engine records what it "
        "degraded; use another key",
    ]


def test_a_fallback_pipe_answers_at_once_so_it_is_not_degradable_itself() -> None:
    found = problems(
        BASE
        + """
[pipes.recommend]
service = "recommender"
path = "/top"
fallback = "price"

[pipes.price]
service = "pricing"
path = "/prices"
optional = true
"""
        + ROUTE
    )
    assert found == [
        "error: pipes.recommend.fallback: pipe 'price' is optional or has a fallback itself; "
        "a fallback answers at once, so name a pipe with neither"
    ]


@pytest.mark.parametrize("kind", ["python", "http"])
def test_both_kinds_of_pipe_take_both_keys(kind: str) -> None:
    spec = (
        'python = "tests.test_config_corpus:enrich"'
        if kind == "python"
        else 'service = "recommender"\npath = "/top"'
    )
    config = loads_config(
        BASE
        + f"""
[pipes.recommend]
{spec}
optional = true
fallback = {{ recs = [] }}

[routes.page]
path = "/page"
chain = ["load", "recommend"]
"""
    )
    pipe = build_registry(config, config.backends()).pipes["recommend"]
    assert isinstance(pipe, pw.Pipe)
    assert pipe.optional
    assert pipe.fallback_state() == {"recs": []}
