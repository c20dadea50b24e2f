"""The report service's settings, read from a TOML file (``report.toml`` beside this module).

Every problem is reported at once, each with its key path (``pdf.pool_size: ...``), and an
unknown key gets a did-you-mean: a bad file fails before anything starts. Relative paths in
the file are relative to the file's own directory.
"""

from __future__ import annotations

import difflib
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from .pdf import WorkerSettings

__all__ = ["DEFAULT_CONFIG", "ReportConfig", "ReportConfigError", "config_from_dict", "load_config"]

DEFAULT_CONFIG: Final = Path(__file__).with_name("report.toml")
DEFAULT_TEMPLATES: Final = Path(__file__).with_name("templates")
MAX_POOL: Final = 64


class ReportConfigError(ValueError):
    """A config with problems; ``problems`` lists each as ``key.path: what``."""

    def __init__(self, source: str, problems: list[str]) -> None:
        super().__init__(f"{source}: " + f"\n{source}: ".join(problems))
        self.problems = problems


@dataclass(frozen=True, slots=True)
class ReportConfig:
    """Where to serve, what to load, and the PDF pool (see report.toml for each key)."""

    host: str = "127.0.0.1"
    port: int = 8100
    timeout: float = 90.0
    shutdown_grace: float = 5.0
    templates: Path = DEFAULT_TEMPLATES
    storage: Path | None = None
    pool_size: int = 4
    borrow_timeout: float = 30.0
    pdf: WorkerSettings = field(default_factory=WorkerSettings)

    def __post_init__(self) -> None:
        # The file's keys are checked with their paths by config_from_dict; this catches
        # the same mistakes made in Python.
        checks = {
            "server.port": _check("port", self.port),
            "server.timeout": _check("seconds", self.timeout),
            "server.shutdown_grace": _check("grace", self.shutdown_grace),
            "pdf.pool_size": _check("size", self.pool_size),
            "pdf.borrow_timeout": _check("seconds", self.borrow_timeout),
        }
        problems = [f"{key}: {problem}" for key, problem in checks.items() if problem]
        if problems:
            raise ReportConfigError("ReportConfig", problems)


# section -> key -> (kind, where it goes)
_SCHEMA: Final[Mapping[str, Mapping[str, str]]] = {
    "server": {"host": "str", "port": "port", "timeout": "seconds", "shutdown_grace": "grace"},
    "templates": {"directory": "path"},
    "storage": {"directory": "path"},
    "pdf": {
        "pool_size": "size",
        "borrow_timeout": "seconds",
        "launch_timeout": "seconds",
        "render_timeout": "seconds",
        "chromium": "str",
        "trace": "path",
    },
}


def _unknown(key: str, known: Any) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown key{hint} (known: {', '.join(sorted(known))})"


def _check(kind: str, value: Any) -> str | None:
    """What is wrong with ``value`` for a key of ``kind``, or None."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if kind in ("str", "path"):
        return None if isinstance(value, str) and value else "must be a non-empty string"
    if kind == "size":
        if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_POOL:
            return None
        return f"must be a whole number from 1 to {MAX_POOL}, not {value!r}"
    if kind == "port":
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 65535:
            return None
        return f"must be a port number from 0 to 65535, not {value!r}"
    if kind == "seconds":
        if number and math.isfinite(value) and value > 0:
            return None
        return f"must be a number of seconds above 0, not {value!r}"
    if number and math.isfinite(value) and value >= 0:  # grace
        return None
    return f"must be a number of seconds, 0 or more, not {value!r}"


def config_from_dict(data: Mapping[str, Any], *, base: Path, source: str) -> ReportConfig:
    """The config a parsed file declares; raises :class:`ReportConfigError`."""
    problems: list[str] = []
    values: dict[str, Any] = {}
    for section, table in data.items():
        if section not in _SCHEMA:
            problems.append(f"{section}: {_unknown(section, _SCHEMA)}")
            continue
        if not isinstance(table, dict):
            problems.append(f"{section}: must be a table ([{section}])")
            continue
        for key, value in table.items():
            where = f"{section}.{key}"
            kind = _SCHEMA[section].get(key)
            if kind is None:
                problems.append(f"{where}: {_unknown(key, _SCHEMA[section])}")
            elif (problem := _check(kind, value)) is not None:
                problems.append(f"{where}: {problem}")
            else:
                values[where] = base / value if kind == "path" else value
    if problems:
        raise ReportConfigError(source, problems)
    defaults = ReportConfig()
    workers = WorkerSettings(
        chromium=values.get("pdf.chromium", defaults.pdf.chromium),
        launch_timeout=float(values.get("pdf.launch_timeout", defaults.pdf.launch_timeout)),
        render_timeout=float(values.get("pdf.render_timeout", defaults.pdf.render_timeout)),
        trace=str(values["pdf.trace"]) if "pdf.trace" in values else None,
    )
    return ReportConfig(
        host=values.get("server.host", defaults.host),
        port=values.get("server.port", defaults.port),
        timeout=float(values.get("server.timeout", defaults.timeout)),
        shutdown_grace=float(values.get("server.shutdown_grace", defaults.shutdown_grace)),
        templates=values.get("templates.directory", defaults.templates),
        storage=values.get("storage.directory"),
        pool_size=values.get("pdf.pool_size", defaults.pool_size),
        borrow_timeout=float(values.get("pdf.borrow_timeout", defaults.borrow_timeout)),
        pdf=workers,
    )


def load_config(path: Path = DEFAULT_CONFIG) -> ReportConfig:
    try:
        with open(path, "rb") as file:
            data = tomllib.load(file)
    except OSError as error:
        raise ReportConfigError(str(path), [f"cannot be read ({error.strerror})"]) from error
    except tomllib.TOMLDecodeError as error:
        raise ReportConfigError(str(path), [f"is not valid TOML ({error})"]) from error
    return config_from_dict(data, base=path.resolve().parent, source=str(path))
