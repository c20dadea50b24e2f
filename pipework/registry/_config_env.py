"""The environment variables a gateway file names (every ``*_env`` key), checked against
an environment: ``pipework check`` and ``pipework serve`` look before anything starts.

A variable that is unset or empty counts as unset (pipework reads it so). What follows:

- ``[store] url_env`` with ``backend = "redis"``, ``[boards] url_env`` with
  ``backplane = "redis"``: an error -- the server could not start without its Redis URL;
- ``[server] admin_token_env``: a warning -- the admin API stays off;
- ``[server] callback_secret_env``: a warning -- callback URLs are signed with another
  secret (``PIPEWORK_CALLBACK_SECRET``, the store's, or one made at start);
- ``[boards.NAME] write_token_env`` / ``read_token_env``: a warning -- no HTTP writes, or
  reads by the write token's holder only (none of it with ``public_read``).
"""

from __future__ import annotations

from collections.abc import Mapping

from ._config_boards import BackplaneSettings, BoardConfig
from ._config_problems import Collector
from ._config_sections import ServerConfig
from ._config_store import StoreSettings

__all__ = ["check_environment"]


def _unset(environ: Mapping[str, str], variable: str | None) -> bool:
    return variable is not None and not environ.get(variable)


def check_environment(
    c: Collector,
    environ: Mapping[str, str],
    *,
    server: ServerConfig,
    store: StoreSettings,
    backplane: BackplaneSettings,
    boards: Mapping[str, BoardConfig],
) -> None:
    """Report every variable the file names that ``environ`` leaves unset."""

    def said(variable: str) -> str:
        return f"names the environment variable {variable!r}, which is not set"

    if store.backend == "redis" and store.url is None and _unset(environ, store.url_env):
        c.error(("store", "url_env"), f"{said(store.url_env or '')}: the job store has no URL")
    redis_boards = backplane.backplane == "redis" and backplane.url is None
    if redis_boards and _unset(environ, backplane.url_env):
        c.error(
            ("boards", "url_env"),
            f"{said(backplane.url_env or '')}: the board backplane has no URL",
        )
    if server.admin_token is None and _unset(environ, server.admin_token_env):
        c.warn(
            ("server", "admin_token_env"),
            f"{said(server.admin_token_env or '')}: the admin API would be off",
        )
    if _unset(environ, server.callback_secret_env):
        c.warn(
            ("server", "callback_secret_env"),
            f"{said(server.callback_secret_env or '')}: callback URLs would be signed with "
            "PIPEWORK_CALLBACK_SECRET, the job store's secret or one made at start",
        )
    for name, board in boards.items():
        if board.write_token is None and _unset(environ, board.write_token_env):
            c.warn(
                ("boards", name, "write_token_env"),
                f"{said(board.write_token_env or '')}: the board would take no HTTP writes",
            )
        if (
            board.read_token is None
            and not board.public_read
            and _unset(environ, board.read_token_env)
        ):
            c.warn(
                ("boards", name, "read_token_env"),
                f"{said(board.read_token_env or '')}: only the write token could read the board",
            )
