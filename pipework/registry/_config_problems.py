"""Problems found in a gateway configuration, and the one error that carries them all.

Validation never stops at the first problem: every check reports into a
:class:`Collector`, and loading fails once, at the end, with a :class:`ConfigError`
listing everything, each problem with its key path (``routes.order.chain[2].any_of[0]``)
and, when the source text is known, its line.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import date, datetime, time
from typing import Any, Final, Literal, TypeAlias

from .._errors import PipeworkError

__all__ = [
    "ConfigError",
    "KeyPath",
    "Problem",
    "Severity",
    "close_match",
    "describe_value",
    "format_path",
]

Severity: TypeAlias = Literal["error", "warning"]
KeyPath: TypeAlias = tuple[str | int, ...]

_BARE_KEY: Final = re.compile(r"[A-Za-z0-9_-]+\Z")


def format_path(path: KeyPath) -> str:
    """``("routes", "order", "chain", 2)`` as ``routes.order.chain[2]``; keys that are not
    bare TOML keys are quoted, as they would be written in the file."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            key = part if _BARE_KEY.match(part) else json.dumps(part, ensure_ascii=False)
            out += f".{key}" if out else key
    return out


@dataclass(frozen=True, slots=True)
class Problem:
    """One problem: where (``path``, ``line`` when known), what, and how bad."""

    path: str
    message: str
    line: int | None = None
    severity: Severity = "error"

    def format(self, source: str = "") -> str:
        """As a compiler would print it: ``gateway.toml:12: error: path: message``
        (``line 12: error: ...`` without a source)."""
        if source:
            where = source if self.line is None else f"{source}:{self.line}"
        else:
            where = "" if self.line is None else f"line {self.line}"
        what = f"{self.path}: {self.message}" if self.path else self.message
        return f"{where}: {self.severity}: {what}" if where else f"{self.severity}: {what}"

    def __str__(self) -> str:
        return self.format()


class ConfigError(PipeworkError, ValueError):
    """A configuration that cannot be served: ``problems`` lists every error (and the
    warnings found with them), in file order; ``source`` names the file."""

    def __init__(self, problems: Iterable[Problem], source: str = "") -> None:
        self.problems = tuple(problems)
        self.source = source
        errors = sum(p.severity == "error" for p in self.problems)
        warnings = len(self.problems) - errors
        counts = _plural(errors, "error") + (
            f", {_plural(warnings, 'warning')}" if warnings else ""
        )
        lines = [f"{source or 'configuration'}: {counts}"]
        lines.extend(f"  {p.format(source)}" for p in self.problems)
        super().__init__("\n".join(lines))

    @property
    def errors(self) -> tuple[Problem, ...]:
        return tuple(p for p in self.problems if p.severity == "error")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


class Collector:
    """Where checks report. ``lines`` maps key paths to line numbers (see
    :mod:`._config_lines`); a path without an entry takes its nearest ancestor's line."""

    def __init__(self, lines: Mapping[KeyPath, int] | None = None) -> None:
        self._lines = lines or {}
        self._found: list[tuple[KeyPath, Problem]] = []

    def error(self, path: KeyPath, message: str) -> None:
        self._add(path, message, "error")

    def warn(self, path: KeyPath, message: str) -> None:
        self._add(path, message, "warning")

    def _add(self, path: KeyPath, message: str, severity: Severity) -> None:
        problem = Problem(format_path(path), message, self.line_of(path), severity)
        self._found.append((path, problem))

    def line_of(self, path: KeyPath) -> int | None:
        for end in range(len(path), 0, -1):
            line = self._lines.get(path[:end])
            if line is not None:
                return line
        return None

    def failed(self, prefix: KeyPath) -> bool:
        """Whether an error was reported at ``prefix`` or below it."""
        n = len(prefix)
        return any(path[:n] == prefix and p.severity == "error" for path, p in self._found)

    @property
    def has_errors(self) -> bool:
        return any(p.severity == "error" for _, p in self._found)

    def problems(self) -> tuple[Problem, ...]:
        """Every problem, by line (those without one last), then in the order found."""
        found = [p for _, p in self._found]
        return tuple(sorted(found, key=lambda p: p.line if p.line is not None else 1 << 62))


def close_match(word: object, choices: Collection[str]) -> str | None:
    """The choice ``word`` was most likely meant to be, if one is close enough."""
    if not isinstance(word, str):
        return None
    found = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=0.6)
    return found[0] if found else None


_TYPE_NAMES: Final[tuple[tuple[type, str], ...]] = (
    (bool, "a boolean"),
    (int, "an integer"),
    (float, "a float"),
    (str, "a string"),
    (list, "an array"),
    (dict, "a table"),
    (datetime, "a datetime"),
    (date, "a date"),
    (time, "a time"),
)


def describe_value(value: Any) -> str:
    """``a string ("fast")``, ``an array``: the TOML type, with short scalars shown."""
    for kind, name in _TYPE_NAMES:
        if isinstance(value, kind):
            if isinstance(value, bool | int | float | str):
                shown = json.dumps(value, ensure_ascii=False) if isinstance(value, str) else value
                text = str(shown).lower() if isinstance(value, bool) else str(shown)
                return f"{name} ({text})" if len(text) <= 40 else name
            return name
    return f"a {type(value).__name__}"
