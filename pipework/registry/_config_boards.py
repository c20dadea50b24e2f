"""The ``[boards.NAME]`` sections of a gateway file: push boards, their batching, limits
and tokens; and ``[boards]``' own keys, the backplane that carries the boards' writes
between processes (see docs/configuration.md#boards)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from ..board import Backplane, BoardSettings, BoardSpec
from ..board._jobs import JOB_BOARD
from ._config_problems import Collector, KeyPath
from ._config_read import Table, check_name, open_table
from ._config_redis import REDIS_KEYS, read_redis_target, redis_url

__all__ = ["BACKPLANE_KEYS", "BOARD_KEYS", "BackplaneSettings", "BoardConfig", "read_boards"]

#: ``[boards]``' own keys (not boards: a board is a table, ``[boards.NAME]``).
BACKPLANE_KEYS: Final = ("backplane", *REDIS_KEYS)

BOARD_KEYS: Final = (
    "window",
    "max_batch",
    "keep_all",
    "history",
    "max_queue",
    "max_followers",
    "max_followers_per_resource",
    "max_resources",
    "keepalive",
    "long_poll",
    "public_read",
    "write_token",
    "write_token_env",
    "read_token",
    "read_token_env",
)


@dataclass(frozen=True, slots=True)
class BoardConfig:
    """``[boards.NAME]``: the board's settings; tokens are read from the environment (or,
    discouraged, from the file) when the gateway starts."""

    name: str
    settings: BoardSettings
    keepalive: float = 15.0
    long_poll: float = 30.0
    public_read: bool = False
    write_token: str | None = None
    write_token_env: str | None = None
    read_token: str | None = None
    read_token_env: str | None = None

    def spec(self, environ: Mapping[str, str] | None = None) -> BoardSpec:
        env = os.environ if environ is None else environ

        def token(literal: str | None, variable: str | None) -> str | None:
            if literal is not None:
                return literal
            return None if variable is None else env.get(variable) or None

        return BoardSpec(
            self.name,
            self.settings,
            write_token=token(self.write_token, self.write_token_env),
            read_token=token(self.read_token, self.read_token_env),
            public_read=self.public_read,
            keepalive=self.keepalive,
            long_poll=self.long_poll,
        )


@dataclass(frozen=True, slots=True)
class BackplaneSettings:
    """``[boards] backplane``: ``local`` (each process's boards are its own) or ``redis``
    (every process on the same server and ``prefix`` shares them); ``url`` or the
    environment variable ``url_env`` names the server (a password belongs in the
    environment, not in the file)."""

    backplane: str = "local"
    url: str | None = None
    url_env: str | None = None
    prefix: str = "pipework"
    sentinels: tuple[str, ...] = ()
    sentinel_master: str | None = None

    def url_value(self, environ: Mapping[str, str] | None = None) -> str:
        return redis_url(
            "boards", self.url, self.url_env, environ, self.sentinels, self.sentinel_master
        )

    def build(self, environ: Mapping[str, str] | None = None) -> Backplane | None:
        """The backplane a container gets (None: its own, in-process)."""
        if self.backplane == "local":
            return None
        from ..redis._backplane import RedisBackplane  # the optional extra

        return RedisBackplane(self.url_value(environ), prefix=self.prefix)


def read_boards(c: Collector, value: Any) -> tuple[dict[str, BoardConfig], BackplaneSettings]:
    if value is None:
        return {}, BackplaneSettings()
    if not isinstance(value, dict):
        c.error(("boards",), "expected a table of boards, [boards.NAME]")
        return {}, BackplaneSettings()
    own = {k: v for k, v in value.items() if k in BACKPLANE_KEYS and not isinstance(v, dict)}
    backplane = _backplane(c, Table(c, ("boards",), own))
    boards: dict[str, BoardConfig] = {}
    for name, spec in value.items():
        path: KeyPath = ("boards", name)
        if name in own:
            continue
        if name in BACKPLANE_KEYS:
            c.error(
                path,
                f"{name!r} is one of [boards]' own keys ({', '.join(BACKPLANE_KEYS)}), "
                "not a board name; name the board otherwise",
            )
            continue
        if not check_name(c, path, name, "board"):
            continue
        if name == JOB_BOARD:
            c.error(path, f"the board name {JOB_BOARD!r} is the job board's; choose another")
            continue
        t = open_table(c, path, spec, BOARD_KEYS)
        if t is not None:
            board = _board(c, t, name)
            if board is not None:
                boards[name] = board
    return boards, backplane


def _backplane(c: Collector, t: Table) -> BackplaneSettings:
    d = BackplaneSettings()
    backplane = t.string("backplane", d.backplane, choices=("local", "redis"))
    target = read_redis_target(c, t, switch="backplane", chosen=backplane, default_prefix=d.prefix)
    return BackplaneSettings(
        backplane=backplane,
        url=target.url,
        url_env=target.url_env,
        prefix=target.prefix,
        sentinels=target.sentinels,
        sentinel_master=target.sentinel_master,
    )


def _token(c: Collector, t: Table, key: str) -> tuple[str | None, str | None]:
    literal = t.string(key, None)
    variable = t.string(f"{key}_env", None)
    if literal is not None and variable is not None:
        c.error(t.at(key), f"set {key} or {key}_env, not both")
    elif literal is not None:
        c.warn(
            t.at(key),
            f"a token written in the file is readable by whoever reads the file; prefer {key}_env",
        )
    return literal, variable


def _board(c: Collector, t: Table, name: str) -> BoardConfig | None:
    d = BoardSettings()
    settings = BoardSettings(
        window=t.number("window", d.window, positive=False),
        max_batch=t.integer("max_batch", d.max_batch, minimum=1),
        keep_all=t.boolean("keep_all", d.keep_all),
        history=t.integer("history", d.history, minimum=1),
        max_queue=t.integer("max_queue", d.max_queue, minimum=1),
        max_followers=t.integer("max_followers", d.max_followers, minimum=1),
        max_per_resource=t.integer("max_followers_per_resource", d.max_per_resource, minimum=1),
        max_resources=t.integer("max_resources", d.max_resources, minimum=1),
    )
    write_token, write_env = _token(c, t, "write_token")
    read_token, read_env = _token(c, t, "read_token")
    public_read = t.boolean("public_read", False)
    if write_token is None and write_env is None:
        c.warn(t.path, "no write_token_env: nothing can write to this board over HTTP")
    if not public_read and read_token is None and read_env is None and write_env is None:
        c.warn(t.path, "no read token and not public_read: nobody can follow this board")
    return BoardConfig(
        name,
        settings,
        keepalive=t.number("keepalive", 15.0),
        long_poll=t.number("long_poll", 30.0),
        public_read=public_read,
        write_token=write_token,
        write_token_env=write_env,
        read_token=read_token,
        read_token_env=read_env,
    )
