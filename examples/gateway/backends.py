"""The demo's backend services: seven small real HTTP servers, each on its own port.

- ``users``: ``GET /users/{id}`` (7, 8 and 9 exist).
- ``quotes``: ``GET /quotes/{sku}?qty=N`` (tea, coffee, cocoa); ``POST /holds`` holds a
  price.
- ``inventory``: ``GET /stock/{sku}``; ``POST /control/hang`` makes stock calls hang
  until ``POST /control/recover``.
- ``mirror_a``, ``mirror_b``: ``GET /search?q=...``, the same catalogue; ``mirror_b``
  takes 1.5 s.
- ``reports``: ``GET /reports/{user}/sections/{n}`` (a quarter of a second each), and
  ``POST /audit`` / ``GET /audit``, a log of events.
- ``payments``: ``POST /charges`` with ``amount`` and ``callback_url`` answers 202, and
  half a second later POSTs ``{"charge_id", "amount", "status": "paid"}`` to the URL.

``serve_backends`` runs them all in the caller's nursery; ``python -m
examples.gateway.backends`` serves them on the ports pipework.toml names, for running the
gateway by hand (``pipework serve examples/gateway/pipework.toml``).
"""

from __future__ import annotations

import collections
import functools
import logging
import secrets
import signal
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import httpx
import trio
from quart import request
from quart_trio import QuartTrio

from pipework.container import BoundAddress, serve

__all__ = ["CONFIG", "SERVICES", "Hang", "configured_ports", "serve_backends"]

CONFIG: Final = Path(__file__).with_name("pipework.toml")
SERVICES: Final = ("users", "quotes", "inventory", "mirror_a", "mirror_b", "reports", "payments")

SLOW_MIRROR_DELAY: Final = 1.5
SECTION_DELAY: Final = 0.25
PAYMENT_DELAY: Final = 0.5

_log = logging.getLogger("demo.backends")

Json = dict[str, Any]
Answer = Json | tuple[Json, int] | tuple[str, int]

USERS: Final[Mapping[str, Json]] = {
    "7": {"id": "7", "name": "Ada", "tier": "gold"},
    "8": {"id": "8", "name": "Grace", "tier": "silver"},
    "9": {"id": "9", "name": "Linus", "tier": "silver"},
}
PRICES: Final[Mapping[str, float]] = {"tea": 4.5, "coffee": 7.25, "cocoa": 5.0}
STOCK: Final[Mapping[str, int]] = {"tea": 40, "coffee": 3, "cocoa": 12}
CATALOGUE: Final = ("green tea", "black tea", "tea pot", "coffee beans", "coffee grinder", "cocoa")
SECTIONS: Final = ("orders", "returns", "payments", "shipping", "reviews", "refunds")


def configured_ports(path: Path = CONFIG) -> dict[str, int]:
    """Each service's port, from the base URLs in the gateway file."""
    with open(path, "rb") as file:
        services = tomllib.load(file)["services"]
    ports: dict[str, int] = {}
    for name in SERVICES:
        port = urlsplit(services[name]["base_url"]).port
        if port is None:
            raise ValueError(f"{path}: services.{name}.base_url names no port")
        ports[name] = port
    return ports


class Hang:
    """A switch: while on, ``wait_released`` waits until it is turned off."""

    def __init__(self) -> None:
        self._released = trio.Event()
        self._released.set()

    @property
    def hanging(self) -> bool:
        return not self._released.is_set()

    def hang(self) -> None:
        if not self.hanging:
            self._released = trio.Event()

    def recover(self) -> None:
        self._released.set()

    async def wait_released(self) -> None:
        await self._released.wait()


def users_app() -> QuartTrio:
    app = QuartTrio("users")

    @app.get("/users/<user_id>")
    async def user(user_id: str) -> Answer:
        found = USERS.get(user_id)
        return (found, 200) if found is not None else ({"error": "no such user"}, 404)

    return app


def quotes_app() -> QuartTrio:
    app = QuartTrio("quotes")

    @app.get("/quotes/<sku>")
    async def quote(sku: str) -> Answer:
        price = PRICES.get(sku)
        qty = request.args.get("qty", "1")
        if price is None:
            return {"error": f"no price for {sku!r}"}, 404
        if not qty.isdigit() or int(qty) < 1:
            return {"error": "qty must be a positive whole number"}, 400
        total = round(price * int(qty), 2)
        return {"sku": sku, "qty": int(qty), "unit_price": price, "total": total}

    @app.post("/holds")
    async def hold() -> Answer:
        body = await request.get_json(silent=True)
        if not isinstance(body, dict) or body.get("sku") not in PRICES:
            return {"error": "send the sku, qty and user_id to hold a price for"}, 400
        return {"hold_id": f"h_{secrets.token_hex(4)}", "sku": body["sku"], "ttl": 600}, 201

    return app


def inventory_app(hang: Hang) -> QuartTrio:
    app = QuartTrio("inventory")

    @app.get("/stock/<sku>")
    async def stock(sku: str) -> Answer:
        await hang.wait_released()
        return {"sku": sku, "available": STOCK.get(sku, 0)}

    @app.post("/control/hang")
    async def start_hanging() -> Answer:
        hang.hang()
        return {"hanging": True}

    @app.post("/control/recover")
    async def recover() -> Answer:
        hang.recover()
        return {"hanging": False}

    return app


def mirror_app(name: str, delay: float) -> QuartTrio:
    app = QuartTrio(name)

    @app.get("/search")
    async def search() -> Answer:
        await trio.sleep(delay)
        q = request.args.get("q", "").lower()
        return {"mirror": name, "q": q, "hits": [item for item in CATALOGUE if q in item]}

    return app


def reports_app() -> QuartTrio:
    app = QuartTrio("reports")
    audit: collections.deque[Any] = collections.deque(maxlen=100)

    @app.get("/reports/<user_id>/sections/<int:n>")
    async def section(user_id: str, n: int) -> Answer:
        await trio.sleep(SECTION_DELAY)  # stands in for a query that takes a while
        title = SECTIONS[(n - 1) % len(SECTIONS)]
        return {"section": n, "title": title, "count": (len(user_id) * 7 + n * 3) % 20}

    @app.post("/audit")
    async def record() -> Answer:
        audit.append(await request.get_json())
        return "", 204

    @app.get("/audit")
    async def records() -> Answer:
        return {"records": list(audit)}

    return app


@dataclass(frozen=True, slots=True)
class Callback:
    url: str
    payload: Json


def payments_app(callbacks: trio.MemorySendChannel[Callback]) -> QuartTrio:
    app = QuartTrio("payments")

    @app.post("/charges")
    async def charge() -> Answer:
        body = await request.get_json(silent=True)
        if not isinstance(body, dict):
            return {"error": "send a JSON object"}, 400
        amount, url = body.get("amount"), body.get("callback_url")
        if not isinstance(amount, int | float) or amount <= 0:
            return {"error": "amount must be a positive number"}, 400
        if not isinstance(url, str) or urlsplit(url).scheme not in ("http", "https"):
            return {"error": "callback_url must be an http(s) URL"}, 400
        charge_id = f"ch_{secrets.token_hex(6)}"
        payload = {"charge_id": charge_id, "amount": amount, "status": "paid"}
        await callbacks.send(Callback(url, payload))
        return {"charge_id": charge_id, "status": "pending"}, 202

    return app


async def _deliver_callbacks(callbacks: trio.MemoryReceiveChannel[Callback]) -> None:
    """What the payment provider does once the customer pays: POST to the callback URL."""
    async with (
        httpx.AsyncClient(timeout=5.0, trust_env=False) as client,
        trio.open_nursery() as nursery,
    ):
        async for callback in callbacks:
            nursery.start_soon(_deliver, client, callback)


async def _deliver(client: httpx.AsyncClient, callback: Callback) -> None:
    await trio.sleep(PAYMENT_DELAY)  # the customer confirms the payment
    try:
        response = await client.post(callback.url, json=callback.payload)
    except httpx.HTTPError as exc:
        _log.warning("payments: callback for %s failed: %r", callback.payload["charge_id"], exc)
        return
    if response.status_code != 204:
        _log.warning(
            "payments: callback for %s answered %d: %s",
            callback.payload["charge_id"],
            response.status_code,
            response.text,
        )


async def serve_backends(
    ports: Mapping[str, int],
    *,
    host: str = "127.0.0.1",
    stop: trio.Event,
    task_status: trio.TaskStatus[dict[str, str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve every service on its port in ``ports`` (0: any free port) until ``stop`` is
    set; ``task_status.started()`` reports each service's base URL."""
    send, receive = trio.open_memory_channel[Callback](100)
    hang = Hang()
    apps: dict[str, Callable[[], QuartTrio]] = {
        "users": users_app,
        "quotes": quotes_app,
        "inventory": functools.partial(inventory_app, hang),
        "mirror_a": functools.partial(mirror_app, "mirror_a", 0.0),
        "mirror_b": functools.partial(mirror_app, "mirror_b", SLOW_MIRROR_DELAY),
        "reports": reports_app,
        "payments": functools.partial(payments_app, send),
    }
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_deliver_callbacks, receive)
        async with trio.open_nursery() as servers:
            urls: dict[str, str] = {}
            for name in SERVICES:
                address: BoundAddress = await servers.start(
                    functools.partial(
                        serve,
                        apps[name](),
                        host=host,
                        port=ports[name],
                        shutdown_trigger=stop,
                        # A hanging stock call is not worth waiting for at shutdown.
                        graceful_timeout=0.5,
                    )
                )
                urls[name] = address.url
            task_status.started(urls)
        # Every server has stopped: callbacks still pending have no one to tell.
        nursery.cancel_scope.cancel()


async def _main() -> None:
    stop = trio.Event()
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            start = functools.partial(serve_backends, configured_ports(), stop=stop)
            urls = await nursery.start(start)
            for name, url in urls.items():
                print(f"{name:<10} {url}", flush=True)
            print("Ctrl-C stops them.", flush=True)
            await signals.__anext__()
            stop.set()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    trio.run(_main)
