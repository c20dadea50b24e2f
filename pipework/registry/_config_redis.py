"""Where a section names its Redis server: ``url`` or ``url_env``, or Sentinels
(``sentinels`` and ``sentinel_master``), and a key ``prefix``.

``[store]`` and ``[boards]`` both say it the same way; one reader keeps their checks and
messages the same. Sentinels become a ``redis+sentinel://`` URL (``pipework/redis/_wire.py``
reads it), which ``url`` or ``url_env`` may also give whole (with a password, say)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final
from urllib.parse import quote

from ..redis._wire import sentinel_target
from ._config_problems import Collector, ConfigError, Problem
from ._config_read import Table

_SCHEMES: Final = ("redis://", "rediss://", "unix://", "redis+sentinel://")
#: The keys of a section that names its Redis server.
REDIS_KEYS: Final = ("url", "url_env", "sentinels", "sentinel_master", "prefix")


@dataclass(frozen=True, slots=True)
class RedisTarget:
    url: str | None
    url_env: str | None
    prefix: str
    #: Sentinels' ``HOST:PORT`` and the name they know the primary by (both or neither).
    sentinels: tuple[str, ...] = ()
    sentinel_master: str | None = None


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
    if url is not None and url.startswith("redis+sentinel://"):
        try:
            sentinel_target(url)
        except ValueError as exc:
            c.error(t.at("url"), f"{exc}: redis+sentinel://HOST:PORT[,HOST:PORT]/MASTER[/DB]")
    sentinels = _sentinels(c, t)
    master = t.string("sentinel_master", None)
    if sentinels and master is None:
        c.error(
            t.at("sentinel_master"),
            "sentinels need sentinel_master: the name the Sentinels monitor the primary by",
        )
    if master is not None and not sentinels:
        c.error(t.at("sentinels"), "sentinel_master needs sentinels: their HOST:PORT addresses")
    if sentinels and (url is not None or url_env is not None):
        c.error(
            t.at("sentinels"),
            "set url (or url_env) or sentinels, not both (a redis+sentinel:// URL in "
            "url_env may carry a password)",
        )
    if chosen == "redis":
        if url is None and url_env is None and not sentinels:
            c.error(
                t.at("url"),
                f'{switch} = "redis" needs url (or url_env, or sentinels) naming the server',
            )
        if not c_reader_installed():
            c.warn(
                t.at(switch),
                "hiredis is not installed: Redis's replies are read in Python, which costs "
                "more CPU; pip install 'pipework[redis]' brings its C reader",
            )
    elif url is not None or url_env is not None or sentinels:
        used = "url" if url is not None else "url_env" if url_env is not None else "sentinels"
        c.warn(t.at(used), f'used only with {switch} = "redis"')
    return RedisTarget(url, url_env, prefix, sentinels, master)


def _sentinels(c: Collector, t: Table) -> tuple[str, ...]:
    """``sentinels``: an array of ``HOST:PORT`` strings, each checked."""
    value = t.data.get("sentinels")
    if value is None:
        return ()
    if not isinstance(value, list) or not value:
        c.error(t.at("sentinels"), f'expected an array of "HOST:PORT", got {value!r}')
        return ()
    found: list[str] = []
    for i, item in enumerate(value):
        if not isinstance(item, str) or "," in item:
            c.error((*t.at("sentinels"), i), f'expected a Sentinel\'s "HOST:PORT", got {item!r}')
            continue
        try:
            sentinel_target(f"redis+sentinel://{item}/m")
        except ValueError as exc:
            c.error((*t.at("sentinels"), i), f'{exc} (a Sentinel\'s "HOST:PORT")')
            continue
        found.append(item)
    return tuple(found)


def redis_url(
    section: str,
    url: str | None,
    url_env: str | None,
    environ: Mapping[str, str] | None,
    sentinels: tuple[str, ...] = (),
    sentinel_master: str | None = None,
) -> str:
    """The server's URL, from the file (its Sentinels' as a ``redis+sentinel://`` URL) or
    from the environment variable it names."""
    if sentinels and sentinel_master is not None:
        return f"redis+sentinel://{','.join(sentinels)}/{quote(sentinel_master, safe='')}"
    if url is not None:
        return url
    assert url_env is not None
    found = (os.environ if environ is None else environ).get(url_env)
    if not found:  # checked with the file when it is loaded for serving: a late change
        message = f"names the environment variable {url_env!r}, which is not set"
        raise ConfigError([Problem(f"{section}.url_env", message)])
    return found
