"""The resilience keys of ``[services.NAME]`` in the gateway file -- ``hosts``, ``balance``
and the ``health``, ``outlier``, ``breaker``, ``retry`` and ``hedge`` tables: read into the
service's specs, every problem reported with its key path, every key in the reference."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipework import (
    BreakerSpec,
    ConfigError,
    GatewayConfig,
    HealthSpec,
    HedgeSpec,
    HostSpec,
    OutlierSpec,
    RetrySpec,
    config_from_dict,
    loads_config,
)
from pipework.backends._resilience_spec import BREAKER_OFF, CONNECT_RETRY, OUTLIER_OFF
from pipework.registry._config_resilience import (
    BREAKER_KEYS,
    HEALTH_KEYS,
    HEDGE_KEYS,
    HOST_KEYS,
    OUTLIER_KEYS,
    RESILIENCE_KEYS,
    RETRY_KEYS,
)
from pipework.registry._config_sections import SERVICE_KEYS

from .test_config_fuzz import values

DOCS = Path(__file__).parent.parent / "docs"

FULL = """
[services.search]
hosts = [
  "http://search-a.internal:8001/api",
  { url = "http://search-b.internal:8002/api", weight = 3 },
]
balance = "random"

[services.search.health]
path = "/health"
interval = 10
expected_statuses = [200, "3xx"]

[services.search.outlier]
consecutive_gateway_failure = 3
max_ejection_percent = 34

[services.search.breaker]
wait = 30

[services.search.retry]
attempts = 4
statuses = [429, "5xx"]
min_retries_per_second = 0.5
budget_window = 30
per_try_timeout = 0.5
idempotent_only = false

[services.search.hedge]
delay = "p95"
"""


def load(text: str) -> GatewayConfig:
    return loads_config(text)


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as raised:
        loads_config(text)
    return [str(p) for p in raised.value.problems]


def test_every_setting_is_read_into_the_services_specs() -> None:
    search = load(FULL).services["search"]
    assert search.hosts == (
        HostSpec("http://search-a.internal:8001/api"),
        HostSpec("http://search-b.internal:8002/api", 3),
    )
    assert search.base_url == ""
    assert str(search.url) == "http://search-a.internal:8001/api"
    assert search.balance == "random"
    assert search.health == HealthSpec(
        "/health", interval=10, expected_statuses=frozenset({200, *range(300, 400)})
    )
    assert search.outlier == OutlierSpec(consecutive_gateway_failure=3, max_ejection_percent=34)
    assert search.breaker == BreakerSpec(wait=30)
    assert search.retry == RetrySpec(
        attempts=4,
        statuses=frozenset({429, *range(500, 600)}),
        min_retries_per_second=0.5,
        budget_window=30,
        per_try_timeout=0.5,
        idempotent_only=False,
    )
    assert search.hedge == HedgeSpec("p95")
    core = search.resilience
    assert [h.weight for h in core.hosts] == [1, 3]


def test_a_base_url_is_one_host_and_behaves_as_before_hosts_existed() -> None:
    users = load('[services.users]\nbase_url = "http://users.internal"\n').services["users"]
    assert users.endpoints == (HostSpec("http://users.internal"),)
    assert users.hosts == ()
    assert (users.balance, users.health, users.hedge) == ("p2c", None, None)
    assert (users.outlier, users.breaker, users.retry) == (None, None, None)
    # What the core runs with: no breaker, a failed connection retried once and nothing
    # else, and no ejection of the one host (there is nowhere else to go).
    core = users.resilience
    assert core.breaker == BREAKER_OFF
    assert not core.breaker.enabled
    assert core.retry == CONNECT_RETRY
    assert (core.retry.attempts, core.retry.statuses, core.retry.connect_only) == (
        2,
        frozenset(),
        True,
    )
    assert core.outlier == OUTLIER_OFF
    assert (core.hedge, core.health) == (None, None)


def test_several_hosts_without_tables_eject_outliers_and_nothing_more() -> None:
    two = load('[services.s]\nhosts = ["http://a", "http://b"]\n').services["s"].resilience
    assert two.outlier == OutlierSpec()  # Envoy's defaults: somewhere else to go
    assert (two.breaker, two.retry) == (BREAKER_OFF, CONNECT_RETRY)


def test_an_empty_table_turns_its_mechanism_on_with_envoys_defaults() -> None:
    text = S + "[services.s.breaker]\n[services.s.retry]\n[services.s.outlier]\n"
    s = load(text).services["s"]
    assert (s.breaker, s.retry, s.outlier) == (BreakerSpec(), RetrySpec(), OutlierSpec())
    core = s.resilience
    assert (core.breaker, core.retry, core.outlier) == (BreakerSpec(), RetrySpec(), OutlierSpec())
    assert core.breaker.enabled
    assert core.retry.statuses == frozenset({502, 503, 504})


def test_a_hedge_delay_in_seconds() -> None:
    text = '[services.s]\nhosts = ["http://a", "http://b"]\nhedge = { delay = 0.2 }\n'
    assert load(text).services["s"].hedge == HedgeSpec(0.2, 1)


S = '[services.s]\nbase_url = "http://s"\n'
TWO = '[services.s]\nhosts = ["http://a", "http://b"]\n'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '[services.s]\nbase_url = "http://a"\nhosts = ["http://b"]\n',
            "services.s.hosts: set base_url (one host) or hosts, not both",
        ),
        (
            "[services.s]\ntimeout = 1\n",
            "services.s.base_url: required key is missing: set base_url, or hosts for several",
        ),
        ("[services.s]\nhosts = []\n", "services.s.hosts: expected a non-empty array of hosts"),
        ('[services.s]\nhosts = "http://a"\n', "services.s.hosts: expected a non-empty array"),
        ("[services.s]\nhosts = [3]\n", "services.s.hosts[0]: expected a URL or a table"),
        (
            '[services.s]\nhosts = ["http://a", "ftp://b"]\n',
            "services.s.hosts[1]: 'ftp://b' must start with http:// or https://",
        ),
        (
            '[services.s]\nhosts = [{ url = "http://a", wieght = 2 }]\n',
            "services.s.hosts[0].wieght: unknown key; did you mean 'weight'?",
        ),
        (
            '[services.s]\nhosts = [{ url = "http://a", weight = 0 }]\n',
            "services.s.hosts[0].weight: must be at least 1, got 0",
        ),
        (
            '[services.s]\nhosts = [{ url = "http://a", weight = 5000 }]\n',
            "services.s.hosts[0].weight: must be at most 1000, got 5000",
        ),
        (
            '[services.s]\nhosts = [{ url = "http://a", weight = "2" }]\n',
            'services.s.hosts[0].weight: expected an integer, got a string ("2")',
        ),
        ("[services.s]\nhosts = [{ weight = 2 }]\n", "services.s.hosts[0].url: required key"),
        (
            '[services.s]\nhosts = ["http://a", { url = "http://a" }]\n',
            "services.s.hosts[1].url: 'http://a' is listed twice (also hosts[0])",
        ),
        (
            '[services.s]\nhosts = ["http://a/v1", "http://b/v2"]\n',
            "services.s.hosts: hosts 'http://a/v1' and 'http://b/v2' differ in path",
        ),
        (
            '[services.s]\nhosts = ["http://a", "https://b"]\n',
            "services.s.hosts: hosts 'http://a' and 'https://b' differ in scheme",
        ),
        (S + 'balance = "p2"\n', "services.s.balance: unknown value 'p2'; did you mean 'p2c'?"),
        (S + "balance = 2\n", "services.s.balance: expected a string, got an integer (2)"),
        (S + "health = 3\n", "services.s.health: expected a table, got an integer (3)"),
        (S + "[services.s.health]\ninterval = 2\n", "services.s.health.path: required key"),
        (
            S + '[services.s.health]\npath = "health"\n',
            "services.s.health.path: must start with '/', got 'health'",
        ),
        (
            S + '[services.s.health]\npath = "/h"\nintervl = 2\n',
            "services.s.health.intervl: unknown key; did you mean 'interval'?",
        ),
        (
            S + '[services.s.health]\npath = "/h"\ntimeout = 10\n',
            "services.s.health.timeout: 10 s is longer than the interval (5 s)",
        ),
        (
            S + '[services.s.health]\npath = "/h"\nhealthy_threshold = 0\n',
            "services.s.health.healthy_threshold: must be at least 1, got 0",
        ),
        (
            S + '[services.s.health]\npath = "/h"\nexpected_statuses = ["6xx"]\n',
            "services.s.health.expected_statuses[0]: expected a status from 100 to 599",
        ),
        (
            S + '[services.s.health]\npath = "/h"\nexpected_statuses = []\n',
            "services.s.health.expected_statuses: expected a non-empty array of statuses",
        ),
        (
            S + "[services.s.outlier]\nconsecutive_5xx = -1\n",
            "services.s.outlier.consecutive_5xx: must be at least 0, got -1",
        ),
        (
            S + "[services.s.outlier]\nmax_ejection_percent = 150\n",
            "services.s.outlier.max_ejection_percent: must be at most 100 (a percentage), got 150",
        ),
        (
            S + "[services.s.outlier]\nbase_ejection_time = 60\nmax_ejection_time = 30\n",
            "services.s.outlier.max_ejection_time: must be at least base_ejection_time (60 s)",
        ),
        (
            S + "[services.s.outlier]\nconsecutive_errors = 3\n",
            "services.s.outlier.consecutive_errors: unknown key; did you mean",
        ),
        (
            S + "[services.s.breaker]\nfailure_percent = 0\n",
            "services.s.breaker.failure_percent: must be above 0, got 0",
        ),
        (
            S + '[services.s.breaker]\nenabled = "yes"\n',
            'services.s.breaker.enabled: expected a boolean, got a string ("yes")',
        ),
        (
            S + "[services.s.breaker]\nhalf_open_calls = 0\n",
            "services.s.breaker.half_open_calls: must be at least 1, got 0",
        ),
        (
            S + "[services.s.breaker]\nwait = -1\n",
            "services.s.breaker.wait: must be above 0, got -1",
        ),
        (
            S + "[services.s.retry]\nattempts = 0\n",
            "services.s.retry.attempts: must be at least 1, got 0",
        ),
        (
            S + '[services.s.retry]\nstatuses = [503, "x"]\n',
            'services.s.retry.statuses[1]: expected a status from 100 to 599 or a class like "5xx"',
        ),
        (
            S + "[services.s.retry]\nbackoff_base = 1\nbackoff_max = 0.5\n",
            "services.s.retry.backoff_max: must be at least backoff_base (1 s), got 0.5",
        ),
        (
            S + "[services.s.retry]\nbudget_percent = 120\n",
            "services.s.retry.budget_percent: must be at most 100 (a percentage), got 120",
        ),
        (
            S + "[services.s.retry]\nmin_retries_per_second = -1\n",
            "services.s.retry.min_retries_per_second: must be 0 or more, got -1",
        ),
        (
            S + '[services.s.retry]\nmin_retries_per_second = "many"\n',
            "services.s.retry.min_retries_per_second: expected a number",
        ),
        (
            S + "[services.s.retry]\nbudget_window = 0\n",
            "services.s.retry.budget_window: must be above 0, got 0",
        ),
        (
            S + "[services.s.retry]\nidempotent_onyl = false\n",
            "services.s.retry.idempotent_onyl: unknown key; did you mean 'idempotent_only'?",
        ),
        (
            TWO + '[services.s.hedge]\ndelay = "p99"\n',
            "services.s.hedge.delay: expected a number of seconds or \"p95\", got 'p99'",
        ),
        (TWO + "[services.s.hedge]\ndelay = -1\n", "services.s.hedge.delay: must be above 0"),
        (
            TWO + "[services.s.hedge]\nmax_extra = 0\n",
            "services.s.hedge.max_extra: must be at least 1, got 0",
        ),
    ],
)
def test_problems_are_reported_with_their_key_path(text: str, message: str) -> None:
    found = problems(text)
    assert any(message in p for p in found), found


def test_every_problem_is_reported_at_once() -> None:
    text = (
        '[services.s]\nhosts = [{ url = "http://a", weight = 0 }, 7]\n'
        "[services.s.retry]\nattempts = 0\n[services.s.breaker]\nwait = 0\n"
    )
    found = problems(text)
    for where in ("hosts[0].weight", "hosts[1]", "retry.attempts", "breaker.wait"):
        assert any(f"services.s.{where}:" in p for p in found), (where, found)


def test_settings_that_do_nothing_are_warned_about() -> None:
    one = load(S + "[services.s.hedge]\ndelay = 0.1\n")
    assert any("services.s.hedge" in str(w) and "never hedge" in str(w) for w in one.warnings)
    slow = load(S + "timeout = 2\n[services.s.retry]\nper_try_timeout = 3\n")
    assert any(
        "services.s.retry.per_try_timeout" in str(w) and "not below the service's timeout" in str(w)
        for w in slow.warnings
    )


def test_a_problem_in_a_hosts_table_is_on_its_line() -> None:
    text = '[services.s]\nhosts = [\n  "http://a",\n  { url = "http://b", weight = 0 },\n]\n'
    with pytest.raises(ConfigError) as raised:
        loads_config(text)
    (problem,) = raised.value.errors
    assert (problem.path, problem.line) == ("services.s.hosts[1].weight", 4)


# -- the reference names every key --------------------------------------------------------


def test_the_configuration_reference_names_every_service_key() -> None:
    text = (DOCS / "configuration.md").read_text(encoding="utf-8")
    start = text.index("## `[services.NAME]`")
    section = text[start : text.index("\n## ", start + 1)]
    documented = set(re.findall(r"^\| `(\w+)` \|", section, re.MULTILINE))
    tables = {
        "": SERVICE_KEYS,
        "hosts": HOST_KEYS,
        "health": HEALTH_KEYS,
        "outlier": OUTLIER_KEYS,
        "breaker": BREAKER_KEYS,
        "retry": RETRY_KEYS,
        "hedge": HEDGE_KEYS,
    }
    for table, keys in tables.items():
        if table:
            heading = "`hosts` entries" if table == "hosts" else f"`[services.NAME.{table}]`"
            assert heading in section, heading
            block = section[section.index(heading) :]
            block = block[: block.find("\n### ", 1) if "\n### " in block[1:] else len(block)]
            rows = set(re.findall(r"^\| `(\w+)` \|", block, re.MULTILINE))
        else:
            rows = documented
        missing = [k for k in keys if k not in rows]
        assert not missing, f"{table or 'services.NAME'}: undocumented keys {missing}"


def test_resilience_is_described_in_its_own_page() -> None:
    text = (DOCS / "resilience.md").read_text(encoding="utf-8")
    for key in RESILIENCE_KEYS:
        assert f"`{key}`" in text or f"`[services.NAME.{key}]`" in text, key
    assert "weighted-pool.md" in text


# -- whatever the values, loading never crashes ---------------------------------------------


def tables(keys: tuple[str, ...]) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(st.sampled_from(keys), values, max_size=len(keys))


urls = st.sampled_from(["http://d", "http://e"])
service = st.fixed_dictionaries(
    {},
    optional={
        "base_url": st.sampled_from(["http://a", "https://b/x"]) | values,
        "hosts": st.lists(
            st.sampled_from(["http://a", "http://b", "http://c/x"])
            | tables(HOST_KEYS)
            | st.fixed_dictionaries({"url": urls}, optional={"weight": values})
            | values,
            max_size=4,
        )
        | values,
        "balance": st.sampled_from(["p2c", "round_robin", "random", "p2"]) | values,
        "timeout": values,
        "health": tables(HEALTH_KEYS) | values,
        "outlier": tables(OUTLIER_KEYS) | values,
        "breaker": tables(BREAKER_KEYS) | values,
        "retry": tables(RETRY_KEYS) | values,
        "hedge": tables(HEDGE_KEYS) | values,
    },
)


@settings(max_examples=150)
@given(service)
def test_any_resilience_settings_load_or_raise_config_error(spec: dict[str, Any]) -> None:
    try:
        config = config_from_dict({"services": {"s": spec}})
    except ConfigError as exc:
        errors = exc.errors
    else:
        assert config.services["s"].resilience.hosts
        return
    assert errors
