"""The collector's young threshold while a container serves: raised for the serving, put
back when the last server in the process stops, left alone when asked."""

from __future__ import annotations

import functools
import gc

import pytest
import trio

import pipework as pw
from pipework.container import BoundAddress, Container, ContainerConfig
from pipework.container._collector import SERVING_GC_THRESHOLD, tuned_collector


def test_nested_servers_restore_the_thresholds_when_the_last_one_stops() -> None:
    found = gc.get_threshold()
    with tuned_collector(SERVING_GC_THRESHOLD):
        assert gc.get_threshold() == (SERVING_GC_THRESHOLD, *found[1:])
        with tuned_collector(SERVING_GC_THRESHOLD):
            pass
        assert gc.get_threshold()[0] == SERVING_GC_THRESHOLD  # the outer one still serves
        with tuned_collector(None):
            assert gc.get_threshold()[0] == SERVING_GC_THRESHOLD
    assert gc.get_threshold() == found


def test_a_lower_threshold_than_the_current_one_is_left_alone() -> None:
    found = gc.get_threshold()
    with tuned_collector(1):
        assert gc.get_threshold() == found
    assert gc.get_threshold() == found


def test_the_threshold_must_be_positive() -> None:
    with pytest.raises(ValueError, match="gc_threshold"):
        ContainerConfig(gc_threshold=0)


async def test_a_container_serves_with_the_raised_threshold_and_restores_it() -> None:
    found = gc.get_threshold()
    seen: list[tuple[int, int, int]] = []
    for config in (ContainerConfig(), ContainerConfig(gc_threshold=None)):
        stop = trio.Event()
        async with pw.Engine(registry=pw.Registry()) as engine:
            container = Container(engine, None, config)
            async with trio.open_nursery() as nursery:
                _: BoundAddress = await nursery.start(
                    functools.partial(container.serve, shutdown_trigger=stop)
                )
                seen.append(gc.get_threshold())
                stop.set()
        assert gc.get_threshold() == found
    assert seen == [(SERVING_GC_THRESHOLD, *found[1:]), found]
