"""Distributed mode: the job store and event queue on Redis (``pip install pipework[redis]``).

Several processes given stores and queues on the same server and prefix share one job pool:
any of them may run a job's next step, and a status request or a signal may land on any of
them. See docs/scaling.md.
"""

from __future__ import annotations

from ._errors import StoreUnavailable
from .dispatcher._redis_queue import RedisEventQueue
from .dispatcher._redis_store import RedisJobStore

__all__ = ["RedisEventQueue", "RedisJobStore", "StoreUnavailable"]
