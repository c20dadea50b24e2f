"""The ``[store]`` section: where jobs and events live. ``memory`` (the default) keeps them
in the serving process; ``redis`` shares them between every process pointed at the same
server and prefix (docs/scaling.md)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from ..dispatcher._queue import EventQueue
from ..dispatcher._store import JobStore, MemoryJobStore
from ._config_problems import Collector, KeyPath
from ._config_read import open_table

__all__ = ["StoreSettings", "read_store"]

STORE_KEYS: Final = (
    "backend",
    "url",
    "url_env",
    "prefix",
    "retain_seconds",
    "retain_count",
    "claim_idle",
)
_SCHEMES: Final = ("redis://", "rediss://", "unix://")


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """``[store]``. ``url`` or the environment variable ``url_env`` names the Redis server
    (a password belongs in the environment, not in the file)."""

    backend: str = "memory"
    url: str | None = None
    url_env: str | None = None
    prefix: str = "pipework"
    retain_seconds: float = 3600.0
    retain_count: int = 10_000
    claim_idle: float = 30.0

    def url_value(self, environ: Mapping[str, str] | None = None) -> str:
        if self.url is not None:
            return self.url
        assert self.url_env is not None
        found = (os.environ if environ is None else environ).get(self.url_env)
        if not found:
            raise RuntimeError(
                f"[store] url_env names {self.url_env!r}, which is not set in the environment"
            )
        return found

    def build(
        self, *, queue_capacity: int, environ: Mapping[str, str] | None = None
    ) -> tuple[JobStore, EventQueue | None]:
        """The job store and event queue an engine gets (None: its in-memory queue)."""
        if self.backend == "memory":
            store = MemoryJobStore(
                retain_seconds=self.retain_seconds, retain_count=self.retain_count
            )
            return store, None
        from ..redis import RedisEventQueue, RedisJobStore  # the optional extra

        url = self.url_value(environ)
        shared = RedisJobStore(
            url,
            prefix=self.prefix,
            retain_seconds=self.retain_seconds,
            retain_count=self.retain_count,
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


def read_store(c: Collector, value: Any) -> StoreSettings:
    path: KeyPath = ("store",)
    t = open_table(c, path, {} if value is None else value, STORE_KEYS)
    if t is None:
        return StoreSettings()
    d = StoreSettings()
    backend = t.string("backend", d.backend, choices=("memory", "redis"))
    url = t.string("url", None)
    url_env = t.string("url_env", None)
    prefix = t.string("prefix", d.prefix)
    if ":" in prefix:
        c.error(t.at("prefix"), f"a key prefix may not contain ':', got {prefix!r}")
    if url is not None and not url.startswith(_SCHEMES):
        c.error(t.at("url"), f"expected a URL starting with {', '.join(_SCHEMES)}, got {url!r}")
    if url is not None and url_env is not None:
        c.error(t.at("url"), "set url or url_env, not both")
    if backend == "redis":
        if url is None and url_env is None:
            c.error(t.at("url"), 'backend = "redis" needs url (or url_env) naming the server')
        if importlib.util.find_spec("coredis") is None:
            c.error(
                t.at("backend"),
                "the redis backend needs the redis extra: pip install 'pipework[redis]'",
            )
    elif url is not None or url_env is not None:
        c.warn(t.at("url" if url is not None else "url_env"), 'used only with backend = "redis"')
    return StoreSettings(
        backend=backend,
        url=url,
        url_env=url_env,
        prefix=prefix,
        retain_seconds=t.number("retain_seconds", d.retain_seconds),
        retain_count=t.integer("retain_count", d.retain_count, minimum=1),
        claim_idle=t.number("claim_idle", d.claim_idle),
    )
