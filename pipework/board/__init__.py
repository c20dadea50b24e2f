"""The push board: resources a client follows, told when they change instead of polling.

- ``_core``: every decision, as a pure state machine (no I/O, no clock, no trio);
- ``_driver``: the trio driver (:class:`Boards`: one flush task for every board, followers
  that wait) and the :class:`Backplane` every write goes through;
- ``_jobs``: job status published on the ``jobs`` board (the engine's observer);
- ``_api``: the board over HTTP (``/boards``, ``/jobs/{id}/events``, ``/jobs/events``),
  with ``_page`` (the jobs page) and ``_metrics`` (``pipework_board_*``).

The container serves the HTTP side; a backplane (the Redis one) and the gateway file's
``[boards]`` use the names below, the board's vocabulary. The board sits below the
container and imports nothing of it (docs/design.md, "Layers" and "Push boards").
"""

from __future__ import annotations

from ._core import BoardCore as BoardCore
from ._core import BoardFull as BoardFull
from ._core import BoardSettings as BoardSettings
from ._core import BoardStatistics as BoardStatistics
from ._core import Event as Event
from ._core import Kind as Kind
from ._core import ResourceExists as ResourceExists
from ._core import ResourceNotFound as ResourceNotFound
from ._core import Taken as Taken
from ._core import Version as Version
from ._driver import Backplane as Backplane
from ._driver import Boards as Boards
from ._driver import BoardSpec as BoardSpec
from ._driver import BoardUnavailable as BoardUnavailable
from ._driver import Change as Change
from ._driver import Follower as Follower
from ._driver import LocalBackplane as LocalBackplane
from ._driver import new_epoch as new_epoch

__all__ = [
    "Backplane",
    "BoardCore",
    "BoardFull",
    "BoardSettings",
    "BoardSpec",
    "BoardStatistics",
    "BoardUnavailable",
    "Boards",
    "Change",
    "Event",
    "Follower",
    "Kind",
    "LocalBackplane",
    "ResourceExists",
    "ResourceNotFound",
    "Taken",
    "Version",
    "new_epoch",
]
