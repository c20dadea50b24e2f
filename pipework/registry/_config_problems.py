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
from collections.abc import Collection, Mapping
from datetime import date, datetime, time
from typing import Any, Final, TypeAlias

from .._errors import ConfigError as ConfigError
from .._errors import ConfigProblem as Problem
from .._errors import Severity as Severity

__all__ = [
    "ConfigError",
    "KeyPath",
    "Problem",
    "Severity",
    "close_match",
    "describe_value",
    "format_path",
]

KeyPath: TypeAlias = tuple[str | int, ...]

_BARE_KEY: Final = re.compile(r"[A-Za-z0-9_-]+\Z")
_ESCAPES: Final = {c: repr(chr(c))[1:-1] for c in (*range(0x20), 0x7F)}


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
        # A name from the file may hold a line break; a problem stays one line.
        message = message.translate(_ESCAPES)
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
