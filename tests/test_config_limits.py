"""``[rate_limits]`` in the gateway file: what it declares, and every problem with its key
path, as ``pipework check`` reports them."""

from __future__ import annotations

import pytest

from pipework import ConfigError, loads_config
from pipework._http._ratelimit_core import Rate

SERVICE = """
[services.api]
base_url = "http://api.internal"

[pipes.call]
service = "api"
path = "/x"
"""
ROUTES = """
[routes.go]
method = "GET"
path = "/go"
chain = ["call"]
rate_limits = ["per-client"]

[routes.px]
proxy = "api"
prefix = "/api"
"""
FORMS = '"client", "header:NAME", "identity" or "claim:NAME"'
OWN = "(store, url, url_env, prefix, timeout, fail_open)"
TO_Y = '\n[routes.y]\nproxy = "api"\nprefix = "/y"\nrate_limits = "x"'
LIMIT = """
[rate_limits.per-client]
rate = 10
burst = 3
"""


def problems(text: str) -> list[str]:
    try:
        config = loads_config(text)
    except ConfigError as exc:
        return [f"{p.severity}: {p.path}: {p.message}" for p in exc.problems]
    return [f"{p.severity}: {p.path}: {p.message}" for p in config.warnings]


def test_a_limit_and_the_routes_that_meet_it() -> None:
    text = (
        SERVICE.replace(
            'base_url = "http://api.internal"',
            'base_url = "http://api.internal"\nrate_limits = "per-key"',
        )
        + ROUTES
        + LIMIT
        + """
[rate_limits.per-key]
rate = 1
period = 60
key = "header:X-Api-Key"
missing = "shared"
max_keys = 50
"""
    )
    config = loads_config(text)
    limits = config.rate_limits.limits
    assert limits["per-client"].rate == Rate(10, 1.0, 3)
    assert limits["per-client"].key == "client"
    assert limits["per-key"].rate == Rate(1, 60.0, 1)  # burst: the rate
    assert (limits["per-key"].argument, limits["per-key"].missing) == ("x-api-key", "shared")
    # Its own first, then its service's; the proxy route meets its service's alone.
    assert dict(config.limited_routes) == {"go": ("per-client", "per-key"), "px": ("per-key",)}
    assert config.rate_limits.store == "memory"


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        (
            "[rate_limits.x]\nrate = 0" + TO_Y,
            "error: rate_limits.x.rate: must be at least 1, got 0",
        ),
        (
            "[rate_limits.x]\nburst = 2" + TO_Y,
            "error: rate_limits.x.rate: required key is missing",
        ),
        (
            '[rate_limits.x]\nrate = 1\nkey = "heder:x"',
            "error: rate_limits.x.key: unknown key 'heder:x'; did you mean 'header'? expected "
            + FORMS,
        ),
        (
            '[rate_limits.x]\nrate = 1\nkey = "claim"',
            'error: rate_limits.x.key: "claim" needs the name after a colon: "claim:NAME"',
        ),
        (
            '[rate_limits.x]\nrate = 1\nkey = "identity:sub"',
            'error: rate_limits.x.key: "identity" takes no name after it; expected ' + FORMS,
        ),
        (
            '[rate_limits.x]\nrate = 1\nkey = "header:a b"',
            "error: rate_limits.x.key: 'a b' is not an HTTP header name",
        ),
        (
            '[rate_limits.x]\nrate = 1\nmissing = "no"',
            "error: rate_limits.x.missing: unknown value 'no'; expected one of: client, shared, "
            "allow",
        ),
        (
            '[rate_limits.x]\nrate = 1\nmissing = "allow"',
            "warning: rate_limits.x.missing: a request always has a client address: used only "
            "with other keys",
        ),
        (
            "[rate_limits.x]\nrate = 2000000",
            "error: rate_limits.x.rate: 2000000 per 1s is more than one per microsecond",
        ),
        (
            "[rate_limits.x]\nrate = 1\nspeed = 2",
            "error: rate_limits.x.speed: unknown key; expected one of: burst, key, max_keys, "
            "missing, period, rate",
        ),
        (
            "[rate_limits.x]\nrate = 1",
            "warning: rate_limits.x: no route or service names this limit",
        ),
        (
            '[rate_limits]\nstore = "redis"',
            'error: rate_limits.url: store = "redis" needs url (or url_env, or sentinels) naming the server',
        ),
        (
            '[rate_limits]\nstore = "disk"',
            "error: rate_limits.store: unknown value 'disk'; did you mean 'redis'? expected one "
            "of: memory, redis",
        ),
        (
            '[rate_limits]\nfail_open = "yes"',
            'error: rate_limits.fail_open: expected a boolean, got a string ("yes")',
        ),
        ("[rate_limits]\ntimeout = 1\n[rate_limits.timeout]\nrate = 1", None),
        (
            "[rate_limits.url]\nrate = 1",
            "error: rate_limits.url: 'url' is one of [rate_limits]' own keys "
            + OWN
            + ", not a limit's name; name the limit otherwise",
        ),
        (
            "[rate_limits]\nrat = 3",
            "error: rate_limits.rat: expected a limit's table ([rate_limits.rat]) or one of "
            "[rate_limits]' own keys " + OWN,
        ),
        (
            '[rate_limits."a b"]\nrate = 1',
            "error: rate_limits.\"a b\": rate limit name 'a b' may use only letters, digits, '_' "
            "and '-'",
        ),
    ],
)
def test_each_problem_has_its_key_path(extra: str, problem: str | None) -> None:
    text = SERVICE + ROUTES + LIMIT + extra
    if problem is None:  # TOML itself refuses a key defined twice
        with pytest.raises(ConfigError):
            loads_config(text)
        return
    assert problem in problems(text)


@pytest.mark.parametrize(
    ("names", "problem"),
    [
        (
            '"per-clint"',
            "error: routes.px.rate_limits: unknown rate limit 'per-clint'; did you mean "
            "'per-client'?",
        ),
        (
            '["per-client", 3]',
            "error: routes.px.rate_limits[1]: expected a limit's name, got an integer (3)",
        ),
        (
            "3",
            "error: routes.px.rate_limits: expected a limit's name or an array of them, got an "
            "integer (3)",
        ),
        (
            '["zzz"]',
            "error: routes.px.rate_limits[0]: unknown rate limit 'zzz'; declared: per-client",
        ),
    ],
)
def test_a_route_names_declared_limits(names: str, problem: str) -> None:
    text = SERVICE + ROUTES + f"rate_limits = {names}\n" + LIMIT
    assert problem in problems(text)


def test_a_service_names_declared_limits() -> None:
    text = (
        SERVICE.replace(
            'base_url = "http://api.internal"',
            'base_url = "http://api.internal"\nrate_limits = ["nope"]',
        )
        + ROUTES
        + LIMIT
    )
    assert (
        "error: services.api.rate_limits[0]: unknown rate limit 'nope'; declared: per-client"
        in problems(text)
    )


def test_a_broken_limit_is_reported_once_where_it_is() -> None:
    text = SERVICE + ROUTES + LIMIT.replace("rate = 10", "rate = -1")
    assert [p for p in problems(text) if p.startswith("error")] == [
        "error: rate_limits.per-client.rate: must be at least 1, got -1"
    ]
