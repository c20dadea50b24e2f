"""``[tracing]``: every mistake named by its key path, the environment's ``OTEL_*``
variables for what the file leaves out, and ``pipework check`` saying it all."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipework import ConfigError, config_from_dict
from pipework._cli_config import check
from pipework._tracing import NO_TRACING
from pipework._tracing_otel import OtelTracing
from pipework.registry import _config_tracing
from pipework.registry._config_tracing import TracingSettings

ROUTES: dict[str, Any] = {
    "pipes": {"p": {"python": "tests.test_config_corpus:enrich"}},
    "routes": {"r": {"path": "/r", "chain": ["p"]}},
}


def problems(tracing: Any) -> list[str]:
    with pytest.raises(ConfigError) as raised:
        config_from_dict({**ROUTES, "tracing": tracing})
    return [f"{p.path}: {p.message}" for p in raised.value.problems]


def test_without_the_section_tracing_is_off() -> None:
    settings = config_from_dict(ROUTES).tracing
    assert settings == TracingSettings()
    assert settings.build({}) is NO_TRACING


def test_every_key_is_read() -> None:
    tracing = {
        "enabled": True,
        "exporter": "console",
        "sample_ratio": 0.25,
        "service_name": "shop",
    }
    settings = config_from_dict({**ROUTES, "tracing": tracing}).tracing
    assert settings == TracingSettings(True, "console", None, 0.25, "shop")
    built = settings.build({})
    assert isinstance(built, OtelTracing)
    built.shutdown()


def test_every_mistake_is_named_by_its_key_path() -> None:
    found = problems(
        {
            "enabled": "yes",
            "exporter": "jaeger",
            "endpoint": "grpc://collector:4317",
            "sample_ratio": 1.5,
            "service_nam": "shop",
        }
    )
    assert found == [
        "tracing.service_nam: unknown key; did you mean 'service_name'?",
        'tracing.enabled: expected a boolean, got a string ("yes")',
        "tracing.exporter: unknown value 'jaeger'; expected one of: otlp, console, none",
        "tracing.endpoint: expected an http:// or https:// URL (OTLP over HTTP, e.g. "
        "http://collector:4318/v1/traces), got 'grpc://collector:4317'",
        "tracing.sample_ratio: must be between 0 and 1, got 1.5",
    ]
    assert problems("on") == ['tracing: expected a table, got a string ("on")']


def test_an_endpoint_another_exporter_ignores_is_a_warning() -> None:
    tracing = {"exporter": "console", "endpoint": "http://collector:4318/v1/traces"}
    config = config_from_dict({**ROUTES, "tracing": tracing})
    assert [f"{w.path}: {w.message}" for w in config.warnings] == [
        "tracing.endpoint: not used: the exporter is 'console', not 'otlp'"
    ]


@pytest.mark.parametrize(
    ("enabled", "environ", "on", "exporter"),
    [
        (None, {}, False, "otlp"),
        (None, {"OTEL_TRACES_EXPORTER": "console"}, True, "console"),
        (None, {"OTEL_TRACES_EXPORTER": "none"}, False, "none"),
        (True, {}, True, "otlp"),
        (False, {"OTEL_TRACES_EXPORTER": "otlp"}, False, "otlp"),
        (True, {"OTEL_SDK_DISABLED": "true"}, False, "otlp"),
    ],
)
def test_what_the_file_leaves_out_the_environment_says(
    enabled: bool | None, environ: dict[str, str], on: bool, exporter: str
) -> None:
    settings = TracingSettings(enabled=enabled)
    assert settings.is_on(environ) is on
    assert settings.exporter_of(environ) == exporter


def test_check_reports_the_section_with_key_paths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(
        """
[pipes.p]
python = "tests.test_config_corpus:enrich"

[routes.r]
path = "/r"
chain = ["p"]

[tracing]
enabled = true
exporter = "otel"
sample_ratio = -1
"""
    )
    assert check(path) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        f"{path}: 2 errors",
        f"  {path}:11: error: tracing.exporter: unknown value 'otel'; did you mean 'otlp'? "
        "expected one of: otlp, console, none",
        f"  {path}:12: error: tracing.sample_ratio: must be 0 or more, got -1",
    ]


def test_tracing_enabled_without_the_extra_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on an installation without ``pipework[otel]``: nothing of it is found."""
    monkeypatch.setattr(_config_tracing, "_installed", lambda module: False)
    assert problems({"enabled": True}) == [
        "tracing.enabled: tracing needs OpenTelemetry's SDK: install the otel extra: "
        "pip install 'pipework[otel]'"
    ]
    # Off, or left to an environment that leaves it off, it needs nothing.
    assert config_from_dict({**ROUTES, "tracing": {"enabled": False}}).tracing.enabled is False
