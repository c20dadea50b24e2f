"""What operators' tools ask the container: ``/healthz`` (alive), ``/readyz`` (ready to take
work) and ``/metrics`` (how it is doing).

``/healthz`` answers while the process serves at all. ``/readyz`` proves a job gets through
the queue and a worker: it runs the engine's canary chain (:meth:`Engine.probe`) within
``readiness_timeout``, and answers 503 while the pool refuses work, when the canary is too
slow, or once a shutdown has begun (so a balancer stops sending before the server stops).
``/metrics`` is the engine's registry in Prometheus' text format; with several processes,
the whole node's.
"""

from __future__ import annotations

from typing import Any, Final

import trio
from quart import Response

from .._errors import Overloaded
from .._http._bodies import JSON, dumps_json
from .._http._problems import Problem, problem_for_exception
from .._metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ..dispatcher._engine import Engine
from ..dispatcher._probe import PROBE_CHAIN
from ._modes_core import shutting_down
from ._parking import Parking

__all__ = ["CANARY_CHAIN", "Probes", "healthz"]

#: The chain ``/readyz`` runs to prove a job gets through the queue and a worker: the
#: engine's own (:meth:`Engine.probe`), in no registry, so reloads leave it in place.
CANARY_CHAIN: Final = PROBE_CHAIN


async def healthz() -> Response:
    return _json({"status": "ok"})


class Probes:
    """The handlers behind ``/readyz`` and ``/metrics``."""

    def __init__(self, engine: Engine, parking: Parking, *, readiness_timeout: float) -> None:
        self.engine = engine
        self.parking = parking
        self.readiness_timeout = readiness_timeout

    async def readyz(self) -> Response:
        if self.parking.draining:
            raise shutting_down()
        limit = self.readiness_timeout
        try:
            await self.engine.probe(limit)
        except Overloaded as exc:
            raise problem_for_exception(exc) from None
        except trio.TooSlowError:
            raise Problem(
                503,
                "Not ready",
                f"the canary job did not get through the queue and a worker in {limit:g}s",
                slug="not-ready",
                headers={"Retry-After": "1"},
            ) from None
        return _json({"status": "ready"})

    async def metrics(self) -> Response:
        metrics = self.engine.metrics
        if metrics.multiprocess_dir is None:
            body = metrics.exposition()
        else:  # the whole node's: this process's state first, then every process's files
            metrics.publish()
            body = await trio.to_thread.run_sync(metrics.node_exposition)
        return Response(body, content_type=METRICS_CONTENT_TYPE)


def _json(value: Any, status: int = 200) -> Response:
    return Response(dumps_json(value), status=status, content_type=JSON)
