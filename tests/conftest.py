"""Shared test configuration."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

# Every test fails, instead of hanging the run, if it runs too long (see the module).
pytest_plugins = ["tests._hang_guard"]

# No per-example deadline: a loaded 2-core machine must not make property tests flaky.
settings.register_profile(
    "pipework",
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("pipework")
