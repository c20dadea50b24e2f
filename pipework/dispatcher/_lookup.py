"""What the dispatcher needs of a plan: chains by name. Nothing else, so the dispatcher
depends on no register centre, route table or configuration file."""

from __future__ import annotations

from typing import Protocol

from ..pipes._stages import Chain

__all__ = ["ChainLookup"]


class ChainLookup(Protocol):
    """Finds a registered chain by name, raising ``RegistrationError`` for unknown names
    (:class:`~pipework.Catalogue` and :class:`~pipework.Registry` are ones)."""

    def get_chain(self, name: str, /) -> Chain: ...
