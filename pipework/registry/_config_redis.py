"""Where a section names its Redis server: ``url`` or ``url_env``, and a key ``prefix``.

``[store]`` and ``[boards]`` both say it the same way; one reader keeps their checks and
messages the same."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from ._config_problems import Collector, ConfigError, Problem
from ._config_read import Table

_SCHEMES: Final = ("redis://", "rediss://", "unix://")


@dataclass(frozen=True, slots=True)
class RedisTarget:
    url: str | None
    url_env: str | None
    prefix: str


def c_reader_installed() -> bool:
    """Whether hiredis, the redis extra's reader of replies, is installed."""
    return importlib.util.find_spec("hiredis") is not None


def read_redis_target(
    c: Collector, t: Table, *, switch: str, chosen: str, default_prefix: str
) -> RedisTarget:
    """Read ``url``, ``url_env`` and ``prefix`` from ``t``; ``switch`` is the key that picks
    Redis (``backend``, ``backplane``) and ``chosen`` whether it does (its value)."""
    url = t.string("url", None)
    url_env = t.string("url_env", None)
    prefix = t.string("prefix", default_prefix)
    if ":" in prefix:
        c.error(t.at("prefix"), f"a key prefix may not contain ':', got {prefix!r}")
    if url is not None and not url.startswith(_SCHEMES):
        c.error(t.at("url"), f"expected a URL starting with {', '.join(_SCHEMES)}, got {url!r}")
    if url is not None and url_env is not None:
        c.error(t.at("url"), "set url or url_env, not both")
    if chosen == "redis":
        if url is None and url_env is None:
            c.error(t.at("url"), f'{switch} = "redis" needs url (or url_env) naming the server')
        if not c_reader_installed():
            c.warn(
                t.at(switch),
                "hiredis is not installed: Redis's replies are read in Python, which costs "
                "more CPU; pip install 'pipework[redis]' brings its C reader",
            )
    elif url is not None or url_env is not None:
        c.warn(t.at("url" if url is not None else "url_env"), f'used only with {switch} = "redis"')
    return RedisTarget(url, url_env, prefix)


def redis_url(
    section: str, url: str | None, url_env: str | None, environ: Mapping[str, str] | None
) -> str:
    """The server's URL, from the file or from the environment variable it names."""
    if url is not None:
        return url
    assert url_env is not None
    found = (os.environ if environ is None else environ).get(url_env)
    if not found:  # checked with the file when it is loaded for serving: a late change
        message = f"names the environment variable {url_env!r}, which is not set"
        raise ConfigError([Problem(f"{section}.url_env", message)])
    return found
