"""The ``[store]`` section: where jobs and events live. ``memory`` (the default) keeps them
in the serving process; ``redis`` shares them between every process pointed at the same
server and prefix (docs/scaling.md)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from ..dispatcher._queue import EventQueue
from ..dispatcher._store import (
    REMEMBER_GONE_COUNT,
    REMEMBER_GONE_SECONDS,
    JobStore,
    MemoryJobStore,
)
from ._config_problems import Collector, KeyPath
from ._config_read import open_table
from ._config_redis import REDIS_KEYS, read_redis_target, redis_url

__all__ = ["StoreSettings", "read_store"]

STORE_KEYS: Final = (
    "backend",
    *REDIS_KEYS,
    "retain_seconds",
    "retain_count",
    "remember_gone_count",
    "remember_gone_seconds",
    "claim_idle",
    "resend_seconds",
)


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """``[store]``. ``url`` or the environment variable ``url_env`` names the Redis server
    (a password belongs in the environment, not in the file). Retention, and how many
    dropped ids are remembered (answering 410 to their owner) for how long, apply to both
    backends."""

    backend: str = "memory"
    url: str | None = None
    url_env: str | None = None
    prefix: str = "pipework"
    sentinels: tuple[str, ...] = ()
    sentinel_master: str | None = None
    retain_seconds: float = 3600.0
    retain_count: int = 10_000
    remember_gone_count: int = REMEMBER_GONE_COUNT
    remember_gone_seconds: float = REMEMBER_GONE_SECONDS
    claim_idle: float = 30.0
    #: How long a step's write to Redis whose round trip failed is sent again (within its
    #: job's deadline) before the job fails for the store, and a parked request's read of
    #: its job before the request is answered 503 naming it (docs/scaling.md).
    resend_seconds: float = 30.0

    def url_value(self, environ: Mapping[str, str] | None = None) -> str:
        return redis_url(
            "store", self.url, self.url_env, environ, self.sentinels, self.sentinel_master
        )

    def build(
        self, *, queue_capacity: int, environ: Mapping[str, str] | None = None
    ) -> tuple[JobStore, EventQueue | None]:
        """The job store and event queue an engine gets (None: its in-memory queue)."""
        if self.backend == "memory":
            store = MemoryJobStore(**self._retention())
            return store, None
        from ..redis import RedisEventQueue, RedisJobStore  # the optional extra

        url = self.url_value(environ)
        shared = RedisJobStore(
            url, prefix=self.prefix, resend_seconds=self.resend_seconds, **self._retention()
        )
        # The queue's writes share the store's round trips (one connection for both).
        queue = RedisEventQueue(
            url,
            prefix=self.prefix,
            capacity=queue_capacity,
            claim_idle=self.claim_idle,
            store=shared,
        )
        return shared, queue

    def _retention(self) -> dict[str, Any]:
        return {
            "retain_seconds": self.retain_seconds,
            "retain_count": self.retain_count,
            "remember_gone_count": self.remember_gone_count,
            "remember_gone_seconds": self.remember_gone_seconds,
        }


def read_store(c: Collector, value: Any) -> StoreSettings:
    path: KeyPath = ("store",)
    t = open_table(c, path, {} if value is None else value, STORE_KEYS)
    if t is None:
        return StoreSettings()
    d = StoreSettings()
    backend = t.string("backend", d.backend, choices=("memory", "redis"))
    target = read_redis_target(c, t, switch="backend", chosen=backend, default_prefix=d.prefix)
    return StoreSettings(
        backend=backend,
        url=target.url,
        url_env=target.url_env,
        prefix=target.prefix,
        sentinels=target.sentinels,
        sentinel_master=target.sentinel_master,
        retain_seconds=t.number("retain_seconds", d.retain_seconds),
        retain_count=t.integer("retain_count", d.retain_count, minimum=1),
        remember_gone_count=t.integer("remember_gone_count", d.remember_gone_count, minimum=0),
        remember_gone_seconds=t.number(
            "remember_gone_seconds", d.remember_gone_seconds, positive=False
        ),
        claim_idle=t.number("claim_idle", d.claim_idle),
        resend_seconds=t.number("resend_seconds", d.resend_seconds, positive=False),
    )
