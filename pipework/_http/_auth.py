"""Who a request comes from: API keys and JWT bearer tokens, checked per route before any
job exists (and before a proxied request waits for a slot).

- :class:`ApiKeys`: keys kept as SHA-256 digests (the file holds the digest, or names an
  environment variable holding the key, hashed when read); a key a request brings is
  hashed and compared with every digest in constant time.
- :class:`JwtBearer`: ``Authorization: Bearer <JWT>`` verified with PyJWT against the keys
  of a JWKS (a file, or a URL fetched, cached and refreshed by :class:`JwksUrl`), for the
  algorithms listed (asymmetric only: never ``none``, never an HMAC algorithm, and the
  token's algorithm must suit the key's type), with ``iss``, ``aud``, ``exp`` and ``nbf``
  checked with a leeway.
- :class:`RouteAuth`: what a route accepts (one or more of those) and the scopes it needs;
  its :meth:`~RouteAuth.authenticate` returns the request's :class:`Identity` or raises a
  :class:`~._problems.Problem`: ``401`` with ``WWW-Authenticate`` (RFC 6750's error codes)
  for a missing or bad credential, ``403`` for a credential without a scope the route needs.

The identity is put in the request's identity mapping (:mod:`._identity`: the ASGI scope's
``"pipework.identity"``, with the token's claims), the one place where later decisions
(rate limits keyed by an identity or a claim) read who the request is from
(:func:`put_identity`); a pipe route's job gets it in its state under
:data:`IDENTITY_STATE_KEY`, with the claims its auth keeps.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os
import time
import urllib.request
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import jwt
import trio

from ._credentials import bearer_token
from ._identity import set_identity
from ._problems import Problem, retry_after_header

__all__ = [
    "ASYMMETRIC_ALGORITHMS",
    "IDENTITY_STATE_KEY",
    "ApiKeys",
    "Authenticator",
    "Identity",
    "JwksFile",
    "JwksUrl",
    "JwtBearer",
    "RouteAuth",
    "jwks_keys",
    "put_identity",
    "sha256_hex",
]

_log = logging.getLogger("pipework.auth")

#: The job state's key for the identity of the request that started it.
IDENTITY_STATE_KEY: Final = "identity"

#: The algorithms a token may be signed with, by the key type (JWK ``kty``) that verifies
#: them. No HMAC: a JWKS of public keys holds no shared secret, and accepting ``HS256``
#: with a public key as the secret is the classic forgery.
ASYMMETRIC_ALGORITHMS: Final[Mapping[str, str]] = {
    "RS256": "RSA",
    "RS384": "RSA",
    "RS512": "RSA",
    "PS256": "RSA",
    "PS384": "RSA",
    "PS512": "RSA",
    "ES256": "EC",
    "ES384": "EC",
    "ES512": "EC",
    "EdDSA": "OKP",
}
#: An EC key's curve, by algorithm (RFC 7518 §3.4).
_CURVES: Final = {"ES256": "P-256", "ES384": "P-384", "ES512": "P-521"}
#: A JWKS document larger than this is refused (a JWKS holds a few keys).
MAX_JWKS_BYTES: Final = 1024 * 1024


def sha256_hex(text: str) -> str:
    """The SHA-256 digest of ``text`` (UTF-8), in hex: how API keys are kept."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a request comes from: ``subject`` (a key's name, a token's ``sub``), how it
    proved it (``scheme``: ``"api_key"`` or ``"jwt"``; ``auth``: the ``[auth.NAME]`` that
    accepted it), its ``scopes``, the ``claims`` its auth keeps for the job's state, and
    every claim of the token (``token_claims``: what rate limits may key on)."""

    subject: str
    scheme: str
    auth: str
    scopes: frozenset[str] = frozenset()
    claims: Mapping[str, Any] = field(default_factory=dict)
    token_claims: Mapping[str, Any] = field(default_factory=dict)

    @property
    def owner(self) -> str:
        """The owner string of the jobs this identity starts (``JobRecord.owner``) and
        lists: ``AUTH:SUBJECT``, the ``[auth.NAME]`` that accepted it and the subject it
        names. The auth is part of it: two auths may each know a subject of the same name
        (a key named ``alice``, an identity provider's ``sub`` ``alice``) who are not the
        same caller."""
        return f"{self.auth}:{self.subject}"

    def state(self) -> dict[str, Any]:
        """The identity as a job's state holds it (under :data:`IDENTITY_STATE_KEY`)."""
        return {
            "subject": self.subject,
            "scheme": self.scheme,
            "auth": self.auth,
            "scopes": sorted(self.scopes),
            "claims": dict(self.claims),
        }


class Refusal(Exception):
    """A credential was there but is not good (its ``description`` says why, for
    ``error_description``); raised by an :class:`Authenticator`."""

    def __init__(self, description: str) -> None:
        super().__init__(description)
        self.description = description


class Authenticator(Protocol):
    """One way to prove who one is (an ``[auth.NAME]`` table)."""

    name: str

    def present(self, headers: Mapping[str, str]) -> bool:
        """Whether the request brings this kind of credential at all."""

    async def identify(self, headers: Mapping[str, str]) -> Identity:
        """The identity the credential proves; raises :class:`Refusal`."""

    def challenge(
        self, error: str | None = None, description: str | None = None, scope: str | None = None
    ) -> str:
        """Its ``WWW-Authenticate`` challenge (RFC 6750 §3's parameters)."""


def _quoted(text: str) -> str:
    # RFC 9110 quoted-string: backslash and quote escaped; no control characters.
    cleaned = "".join(ch if " " <= ch <= "~" else "?" for ch in text)
    return '"' + cleaned.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _challenge(
    scheme: str,
    realm: str,
    error: str | None,
    description: str | None,
    scope: str | None,
    **more: str,
) -> str:
    parts = [f"realm={_quoted(realm)}"]
    if error is not None:
        parts.append(f"error={_quoted(error)}")
    if description is not None:
        parts.append(f"error_description={_quoted(description)}")
    if scope is not None:
        parts.append(f"scope={_quoted(scope)}")
    parts.extend(f"{name}={_quoted(value)}" for name, value in more.items())
    return f"{scheme} " + ", ".join(parts)


# -- API keys -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One key: its name (the identity's subject), its SHA-256 digest and its scopes."""

    name: str
    digest: bytes
    scopes: frozenset[str] = frozenset()


class ApiKeys:
    """API keys in a header (``X-API-Key`` by default; ``Authorization`` takes
    ``Bearer <key>``). Only digests are kept; every digest is compared, so the time taken
    says nothing of which key (or how much of one) matched."""

    def __init__(
        self, name: str, keys: tuple[ApiKey, ...], *, header: str = "X-API-Key", realm: str = ""
    ) -> None:
        self.name = name
        self.keys = keys
        self.header = header.lower()
        self.realm = realm or name

    def _given(self, headers: Mapping[str, str]) -> str | None:
        value = headers.get(self.header)
        if value is not None and self.header == "authorization":
            return bearer_token(value)
        return value

    def present(self, headers: Mapping[str, str]) -> bool:
        return self._given(headers) is not None

    async def identify(self, headers: Mapping[str, str]) -> Identity:
        given = self._given(headers)
        if not given:
            raise Refusal(f"the {self.header} header holds no key")
        digest = hashlib.sha256(given.encode("utf-8", "surrogatepass")).digest()
        found: ApiKey | None = None
        for key in self.keys:  # all of them, whichever matches
            if hmac.compare_digest(digest, key.digest):
                found = key
        if found is None:
            raise Refusal("the API key is not one this route accepts")
        return Identity(found.name, "api_key", self.name, found.scopes)

    def challenge(
        self, error: str | None = None, description: str | None = None, scope: str | None = None
    ) -> str:
        return _challenge("ApiKey", self.realm, error, description, scope, header=self.header)


# -- JWKS -----------------------------------------------------------------------------------


class JwksError(ValueError):
    """A JWKS document that is not one (its message says where and what)."""


def jwks_keys(document: bytes | str | Mapping[str, Any], where: str) -> dict[str, jwt.PyJWK]:
    """The usable keys of a JWKS document by ``kid`` (a key without one is kept under
    ``""``); raises :class:`JwksError` saying what is wrong (``where`` names the source)."""
    if isinstance(document, bytes | str):
        try:
            data = json.loads(document)
        except ValueError as exc:
            raise JwksError(f"{where}: not JSON: {exc}") from None
    else:
        data = document
    if not isinstance(data, Mapping) or not isinstance(data.get("keys"), list):
        raise JwksError(f'{where}: a JWKS is a JSON object with a "keys" array')
    found: dict[str, jwt.PyJWK] = {}
    for i, entry in enumerate(data["keys"]):
        if not isinstance(entry, Mapping):
            raise JwksError(f"{where}: keys[{i}] is not an object")
        kty = entry.get("kty")
        if kty not in {"RSA", "EC", "OKP"}:
            # "oct" (a shared secret) has no place in a JWKS verifying signatures here.
            raise JwksError(
                f"{where}: keys[{i}] has kty {kty!r}; only public keys (RSA, EC, OKP) verify "
                "tokens here"
            )
        if any(part in entry for part in ("d", "p", "q")):
            raise JwksError(f"{where}: keys[{i}] holds a private key; publish only the public part")
        try:
            key = jwt.PyJWK(dict(entry))
        except jwt.PyJWTError as exc:
            raise JwksError(f"{where}: keys[{i}] is not a usable key: {exc}") from None
        kid = entry.get("kid", "")
        if not isinstance(kid, str):
            raise JwksError(f"{where}: keys[{i}]'s kid is not a string")
        if kid in found:
            raise JwksError(f"{where}: two keys have kid {kid!r}")
        found[kid] = key
    if not found:
        raise JwksError(f"{where}: the JWKS holds no key")
    return found


class KeySource(Protocol):
    """Where a :class:`JwtBearer` finds the key of a ``kid``."""

    async def key(self, kid: str | None) -> jwt.PyJWK | None: ...

    def generation(self) -> int | None:
        """Which set of keys is in force (tokens verified under another are verified
        again); None when the keys are due for a refresh."""


def _pick(keys: Mapping[str, jwt.PyJWK], kid: str | None) -> jwt.PyJWK | None:
    if kid is not None:
        return keys.get(kid)
    # A token without a kid: only a JWKS of exactly one key says which key is meant.
    return next(iter(keys.values())) if len(keys) == 1 else None


class JwksFile:
    """The keys of a JWKS file, read when the configuration is (a reload reads it again)."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as file:
            self.keys = jwks_keys(file.read(), path)

    async def key(self, kid: str | None) -> jwt.PyJWK | None:
        return _pick(self.keys, kid)

    def generation(self) -> int | None:
        return 0  # read once: a reload builds a new one


Fetch = Callable[[str], Awaitable[bytes]]


async def fetch_url(url: str, socket_timeout: float = 5.0) -> bytes:
    """GET ``url`` (in a worker thread: urllib blocks), at most :data:`MAX_JWKS_BYTES`."""

    def get() -> bytes:
        request = urllib.request.Request(url, headers={"Accept": "application/json"})
        with urllib.request.urlopen(request, timeout=socket_timeout) as answer:
            body: bytes = answer.read(MAX_JWKS_BYTES + 1)
        if len(body) > MAX_JWKS_BYTES:
            raise JwksError(f"{url}: the JWKS is larger than {MAX_JWKS_BYTES} bytes")
        return body

    return await trio.to_thread.run_sync(get, abandon_on_cancel=True)


class JwksUnavailable(Exception):
    """The JWKS could not be fetched and no keys are known yet."""


class JwksUrl:
    """The keys of a JWKS URL: fetched on first use, kept ``max_age`` seconds, then fetched
    again on the next use; a ``kid`` it does not know fetches it again at once (a key
    rotated in), but at most once per ``min_refetch`` seconds, so tokens with made-up kids
    cannot make the gateway hammer the identity provider. One fetch at a time: requests
    arriving meanwhile wait for it. A failed fetch keeps the keys already known (logged)."""

    def __init__(
        self,
        url: str,
        *,
        max_age: float = 300.0,
        min_refetch: float = 30.0,
        fetch: Fetch = fetch_url,
    ) -> None:
        self.url = url
        self.max_age = max_age
        self.min_refetch = min_refetch
        self._fetch = fetch
        self.keys: dict[str, jwt.PyJWK] = {}
        self.fetched_at = -float("inf")  # trio time of the last fetch, good or not
        self.fetches = 0
        self._generation = 0
        self._under_way: trio.Event | None = None

    def generation(self) -> int | None:
        if trio.current_time() - self.fetched_at >= self.max_age:
            return None
        return self._generation

    async def key(self, kid: str | None) -> jwt.PyJWK | None:
        now = trio.current_time()
        if now - self.fetched_at >= self.max_age:
            await self._refresh()
        found = _pick(self.keys, kid)
        if found is None and trio.current_time() - self.fetched_at >= self.min_refetch:
            await self._refresh()  # a rotated key, maybe
            found = _pick(self.keys, kid)
        if not self.keys:
            raise JwksUnavailable(self.url)
        return found

    async def _refresh(self) -> None:
        if self._under_way is not None:
            await self._under_way.wait()
            return
        self._under_way = done = trio.Event()
        try:
            self.fetches += 1
            try:
                self.keys = jwks_keys(await self._fetch(self.url), self.url)
                self._generation += 1
            except (OSError, ValueError) as exc:
                _log.warning(
                    "could not fetch the JWKS at %s (%s); keeping the %d keys known",
                    self.url,
                    exc,
                    len(self.keys),
                )
        finally:
            self.fetched_at = trio.current_time()
            self._under_way = None
            done.set()


# -- JWT ------------------------------------------------------------------------------------


class JwtBearer:
    """``Authorization: Bearer <JWT>``, verified against ``source``'s keys.

    ``algorithms``: those accepted (from :data:`ASYMMETRIC_ALGORITHMS`); ``issuer`` and
    ``audience``: what ``iss`` and ``aud`` must hold (None: not checked); ``leeway``:
    seconds of clock skew allowed on ``exp``, ``nbf`` and ``iat``; ``subject_claim``: the
    claim naming the identity; ``claims``: those kept on the identity (and in the job's
    state).

    A token that verified is remembered (up to ``cache_size`` tokens, the oldest dropped
    first; 0: none): a client sends the same access token with each request, and its
    signature need not be checked again while the keys it was checked with are in force
    (the same JWKS file; for a URL, the same fetch, within ``jwks_max_age``). Its ``exp``
    and ``nbf`` are checked at every use all the same. A refused token is never
    remembered."""

    def __init__(
        self,
        name: str,
        source: KeySource,
        *,
        algorithms: tuple[str, ...],
        issuer: str | None = None,
        audience: tuple[str, ...] = (),
        leeway: float = 0.0,
        require: tuple[str, ...] = ("exp",),
        subject_claim: str = "sub",
        claims: tuple[str, ...] = (),
        realm: str = "",
        cache_size: int = 10_000,
    ) -> None:
        for alg in algorithms:
            if alg not in ASYMMETRIC_ALGORITHMS:
                raise ValueError(f"algorithm {alg!r} is not one of {list(ASYMMETRIC_ALGORITHMS)}")
        if not algorithms:
            raise ValueError("list at least one algorithm")
        self.name = name
        self.source = source
        self.algorithms = frozenset(algorithms)
        self.issuer = issuer
        self.audience = list(audience) or None
        self.leeway = leeway
        required = set(require)
        if issuer is not None:
            required.add("iss")
        if audience:
            required.add("aud")
        self._options: Any = {"require": sorted(required), "verify_aud": bool(audience)}
        self.subject_claim = subject_claim
        self.claims = claims
        self.realm = realm or name
        self.cache_size = cache_size
        # token -> (identity, exp, nbf, keys' generation); dicts keep insertion order.
        self._verified: dict[str, tuple[Identity, float, float, int]] = {}

    def present(self, headers: Mapping[str, str]) -> bool:
        value = headers.get("authorization")
        return value is not None and bearer_token(value) is not None

    async def identify(self, headers: Mapping[str, str]) -> Identity:
        token = bearer_token(headers.get("authorization"))
        if not token:
            raise Refusal("the Authorization header holds no token")
        hit = self._verified.get(token)
        if hit is not None:
            identity, expires, not_before, generation = hit
            now = _wall_clock()
            # PyJWT's own bounds: expired once exp <= now - leeway, early while nbf > now + leeway.
            if (
                generation == self.source.generation()
                and now - self.leeway < expires
                and not_before <= now + self.leeway
            ):
                return identity
            del self._verified[token]  # checked again below, in full
        identity, expires, not_before = await self._verify(token)
        current = self.source.generation()
        if self.cache_size and current is not None:
            if len(self._verified) >= self.cache_size:
                del self._verified[next(iter(self._verified))]
            self._verified[token] = (identity, expires, not_before, current)
        return identity

    async def _verify(self, token: str) -> tuple[Identity, float, float]:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise Refusal("the bearer token is not a JWT") from None
        alg = header.get("alg")
        if alg not in self.algorithms:
            allowed = ", ".join(sorted(self.algorithms))
            raise Refusal(f"the token is signed with {alg!r}; this route accepts {allowed}")
        kid = header.get("kid")
        if kid is not None and not isinstance(kid, str):
            raise Refusal("the token's kid is not a string")
        try:
            key = await self.source.key(kid)
        except JwksUnavailable:
            raise Problem(
                503,
                "Service Unavailable",
                "the keys that verify this route's tokens could not be fetched; retry later",
                slug="jwks-unavailable",
                headers=retry_after_header(5),
            ) from None
        if key is None:
            which = f"kid {kid!r}" if kid is not None else "no kid (and several keys)"
            raise Refusal(f"no key for the token's {which}")
        _check_key_fits(key, alg)
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                key.key,
                algorithms=[alg],
                audience=self.audience,
                issuer=self.issuer,
                leeway=self.leeway,
                options=self._options,
            )
        except jwt.ExpiredSignatureError:
            raise Refusal("the token has expired") from None
        except jwt.ImmatureSignatureError:
            raise Refusal("the token is not valid yet (nbf or iat in the future)") from None
        except jwt.InvalidAudienceError:
            raise Refusal("the token is not for this audience (aud)") from None
        except jwt.InvalidIssuerError:
            raise Refusal("the token is from another issuer (iss)") from None
        except jwt.MissingRequiredClaimError as exc:
            raise Refusal(f"the token lacks the {exc.claim!r} claim") from None
        except jwt.InvalidSignatureError:
            raise Refusal("the token's signature does not verify") from None
        except jwt.PyJWTError as exc:
            raise Refusal(f"the token is not valid: {exc}") from None
        subject = claims.get(self.subject_claim)
        if not isinstance(subject, str) or not subject:
            raise Refusal(f"the token's {self.subject_claim!r} claim is not a non-empty string")
        try:
            subject.encode("utf-8")  # what a store writes an owner as
        except UnicodeEncodeError:
            raise Refusal(
                f"the token's {self.subject_claim!r} claim is not valid Unicode "
                "(it escapes half of a surrogate pair)"
            ) from None
        kept = {name: claims[name] for name in self.claims if name in claims}
        identity = Identity(subject, "jwt", self.name, _scopes(claims), kept, claims)
        return identity, _bound(claims.get("exp"), math.inf), _bound(claims.get("nbf"), -math.inf)

    def challenge(
        self, error: str | None = None, description: str | None = None, scope: str | None = None
    ) -> str:
        return _challenge("Bearer", self.realm, error, description, scope)


#: The wall clock tokens' exp and nbf are read against (PyJWT reads the same one).
_wall_clock = time.time


def _bound(value: Any, default: float) -> float:
    # PyJWT has checked that exp and nbf, when present, are numbers.
    return float(value) if isinstance(value, int | float) else default


def _check_key_fits(key: jwt.PyJWK, alg: str) -> None:
    """The token's algorithm must be one the key's type signs with (and the key's own
    ``alg``, when the JWKS names one): a token cannot choose how its key is used."""
    data = key._jwk_data  # the JWK as published
    if data.get("kty") != ASYMMETRIC_ALGORITHMS[alg]:
        raise Refusal(f"the token's algorithm {alg} does not suit its key (kty {data.get('kty')})")
    stated = data.get("alg")
    if stated is not None and stated != alg:
        raise Refusal(f"the token's algorithm {alg} is not its key's ({stated})")
    curve = _CURVES.get(alg)
    if curve is not None and data.get("crv") != curve:
        raise Refusal(f"the token's algorithm {alg} needs a {curve} key")


def _scopes(claims: Mapping[str, Any]) -> frozenset[str]:
    """OAuth scopes: ``scope`` (space-separated, RFC 8693 §4.2) or ``scp`` (a list)."""
    scope = claims.get("scope")
    if isinstance(scope, str):
        return frozenset(scope.split())
    scp = claims.get("scp")
    if isinstance(scp, list):
        return frozenset(s for s in scp if isinstance(s, str))
    if isinstance(scp, str):
        return frozenset(scp.split())
    return frozenset()


# -- a route's --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class RouteAuth:
    """What a route accepts (any one of ``methods``, tried in order: the first whose
    credential the request brings decides) and the ``scopes`` it needs (all of them)."""

    methods: tuple[Authenticator, ...]
    scopes: frozenset[str] = frozenset()

    async def authenticate(self, headers: Mapping[str, str]) -> Identity:
        """The request's identity; raises a 401 or 403 :class:`Problem`."""
        for method in self.methods:
            if not method.present(headers):
                continue
            try:
                identity = await method.identify(headers)
            except Refusal as refusal:
                raise self._unauthorized(
                    f"{refusal.description}; see WWW-Authenticate",
                    method.challenge("invalid_token", refusal.description),
                ) from None
            missing = self.scopes - identity.scopes
            if missing:
                needed = " ".join(sorted(self.scopes))
                raise Problem(
                    403,
                    "Forbidden",
                    f"the credential lacks the scope this route needs: {' '.join(sorted(missing))}",
                    slug="insufficient-scope",
                    headers={
                        "WWW-Authenticate": method.challenge("insufficient_scope", None, needed)
                    },
                )
            return identity
        what = " or ".join(_what(m) for m in self.methods)
        raise self._unauthorized(
            f"this route needs {what}; see WWW-Authenticate",
            ", ".join(m.challenge() for m in self.methods),
        )

    @staticmethod
    def _unauthorized(detail: str, challenge: str) -> Problem:
        return Problem(
            401,
            "Unauthorized",
            detail,
            slug="unauthorized",
            headers={"WWW-Authenticate": challenge},
        )


def _what(method: Authenticator) -> str:
    if isinstance(method, ApiKeys):
        return f"an API key in {method.header}"
    return "a bearer token (Authorization: Bearer ...)"


def put_identity(scope: MutableMapping[str, Any], identity: Identity) -> None:
    """Keep ``identity`` in the request's identity mapping, where later decisions (rate
    limits keyed by ``identity`` or ``claim:NAME``) read it: the subject, and the token's
    claims (none for an API key)."""
    set_identity(scope, identity.subject, identity.token_claims)


def env_key(variable: str) -> str | None:
    """The API key an environment variable holds (None: unset or empty)."""
    value = os.environ.get(variable)
    return value or None
