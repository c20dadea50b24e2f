"""A gateway with proxy routes, served from its file on a free port, for the tests that put
it in front of a backend of their own (``tests/_proxy_backend.py``, or a raw one)."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Protocol

import trio

from pipework import Gateway
from pipework.container import BoundAddress

__all__ = ["API", "gateway", "gateway_file"]


class Served(Protocol):
    """A backend: where it is served."""

    @property
    def url(self) -> str: ...


def gateway_file(backend: Served, routes: str, *, service: str = "", server: str = "") -> str:
    """A gateway file with the service ``echo`` at ``backend`` (``service``: its keys
    besides ``base_url`` and ``timeout``), ``routes`` and ``server`` (keys of ``[server]``)."""
    return f"""
[server]
admin_token = "proxy-admin"
{server}

[services.echo]
base_url = "{backend.url}"
timeout = 5
{service or "limit = 4"}

{routes}
"""


#: Every path under ``/api`` to ``echo``, the prefix stripped.
API = """
[routes.api]
proxy = "echo"
prefix = "/api"
strip_prefix = true
"""


@asynccontextmanager
async def gateway(
    tmp_path: Path, text: str, **python: Any
) -> AsyncIterator[tuple[Gateway, BoundAddress]]:
    """The gateway of file ``text`` (written under ``tmp_path``), served on a free port."""
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    gw = Gateway(str(path), **python)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        address: BoundAddress = await nursery.start(functools.partial(gw.run, port=0, stop=stop))
        try:
            yield gw, address
        finally:
            stop.set()
