"""Templates that fill an HTTP call's path, query, headers and body from job state.

``/users/{user_id}`` takes ``state["user_id"]``; ``{user.id}`` walks into nested dicts (and
lists, by index); ``{{`` and ``}}`` are literal braces. A template is parsed once, when the
pipe is declared, so a typo fails at start-up; it is rendered on every call.

Values come from requests, so rendering is where hostile input is met. A path value is
percent-encoded as one segment (``/``, ``?``, ``#``, ``%`` and ``:`` included), so it can
neither leave its segment nor reach the scheme or host; ``.``, ``..`` and empty values are
refused outright because servers collapse such segments. Header values may not hold
control characters (no header injection). A missing state key is a :class:`TemplateError`
(HTTP 400: the request lacked what the call needs).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeAlias
from urllib.parse import quote

from .._errors import TemplateError, TemplateSyntaxError

__all__ = [
    "BodyTemplate",
    "Template",
    "TemplateError",
    "TemplateSyntaxError",
    "parse_body",
    "render_body",
]

_FIELD: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.(?:[A-Za-z_][A-Za-z0-9_]*|[0-9]+))*\Z")
# RFC 3986 path characters (unreserved, sub-delims, ':' and '@'), '/' and escapes.
_PATH_LITERAL: Final = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/]|%[0-9A-Fa-f]{2})*\Z")
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]")


Field: TypeAlias = tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Template:
    """A parsed template: literal text and ``{field}`` placeholders, in order."""

    text: str
    parts: tuple[str | Field, ...]

    @classmethod
    def parse(cls, text: str) -> Template:
        """Parse ``text``; raises :class:`TemplateSyntaxError` naming the position."""
        parts: list[str | Field] = []
        literal: list[str] = []
        i = 0
        while i < len(text):
            char = text[i]
            if char in "{}" and text.startswith(char * 2, i):
                literal.append(char)
                i += 2
            elif char == "}":
                raise TemplateSyntaxError(
                    f"single '}}' at position {i}; write '}}}}' for a literal brace"
                )
            elif char == "{":
                end = text.find("}", i)
                if end < 0:
                    raise TemplateSyntaxError(f"unclosed '{{' at position {i}")
                name = text[i + 1 : end]
                if not _FIELD.match(name):
                    raise TemplateSyntaxError(
                        f"placeholder {{{name}}} must name a state key (letters, digits, '_'), "
                        "optionally followed by .key or .index parts"
                    )
                if literal:
                    parts.append("".join(literal))
                    literal = []
                parts.append(tuple(name.split(".")))
                i = end + 1
            else:
                literal.append(char)
                i += 1
        if literal:
            parts.append("".join(literal))
        return cls(text, tuple(parts))

    @classmethod
    def parse_path(cls, text: str) -> Template:
        """Parse a URL path template: it starts with ``/`` and its literal text is plain
        path characters without ``//``, ``.`` or ``..`` segments, query or fragment."""
        template = cls.parse(text)
        if not text.startswith("/"):
            raise TemplateSyntaxError(f"path {text!r} must start with '/'")
        literal = "".join(p if isinstance(p, str) else "x" for p in template.parts)
        if not _PATH_LITERAL.match(literal):
            raise TemplateSyntaxError(
                f"path {text!r} may hold only URL path characters; put the query in 'query' "
                "and escape other characters as %XX"
            )
        segments = literal.split("/")[1:]
        if any(s in ("", ".", "..") for s in segments[:-1]) or segments[-1] in (".", ".."):
            raise TemplateSyntaxError(f"path {text!r} may not hold '//', '.' or '..' segments")
        return template

    @property
    def fields(self) -> tuple[str, ...]:
        """The placeholders, as written (``user.id``)."""
        return tuple(".".join(p) for p in self.parts if isinstance(p, tuple))

    @property
    def whole(self) -> Field | None:
        """The field if the template is exactly one placeholder, else None."""
        if len(self.parts) == 1 and isinstance(self.parts[0], tuple):
            return self.parts[0]
        return None

    def render(self, state: Mapping[str, Any], *, what: str = "template") -> str:
        """Fill the placeholders with their values as text."""
        return "".join(
            p if isinstance(p, str) else as_text(lookup(state, p), p, what) for p in self.parts
        )

    def render_path(self, state: Mapping[str, Any]) -> str:
        """Fill a path template, each value percent-encoded as a single path segment."""
        out: list[str] = []
        for part in self.parts:
            if isinstance(part, str):
                out.append(part)
                continue
            text = as_text(lookup(state, part), part, "path")
            if text in ("", ".", ".."):
                raise TemplateError(
                    f"path placeholder {{{'.'.join(part)}}} may not be {text!r}: "
                    "it would change which resource the path names"
                )
            out.append(quote(text, safe=""))
        return "".join(out)

    def render_header(self, state: Mapping[str, Any], name: str) -> str | None:
        """A header value, or None when a whole-placeholder template's value is null."""
        whole = self.whole
        if whole is not None and lookup(state, whole) is None:
            return None
        value = self.render(state, what=f"header {name!r}")
        if _CONTROL.search(value):
            raise TemplateError(f"header {name!r} may not hold control characters")
        return value

    def render_query(self, state: Mapping[str, Any], name: str) -> list[str]:
        """A query parameter's values: one, several (a whole placeholder holding a list),
        or none (a whole placeholder holding null)."""
        whole = self.whole
        if whole is not None:
            value = lookup(state, whole)
            if value is None:
                return []
            if isinstance(value, list | tuple):
                return [as_text(item, whole, f"query parameter {name!r}") for item in value]
        return [self.render(state, what=f"query parameter {name!r}")]


def lookup(state: Mapping[str, Any], field: Field) -> Any:
    """The value at ``field`` in ``state``; TemplateError naming the missing part."""
    value: Any = state
    for depth, key in enumerate(field):
        if isinstance(value, Mapping) and key in value:
            value = value[key]
        elif isinstance(value, Sequence) and not isinstance(value, str) and key.isdigit():
            index = int(key)
            if index >= len(value):
                raise TemplateError(f"state has no {'.'.join(field[: depth + 1])}")
            value = value[index]
        else:
            raise TemplateError(f"state has no {'.'.join(field[: depth + 1])}")
    return value


def as_text(value: Any, field: Field, what: str) -> str:
    """A scalar as it appears in a URL or header: JSON spelling for booleans and numbers."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return repr(value)
    raise TemplateError(
        f"{what}: state value {'.'.join(field)} is a {type(value).__name__}; "
        "only strings, numbers and booleans fit here"
    )


#: A body template: the TOML value with every string parsed as a template.
BodyTemplate: TypeAlias = Any


def parse_body(value: Any, path: str = "body") -> BodyTemplate:
    """Parse every string in ``value`` (tables, arrays, scalars) as a template.

    Raises TemplateSyntaxError with the failing part's path in the message."""
    if isinstance(value, str):
        try:
            return Template.parse(value)
        except TemplateSyntaxError as exc:
            raise TemplateSyntaxError(f"{path}: {exc}") from None
    if isinstance(value, Mapping):
        return {k: parse_body(v, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [parse_body(v, f"{path}[{i}]") for i, v in enumerate(value)]
    return value


def render_body(template: BodyTemplate, state: Mapping[str, Any]) -> Any:
    """Fill a body template: a string that is one whole placeholder takes the state value as
    is (a dict stays a dict); other strings are filled as text."""
    if isinstance(template, Template):
        whole = template.whole
        return lookup(state, whole) if whole is not None else template.render(state, what="body")
    if isinstance(template, dict):
        return {k: render_body(v, state) for k, v in template.items()}
    if isinstance(template, list):
        return [render_body(v, state) for v in template]
    return template
