"""The ``[auth.NAME]`` and ``[cors.NAME]`` sections, the routes' ``auth``, ``scopes`` and
``cors`` keys, and ``[server] cors`` and ``jobs_auth``: who may call a route, which other
origins' pages may call it from a browser, and who lists their jobs in the download centre
(docs/edge-policy.md).

Named tables, so that routes share one: routes naming the same ``[auth.NAME]`` share its
keys (a JWKS URL is fetched once for all of them).
"""

from __future__ import annotations

import binascii
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final
from urllib.parse import urlsplit

from .._http._auth import (
    ASYMMETRIC_ALGORITHMS,
    ApiKey,
    ApiKeys,
    Authenticator,
    JwksFile,
    JwksUrl,
    JwtBearer,
    RouteAuth,
    env_key,
    sha256_hex,
)
from .._http._cors import CorsPolicy, check_origin
from ._config_problems import Collector, KeyPath, close_match, describe_value
from ._config_read import Table, check_name, open_table

__all__ = ["EDGE_ROUTE_KEYS", "EdgeConfig", "read_edge"]

#: The keys every route (chain or proxy) may hold for its edge policy.
EDGE_ROUTE_KEYS: Final = ("auth", "scopes", "cors")
AUTH_TYPES: Final = ("api_key", "jwt")
API_KEY_KEYS: Final = ("type", "header", "realm", "keys")
KEY_KEYS: Final = ("sha256", "env", "scopes")
JWT_KEYS: Final = (
    "type",
    "realm",
    "jwks_file",
    "jwks_url",
    "jwks_max_age",
    "jwks_min_refetch",
    "algorithms",
    "issuer",
    "audience",
    "leeway",
    "require",
    "subject_claim",
    "claims",
    "token_cache",
)
CORS_KEYS: Final = ("origins", "methods", "headers", "expose", "credentials", "max_age")


@dataclass(frozen=True, slots=True)
class EdgeConfig:
    """Each route's :class:`RouteAuth` and :class:`CorsPolicy` (by route name, chain and
    proxy routes alike), the container's own endpoints' policy (``[server] cors``) and the
    JWKS URLs the file names (``pipework check --fetch`` fetches them)."""

    auth: Mapping[str, RouteAuth] = field(default_factory=lambda: MappingProxyType({}))
    cors: Mapping[str, CorsPolicy] = field(default_factory=lambda: MappingProxyType({}))
    server_cors: CorsPolicy | None = None
    #: ``[server] jobs_auth``: the download centre's endpoints list an identity's jobs.
    jobs_auth: RouteAuth | None = None
    jwks_urls: Mapping[str, JwksUrl] = field(default_factory=lambda: MappingProxyType({}))


def read_edge(c: Collector, data: Mapping[str, Any], source: str) -> EdgeConfig:
    """Read ``[auth]``, ``[cors]``, the routes' edge keys and ``[server] cors``; relative
    ``jwks_file`` paths are taken from the directory of ``source`` (the file)."""
    base = os.path.dirname(source) if os.path.isfile(source) else ""
    urls: dict[str, JwksUrl] = {}
    methods: dict[str, Authenticator] = {}
    section = data.get("auth")
    if section is not None:
        if not isinstance(section, dict):
            c.error(("auth",), "expected a table of authentications, one [auth.NAME] each")
        else:
            for name, spec in section.items():
                found = _auth(c, ("auth", name), name, spec, base, urls)
                if found is not None:
                    methods[name] = found
    policies: dict[str, CorsPolicy] = {}
    section = data.get("cors")
    if section is not None:
        if not isinstance(section, dict):
            c.error(("cors",), "expected a table of CORS policies, one [cors.NAME] each")
        else:
            for name, spec in section.items():
                policy = _cors(c, ("cors", name), name, spec)
                if policy is not None:
                    policies[name] = policy
    declared_auth = set(section_names(data.get("auth")))
    declared_cors = set(section_names(data.get("cors")))
    route_auth: dict[str, RouteAuth] = {}
    route_cors: dict[str, CorsPolicy] = {}
    routes = data.get("routes")
    for name, spec in routes.items() if isinstance(routes, dict) else ():
        if not isinstance(spec, dict):
            continue  # the routes' reader says so
        where: KeyPath = ("routes", name)
        t = Table(c, where, spec)
        auth = _route_auth(t, methods, declared_auth)
        if auth is not None:
            route_auth[name] = auth
        cors = _named(t, "cors", policies, declared_cors)
        if cors is not None:
            route_cors[name] = cors
    server_cors = jobs_auth = None
    server = data.get("server")
    if isinstance(server, dict) and "cors" in server:
        server_cors = _named(Table(c, ("server",), server), "cors", policies, declared_cors)
    if isinstance(server, dict) and "jobs_auth" in server:
        jobs_auth = _auth_named(Table(c, ("server",), server), "jobs_auth", methods, declared_auth)
    return EdgeConfig(
        MappingProxyType(route_auth),
        MappingProxyType(route_cors),
        server_cors,
        jobs_auth,
        MappingProxyType(urls),
    )


def section_names(section: Any) -> list[str]:
    return [k for k in section if isinstance(k, str)] if isinstance(section, dict) else []


def _strings(t: Table, key: str, *, nonempty: bool = False) -> tuple[str, ...] | None:
    """An array of strings (a lone string is an array of one); None when absent or wrong."""
    if key not in t:
        return None
    value = t.data[key]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        t.c.error(t.at(key), f"expected an array of strings, got {describe_value(value)}")
        return None
    if nonempty and not value:
        t.c.error(t.at(key), "must list at least one")
        return None
    return tuple(value)


def _named(t: Table, key: str, found: Mapping[str, Any], declared: set[str]) -> Any:
    name = t.string(key, None)
    if name is None:
        return None
    if name not in declared:
        section = "auth" if key == "auth" else "cors"
        guess = close_match(name, declared)
        also = f"; did you mean {guess!r}?" if guess else f"; declare it as [{section}.{name}]"
        t.c.error(t.at(key), f"unknown {section} {name!r}{also}")
        return None
    return found.get(name)  # None: its own table has errors, reported there


def _route_auth(
    t: Table, methods: Mapping[str, Authenticator], declared: set[str]
) -> RouteAuth | None:
    scopes = _strings(t, "scopes")
    if "auth" not in t:
        if scopes is not None:
            t.c.error(t.at("scopes"), 'scopes need auth = "NAME" to say who proves them')
        return None
    return _auth_named(t, "auth", methods, declared, frozenset(scopes or ()))


def _auth_named(
    t: Table,
    key: str,
    methods: Mapping[str, Authenticator],
    declared: set[str],
    scopes: frozenset[str] = frozenset(),
) -> RouteAuth | None:
    """The :class:`RouteAuth` of the ``[auth.NAME]`` tables ``key`` names (one name or an
    array); None (and the problems said) if one is unknown or has errors of its own."""
    names = _strings(t, key, nonempty=True)
    if names is None:
        return None
    chosen: list[Authenticator] = []
    for i, name in enumerate(names):
        where = t.at(key) if isinstance(t.data[key], str) else (*t.at(key), i)
        if name not in declared:
            guess = close_match(name, declared)
            also = f"; did you mean {guess!r}?" if guess else f"; declare it as [auth.{name}]"
            t.c.error(where, f"unknown auth {name!r}{also}")
        elif name in methods:
            chosen.append(methods[name])
    if len(chosen) != len(names):
        return None
    return RouteAuth(tuple(chosen), scopes)


def _auth(
    c: Collector, where: KeyPath, name: str, spec: Any, base: str, urls: dict[str, JwksUrl]
) -> Authenticator | None:
    if not check_name(c, where, name, "auth"):
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    keys = (
        JWT_KEYS
        if kind == "jwt"
        else API_KEY_KEYS
        if kind == "api_key"
        else (
            *API_KEY_KEYS,
            *JWT_KEYS,
        )
    )
    t = open_table(c, where, spec, keys)
    if t is None:
        return None
    kind = t.string("type", None, required=True, choices=AUTH_TYPES)
    if kind == "api_key":
        return _api_keys(t, name)
    if kind == "jwt":
        return _jwt(t, name, base, urls)
    return None


def _api_keys(t: Table, name: str) -> ApiKeys | None:
    c = t.c
    header = t.string("header", "X-API-Key")
    realm = t.string("realm", name)
    keys = t.table("keys")
    if keys is None:
        if "keys" not in t:
            c.error(t.at("keys"), "required key is missing: list the keys, [auth.NAME.keys.KEY]")
        return None
    found: list[ApiKey] = []
    for key_name, spec in keys.items():
        where = (*t.at("keys"), key_name)
        k = open_table(c, where, spec, KEY_KEYS)
        if k is None or not check_name(c, where, key_name, "key"):
            continue
        scopes = frozenset(_strings(k, "scopes") or ())
        if ("sha256" in k) == ("env" in k):
            c.error(
                where,
                'a key needs sha256 = "HEX" (the key\'s SHA-256 digest) or env = "VARIABLE" '
                "(an environment variable holding the key), one of them",
            )
            continue
        if "sha256" in k:
            digest = k.string("sha256", None)
            if digest is None:
                continue
            try:
                raw = binascii.unhexlify(digest)
            except (binascii.Error, ValueError):
                raw = b""
            if len(raw) != 32:
                c.error(
                    k.at("sha256"),
                    "expected a SHA-256 digest: 64 hex digits (printf %s KEY | sha256sum)",
                )
                continue
            found.append(ApiKey(key_name, raw, scopes))
            continue
        variable = k.string("env", None)
        if variable is None:
            continue
        value = env_key(variable)
        if value is None:
            c.warn(
                k.at("env"),
                f"environment variable {variable} is not set: key {key_name!r} accepts nothing",
            )
            continue
        found.append(ApiKey(key_name, binascii.unhexlify(sha256_hex(value)), scopes))
    if c.failed(t.path):
        return None
    return ApiKeys(name, tuple(found), header=header, realm=realm)


def _jwt(t: Table, name: str, base: str, urls: dict[str, JwksUrl]) -> JwtBearer | None:
    c = t.c
    algorithms = _strings(t, "algorithms", nonempty=True)
    if "algorithms" not in t:
        c.error(
            t.at("algorithms"),
            'required key is missing: list the algorithms tokens may use, e.g. ["RS256"]',
        )
    for i, alg in enumerate(algorithms or ()):
        if alg not in ASYMMETRIC_ALGORITHMS:
            why = (
                "an unsigned token proves nothing"
                if alg.lower() == "none"
                else "an HMAC algorithm needs a shared secret, and a JWKS of public keys holds none"
                if alg.upper().startswith("HS")
                else "not a signature algorithm this gateway verifies"
            )
            c.error(
                (*t.at("algorithms"), i),
                f"{alg!r}: {why}; expected some of: {', '.join(ASYMMETRIC_ALGORITHMS)}",
            )
    audience = _strings(t, "audience") or ()
    issuer = t.string("issuer", None)
    leeway = t.number("leeway", 0.0, positive=False)
    require = _strings(t, "require") or ("exp",)
    subject_claim = t.string("subject_claim", "sub")
    claims = _strings(t, "claims") or ()
    max_age = t.number("jwks_max_age", 300.0)
    min_refetch = t.number("jwks_min_refetch", 30.0, positive=False)
    realm = t.string("realm", name)
    token_cache = t.integer("token_cache", 10_000, minimum=0)
    file, url = t.string("jwks_file", None), t.string("jwks_url", None)
    source: JwksFile | JwksUrl | None = None
    if (file is None) == (url is None):
        c.error(
            t.path,
            'a jwt auth needs jwks_file = "PATH" or jwks_url = "https://...", one of them',
        )
    elif file is not None:
        path = file if os.path.isabs(file) else os.path.join(base, file)
        try:
            source = JwksFile(path)
        except OSError as exc:
            c.error(t.at("jwks_file"), f"cannot read {path}: {exc.strerror or exc}")
        except ValueError as exc:
            c.error(t.at("jwks_file"), str(exc))
    elif url is not None:
        parts = urlsplit(url)
        if parts.scheme not in {"http", "https"} or not parts.netloc:
            c.error(t.at("jwks_url"), f"{url!r} is not an http:// or https:// URL")
        else:
            if parts.scheme == "http" and parts.hostname not in {"localhost", "127.0.0.1", "::1"}:
                c.warn(
                    t.at("jwks_url"),
                    "keys fetched over plain http can be swapped on the way; use https",
                )
            source = urls[name] = JwksUrl(url, max_age=max_age, min_refetch=min_refetch)
    if source is None or algorithms is None or c.failed(t.path):
        return None
    return JwtBearer(
        name,
        source,
        algorithms=algorithms,
        issuer=issuer,
        audience=audience,
        leeway=leeway,
        require=require,
        subject_claim=subject_claim,
        claims=claims,
        realm=realm,
        cache_size=token_cache,
    )


def _cors(c: Collector, where: KeyPath, name: str, spec: Any) -> CorsPolicy | None:
    t = open_table(c, where, spec, CORS_KEYS)
    if t is None or not check_name(c, where, name, "cors"):
        return None
    origins = _strings(t, "origins", nonempty=True)
    if "origins" not in t:
        c.error(t.at("origins"), 'required key is missing: list the origins, or ["*"]')
    for i, origin in enumerate(origins or ()):
        problem = check_origin(origin)
        if problem is not None:
            c.error((*t.at("origins"), i), problem)
    methods = _strings(t, "methods") or ("GET", "HEAD", "POST")
    headers = _strings(t, "headers") or ()
    expose = _strings(t, "expose") or ()
    credentials = t.boolean("credentials", False)
    max_age = t.integer("max_age", None, minimum=0)
    if origins is None or c.failed(where):
        return None
    try:
        return CorsPolicy(origins, methods, headers, expose, credentials, max_age)
    except ValueError as exc:
        c.error(where, str(exc))
        return None
