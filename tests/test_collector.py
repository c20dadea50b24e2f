"""The collector while a container serves: its young threshold raised and the heap frozen
when asked (``pipework serve`` asks by default; an embedding program's container does not),
both put back when the last server in the process stops; frozen again after a reload."""

from __future__ import annotations

import functools
import gc
import weakref
from dataclasses import replace
from pathlib import Path

import pytest
import trio

import pipework as pw
from pipework import ConfigError, Gateway, load_config
from pipework.__main__ import _overrides, build_parser
from pipework.container import BoundAddress, Container, ContainerConfig
from pipework.container._collector import SERVING_GC_THRESHOLD, refreeze, tuned_collector
from pipework.registry._gateway import _container_config


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


async def test_a_container_serves_with_the_raised_threshold_only_when_asked() -> None:
    found = gc.get_threshold()
    seen: list[tuple[int, int, int]] = []
    for config in (ContainerConfig(gc_threshold=SERVING_GC_THRESHOLD), ContainerConfig()):
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


def test_pipework_serve_raises_it_unless_the_file_or_the_command_line_says_otherwise(
    tmp_path: Path,
) -> None:
    path = tmp_path / "gateway.toml"
    for server, flags, expected in (
        ("", [], SERVING_GC_THRESHOLD),
        ("gc_threshold = 20000", [], 20_000),
        ("gc_threshold = 0", [], None),
        ("gc_threshold = 20000", ["--gc-threshold", "0"], None),
        ("", ["--gc-threshold", "30000"], 30_000),
    ):
        path.write_text(f"[server]\n{server}\n")
        args = build_parser().parse_args(["serve", str(path), *flags])
        gateway = Gateway(str(path), overrides=_overrides(args))
        config = replace(_container_config(gateway.config), **gateway.overrides)
        assert config.gc_threshold == expected, (server, flags)


def test_a_negative_threshold_is_refused_where_it_was_written(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text("[server]\ngc_threshold = -1\n")
    with pytest.raises(ConfigError, match=r"server\.gc_threshold"):
        load_config(path)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", str(path), "--gc-threshold", "-1"])


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_freezing_nests_and_ends_with_the_last_server() -> None:
    assert gc.get_freeze_count() == 0
    with tuned_collector(None, freeze=True):
        frozen = gc.get_freeze_count()
        assert frozen > 0  # everything alive now: never scanned while serving
        with tuned_collector(None, freeze=True):
            assert gc.get_freeze_count() == frozen  # frozen once
        assert gc.get_freeze_count() == frozen  # the outer one still serves
    assert gc.get_freeze_count() == 0


def test_a_reload_freezes_again_so_the_old_plan_is_collected() -> None:
    plan = _Cycle()  # what a plan made at start-up is: garbage after a reload, in cycles
    gone = weakref.ref(plan)
    with tuned_collector(None, freeze=True):
        del plan
        gc.collect()
        assert gone() is not None  # frozen: no collection frees it
        refreeze()
        assert gone() is None
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_refreeze_leaves_an_unfrozen_heap_alone() -> None:
    refreeze()
    assert gc.get_freeze_count() == 0


def test_pipework_serve_freezes_unless_the_file_says_otherwise(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    for server, expected in (("", True), ("gc_freeze = false", False)):
        path.write_text(f"[server]\n{server}\n")
        assert _container_config(Gateway(str(path)).config).gc_freeze is expected
    assert ContainerConfig().gc_freeze is False  # an embedding program's process: its own
    path.write_text('[server]\ngc_freeze = "yes"\n')
    with pytest.raises(ConfigError, match=r"server\.gc_freeze"):
        load_config(path)


async def test_a_gateway_serves_frozen_and_unfreezes_when_it_stops(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text("[server]\nport = 0\n")
    gateway = Gateway(str(path))
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(gateway.run, port=0, stop=stop))
        assert gc.get_freeze_count() > 0
        stop.set()
    assert gc.get_freeze_count() == 0
