"""The register centre: a catalogue of pipes and chains, plus the HTTP routes that start
them. The gateway file builds one; an :class:`~pipework.Engine` runs on it and a
:class:`~pipework.Container` serves its routes."""

from __future__ import annotations

from .._errors import RegistrationError
from ..container._routes import BodyKind, Mode, OnDisconnect, Route, RouteTable
from ..pipes._catalogue import Catalogue

__all__ = ["Registry"]


class Registry(Catalogue):
    """Pipes and chains by name (see :class:`~pipework.Catalogue`) and routes to them."""

    def __init__(self) -> None:
        super().__init__()
        self._routes = RouteTable()

    def route(
        self,
        name: str,
        *,
        path: str,
        chain: str,
        method: str = "POST",
        mode: Mode = "sync",
        timeout: float | None = None,
        sync_wait: float = 10.0,
        on_disconnect: OnDisconnect = "cancel",
        max_body: int | None = None,
        body: BodyKind = "object",
    ) -> Route:
        """Register an HTTP route that submits a job on ``chain`` (registered first)."""
        return self.add_route(
            Route(
                name, method, path, chain, mode, timeout, sync_wait, on_disconnect, max_body, body
            )
        )

    def add_route(self, route: Route) -> Route:
        chain = self._chains.get(route.chain)
        if chain is None:
            raise RegistrationError(
                f"route {route.name!r} runs chain {route.chain!r}, which is not registered; "
                "register the chain first"
            )
        use = chain.request_use
        if use is not None and use.body and route.body != "raw":
            raise RegistrationError(
                f"route {route.name!r} runs chain {route.chain!r}, whose pipes send the "
                "request's body as it came: declare the route with body='raw'"
            )
        return self._routes.add(route)

    @property
    def routes(self) -> dict[str, Route]:
        return self._routes.as_dict()
