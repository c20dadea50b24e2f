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


# -- a branch of several pipes -------------------------------------------------------------------

BRANCH_PIPES = """
[services.recommender]
base_url = "http://recommender.internal"

[pipes.load]
python = "tests.test_config_corpus:enrich"

[pipes.recommend]
service = "recommender"
path = "/top"

[pipes.rank]
python = "tests.test_config_corpus:enrich"
"""


RECS_NODE = 'recs = { chain = ["recommend", "rank"], after = ["first"], optional = true }'


def test_a_serial_branch_of_a_parallel_stage_and_a_graph_nodes_chain_take_the_marks() -> None:
    config = loads_config(
        BRANCH_PIPES
        + """
[routes.page]
path = "/page"
chain = [
  "load",
  { all_of = [
      "load",
      { serial = ["recommend", "rank"], fallback = { recs = [] }, timeout = 0.5 },
      { serial = ["rank", "recommend"], optional = true, name = "ranked" },
  ] },
  { graph = { first = { pipe = "load" }, """
        + RECS_NODE
        + """ } },
]
"""
    )
    assert config.warnings == ()
    root = config.routes["page"].chain
    stage, grid = root.items[1], root.items[2]
    assert isinstance(stage, pw.Parallel)
    assert isinstance(grid, pw.Parallel)
    assert stage.names == ("load", "recommend+rank", "ranked")
    marked = stage.branches[1]
    assert marked.fallback == {"recs": []}
    assert marked.timeout == 0.5
    assert not marked.optional
    assert stage.branches[2].optional
    assert grid.names == ("first", "recs")
    assert grid.branches[1].optional
    assert grid.branches[1].name == "recs"


def test_every_bad_branch_mark_is_reported_at_its_key_path() -> None:
    found = problems(
        BRANCH_PIPES
        + """
[routes.page]
path = "/page"
chain = [
  "load",
  { serial = ["recommend", "rank"], optional = true },
  { all_of = [
      { serial = ["recommend", "rank"], optional = "yes" },
      { serial = ["recommend", "rank"], fallback = "rank" },
      { serial = ["recommend", "rank"], fallback = { degraded = 1 } },
      { serial = ["recommend", "rank"], name = "recs" },
      { all_of = ["recommend", "rank"], optional = true },
  ] },
  { graph = { a = { pipe = "load", optional = true } } },
]
"""
    )
    assert found == [
        "error: routes.page.chain[1].optional: only a branch of an all_of, any_of or quorum "
        "stage (or a graph node's chain) can be marked; here its chain needs it: mark the "
        "pipes it can do without",
        'error: routes.page.chain[2].all_of[0].optional: expected a boolean, got a string ("yes")',
        "error: routes.page.chain[2].all_of[1].fallback: expected a table (the state to set in "
        'the branch\'s place), got a string ("rank"); a fallback pipe is for a pipe, not a '
        "branch",
        "error: routes.page.chain[2].all_of[2].fallback.degraded: 'degraded' is where the "
        "engine records what it degraded; use another key",
        "error: routes.page.chain[2].all_of[3]: a branch with a name must also be marked: set "
        "optional = true or a fallback table (the state it sets in its place)",
        "error: routes.page.chain[2].all_of[4].optional: marks a branch of several pipes, not "
        "the all_of stage: write the branch as {serial = [...], optional = ...}",
        "error: routes.page.chain[3].graph.a.optional: marks a node's chain; a node's single "
        "pipe is marked on the pipe, under [pipes]",
    ]
