"""The ``[tracing]`` section: OpenTelemetry spans (the ``otel`` extra; docs/tracing.md).

Every key is optional; one left out is taken from the standard ``OTEL_*`` environment
variables as the SDK reads them (``OTEL_TRACES_EXPORTER``, ``OTEL_EXPORTER_OTLP_*``,
``OTEL_TRACES_SAMPLER``, ``OTEL_SERVICE_NAME``). Without ``enabled``, tracing is on when
``OTEL_TRACES_EXPORTER`` names an exporter; ``OTEL_SDK_DISABLED=true`` turns it off
whatever the file says. It is read at start-up: a reload does not change it.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

from .._tracing import NO_TRACING, Tracing
from ._config_problems import Collector, KeyPath
from ._config_read import open_table

__all__ = ["TracingSettings", "read_tracing"]

TRACING_KEYS: Final = ("enabled", "exporter", "endpoint", "sample_ratio", "service_name")
EXPORTERS: Final = ("otlp", "console", "none")
#: What each part needs installed (the ``otel`` extra has them all).
_SDK: Final = "opentelemetry.sdk"
_OTLP: Final = "opentelemetry.exporter.otlp.proto.http"
_INSTALL: Final = "install the otel extra: pip install 'pipework[otel]'"


@dataclass(frozen=True, slots=True)
class TracingSettings:
    """``[tracing]``: None for a key the file leaves to the environment."""

    enabled: bool | None = None
    exporter: str | None = None
    endpoint: str | None = None
    sample_ratio: float | None = None
    service_name: str | None = None

    def is_on(self, environ: Mapping[str, str]) -> bool:
        if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return False
        if self.enabled is not None:
            return self.enabled
        return _env_exporter(environ) not in (None, "none")

    def exporter_of(self, environ: Mapping[str, str]) -> str:
        return self.exporter or _env_exporter(environ) or "otlp"

    def build(self, environ: Mapping[str, str]) -> Tracing:
        """The process's tracing: :data:`~pipework._tracing.NO_TRACING` when off (nothing
        of OpenTelemetry imported), else the SDK's. RuntimeError, saying what to install,
        when it is on and the SDK is not installed."""
        if not self.is_on(environ):
            return NO_TRACING
        exporter = self.exporter_of(environ)
        try:
            from .._tracing_otel import build  # the otel extra, imported only when on
        except ImportError as exc:
            raise RuntimeError(f"[tracing] is on but OpenTelemetry is missing: {_INSTALL}") from exc
        return build(
            exporter=exporter,
            endpoint=self.endpoint,
            sample_ratio=self.sample_ratio,
            service_name=self.service_name,
        )


def _env_exporter(environ: Mapping[str, str]) -> str | None:
    # The SDK's variable may list several; pipework exports to one (the first).
    first = environ.get("OTEL_TRACES_EXPORTER", "").split(",")[0].strip().lower()
    return first or None


def read_tracing(
    c: Collector, value: Any, environ: Mapping[str, str] | None = None
) -> TracingSettings:
    path: KeyPath = ("tracing",)
    if value is None:
        return TracingSettings()
    t = open_table(c, path, value, TRACING_KEYS)
    if t is None:
        return TracingSettings()
    enabled = t.boolean("enabled", False) if "enabled" in t else None
    exporter = t.string("exporter", None, choices=EXPORTERS)
    endpoint = t.string("endpoint", None)
    if endpoint is not None:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            c.error(
                t.at("endpoint"),
                f"expected an http:// or https:// URL (OTLP over HTTP, e.g. "
                f"http://collector:4318/v1/traces), got {endpoint!r}",
            )
            endpoint = None
        elif exporter is not None and exporter != "otlp":
            c.warn(t.at("endpoint"), f"not used: the exporter is {exporter!r}, not 'otlp'")
    ratio = t.number("sample_ratio", None, positive=False)
    if ratio is not None and not (0.0 <= ratio <= 1.0 and math.isfinite(ratio)):
        c.error(t.at("sample_ratio"), f"must be between 0 and 1, got {ratio:g}")
        ratio = None
    settings = TracingSettings(
        enabled=enabled,
        exporter=exporter,
        endpoint=endpoint,
        sample_ratio=ratio,
        service_name=t.string("service_name", None),
    )
    if enabled:  # what it needs must be installed, or serving would fail at start-up
        if not _installed(_SDK):
            c.error(t.at("enabled"), f"tracing needs OpenTelemetry's SDK: {_INSTALL}")
        elif settings.exporter_of(os.environ if environ is None else environ) == "otlp" and (
            not _installed(_OTLP)
        ):
            c.error(
                t.at("exporter"),
                f"the otlp exporter needs opentelemetry-exporter-otlp-proto-http: {_INSTALL}",
            )
    return settings


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False
