"""Signed, expiring callback URLs: how a backend resumes a suspended job without its token.

A pipe asks for ``ctx.callback_url("paid", ttl=600)`` and hands the URL to a backend; the
backend POSTs the signal's payload to it. The URL is
``/callbacks/{job}/{signal}?exp={unix seconds}&sig={signature}``, where the signature is
HMAC-SHA256, keyed with the container's secret, over ``POST``, the path and ``exp``. It
names one job and one signal, so a leaked URL can do nothing else, and only until ``exp``.

Every process that may receive a callback must sign with the same secret, so it is, in
this order (docs/scaling.md#callback-urls-across-processes):

1. the configuration's (``ContainerConfig.callback_secret``, ``[server]
   callback_secret_env``), else ``PIPEWORK_CALLBACK_SECRET``: chosen by the operator;
2. the one a shared job store keeps (:class:`SecretKeeper`, the Redis store: the first
   process to ask stores its own, every later one takes it), asked when the container
   starts serving: every process on one Redis agrees, across machines and restarts;
3. the one ``pipework serve --workers N`` makes at start and hands every worker in
   ``PIPEWORK_WORKERS_CALLBACK_SECRET`` (through the environment, never a command line);
4. else a random one, made at start (then URLs handed out before a restart stop working,
   as do the jobs they would resume, which lived in that process's memory).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import os
import re
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Final, Protocol, runtime_checkable
from urllib.parse import quote, urlencode

from .._http._problems import Problem

__all__ = ["SECRET_ENV", "WORKERS_SECRET_ENV", "CallbackSigner", "SecretKeeper"]

#: The operator's secret, when the configuration names none.
SECRET_ENV: Final = "PIPEWORK_CALLBACK_SECRET"
#: The secret ``serve --workers N`` makes for its workers (see the module).
WORKERS_SECRET_ENV: Final = "PIPEWORK_WORKERS_CALLBACK_SECRET"
_MIN_SECRET: Final = 16
# Query values are parsed strictly: ASCII digits only (str.isdigit() takes "²" and "٣").
_EXPIRES: Final = re.compile(r"[0-9]{1,12}\Z")
_SIGNATURE: Final = re.compile(r"[A-Za-z0-9_-]{1,128}\Z")


@runtime_checkable
class SecretKeeper(Protocol):
    """A job store shared by several processes that keeps one callback secret for all."""

    async def callback_secret(self, proposed: bytes) -> bytes:
        """The secret kept, else ``proposed``, kept from now on."""
        ...


class CallbackSigner:
    """Makes and checks callback URLs. ``base_url`` (e.g. ``https://gw.example.com``) is
    put in front of the path; the container sets it to where it serves unless configured.
    ``clock`` gives Unix time (a parameter so tests can move it). ``chosen``: the secret is
    the operator's; one that is not gives way to a shared store's (:meth:`share`)."""

    def __init__(
        self,
        secret: bytes | str,
        *,
        base_url: str = "",
        clock: Callable[[], float] = time.time,
        chosen: bool = True,
    ) -> None:
        self._key = _checked(secret, "the callback secret")
        self.base_url = base_url.rstrip("/")
        self._clock = clock
        self.chosen = chosen

    @classmethod
    def from_config(
        cls,
        secret: bytes | str | None,
        *,
        base_url: str = "",
        environ: Mapping[str, str] | None = None,
    ) -> CallbackSigner:
        """The configured secret, else ``PIPEWORK_CALLBACK_SECRET``, else the one
        ``serve --workers N`` handed its workers, else a new random one (see the module)."""
        environ = os.environ if environ is None else environ
        chosen = secret if secret is not None else environ.get(SECRET_ENV)
        if chosen:
            return cls(chosen, base_url=base_url)
        made = environ.get(WORKERS_SECRET_ENV) or secrets.token_urlsafe(32)
        return cls(made, base_url=base_url, chosen=False)

    async def share(self, keeper: SecretKeeper) -> bool:
        """Unless the operator chose the secret, sign with the one ``keeper`` keeps for
        every process (this one's, if none was kept yet). Whether it did."""
        if self.chosen:
            return False
        self._key = _checked(await keeper.callback_secret(self._key), "a kept callback secret")
        return True

    @staticmethod
    def path(job_id: str, signal: str) -> str:
        return f"/callbacks/{quote(job_id, safe='')}/{quote(signal, safe='')}"

    def url(self, job_id: str, signal: str, ttl: float) -> str:
        """A URL that delivers ``signal`` to ``job_id`` for the next ``ttl`` seconds."""
        if not ttl > 0:
            raise ValueError(f"a callback URL's ttl must be positive, got {ttl}")
        return self.url_expiring_at(job_id, signal, math.ceil(self._clock() + ttl))

    def url_expiring_at(self, job_id: str, signal: str, expires: int) -> str:
        path = self.path(job_id, signal)
        query = urlencode({"exp": expires, "sig": self._sign("POST", path, expires)})
        return f"{self.base_url}{path}?{query}"

    def verify(self, job_id: str, signal: str, exp: str | None, sig: str | None) -> None:
        """Raise a 403 problem unless ``exp`` and ``sig`` sign this job and signal and the
        URL has not expired."""
        if exp is None or sig is None or not _EXPIRES.match(exp) or not _SIGNATURE.match(sig):
            raise _refused("the callback URL lacks its exp and sig parameters, or one is malformed")
        expected = self._sign("POST", self.path(job_id, signal), int(exp))
        if not hmac.compare_digest(expected.encode(), sig.encode("ascii")):
            raise _refused("the callback URL's signature does not match")
        if int(exp) <= self._clock():
            raise _refused("the callback URL has expired; ask the job for a new one")

    def now(self) -> float:
        """Unix time as this signer reads it (its ``clock``)."""
        return self._clock()

    def signature(self, method: str, target: str, expires: int) -> str:
        """The signature of ``method`` on ``target`` (a path, with what else it names)
        until ``expires``: the key and the HMAC of callback URLs, for the container's other
        signed links (the download centre's). A callback is always ``POST`` on
        ``/callbacks/...``, so no other link's signature can pass for one."""
        return self._sign(method, target, expires)

    def _sign(self, method: str, path: str, expires: int) -> str:
        message = f"{method}\n{path}\n{expires}".encode()
        digest = hmac.new(self._key, message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def _checked(secret: bytes | str, what: str) -> bytes:
    key = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(key) < _MIN_SECRET:
        raise ValueError(
            f"{what} must be at least {_MIN_SECRET} bytes; "
            "use e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
        )
    return key


def _refused(detail: str) -> Problem:
    return Problem(403, "Callback refused", detail, slug="callback-refused")
