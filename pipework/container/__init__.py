"""The HTTP container: quart-trio on hypercorn."""

from __future__ import annotations

from ._app import CANARY_CHAIN as CANARY_CHAIN
from ._app import Container as Container
from ._app import ContainerConfig as ContainerConfig
from ._app import create_app as create_app
from ._callbacks import CallbackSigner as CallbackSigner
from ._server import BoundAddress as BoundAddress
from ._server import serve as serve

__all__ = [
    "CANARY_CHAIN",
    "BoundAddress",
    "CallbackSigner",
    "Container",
    "ContainerConfig",
    "create_app",
    "serve",
]
