"""Proxy routes: requests passed through to a service as they are.

- ``_route``: :class:`ProxyRoute` (a prefix, methods and a service, checked when made),
  :class:`ProxyTable` (which route a request takes) and the target sent on;
- ``_forwarding``: the header policy both ways (hop-by-hop fields, framing,
  ``X-Forwarded-*``, ``Forwarded``, ``Via``), pure functions;
- ``_websocket`` (rules without I/O in ``_websocket_core``): a websocket relayed to the
  service's, frames both ways, close codes kept;
- ``_upstream``: a service as the proxy sees it (address, time limits, a streaming client);
- ``_relay``: the request body and the client's hang-up at the ASGI boundary;
- ``_asgi``: :class:`ProxyLayer`, the ASGI app in front of the container's own (made of
  ``_asgi_service``, the exchange with the service and the route's chains, and
  ``_asgi_websocket``); one request's record and the small rules it goes by in
  ``_exchange``; the routes in force, swapped whole on reload, in ``_proxies``
  (:class:`ProxySet`).

This package sits below the container, which mounts it in front of its app, and above
``_http`` (docs/design.md, "Layers"); it never imports the container or the registry.
"""

from ._asgi import ProxyLayer
from ._proxies import ProxySet
from ._route import ProxyMiss, ProxyRoute, ProxyTable
from ._upstream import Streams, Upstream

__all__ = [
    "ProxyLayer",
    "ProxyMiss",
    "ProxyRoute",
    "ProxySet",
    "ProxyTable",
    "Streams",
    "Upstream",
]
