"""Proxy routes: requests passed through to a service as they came, streamed both ways."""

from ._asgi import ProxyLayer, ProxySet
from ._route import ProxyMiss, ProxyRoute, ProxyTable

__all__ = ["ProxyLayer", "ProxyMiss", "ProxyRoute", "ProxySet", "ProxyTable"]
