"""Proxy routes in the gateway file (``[routes.NAME]`` with ``proxy``) and ``[server]
trusted_proxies``: read into checked objects, every problem named by its key path."""

from __future__ import annotations

from ipaddress import ip_network
from pathlib import Path

import pytest

import pipework as pw
from pipework import ConfigError, build_registry, load_config, loads_config
from pipework._cli_config import check
from pipework.proxy._route import ProxyRoute, ProxyTable

CONFIGS = Path(__file__).parent / "configs"

MIXED = """
[server]
trusted_proxies = ["10.0.0.0/8", "127.0.0.1", "fd00::/8"]

[services.users]
base_url = "http://users.internal"

[services.legacy]
base_url = "http://legacy.internal:8080"

[pipes.auth]
python = "tests.test_config_corpus:enrich"

[pipes.stamp]
python = "tests.test_config_corpus:enrich"

[pipes.get_user]
service = "users"
path = "/users/{id}"

[routes.user]
method = "GET"
path = "/users/{id}"
chain = ["get_user"]

[routes.legacy]
proxy = "legacy"
prefix = "/legacy/"
methods = ["get", "POST", "PROPFIND"]
rewrite = "/v2"
host = "keep"
key = "slow"
timeout = 120
connect_timeout = 1.5
first_byte_timeout = 10
idle_timeout = 30
max_body = 1048576
chain = ["auth"]
after = [["stamp"]]
websocket = false

[routes.everything]
proxy = "legacy"
prefix = "/static"
strip_prefix = true
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


def test_a_file_mixes_chain_routes_and_proxy_routes() -> None:
    config = loads_config(MIXED)
    assert list(config.routes) == ["user"]
    assert list(config.proxies) == ["legacy", "everything"]
    legacy = config.proxies["legacy"].route
    assert legacy == ProxyRoute(
        "legacy",
        "legacy",
        "/legacy",
        methods=frozenset({"GET", "HEAD", "POST", "PROPFIND"}),
        rewrite="/v2",
        host="keep",
        key="slow",
        timeout=120,
        connect_timeout=1.5,
        first_byte_timeout=10,
        idle_timeout=30,
        max_body=1048576,
        chain="legacy",
        after="legacy.after",
        websocket=False,
    )
    assert legacy.pool_key == "slow"
    assert config.proxies["legacy"].pipes == ("auth", "stamp")
    everything = config.proxies["everything"].route
    assert (everything.prefix, everything.strip_prefix, everything.methods) == (
        "/static",
        True,
        None,
    )
    assert (everything.chain, everything.after, everything.websocket) == (None, None, True)
    assert (everything.host, everything.pool_key) == ("service", "legacy")
    assert config.warnings == ()  # legacy is used, and so are auth and stamp
    assert config.server.trusted_proxies == (
        ip_network("10.0.0.0/8"),
        ip_network("127.0.0.1/32"),
        ip_network("fd00::/8"),
    )
    assert 120 in config.timeouts()
    assert config.summary()["proxy_routes"] == 2
    ProxyTable(p.route for p in config.proxies.values())  # they go in one table


def test_a_proxy_route_s_chains_are_registered_before_and_after() -> None:
    config = loads_config(MIXED)
    registry = build_registry(config, config.backends())
    assert set(registry.routes) == {"user"}  # a proxy route is no chain route
    before, after = registry.get_chain("legacy"), registry.get_chain("legacy.after")
    assert [getattr(p, "name", None) for p in before.root.children] == ["auth"]
    assert before.key == after.key == "default"
    assert "everything" not in registry.chains
    assert "everything.after" not in registry.chains


def test_methods_star_means_any() -> None:
    config = loads_config(
        '[services.s]\nbase_url = "http://s"\n'
        '[routes.p]\nproxy = "s"\nprefix = "/"\nmethods = "*"\n'
    )
    assert config.proxies["p"].route.methods is None
    assert config.proxies["p"].route.prefix == "/"


def test_no_trusted_proxies_by_default() -> None:
    assert loads_config("").server.trusted_proxies == ()


SERVICE = '[services.users]\nbase_url = "http://users.internal"\n'
PIPE = '[pipes.auth]\npython = "tests.test_config_corpus:enrich"\n'


def proxy(body: str) -> str:
    return SERVICE + PIPE + '[routes.p]\nproxy = "users"\nprefix = "/api"\n' + body


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        pytest.param(
            proxy("prefx = 1"),
            "error: routes.p.prefx: unknown key; did you mean 'prefix'?",
            id="unknown-key-close",
        ),
        pytest.param(
            proxy("flavour = 1"),
            "error: routes.p.flavour: unknown key; a proxy route takes proxy, prefix, methods, "
            "strip_prefix, rewrite, host, key, timeout, connect_timeout, first_byte_timeout, "
            "idle_timeout, max_body, chain, after, websocket, auth, scopes, cors, rate_limits",
            id="unknown-key",
        ),
        pytest.param(
            SERVICE + '[routes.p]\nproxy = "user"\nprefix = "/api"',
            "error: routes.p.proxy: unknown service 'user'; did you mean 'users'?",
            id="unknown-service",
        ),
        pytest.param(
            '[routes.p]\nproxy = "users"\nprefix = "/api"',
            "error: routes.p.proxy: unknown service 'users'; declared: none",
            id="no-services",
        ),
        pytest.param(
            SERVICE + "[routes.p]\nproxy = 3\nprefix = '/api'",
            "error: routes.p.proxy: expected a string, got an integer (3)",
            id="service-type",
        ),
        pytest.param(
            SERVICE + '[routes.p]\nproxy = "users"',
            "error: routes.p.prefix: required key is missing",
            id="no-prefix",
        ),
        pytest.param(
            SERVICE + '[routes.p]\nproxy = "users"\nprefix = "api"',
            "error: routes.p.prefix: prefix 'api' must start with '/'",
            id="relative-prefix",
        ),
        pytest.param(
            SERVICE + '[routes.p]\nproxy = "users"\nprefix = "/jobs/x"',
            "error: routes.p.prefix: prefix '/jobs/x' is under /jobs, which the container "
            "serves itself",
            id="reserved",
        ),
        pytest.param(
            SERVICE + '[routes.p]\nproxy = "users"\nprefix = "/boards"',
            "error: routes.p.prefix: prefix '/boards' is under /boards, which the container "
            "serves itself",
            id="boards",
        ),
        pytest.param(
            SERVICE + '[routes.p]\nproxy = "users"\nprefix = "/ui/"',
            "error: routes.p.prefix: prefix '/ui/' is under /ui, which the container serves itself",
            id="ui",
        ),
        pytest.param(
            SERVICE + '[routes.p]\nproxy = "users"\nprefix = "/a%20b"',
            "error: routes.p.prefix: prefix '/a%20b' may hold only the characters of a URL "
            "path, unencoded (it is matched against the decoded path)",
            id="encoded-prefix",
        ),
        pytest.param(
            proxy('path = "/api"'),
            "error: routes.p.path: a chain route's key, not a proxy route's: a proxy route "
            'matches prefix = "/..."',
            id="path-on-proxy",
        ),
        pytest.param(
            proxy('method = "GET"'),
            "error: routes.p.method: a chain route's key, not a proxy route's: a proxy route "
            'takes methods = [...] (or "*", any)',
            id="method-on-proxy",
        ),
        pytest.param(
            proxy('mode = "async"'),
            "error: routes.p.mode: a chain route's key, not a proxy route's: a proxy route "
            "relays the answer as it comes",
            id="mode-on-proxy",
        ),
        pytest.param(
            proxy('methods = "GET"'),
            'error: routes.p.methods: expected an array of method names or "*" (any), got a '
            'string ("GET")',
            id="methods-string",
        ),
        pytest.param(
            proxy("methods = []"),
            'error: routes.p.methods: must name at least one method (or be "*", any)',
            id="methods-empty",
        ),
        pytest.param(
            proxy('methods = ["GET", "BAD METHOD"]'),
            "error: routes.p.methods[1]: 'BAD METHOD' is not an HTTP method name (a token, "
            "as PROPFIND)",
            id="methods-token",
        ),
        pytest.param(
            proxy('methods = ["GET", 7]'),
            "error: routes.p.methods[1]: expected a method name, got an integer (7)",
            id="methods-type",
        ),
        pytest.param(
            proxy('methods = ["GET", "get"]'),
            "error: routes.p.methods[1]: GET is listed twice",
            id="methods-twice",
        ),
        pytest.param(
            proxy('strip_prefix = true\nrewrite = "/v2"'),
            "error: routes.p.rewrite: strip_prefix and rewrite both replace the prefix; set one "
            "of them",
            id="strip-and-rewrite",
        ),
        pytest.param(
            proxy('rewrite = "v2"'),
            "error: routes.p.rewrite: rewrite 'v2' must start with '/'",
            id="rewrite-relative",
        ),
        pytest.param(
            proxy('strip_prefix = "yes"'),
            'error: routes.p.strip_prefix: expected a boolean, got a string ("yes")',
            id="strip-type",
        ),
        pytest.param(
            proxy('host = "client"'),
            "error: routes.p.host: unknown value 'client'; expected one of: service, keep",
            id="host",
        ),
        pytest.param(
            proxy("timeout = 0"),
            "error: routes.p.timeout: must be above 0, got 0",
            id="timeout",
        ),
        pytest.param(
            proxy('idle_timeout = "30s"'),
            'error: routes.p.idle_timeout: expected a number, got a string ("30s")',
            id="idle-type",
        ),
        pytest.param(
            proxy("first_byte_timeout = -1"),
            "error: routes.p.first_byte_timeout: must be above 0, got -1",
            id="first-byte",
        ),
        pytest.param(
            proxy("connect_timeout = true"),
            "error: routes.p.connect_timeout: expected a number, got a boolean (true)",
            id="connect-type",
        ),
        pytest.param(
            proxy("max_body = -1"),
            "error: routes.p.max_body: must be at least 0, got -1",
            id="max-body",
        ),
        pytest.param(
            proxy('websocket = "no"'),
            'error: routes.p.websocket: expected a boolean, got a string ("no")',
            id="websocket",
        ),
        pytest.param(
            proxy('key = ""'),
            "error: routes.p.key: must not be empty",
            id="key",
        ),
        pytest.param(
            proxy('chain = ["auht"]'),
            "error: routes.p.chain[0]: unknown pipe 'auht'; did you mean 'auth'?",
            id="chain-pipe",
        ),
        pytest.param(
            proxy('after = "auth"'),
            'error: routes.p.after: expected an array of pipes and stages, got a string ("auth")',
            id="after-type",
        ),
        pytest.param(
            proxy("after = []"),
            "error: routes.p.after: must name at least one pipe or stage",
            id="after-empty",
        ),
        pytest.param(
            SERVICE + '[routes."p q"]\nproxy = "users"\nprefix = "/api"',
            "error: routes.\"p q\": route name 'p q' may use only letters, digits, '_' and '-'",
            id="name",
        ),
        pytest.param(
            SERVICE + PIPE + '[routes.c]\npath = "/c"\nchain = ["auth"]\nprefix = "/c"',
            "error: routes.c.prefix: a proxy route's key, not a chain route's: add proxy = "
            '"SERVICE" to pass this route\'s requests through to a service',
            id="proxy-key-on-chain-route",
        ),
        pytest.param(
            SERVICE + PIPE + '[routes.c]\npath = "/c"\nchain = ["auth"]\npreffix = "/c"',
            "error: routes.c.preffix: unknown key; did you mean 'prefix'?",
            id="close-to-a-proxy-key",
        ),
        pytest.param(
            SERVICE + PIPE + '[routes.c]\npath = "/c"\nchain = ["auth"]\nflavour = 1',
            "error: routes.c.flavour: unknown key; expected one of: auth, body, chain, cors, key, "
            "max_body, method, mode, on_disconnect, path, pool_key, rate_limits, result, scopes, "
            "sync_wait, timeout",
            id="chain-route-hint-unchanged",
        ),
    ],
)
def test_each_problem_is_reported_with_its_key_path(text: str, problem: str) -> None:
    assert problem in problems(text)


def test_proxy_routes_one_method_could_reach_under_one_prefix_clash() -> None:
    text = (
        SERVICE
        + '[routes.a]\nproxy = "users"\nprefix = "/api"\nmethods = ["GET"]\n'
        + '[routes.b]\nproxy = "users"\nprefix = "/api/"\nmethods = ["POST", "HEAD"]\n'
        + '[routes.c]\nproxy = "users"\nprefix = "/api"\nmethods = ["PUT"]\n'
    )
    assert problems(text) == [
        "error: routes.b.prefix: proxy route 'b' clashes with proxy route 'a': both take "
        "HEAD under /api"
    ]


def test_a_chain_route_under_a_proxy_prefix_is_reported() -> None:
    text = (
        SERVICE
        + PIPE
        + '[routes.orders]\npath = "/api/orders/{id}"\nchain = ["auth"]\n'
        + '[routes.anything]\nmethod = "GET"\npath = "/{section}/x"\nchain = ["auth"]\n'
        + '[routes.elsewhere]\npath = "/apix"\nchain = ["auth"]\n'
        + '[routes.api]\nproxy = "users"\nprefix = "/api"\nmethods = ["GET"]\n'
    )
    assert problems(text) == [
        "error: routes.api.prefix: covers route 'orders' (POST /api/orders/{id}): every "
        "request to it would be proxied, so it would never run; move one of them",
        "warning: routes.api.prefix: covers some paths of route 'anything' (GET "
        "/{section}/x): those under /api are proxied instead",
    ]


def test_a_service_only_a_proxy_route_calls_is_not_warned_about() -> None:
    text = SERVICE + '[services.other]\nbase_url = "http://o"\n'
    text += '[routes.p]\nproxy = "users"\nprefix = "/p"\nkey = "other"\n'
    assert problems(text) == []


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        pytest.param(
            'trusted_proxies = "10.0.0.0/8"',
            "error: server.trusted_proxies: expected an array of addresses and CIDR blocks, "
            'got a string ("10.0.0.0/8")',
            id="type",
        ),
        pytest.param(
            'trusted_proxies = ["127.0.0.1", 10]',
            "error: server.trusted_proxies[1]: expected an address or CIDR block, got an "
            "integer (10)",
            id="item-type",
        ),
        pytest.param(
            'trusted_proxies = ["localhost"]',
            "error: server.trusted_proxies[0]: 'localhost' is not an IP address or CIDR block",
            id="name",
        ),
        pytest.param(
            'trusted_proxies = ["10.1.2.3/8"]',
            "error: server.trusted_proxies[0]: '10.1.2.3/8' is not an IP address or CIDR "
            "block: it has bits set past the /8; write '10.0.0.0/8'",
            id="host-bits",
        ),
        pytest.param(
            'trusted_proxies = ["::/0"]',
            "warning: server.trusted_proxies[0]: ::/0 trusts every address: any client can "
            "then set the client address a backend sees (X-Forwarded-For, Forwarded)",
            id="everyone",
        ),
        pytest.param(
            'trusted_proxy = ["127.0.0.1"]',
            "error: server.trusted_proxy: unknown key; did you mean 'trusted_proxies'?",
            id="unknown-key",
        ),
    ],
)
def test_trusted_proxy_problems_are_reported_with_their_key_path(text: str, problem: str) -> None:
    assert problem in problems("[server]\n" + text + "\n")


def test_check_reports_proxy_route_problems(capsys: pytest.CaptureFixture[str]) -> None:
    path = CONFIGS / "invalid" / "proxy_routes.toml"
    assert check(path) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert f"{path}:20: error: routes.clash.prefix: proxy route 'clash' clashes" in err
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert len(err.splitlines()) == len(info.value.problems) + 1


def test_check_counts_proxy_routes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(MIXED, encoding="utf-8")
    assert check(path) == 0
    out = capsys.readouterr().out
    assert (
        out
        == f"{path}: valid: 2 services, 3 pipes, 1 route, 2 proxy routes; 64 workers (0 reserved)\n"
    )


def test_proxy_routes_are_registration_errors_in_python_too() -> None:
    with pytest.raises(pw.RegistrationError):
        ProxyRoute("p", "s", "/metrics")


def test_the_full_reference_file_holds_proxy_routes() -> None:
    config = load_config(CONFIGS / "valid" / "full.toml")
    legacy, assets = config.proxies["legacy"].route, config.proxies["assets"].route
    assert (legacy.prefix, legacy.rewrite, legacy.host, legacy.pool_key) == (
        "/legacy",
        "/v1",
        "keep",
        "enrich",
    )
    assert (legacy.chain, legacy.after, legacy.websocket) == ("legacy", "legacy.after", False)
    assert (assets.methods, assets.strip_prefix) == (None, True)
    registry = build_registry(config, config.backends())
    assert registry.get_chain("legacy.after").root.children[0] == registry.pipes["render"]
    assert config.server.trusted_proxies[1] == ip_network("127.0.0.1/32")
