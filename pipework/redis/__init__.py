"""Distributed mode: every Redis part of pipework (``pip install 'pipework[redis]'``).

Several processes given stores and queues on the same server and prefix share one job pool:
any of them may run a job's next step, and a status request or a signal may land on any of
them. See docs/scaling.md.

The engine and the container never import this package: the registry (``[store]`` and
``[boards]``), or a program, builds these parts and hands them to an engine or a container
through their interfaces (the layers are checked by ``lint-imports``). Inside:

- ``_wire``: the RESP protocol and one connection (``Connection``), read by hiredis's C
  reader when it is installed (a Python reader otherwise);
- ``_client``: on top of it, a connection concurrent callers share (``Client``), and a
  pub/sub subscription that is made again after every reconnect (``Subscription``);
- ``_scripts``: the Lua scripts, files under ``lua/`` read once at import;
- ``_batches`` and ``_store``: the job store, its calls batched on one connection (the
  store in layers: ``_store_resend``, ``_store_ends``, ``_store_reads``, ``_store_writes``;
  its records' format in ``_record``, its scripts' commands in ``_store_scripts``);
- ``_queue`` and ``_timers``: the event queue on a Stream (in layers: ``_queue_reads``,
  ``_queue_shared``, the writes in the store's round trips; its events' format in
  ``_queue_events``), and suspend timers;
- ``_relay``: a job's progress, chunks and cancels between processes;
- ``_backplane``: the push board's writes shared between processes.

One client speaks to Redis for all of them: pipework's own (see docs/design.md, "One Redis
client").
"""

from __future__ import annotations

from .._errors import StoreUnavailable
from ._queue import RedisEventQueue
from ._store import RedisJobStore

__all__ = ["RedisEventQueue", "RedisJobStore", "StoreUnavailable"]
