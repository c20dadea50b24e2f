"""Typed reading of one TOML table: each getter checks a value's type and range, reports any
problem with its key path, and returns a usable fallback so the checks can go on.

Unknown keys are reported when the table is opened, with a did-you-mean."""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Final, TypeVar

from ._config_problems import Collector, KeyPath, close_match, describe_value

__all__ = ["NAME", "Table", "check_name", "open_table"]

T = TypeVar("T")

#: Names of services, pipes, routes and graph nodes: they appear in logs, metrics and URLs.
NAME: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*\Z")


def check_name(c: Collector, path: KeyPath, name: str, what: str) -> bool:
    if NAME.match(name):
        return True
    c.error(path, f"{what} name {name!r} may use only letters, digits, '_' and '-'")
    return False


def open_table(
    c: Collector,
    path: KeyPath,
    value: Any,
    known: Collection[str],
    *,
    hint: str = "",
) -> Table | None:
    """``value`` as a :class:`Table` whose keys are all in ``known``; None if not a table.

    Unknown keys are reported (``hint`` replaces the list of known keys in the message)."""
    if not isinstance(value, dict):
        c.error(path, f"expected a table, got {describe_value(value)}")
        return None
    for key in value:
        if key not in known:
            report_unknown(c, (*path, key), key, known, hint)
    return Table(c, path, value)


def report_unknown(
    c: Collector, path: KeyPath, key: str, known: Collection[str], hint: str = ""
) -> None:
    guess = close_match(key, known)
    if guess is not None:
        c.error(path, f"unknown key; did you mean {guess!r}?")
    else:
        c.error(path, f"unknown key; {hint or 'expected one of: ' + ', '.join(sorted(known))}")


class Table:
    """Getters for the keys of one table; ``path`` is where the table is."""

    def __init__(self, c: Collector, path: KeyPath, data: Mapping[str, Any]) -> None:
        self.c = c
        self.path = path
        self.data = data

    def __contains__(self, key: str) -> bool:
        return key in self.data

    def at(self, key: str) -> KeyPath:
        return (*self.path, key)

    def _get(self, key: str, required: bool) -> Any:
        if key not in self.data:
            if required:
                self.c.error(self.at(key), "required key is missing")
            return None
        return self.data[key]

    def _wrong(self, key: str, expected: str, value: Any) -> None:
        self.c.error(self.at(key), f"expected {expected}, got {describe_value(value)}")

    def string(
        self,
        key: str,
        default: T,
        *,
        required: bool = False,
        choices: Sequence[str] | None = None,
        nonempty: bool = True,
    ) -> str | T:
        value = self._get(key, required)
        if value is None:
            return default
        if not isinstance(value, str):
            self._wrong(key, "a string", value)
            return default
        if nonempty and not value:
            self.c.error(self.at(key), "must not be empty")
            return default
        if choices is not None and value not in choices:
            guess = close_match(value, choices)
            also = f"did you mean {guess!r}? " if guess else ""
            self.c.error(
                self.at(key),
                f"unknown value {value!r}; {also}expected one of: {', '.join(choices)}",
            )
            return default
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self._get(key, False)
        if value is None:
            return default
        if not isinstance(value, bool):
            self._wrong(key, "a boolean", value)
            return default
        return value

    def integer(
        self,
        key: str,
        default: T,
        *,
        minimum: int | None = None,
        maximum: int | None = None,
        required: bool = False,
    ) -> int | T:
        value = self._get(key, required)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            self._wrong(key, "an integer", value)
            return default
        if minimum is not None and value < minimum:
            self.c.error(self.at(key), f"must be at least {minimum}, got {value}")
            return default
        if maximum is not None and value > maximum:
            self.c.error(self.at(key), f"must be at most {maximum}, got {value}")
            return default
        return value

    def number(
        self, key: str, default: T, *, positive: bool = True, required: bool = False
    ) -> float | T:
        """A finite number (integer or float) of seconds or a ratio; above 0 if
        ``positive``, else 0 or more."""
        value = self._get(key, required)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            self._wrong(key, "a number", value)
            return default
        number = float(value)
        if not math.isfinite(number):
            self.c.error(self.at(key), f"must be a finite number, got {value}")
            return default
        if positive and not number > 0:
            self.c.error(self.at(key), f"must be above 0, got {value}")
            return default
        if not positive and number < 0:
            self.c.error(self.at(key), f"must be 0 or more, got {value}")
            return default
        return number

    def table(self, key: str) -> dict[str, Any] | None:
        value = self._get(key, False)
        if value is None:
            return None
        if not isinstance(value, dict):
            self._wrong(key, "a table", value)
            return None
        return value

    def string_table(self, key: str) -> dict[str, str]:
        """A table of strings (numbers and booleans are taken as their TOML spelling)."""
        table = self.table(key)
        out: dict[str, str] = {}
        for name, value in (table or {}).items():
            if isinstance(value, str):
                out[name] = value
            elif isinstance(value, bool):
                out[name] = "true" if value else "false"
            elif isinstance(value, int | float) and math.isfinite(value):
                out[name] = str(value)
            else:
                self.c.error(
                    (*self.at(key), name), f"expected a string, got {describe_value(value)}"
                )
        return out
