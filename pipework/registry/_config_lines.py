"""Where each key and value sits in a TOML file: a map from key paths to line numbers.

``tomllib`` keeps no positions, so this walks the source text a second time, after
``tomllib`` has accepted it. It is a scanner, not a parser: it skips strings and comments,
follows table headers, dotted keys, arrays (elements are numbered) and inline tables, and
records the line where each path first appears. It never interprets values.

Limits: a path is recorded where it is *first* written (a table extended later by dotted
keys keeps its first line); a problem about something absent (a required key) points at
the nearest enclosing table or key that is present. If the scanner meets text it does not
understand, :func:`scan_lines` returns what it has so far: positions are a courtesy and
never make loading fail.
"""

from __future__ import annotations

import bisect
import tomllib
from typing import Final

from ._config_problems import KeyPath

__all__ = ["scan_lines"]

_BARE: Final = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_SCALAR_END: Final = frozenset(",]}\n\r#")


def scan_lines(text: str, *, strict: bool = False) -> dict[KeyPath, int]:
    """Map every key path in ``text`` (already valid TOML) to the line it starts on.

    ``strict=True`` raises where the scanner gets lost instead of returning what it has."""
    scanner = _Scanner(text)
    try:
        scanner.document()
    except (IndexError, ValueError, tomllib.TOMLDecodeError):
        if strict:
            raise
    return scanner.lines


class _Scanner:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.lines: dict[KeyPath, int] = {}
        self._newlines = [i for i, c in enumerate(text) if c == "\n"]
        self._tables_in_array: dict[KeyPath, int] = {}

    def record(self, path: KeyPath, pos: int) -> None:
        if path not in self.lines:
            self.lines[path] = bisect.bisect_left(self._newlines, pos) + 1

    # -- structure -------------------------------------------------------------------------

    def document(self) -> None:
        table: KeyPath = ()
        while True:
            self.skip_blank(newlines=True)
            if self.pos >= len(self.text):
                return
            start = self.pos
            if self.text[start] == "[":
                array = self.text.startswith("[[", start)
                self.pos += 2 if array else 1
                keys = tuple(self.key())
                self.expect("]]" if array else "]")
                for end in range(1, len(keys) + 1):
                    self.record(keys[:end], start)
                if array:
                    index = self._tables_in_array.get(keys, 0)
                    self._tables_in_array[keys] = index + 1
                    table = (*keys, index)
                    self.record(table, start)
                else:
                    table = keys
            else:
                self.key_value(table)

    def key_value(self, table: KeyPath) -> None:
        start = self.pos
        keys = self.key()
        for end in range(1, len(keys) + 1):
            self.record((*table, *keys[:end]), start)
        self.expect("=")
        self.skip_blank()
        self.value((*table, *keys))

    def key(self) -> list[str]:
        parts: list[str] = []
        while True:
            self.skip_blank()
            char = self.text[self.pos]
            if char in "\"'":
                start = self.pos
                self.string()
                # A quoted key may hold escapes: let tomllib decode exactly what it decoded.
                raw = self.text[start : self.pos]
                parts.append(tomllib.loads(f"k = {raw}")["k"])
            else:
                start = self.pos
                while self.pos < len(self.text) and self.text[self.pos] in _BARE:
                    self.pos += 1
                if self.pos == start:
                    raise ValueError(f"expected a key at offset {start}")
                parts.append(self.text[start : self.pos])
            self.skip_blank()
            if self.text[self.pos] != ".":
                return parts
            self.pos += 1

    def value(self, path: KeyPath) -> None:
        char = self.text[self.pos]
        if char in "\"'":
            self.string()
        elif char == "[":
            self.array(path)
        elif char == "{":
            self.inline_table(path)
        else:
            start = self.pos
            while self.pos < len(self.text) and self.text[self.pos] not in _SCALAR_END:
                self.pos += 1
            if self.pos == start:
                raise ValueError(f"expected a value at offset {start}")

    def array(self, path: KeyPath) -> None:
        self.pos += 1
        index = 0
        while True:
            self.skip_blank(newlines=True)
            if self.text[self.pos] == "]":
                self.pos += 1
                return
            self.record((*path, index), self.pos)
            self.value((*path, index))
            index += 1
            self.skip_blank(newlines=True)
            if self.text[self.pos] == ",":
                self.pos += 1

    def inline_table(self, path: KeyPath) -> None:
        self.pos += 1
        while True:
            self.skip_blank(newlines=True)
            if self.text[self.pos] == "}":
                self.pos += 1
                return
            self.key_value(path)
            self.skip_blank(newlines=True)
            if self.text[self.pos] == ",":
                self.pos += 1

    # -- lexical ---------------------------------------------------------------------------

    def string(self) -> None:
        text, quote = self.text, self.text[self.pos]
        if text.startswith(quote * 3, self.pos):
            self.pos += 3
            while True:
                if quote == '"' and text[self.pos] == "\\":
                    self.pos += 2
                elif text.startswith(quote * 3, self.pos):
                    end = self.pos + 3
                    while end < len(text) and text[end] == quote and end - self.pos < 5:
                        end += 1  # up to two quotes may end the content itself
                    self.pos = end
                    return
                else:
                    self.pos += 1
        self.pos += 1
        while True:
            char = text[self.pos]
            if quote == '"' and char == "\\":
                self.pos += 2
            elif char == quote:
                self.pos += 1
                return
            elif char == "\n":
                raise ValueError(f"unterminated string at offset {self.pos}")
            else:
                self.pos += 1

    def skip_blank(self, *, newlines: bool = False) -> None:
        text = self.text
        while self.pos < len(text):
            char = text[self.pos]
            if char in " \t" or (newlines and char in "\r\n"):
                self.pos += 1
            elif char == "#" and newlines:
                end = text.find("\n", self.pos)
                self.pos = len(text) if end < 0 else end
            else:
                return

    def expect(self, token: str) -> None:
        self.skip_blank()
        if not self.text.startswith(token, self.pos):
            raise ValueError(f"expected {token!r} at offset {self.pos}")
        self.pos += len(token)
