"""The report templates: read and checked once at start-up, filled in memory per request.

A template is an HTML file with ``{{ name }}`` placeholders (the value is HTML-escaped) and
``{{ name | html }}`` ones (the value is markup the service built and escaped itself, such
as the chart). :func:`load_templates` reads every kind's file before the service starts:
a missing file, a file that is not UTF-8, an unclosed ``{{``, or a placeholder the service
does not fill is a :class:`TemplateLoadError` listing every problem with its file and line,
so a broken deployment fails to start instead of failing its first request. The parsed
templates are immutable and shared by every request.
"""

from __future__ import annotations

import difflib
import html
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = ["Template", "TemplateLoadError", "Templates", "load_templates"]

_PLACEHOLDER: Final = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*(\|\s*html\s*)?\}\}")


class TemplateLoadError(Exception):
    """Templates that cannot be used; ``problems`` lists each as ``file:line: what``."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__(
            "the report templates cannot be used:\n  " + "\n  ".join(problems) + "\nfix the "
            "templates (or [templates] directory in the config) and start again"
        )
        self.problems = problems


@dataclass(frozen=True, slots=True)
class Template:
    """A parsed template: literal text and placeholders, alternately."""

    kind: str
    parts: tuple[str | tuple[str, bool], ...]

    def render(self, values: Mapping[str, object]) -> str:
        out: list[str] = []
        for part in self.parts:
            if isinstance(part, str):
                out.append(part)
            else:
                name, raw = part
                value = str(values[name])
                out.append(value if raw else html.escape(value))
        return "".join(out)


def _parse(kind: str, path: Path, text: str, fields: frozenset[str]) -> tuple[Template, list[str]]:
    problems: list[str] = []
    parts: list[str | tuple[str, bool]] = []
    position = 0
    while (start := text.find("{{", position)) != -1:
        line = text.count("\n", 0, start) + 1
        match = _PLACEHOLDER.match(text, start)
        if match is None:
            end = text.find("}}", start)
            shown = text[start : end + 2 if end != -1 else start + 30].split("\n")[0]
            problems.append(
                f"{path}:{line}: {shown!r} is not a placeholder; write {{{{ name }}}} or "
                "{{ name | html }}"
            )
            parts.append(text[position : start + 2])
            position = start + 2
            continue
        name = match.group(1)
        if name not in fields:
            close = difflib.get_close_matches(name, sorted(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append(
                f"{path}:{line}: unknown placeholder {name!r} for a {kind} report{hint} "
                f"(known: {', '.join(sorted(fields))})"
            )
        parts.append(text[position:start])
        parts.append((name, match.group(2) is not None))
        position = match.end()
    parts.append(text[position:])
    return Template(kind, tuple(p for p in parts if p != "")), problems


class Templates:
    """One parsed template per report kind."""

    def __init__(self, templates: Mapping[str, Template]) -> None:
        self._templates = dict(templates)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self._templates)

    def render(self, kind: str, values: Mapping[str, object]) -> str:
        return self._templates[kind].render(values)


def load_templates(directory: Path, kinds: Iterable[str], fields: Iterable[str]) -> Templates:
    """Read ``directory/<kind>.html`` for every kind; raise :class:`TemplateLoadError` with
    every problem found, or return them all parsed."""
    known = frozenset(fields)
    problems: list[str] = []
    parsed: dict[str, Template] = {}
    if not directory.is_dir():
        raise TemplateLoadError([f"{directory}: no such directory"])
    for kind in kinds:
        path = directory / f"{kind}.html"
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            problems.append(f"{path}: missing (the {kind!r} report's template)")
            continue
        except (OSError, UnicodeDecodeError) as error:
            problems.append(f"{path}: cannot be read as UTF-8 ({error})")
            continue
        template, found = _parse(kind, path, text, known)
        problems += found
        parsed[kind] = template
    if problems:
        raise TemplateLoadError(problems)
    return Templates(parsed)
