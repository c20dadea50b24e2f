"""The Grafana dashboard and docs/operations.md against what a real engine exports.

Both may name only metrics a running :class:`pipework.Engine` exposes, and operations.md
must describe every family it exposes, with its type and labels, so neither can drift from
the code. The PromQL in both is checked by promtool (installed by ``scripts/ensure-tools``):
the rule file parses, the scrape config loads it, and the trickier alerts fire on the
series they are meant for and stay quiet otherwise.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

import pipework as pw
from pipework import WeightedPool, Weights
from pipework.board import Boards, BoardSpec
from pipework.board._metrics import BoardCollector

from .test_metrics_honest import demo_under_a_hanging_backend

DOCS = Path(__file__).resolve().parent.parent / "docs"
DASHBOARD = DOCS / "grafana-dashboard.json"
OPERATIONS = DOCS / "operations.md"

HANG_GUARD = 10.0

METRIC_NAME = re.compile(r"\bpipework_[a-z_]+")
# Grafana's variables, `$name` or `${name}` or `${name:format}`.
VARIABLE = re.compile(r"\$\{?([A-Za-z_]\w*)(?::\w+)?\}?")
# The series names each family type is exposed as, by suffix.
SERIES_SUFFIXES = {
    "counter": ("",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
}


# -- what a real engine exposes ------------------------------------------------------------


@dataclass
class Family:
    type: str
    labels: set[str] = field(default_factory=set)
    has_samples: bool = False


@dataclass
class Exposition:
    families: dict[str, Family] = field(default_factory=dict)

    def add(self, text: str) -> None:
        """Read the text format: families from ``# TYPE``, label names from the samples."""
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(" ")
                self.families.setdefault(name, Family(kind))
            elif line and not line.startswith("#"):
                series = re.match(r"[a-zA-Z_:][\w:]*", line)
                assert series is not None, line
                owner = self.family_of(series.group())
                assert owner is not None, f"a sample outside any family: {line}"
                family = self.families[owner]
                family.has_samples = True
                labels = re.findall(r'([a-zA-Z_]\w*)="', line)
                family.labels.update(name for name in labels if name != "le")

    def family_of(self, series: str) -> str | None:
        """The family a series name belongs to, if it is one this exposition has."""
        for name, family in self.families.items():
            if any(series == name + suffix for suffix in SERIES_SUFFIXES[family.type]):
                return name
        return None

    @property
    def documented(self) -> dict[str, Family]:
        """The families operations.md must describe: all but prometheus-client's
        ``_created`` companions of counters and histograms."""
        return {
            name: family
            for name, family in self.families.items()
            if not (name.endswith("_created") and name[: -len("_created")] in self.bases)
        }

    @property
    def bases(self) -> set[str]:
        names = set(self.families)
        return names | {name.removesuffix("_total") for name in names}


async def _default_engine() -> str:
    engine = pw.Engine()

    @engine.pipe
    async def hello(ctx: pw.Context) -> None:
        ctx.state["greeting"] = "hello"

    engine.chain("hello", hello, result="greeting")
    # What a serving container adds: its push boards' families.
    engine.metrics.registry.register(BoardCollector(Boards([BoardSpec("news")])))
    with trio.fail_after(HANG_GUARD):
        async with engine:
            assert await engine.run("hello") == "hello"
    return engine.metrics.exposition().decode()


async def _weighted_engine() -> str:
    # Built from the module so the test does not depend on the public re-export.
    pool = WeightedPool(max_workers=4, keys={"users": Weights(reserve=1, limit=2)})
    engine = pw.Engine(pool=pool)

    @engine.pipe(key="users")
    async def load_user(ctx: pw.Context) -> None:
        ctx.state["user"] = {"id": ctx.state["user_id"]}

    @engine.pipe
    async def audit(ctx: pw.Context) -> None:
        raise RuntimeError("audit backend down")

    @engine.pipe
    async def slow(ctx: pw.Context) -> None:
        await trio.sleep(1)  # outlasts the detached node, so its failure is counted
        ctx.state["slow"] = True

    engine.chain("user", load_user, result="user")
    engine.chain(
        "order",
        pw.graph(pw.node("audit", audit, detach=True), pw.node("slow", slow)),
    )

    async def make() -> object:
        return object()

    # A resource pool reports its families to the engine's metrics while it runs.
    resources = pw.ResourcePool(
        make, 2, borrow_timeout=1, launch_timeout=1, name="pdf", metrics=engine.metrics
    )
    # An http:// service of two hosts: its resilience families, read at every scrape.
    backends = pw.Backends(
        [
            pw.Service(
                "search",
                hosts=(pw.HostSpec("http://127.0.0.1:9"), pw.HostSpec("http://127.0.0.1:10")),
            )
        ]
    )
    backends.metrics = engine.metrics
    with trio.fail_after(HANG_GUARD):  # virtual time: a hang fails at once
        async with engine, resources, backends:
            assert await engine.run("user", {"user_id": 7}) == {"id": 7}
            await engine.run("order")
            async with resources.borrow():
                pass
            return engine.metrics.exposition().decode()


@pytest.fixture(scope="module")
def exposition() -> Exposition:
    result = Exposition()
    result.add(trio.run(_default_engine))
    result.add(trio.run(_weighted_engine, clock=trio.testing.MockClock(autojump_threshold=0)))
    return result


def test_the_test_engines_expose_what_the_checks_rely_on(exposition: Exposition) -> None:
    families = exposition.families
    assert families["pipework_pool_in_use"].labels == {"key", "kind"}
    assert families["pipework_pool_admitted_total"].type == "counter"
    assert families["pipework_pipe_duration_seconds"].has_samples
    assert families["pipework_detached_failures_total"].labels == {"route"}


# -- the dashboard -------------------------------------------------------------------------


def load_dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return dashboard


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and annotation query."""
    queries = [
        (f"panel {panel['title']!r} target {target['refId']}", target["expr"])
        for panel in panels(dashboard["panels"])
        for target in panel.get("targets", [])
    ]
    queries += [
        (f"annotation {annotation['name']!r}", annotation["expr"])
        for annotation in dashboard["annotations"]["list"]
        if "expr" in annotation
    ]
    return queries


def variable_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        (f"variable {variable['name']!r}", variable["definition"])
        for variable in dashboard["templating"]["list"]
        if variable["type"] == "query"
    ]


def test_dashboard_is_a_grafana_dashboard() -> None:
    dashboard = load_dashboard()
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["uid"]
    assert dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"key", "route"} <= set(variables)
    assert variables["key"]["multi"]
    assert variables["route"]["multi"]

    ids = [panel["id"] for panel in panels(dashboard["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(dashboard["panels"]):
        assert set(panel["gridPos"]) == {"x", "y", "w", "h"}, panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]


def test_dashboard_uses_only_its_own_variables() -> None:
    dashboard = load_dashboard()
    defined = {v["name"] for v in dashboard["templating"]["list"]}
    for where, query in dashboard_queries(dashboard) + variable_queries(dashboard):
        for name in VARIABLE.findall(query):
            assert name.startswith("__") or name in defined, f"{where}: ${name} is not defined"


def test_dashboard_names_only_exported_metrics(exposition: Exposition) -> None:
    dashboard = load_dashboard()
    queries = dashboard_queries(dashboard) + variable_queries(dashboard)
    shown: set[str] = set()
    for where, query in queries:
        names = METRIC_NAME.findall(query)
        assert names, f"{where} names no pipework metric: {query}"
        for name in names:
            family = exposition.family_of(name)
            assert family is not None, f"{where}: {name} is not a series a pipework engine exposes"
            shown.add(family)
    missing = set(exposition.documented) - shown
    assert missing == set(), "families the dashboard does not show"


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    dashboard = load_dashboard()
    rules = []
    for i, (where, query) in enumerate(dashboard_queries(dashboard)):
        promql = re.sub(r"\$__\w+", "5m", query)
        promql = VARIABLE.sub(".*", promql)
        rules.append({"record": f"dashboard:query_{i}", "expr": promql, "labels": {"at": where}})
    path = tmp_path / "dashboard.rules.json"  # JSON is YAML to promtool
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    promtool("check", "rules", str(path))


# -- docs/operations.md --------------------------------------------------------------------


def operations() -> str:
    return OPERATIONS.read_text(encoding="utf-8")


def section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def reference_rows() -> dict[str, tuple[str, set[str]]]:
    """name -> (type, labels) from the metric tables."""
    rows: dict[str, tuple[str, set[str]]] = {}
    for line in section(operations(), "Metric reference").splitlines():
        match = re.match(r"\| `(pipework_[a-z_]+)` \| (\w+) \| ([^|]*) \|", line)
        if match:
            name, kind, labels = match.groups()
            assert name not in rows, f"{name} is described twice"
            rows[name] = (kind, set(re.findall(r"`(\w+)`", labels)))
    return rows


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


def test_operations_names_only_exported_metrics(exposition: Exposition) -> None:
    for name in sorted(set(METRIC_NAME.findall(operations()))):
        assert name in exposition.families or exposition.family_of(name) is not None, (
            f"docs/operations.md names {name}, which a pipework engine does not expose"
        )


def test_operations_describes_every_exported_family(exposition: Exposition) -> None:
    rows = reference_rows()
    documented = exposition.documented
    assert set(documented) - set(rows) == set(), "exposed but not in the metric reference"
    assert set(rows) - set(documented) == set(), "in the metric reference but not exposed"
    for name, family in documented.items():
        kind, labels = rows[name]
        assert kind == family.type, f"{name} is a {family.type}, documented as a {kind}"
        if family.has_samples:  # families without samples do not show their labels
            assert labels == family.labels, f"{name} has labels {sorted(family.labels)}"


def rule_file() -> str:
    (rules,) = [block for block in code_blocks(operations(), "yaml") if "\ngroups:\n" in block]
    return rules


def test_operations_scrape_config_and_rules_pass_promtool(tmp_path: Path) -> None:
    (config,) = [block for block in code_blocks(operations(), "yaml") if "scrape_configs:" in block]
    (rules_name,) = re.findall(r"^\s+- (\S+\.yml)", config, flags=re.MULTILINE)
    (tmp_path / rules_name).write_text(rule_file())
    (tmp_path / "prometheus.yml").write_text(config)
    promtool("check", "rules", str(tmp_path / rules_name))
    promtool("check", "config", str(tmp_path / "prometheus.yml"))


def test_operations_promql_examples_parse(tmp_path: Path) -> None:
    examples = code_blocks(operations(), "promql")
    assert examples
    rules = [{"record": f"docs:example_{i}", "expr": expr} for i, expr in enumerate(examples)]
    path = tmp_path / "examples.rules.json"
    path.write_text(json.dumps({"groups": [{"name": "examples", "rules": rules}]}))
    promtool("check", "rules", str(path))


def test_every_alert_has_a_runbook() -> None:
    alerts = re.findall(r"^\s+- alert: (\w+)$", rule_file(), flags=re.MULTILINE)
    runbooks = re.findall(r"^### (Pipework\w+)$", section(operations(), "Alerts"), re.MULTILINE)
    assert alerts == runbooks, "one runbook per alert, in the rule file's order"
    for line in section(operations(), "Metric reference").splitlines():
        for alert, anchor in re.findall(r"\[(Pipework\w+)\]\(#(\w+)\)", line):
            assert alert in alerts, line
            assert anchor == alert.lower(), line


def without_annotations(rules: str) -> str:
    """The rule file without its annotations, which promtool's alert tests would otherwise
    have to repeat word for word."""
    kept: list[str] = []
    skip_deeper_than: int | None = None
    for line in rules.splitlines():
        indent = len(line) - len(line.lstrip())
        if skip_deeper_than is not None and (not line.strip() or indent > skip_deeper_than):
            continue
        skip_deeper_than = indent if line.strip() == "annotations:" else None
        if skip_deeper_than is None:
            kept.append(line)
    return "\n".join(kept) + "\n"


# Each case: series given for 30 minutes at 1-minute steps, then which alerts fire at 20 and
# 30 minutes (labels beyond the series' own: severity and alertname). Series are written in
# promtool's notation: "a+bxN" starts at a and adds b N times.
INSTANCE = 'job="pipework", instance="gw-1:8000"'
ALERT_CASES: list[dict[str, Any]] = [
    {
        "input_series": [
            {"series": f"pipework_event_queue_depth{{{INSTANCE}}}", "values": "9000x30"},
            {"series": f"pipework_event_queue_capacity{{{INSTANCE}}}", "values": "10000x30"},
        ],
        "alert_rule_test": [
            {
                "eval_time": "20m",
                "alertname": "PipeworkEventQueueNearCapacity",
                "exp_alerts": [
                    {
                        "exp_labels": {
                            "severity": "warning",
                            "job": "pipework",
                            "instance": "gw-1:8000",
                        }
                    }
                ],
            },
            {"eval_time": "20m", "alertname": "PipeworkSubmissionsRefused", "exp_alerts": []},
        ],
    },
    {
        # Four slots of four in use, two steps of "search" waiting at its limit of 2;
        # "users" has no limit (-1) and must not count as held at one.
        "input_series": [
            {
                "series": f'pipework_pool_in_use{{{INSTANCE}, key="search", kind="shared"}}',
                "values": "2x30",
            },
            {
                "series": f'pipework_pool_in_use{{{INSTANCE}, key="users", kind="reserved"}}',
                "values": "1x30",
            },
            {
                "series": f'pipework_pool_in_use{{{INSTANCE}, key="users", kind="shared"}}',
                "values": "1x30",
            },
            {"series": f'pipework_pool_waiting{{{INSTANCE}, key="search"}}', "values": "2x30"},
            {"series": f'pipework_pool_waiting{{{INSTANCE}, key="users"}}', "values": "3x30"},
            {
                "series": f'pipework_pool_effective_limit{{{INSTANCE}, key="search"}}',
                "values": "2x30",
            },
            {
                "series": f'pipework_pool_effective_limit{{{INSTANCE}, key="users"}}',
                "values": "-1x30",
            },
            {"series": f"pipework_pool_max_workers{{{INSTANCE}}}", "values": "4x30"},
        ],
        "alert_rule_test": [
            {
                "eval_time": "20m",
                "alertname": "PipeworkKeyAtLimit",
                "exp_alerts": [
                    {
                        "exp_labels": {
                            "severity": "warning",
                            "job": "pipework",
                            "instance": "gw-1:8000",
                            "key": "search",
                        }
                    }
                ],
            },
            {
                "eval_time": "20m",
                "alertname": "PipeworkPoolSaturated",
                "exp_alerts": [
                    {
                        "exp_labels": {
                            "severity": "warning",
                            "job": "pipework",
                            "instance": "gw-1:8000",
                        }
                    }
                ],
            },
        ],
    },
    {
        # "search": 20 grants and 1 wait_timeout a second, on two instances; paused
        # rejections of "users" are not this alert's business.
        "input_series": [
            *(
                {
                    "series": f'pipework_pool_admitted_total{{job="pipework", instance="{i}", '
                    f'key="search"}}',
                    "values": "0+600x30",
                }
                for i in ("a", "b")
            ),
            *(
                {
                    "series": f'pipework_pool_rejected_total{{job="pipework", instance="{i}", '
                    f'key="search", reason="wait_timeout"}}',
                    "values": "0+30x30",
                }
                for i in ("a", "b")
            ),
            {
                "series": 'pipework_pool_rejected_total{job="pipework", instance="a", '
                'key="users", reason="paused"}',
                "values": "0+60x30",
            },
            {
                "series": 'pipework_pool_admitted_total{job="pipework", instance="a", key="users"}',
                "values": "0x30",
            },
        ],
        "alert_rule_test": [
            {
                "eval_time": "20m",
                "alertname": "PipeworkPoolRejecting",
                "exp_alerts": [
                    {
                        "exp_labels": {
                            "severity": "warning",
                            "job": "pipework",
                            "key": "search",
                            "reason": "wait_timeout",
                        }
                    }
                ],
            }
        ],
    },
    {
        # "order": 10% of jobs fail; "rare": all fail, but one job in two minutes is no signal.
        "input_series": [
            {
                "series": f'pipework_job_duration_seconds_count{{{INSTANCE}, route="order", '
                f'outcome="done"}}',
                "values": "0+54x30",
            },
            {
                "series": f'pipework_job_duration_seconds_count{{{INSTANCE}, route="order", '
                f'outcome="failed"}}',
                "values": "0+6x30",
            },
            {
                "series": f'pipework_job_duration_seconds_count{{{INSTANCE}, route="rare", '
                f'outcome="failed"}}',
                "values": "0+0.5x30",
            },
        ],
        "alert_rule_test": [
            {
                "eval_time": "20m",
                "alertname": "PipeworkRouteFailing",
                "exp_alerts": [
                    {
                        "exp_labels": {
                            "severity": "warning",
                            "job": "pipework",
                            "route": "order",
                        }
                    }
                ],
            }
        ],
    },
    {
        # Reconfigured at minute 5; restarted (generation back to 1) at minute 20.
        "input_series": [
            {
                "series": f"pipework_pool_config_generation{{{INSTANCE}}}",
                "values": "1x5 2x14 1x10",
            },
        ],
        "alert_rule_test": [
            {
                "eval_time": "8m",
                "alertname": "PipeworkPoolReconfigured",
                "exp_alerts": [
                    {
                        "exp_labels": {
                            "severity": "info",
                            "job": "pipework",
                            "instance": "gw-1:8000",
                        }
                    }
                ],
            },
            {"eval_time": "25m", "alertname": "PipeworkPoolReconfigured", "exp_alerts": []},
        ],
    },
    {
        # 10% of calls to "users" fail.
        "input_series": [
            {
                "series": f'pipework_backend_calls_total{{{INSTANCE}, service="users", '
                f'outcome="ok"}}',
                "values": "0+540x30",
            },
            {
                "series": f'pipework_backend_calls_total{{{INSTANCE}, service="users", '
                f'outcome="error"}}',
                "values": "0+60x30",
            },
        ],
        "alert_rule_test": [
            {
                "eval_time": "20m",
                "alertname": "PipeworkBackendErrors",
                "exp_alerts": [
                    {
                        "exp_labels": {
                            "severity": "warning",
                            "job": "pipework",
                            "service": "users",
                        }
                    }
                ],
            }
        ],
    },
]


def _fires(alertname: str, eval_time: str = "20m", **labels: str) -> dict[str, Any]:
    return {
        "eval_time": eval_time,
        "alertname": alertname,
        "exp_alerts": [{"exp_labels": {"job": "pipework", **labels}}],
    }


def _quiet(alertname: str, eval_time: str = "20m") -> dict[str, Any]:
    return {"eval_time": eval_time, "alertname": alertname, "exp_alerts": []}


def _histogram(name: str, labels: str, per_minute: dict[str, float]) -> list[dict[str, str]]:
    """Cumulative bucket series (and _count) of a histogram observed at a steady rate:
    ``per_minute`` maps each ``le`` to the observations at or below it each minute."""
    series = [
        {"series": f'{name}_bucket{{{INSTANCE}, {labels}, le="{le}"}}', "values": f"0+{n:g}x30"}
        for le, n in per_minute.items()
    ]
    series.append(
        {
            "series": f"{name}_count{{{INSTANCE}, {labels}}}",
            "values": f"0+{per_minute['+Inf']:g}x30",
        }
    )
    return series


# The alerts the cases above do not make fire.
ALERT_CASES += [
    {
        "input_series": [
            {"series": f"up{{{INSTANCE}}}", "values": "1x5 0x25"},
            {"series": f"pipework_event_queue_refused_total{{{INSTANCE}}}", "values": "0+60x30"},
        ],
        "alert_rule_test": [
            _quiet("PipeworkTargetDown", "6m"),
            {
                **_fires("PipeworkTargetDown", instance="gw-1:8000"),
                "exp_alerts": [
                    {"exp_labels": {"job": "pipework", "instance": "gw-1:8000", "severity": "page"}}
                ],
            },
            {
                **_fires("PipeworkSubmissionsRefused"),
                "exp_alerts": [
                    {"exp_labels": {"job": "pipework", "instance": "gw-1:8000", "severity": "page"}}
                ],
            },
        ],
    },
    {
        "input_series": [
            {
                "series": f'pipework_pool_oldest_wait_seconds{{{INSTANCE}, key="search"}}',
                "values": "12x30",
            },
            {
                "series": f'pipework_pool_oldest_wait_seconds{{{INSTANCE}, key="users"}}',
                "values": "0x30",
            },
            {"series": f'pipework_pool_limit{{{INSTANCE}, key="search"}}', "values": "2x30"},
            {"series": f'pipework_pool_limit{{{INSTANCE}, key="reports"}}', "values": "0x90"},
        ],
        "alert_rule_test": [
            _fires(
                "PipeworkKeyWaitingLong", instance="gw-1:8000", key="search", severity="warning"
            ),
            _quiet("PipeworkKeyPaused", "30m"),
            _fires(
                "PipeworkKeyPaused", "70m", instance="gw-1:8000", key="reports", severity="info"
            ),
        ],
    },
    {
        # "render" answers in 2.5-3 s (slow); "quote" in 0.2 s; "lookup" is cut at its 1 s
        # timeout every time, which is a failure, not slowness.
        "input_series": [
            *_histogram(
                "pipework_pipe_duration_seconds",
                'pipe="render", outcome="ok"',
                {"2": 0, "2.5": 0, "3": 60, "+Inf": 60},
            ),
            *_histogram(
                "pipework_pipe_duration_seconds",
                'pipe="quote", outcome="ok"',
                {"0.1": 0, "0.25": 60, "+Inf": 60},
            ),
            *_histogram(
                "pipework_pipe_duration_seconds",
                'pipe="lookup", outcome="timeout"',
                {"1": 0, "1.05": 60, "+Inf": 60},
            ),
            *_histogram(
                "pipework_backend_latency_seconds",
                'service="search", outcome="ok"',
                {"1": 0, "1.25": 30, "1.5": 60, "+Inf": 60},
            ),
            *_histogram(
                "pipework_backend_latency_seconds",
                'service="users", outcome="ok"',
                {"0.25": 60, "+Inf": 60},
            ),
        ],
        "alert_rule_test": [
            _fires("PipeworkPipeSlow", pipe="render", severity="warning"),
            _fires("PipeworkBackendSlow", service="search", severity="warning"),
        ],
    },
    {
        "input_series": [
            {
                "series": f'pipework_detached_failures_total{{{INSTANCE}, route="order"}}',
                "values": "0+3x60",
            },
        ],
        "alert_rule_test": [
            _quiet("PipeworkDetachedNodesFailing", "20m"),
            _fires("PipeworkDetachedNodesFailing", "50m", route="order", severity="warning"),
        ],
    },
]


def _cycle(pattern: tuple[float, ...], length: int = 31) -> str:
    """``pattern`` repeated for ``length`` samples, in promtool's notation."""
    return " ".join(f"{pattern[i % len(pattern)]:g}" for i in range(length))


def _host_states(service: str, host: str, ejected: str, available: str) -> list[dict[str, str]]:
    labels = f'{INSTANCE}, service="{service}", host="{host}"'
    return [
        {"series": f'pipework_backend_host_state{{{labels}, state="ejected"}}', "values": ejected},
        {
            "series": f'pipework_backend_host_state{{{labels}, state="available"}}',
            "values": available,
        },
    ]


def _breaker(service: str, **states: str) -> list[dict[str, str]]:
    return [
        {
            "series": f'pipework_backend_breaker_state{{{INSTANCE}, service="{service}", '
            f'state="{state}"}}',
            "values": values,
        }
        for state, values in states.items()
    ]


def _refused(service: str, reason: str, values: str) -> dict[str, str]:
    return {
        "series": f'pipework_backend_refused_total{{{INSTANCE}, service="{service}", '
        f'reason="{reason}"}}',
        "values": values,
    }


def _each_fires(alertname: str, severity: str, *labels: dict[str, str]) -> dict[str, Any]:
    return {
        "eval_time": "20m",
        "alertname": alertname,
        "exp_alerts": [
            {
                "exp_labels": {
                    "job": "pipework",
                    "instance": "gw-1:8000",
                    **one,
                    "severity": severity,
                }
            }
            for one in labels
        ],
    }


# Upstream resilience (docs/resilience.md).
ALERT_CASES += [
    {
        # .1 ejected from minute 5 on; .2 for one minute; .3 one minute in three (a host
        # that keeps coming back); .4 ejected all along by one of two processes (the
        # state gauge sums them), the other balancing over it: out half of the views.
        "input_series": [
            *_host_states("search", "10.0.0.1:9200", "0x5 1x25", "1x5 0x25"),
            *_host_states("search", "10.0.0.2:9200", "0x10 1 0x19", "1x10 0 1x19"),
            *_host_states("search", "10.0.0.3:9200", _cycle((0, 0, 1)), _cycle((1, 1, 0))),
            *_host_states("search", "10.0.0.4:9200", "1x30", "1x30"),
        ],
        "alert_rule_test": [
            _quiet("PipeworkBackendHostEjected", "9m"),  # out half of the last 10 minutes
            _each_fires(
                "PipeworkBackendHostEjected",
                "warning",
                {"service": "search", "host": "10.0.0.1:9200"},
            ),
        ],
    },
    {
        # From minute 5, "search" is open and refuses calls; "flapping" goes between open
        # and half open, its probes failing; "quiet" opened, then no call came (it stays open
        # until one does, refusing nothing); "closed" refused calls between two scrapes.
        "input_series": [
            *_breaker("search", closed="1x5 0x25", open="0x5 1x25", half_open="0x30"),
            _refused("search", "circuit_open", "0x5 10+10x24"),
            *_breaker(
                "flapping",
                closed="1x5 0x25",
                open="0x5 " + _cycle((1, 0), 25),
                half_open="0x5 " + _cycle((0, 1), 25),
            ),
            _refused("flapping", "circuit_open", "0x5 5+5x24"),
            _refused("flapping", "circuit_probing", "0x5 1+1x24"),
            *_breaker("quiet", closed="0x30", open="1x30", half_open="0x30"),
            _refused("quiet", "circuit_open", "0x30"),
            *_breaker("closed", closed="1x30", open="0x30", half_open="0x30"),
            _refused("closed", "circuit_open", "0+2x30"),
            _refused("closed", "no_host", "0+2x30"),
        ],
        "alert_rule_test": [
            _quiet("PipeworkBackendCircuitOpen", "6m"),
            _each_fires(
                "PipeworkBackendCircuitOpen",
                "warning",
                {"service": "flapping"},
                {"service": "search"},
            ),
        ],
    },
    {
        # "search" keeps exhausting its budget; "users" did once, at minute 11.
        "input_series": [
            {
                "series": f"pipework_backend_retry_budget_exhausted_total{{{INSTANCE}, "
                f'service="search"}}',
                "values": "0+3x30",
            },
            {
                "series": f"pipework_backend_retry_budget_exhausted_total{{{INSTANCE}, "
                f'service="users"}}',
                "values": "0x10 1x20",
            },
        ],
        "alert_rule_test": [
            _quiet("PipeworkBackendRetryBudgetExhausted", "8m"),
            _each_fires("PipeworkBackendRetryBudgetExhausted", "warning", {"service": "search"}),
        ],
    },
]


def run_alert_tests(tmp_path: Path, cases: list[dict[str, Any]]) -> None:
    (tmp_path / "rules.yml").write_text(without_annotations(rule_file()))
    tests = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", **case} for case in cases],
    }
    (tmp_path / "tests.yml").write_text(json.dumps(tests, indent=1))
    promtool("test", "rules", str(tmp_path / "tests.yml"))


def test_alerts_fire_on_the_series_they_are_meant_for(tmp_path: Path) -> None:
    run_alert_tests(tmp_path, ALERT_CASES)


def test_every_shipped_alert_is_tested_firing() -> None:
    alerts = set(re.findall(r"^\s+- alert: (\w+)$", rule_file(), flags=re.MULTILINE))
    fired = {
        test["alertname"]
        for case in ALERT_CASES
        for test in case["alert_rule_test"]
        if test["exp_alerts"]
    }
    assert alerts - fired == set(), "alerts no promtool case makes fire"


def steady_series(exposition: str, families: tuple[str, ...]) -> list[dict[str, str]]:
    """The exposition's counters and histogram series of ``families`` as promtool input:
    the same calls again every minute, for 30 minutes."""
    series = []
    for family in text_string_to_metric_families(exposition):
        if family.name not in families:
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = ", ".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            series.append(
                {
                    "series": f"{sample.name}{{{INSTANCE}, {labels}}}",
                    "values": f"0+{sample.value:g}x30",
                }
            )
    return series


async def test_a_hanging_backend_fires_errors_not_slowness(tmp_path: Path) -> None:
    """The demo's service timeout (1 s) against a real backend that never answers: every
    call is cut at 1 s. Nothing took longer than its timeout, so neither Slow alert may
    fire; the calls failed, so PipeworkBackendErrors must."""
    calls = 12
    exposition = await demo_under_a_hanging_backend(calls)
    series = steady_series(
        exposition,
        (
            "pipework_backend_latency_seconds",
            "pipework_pipe_duration_seconds",
            "pipework_backend_calls",
        ),
    )
    assert any('outcome="timeout"' in s["series"] for s in series), series
    case = {
        "input_series": series,
        "alert_rule_test": [
            _quiet("PipeworkBackendSlow"),
            _quiet("PipeworkPipeSlow"),
            _fires("PipeworkBackendErrors", service="users", severity="warning"),
        ],
    }
    run_alert_tests(tmp_path, [case])


# -- promtool ------------------------------------------------------------------------------


def promtool(*args: str) -> None:
    binary = shutil.which("promtool")
    assert binary is not None, "promtool is missing: run scripts/ensure-tools (package prometheus)"
    done = subprocess.run([binary, *args], capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}{done.stderr}"
