"""The resilience benchmark (benchmarks/bench_resilience.py, benchmarks/resilience) cannot
rot unnoticed: its gateway files load, HAProxy accepts its configuration, the replicas
behave as told and log what they get, the load script records every request with its own
id, both gateways pass a call on and say their state, and the figures are read right from
runs made up here (no load measured, no timing asserted)."""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
from pathlib import Path

import pytest
import trio

import pipework as pw
from benchmarks import _load, bench_resilience
from benchmarks.bench_peers import enter_all
from benchmarks.bench_resilience import Answer, Call, Change, Run, Scenario
from benchmarks.peers import native
from benchmarks.resilience import haproxy, probe, serve

HOSTS = ("http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3")


def test_the_gateway_file_loads_with_and_without_hedging(tmp_path: Path) -> None:
    for hedge in (False, True):
        text = serve.gateway_text(HOSTS, hedge=hedge)
        for host in HOSTS:
            assert text.count(f'"{host}"') == 1
        path = tmp_path / f"gateway-{hedge}.toml"
        path.write_text(text)
        config = pw.load_config(path)
        assert config.warnings == ()
        service = config.services["replicas"]
        assert [h.url for h in service.endpoints] == list(HOSTS)
        assert (service.resilience.hedge is not None) == hedge


def test_the_degradation_scenario_adds_service_b_and_route_d(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(serve.gateway_text(HOSTS, degrade="http://127.0.0.1:4"))
    config = pw.load_config(path)
    assert config.warnings == ()
    assert config.services["b"].base_url == "http://127.0.0.1:4"
    assert config.pipes["call_b"].optional
    assert not config.pipes["hold_b"].optional
    assert {r.route.path for r in config.routes.values()} >= {"/d", "/hold"}
    # Route D alone never lacks a slot of B: B's limit covers the load's connections.
    assert serve.B_LIMIT >= bench_resilience.CONNECTIONS


def test_haproxy_accepts_its_configuration(tmp_path: Path) -> None:
    executable = native.ensure_installed("haproxy")
    path = tmp_path / "haproxy.cfg"
    path.write_text(haproxy.conf(native.free_port(), native.free_port(), HOSTS))
    checked = subprocess.run(
        [executable, "-c", "-f", str(path)], capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


async def _get(replica: _load.Server, path: str, request_id: str) -> tuple[int, bytes]:
    request = (
        f"GET {path} HTTP/1.1\r\nHost: x\r\nX-Request-ID: {request_id}\r\nConnection: close\r\n\r\n"
    ).encode()
    return await _load.call(replica.host, replica.port, request)


async def _logged(replica: _load.Server) -> list[list[object]]:
    log = json.loads((await _get(replica, "/_log", "-"))[1])
    calls: list[list[object]] = log["calls"]
    return calls


def test_a_replica_behaves_as_told_and_logs_every_call() -> None:
    async def main(replica: _load.Server) -> None:
        ok, failed = b'{"replica": "r1", "ok": true}', b'{"replica": "r1", "ok": false}'
        assert await _get(replica, "/x", "one") == (200, ok)
        await bench_resilience.set_modes([replica], ["fail 1"])
        assert await _get(replica, "/x", "two") == (503, failed)
        assert await _get(replica, "/health", "-") == (200, ok)  # checks pass
        await bench_resilience.set_modes([replica], ["down"])
        assert await _get(replica, "/x", "three") == (503, failed)
        assert await _get(replica, "/health", "-") == (503, failed)
        await bench_resilience.set_modes([replica], ["tail 1 0.01"])
        assert await _get(replica, "/x", "four") == (200, ok)
        await bench_resilience.set_modes([replica], ["hang"])
        async with trio.open_nursery() as nursery:
            answers: list[tuple[int, bytes]] = []

            async def held() -> None:
                answers.append(await _get(replica, "/x", "five"))

            nursery.start_soon(held)
            while len(await _logged(replica)) < 5:  # noqa: ASYNC110 - another process
                await trio.sleep(0.05)
            assert answers == []
            await bench_resilience.set_modes([replica], ["fast"])  # answers what it holds
        assert answers == [(200, ok)]
        calls = await _logged(replica)
        assert [(rid, outcome) for _, rid, outcome in calls] == [
            ("one", "ok"),
            ("two", "503"),
            ("three", "503"),
            ("four", "slow"),
            ("five", "hang"),
        ]
        log = json.loads((await _get(replica, "/_log", "-"))[1])
        assert log["health"] == 2
        refused = await _load.call(replica.host, replica.port, _load.post_request("/_mode", b"x"))
        assert refused[0] == 400
        await bench_resilience.calls([replica], 0.0)  # reads the log as the benchmark does
        await bench_resilience._send(replica, "POST", "/_reset")
        assert await _logged(replica) == []

    with _load.server("r1", module=bench_resilience.REPLICA) as replica:
        trio.run(main, replica)


def test_the_load_records_every_request_with_its_own_id() -> None:
    async def main(replica: _load.Server) -> None:
        # Each way of drawing the pauses, and none (the degradation scenario's).
        for think in (*bench_resilience.THINKS, bench_resilience.AT_ONCE):
            await bench_resilience._send(replica, "POST", "/_reset")
            began, stdout = await bench_resilience.wrk(f"{replica.url}/x", 1, think)
            answers, unfinished = bench_resilience.parse_wrk(stdout, began)
            calls, _ = await bench_resilience.calls([replica], began)
            assert answers, think
            assert {a.status for a in answers} == {200}
            assert {a.degraded for a in answers} == {""}  # the replica marks nothing
            assert all(a.start >= 0 and a.latency >= 0 for a in answers)
            # Every answer was a call; a request still out at the end may have arrived too.
            assert len(answers) <= len(calls) <= len(answers) + len(unfinished)
            ids = [c.request_id for c in calls]
            assert all(ids)
            assert len(set(ids)) == len(ids)
        with pytest.raises(ValueError, match="think must be one of"):
            await bench_resilience.wrk(f"{replica.url}/x", 1, "steady")

    with _load.server("r1", module=bench_resilience.REPLICA) as replica:
        trio.run(main, replica)


def test_the_load_reads_the_degraded_mark() -> None:
    stdout = "R 1000000 2000 200 no_slot\nR 1100000 2000 200 -\nR 1200000 5000 0\n"
    answers, unfinished = bench_resilience.parse_wrk(stdout, 0.0)
    assert answers == [
        Answer(1.0, 0.002, 200, "no_slot"),
        Answer(1.1, 0.002, 200),
        Answer(1.2, 0.005, 0),
    ]
    assert unfinished == []


def test_route_d_is_degraded_while_b_is_saturated_and_only_then() -> None:
    """The degradation scenario through pipework, briefly: with B free every answer of
    route D is whole and its branch called B; with B's slots held by the holding route's
    calls, every answer is marked degraded for ``no_slot`` and none of them reached B."""
    scenario = bench_resilience.Scenario("degrade", "route D", 1, degrade=True, rounds=1)
    with contextlib.ExitStack() as stack:
        replicas = enter_all(
            stack,
            [_load.server(f"r{n}", module=bench_resilience.REPLICA) for n in (1, 2, 3, 4)],
        )
        b = replicas.pop()
        with bench_resilience.started(
            bench_resilience.GATEWAYS[0], replicas, scenario, b
        ) as served:
            phases = trio.run(bench_resilience.run_degrade, served, replicas, b, scenario, 1)
    assert [p.saturated for p in phases] == [False, True]
    alone, held = phases
    assert alone.answers
    assert {(a.status, a.degraded) for a in alone.answers} == {(200, "")}
    assert len(alone.answers) <= alone.calls_to_b <= len(alone.answers) + len(alone.unfinished)
    assert held.answers
    assert {(a.status, a.degraded) for a in held.answers} == {(200, "no_slot")}
    assert held.calls_to_b == 0
    figures = bench_resilience.degrade(phases)
    assert figures.values["marked"] == 100
    assert figures.values["marked_alone"] == 0


def test_the_degradation_scenario_only_runs_on_pipework_with_b() -> None:
    scenario = bench_resilience.Scenario("degrade", "route D", 1, degrade=True)
    gateway = bench_resilience.GATEWAYS[1]
    with (
        pytest.raises(ValueError, match="runs on pipework"),
        bench_resilience.started(gateway, [], scenario),
    ):
        pass


def test_both_gateways_pass_a_call_on_and_say_their_state() -> None:
    async def main(served: bench_resilience.Served, replicas: list[_load.Server]) -> None:
        for replica in replicas:
            await bench_resilience._send(replica, "POST", "/_reset")
        for path in bench_resilience.PATHS.values():
            status, body = await _get(served.server, path, f"through{path.replace('/', '-')}")
            assert (path, status) == (path, 200)
            assert json.loads(body)["ok"] is True
        calls, _ = await bench_resilience.calls(replicas, 0.0)
        assert sorted(c.request_id for c in calls) == ["through-a", "through-p"]
        assert await served.state() == "closed"
        counted = await served.counters()
        assert counted
        assert set(counted.values()) == {0}

    scenario = bench_resilience.scenarios(quick=True)[0]
    with contextlib.ExitStack() as stack:
        replicas = enter_all(
            stack,
            [_load.server(f"r{n}", module=bench_resilience.REPLICA) for n in (1, 2, 3)],
        )
        for gateway in bench_resilience.GATEWAYS:
            with bench_resilience.started(gateway, replicas, scenario) as served:
                trio.run(main, served, replicas)


# -- the figures, from runs made up here ------------------------------------------------


def _run(
    scenario: Scenario,
    answers: list[Answer],
    calls: list[Call],
    *,
    unfinished: tuple[float, ...] = (),
    changed: dict[str, float] | None = None,
    states: tuple[tuple[float, str], ...] = (),
) -> Run:
    return Run(
        "pipework", scenario, answers, list(unfinished), calls, 0, changed or {}, list(states)
    )


def test_a_request_still_out_counts_as_failed_once_it_waited() -> None:
    scenario = Scenario("healthy", "every replica fast", 10)
    run = _run(scenario, [Answer(1, 0.01, 200)], [], unfinished=(2.0, 9.5))
    assert run.requests() == [Answer(1, 0.01, 200), Answer(2.0, 8.0, 0)]
    assert run.sent == 3
    assert bench_resilience.ok_share(run.requests()) == 50


def test_the_down_scenario_reads_its_figures() -> None:
    scenario = Scenario(
        "down",
        "every replica down",
        10,
        (Change(2, ("down",) * 3, "down"), Change(6, ("fast",) * 3, "back")),
        poll=True,
    )
    answers = [
        Answer(1.0, 0.002, 200),
        Answer(2.1, 0.020, 502),  # before the breaker was read open
        *(Answer(3 + n / 100, 0.001 * (n + 1), 503) for n in range(100)),
        Answer(6.5, 0.004, 503),  # refused once more after the replicas came back
        Answer(7.0, 0.002, 200),
        Answer(7.5, 0.002, 200),
    ]
    calls = [
        Call(2.1, "w1-1", 0, "503"),
        Call(2.2, "w1-1", 1, "503"),  # its retry
        Call(2.3, "w2-1", 2, "503"),
        Call(2.4, "w3-1", 0, "503"),
        Call(7.0, "w1-9", 0, "ok"),
    ]
    run = _run(
        scenario,
        answers,
        calls,
        changed={"down": 2.0, "back": 6.0},
        states=((1.9, "closed"), (2.5, "open"), (6.9, "closed")),
    )
    figures = bench_resilience.down(run)
    assert math.isclose(figures.values["p99"], 99)  # the refusals after 2.5 s: 1 to 100 ms
    assert math.isclose(figures.values["extra"], 100 / 3)  # 4 calls for 3 requests
    assert math.isclose(figures.values["closed"], 0.5)
    assert "read open 0.50 s after" in figures.note


def test_the_other_scenarios_read_their_figures() -> None:
    healthy_run = _run(
        Scenario("healthy", "fast", 10),
        [Answer(n / 10, 0.001 * (n % 10 + 1), 200) for n in range(100)],
        [],
    )
    assert math.isclose(bench_resilience.healthy(healthy_run).values["p99"], 10)
    hang_run = _run(
        Scenario("hang", "hangs", 10, (Change(2, ("hang", None, None), "hang"),), 5),
        [Answer(3, 0.25, 504), *(Answer(5 + n / 100, 0.002, 200) for n in range(100))],
        [Call(3, "w1-1", 0, "hang"), Call(5.5, "w1-2", 1, "ok")],
        changed={"hang": 2.0},
    )
    figures = bench_resilience.hang(hang_run, healthy_run)
    assert figures.values["ok"] == 100  # judged from t = 5 s
    assert math.isclose(figures.values["p99_ratio"], 0.2)
    tail_run = _run(
        Scenario("tail", "tail", 10, hedge=True),
        [Answer(n / 10, 0.001 if n < 98 else 0.1, 200) for n in range(100)],
        [Call(n / 10, f"w1-{n}", 0, "ok") for n in range(105)],
    )
    figures = bench_resilience.tail(tail_run)
    assert math.isclose(figures.values["ratio"], 100)  # p99 0.1 s ÷ p50 1 ms
    assert math.isclose(figures.values["extra"], 5)


def test_the_degradation_scenario_reads_its_figures() -> None:
    Phase = bench_resilience.Phase
    phases = [
        # Alone: 100 answers in 1 s, then 120 in 1 s; every answer whole.
        Phase(False, 1, [Answer(n / 100, 0.01, 200) for n in range(100)], [], 100),
        Phase(False, 1, [Answer(n / 120, 0.01, 200) for n in range(120)], [5.0], 121),
        # Saturated: 200 answers in 2 s, one of them failed and not marked.
        Phase(
            True,
            2,
            [*(Answer(n / 100, 0.005, 200, "no_slot") for n in range(199)), Answer(1.99, 1, 0)],
            [],
            0,
        ),
    ]
    figures = bench_resilience.degrade(phases)
    assert math.isclose(figures.values["alone_rps"], 110)
    assert math.isclose(figures.values["saturated_rps"], 99.5)
    assert math.isclose(figures.values["throughput"], 99.5 / 110)
    assert math.isclose(figures.values["cost"], 110 / 99.5)
    assert math.isclose(figures.values["marked"], 99.5)
    assert figures.values["marked_alone"] == 0
    assert "199×no_slot" in figures.note
    results = bench_resilience.Results(bench_resilience.scenarios(quick=True), True)
    results.phases = phases
    kept, marked = bench_resilience.degrade_rows(results)
    assert kept["ratio"] == figures.values["cost"]
    assert kept["note"].startswith("missed")  # 0.90x the throughput alone
    assert marked["subject_us"] == 99.5
    assert marked["note"] == "missed"  # one answer was not marked


def test_the_probe_runs_a_scenario_of_the_full_mode_on_either_route() -> None:
    down = bench_resilience.scenario_named("down", "proxy")
    assert down.path == "/p"
    assert down.poll
    assert bench_resilience.scenario_named("tail", "pipe").hedge
    assert set(probe.NAMES) <= {s.name for s in bench_resilience.scenarios(False)}
    with pytest.raises(SystemExit):
        probe.main(["--scenario", "degrade"])  # its phases are the benchmark's alone
