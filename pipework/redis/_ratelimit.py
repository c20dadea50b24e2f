"""The rate limits' state shared by every process on one Redis server and prefix.

One request is one round trip: ``EVALSHA`` of ``lua/ratelimit.lua`` with the TAT key of each
limit it meets, deciding all of them at once on Redis's clock (the same rule as the memory
store, :mod:`pipework._http._ratelimit_core`). Each key expires when its bucket would be full
again, so Redis holds only the keys still draining. A round trip that fails or takes longer
than ``timeout`` is :class:`~pipework._http._ratelimit.LimitStoreUnavailable`: the limits'
failure policy decides the request (``[rate_limits] fail_open``).
"""

from __future__ import annotations

from collections.abc import Sequence

from .._http._ratelimit import Limit, LimitStoreUnavailable
from ._client import Client
from ._scripts import load
from ._wire import UNREACHABLE, ReplyError, public_url

__all__ = ["RedisLimitStore"]

_SCRIPT = load("ratelimit")


class RedisLimitStore:
    """The limits' TATs under ``{prefix}:ratelimit:{limit}:{key}`` on the server at ``url``."""

    def __init__(self, url: str, *, prefix: str = "pipework", timeout: float = 0.5) -> None:
        self.url = url
        self.prefix = prefix
        self._client = Client(url, timeout=timeout)
        #: Tests set it (microseconds) to decide at a time of their own, not Redis's.
        self.now: int | None = None

    def key(self, limit: Limit, key: str) -> str:
        return f"{self.prefix}:ratelimit:{limit.name}:{key}"

    async def take(
        self, limits: Sequence[Limit], keys: Sequence[str]
    ) -> tuple[bool, int, list[int]]:
        names = [self.key(limit, key) for limit, key in zip(limits, keys, strict=True)]
        args: list[str | int] = ["" if self.now is None else self.now]
        for limit in limits:
            args += [limit.rate.interval, limit.rate.tolerance]
        try:
            reply = await self._client.script(_SCRIPT, names, args)
        except (*UNREACHABLE, ReplyError, TimeoutError) as exc:
            raise LimitStoreUnavailable(f"Redis at {public_url(self.url)}: {exc}") from exc
        allowed, now, *tats = reply
        return bool(allowed), int(now), [int(tat) for tat in tats]

    async def aclose(self) -> None:
        await self._client.aclose()
