"""A small TOML writer for tests: it turns generated data into text and says on which line
it wrote each key path, so the line scanner and the loader can be checked against it.

Tables become ``[headers]``, arrays are written one element per line, and anything inside
an array is written inline; that exercises headers, keys, multi-line arrays and inline
tables. This file's tests check the writer itself: what it writes, tomllib reads back.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from datetime import datetime
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from pipework.registry._config_problems import KeyPath

_BARE = re.compile(r"[A-Za-z0-9_-]+\Z")


def toml_key(key: str) -> str:
    return key if _BARE.match(key) else toml_string(key)


def toml_string(text: str) -> str:
    # JSON's escapes are TOML's, except that TOML wants DEL escaped too.
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def inline(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(inline(v) for v in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{toml_key(k)} = {inline(v)}" for k, v in value.items())
        return "{ " + items + " }" if items else "{}"
    raise TypeError(f"cannot write {value!r} as TOML")


def emit(data: dict[str, Any]) -> tuple[str, dict[KeyPath, int]]:
    """TOML text for ``data`` and the line on which each key path starts."""
    out: list[str] = []
    lines: dict[KeyPath, int] = {}
    _table(data, (), out, lines)
    return "\n".join(out) + "\n", lines


def _table(data: dict[str, Any], path: KeyPath, out: list[str], lines: dict[KeyPath, int]) -> None:
    for key, value in data.items():
        if isinstance(value, dict):
            continue
        here = (*path, key)
        lines[here] = len(out) + 1
        if isinstance(value, list) and value:
            out.append(f"{toml_key(key)} = [")
            for i, item in enumerate(value):
                _inline_lines(item, (*here, i), len(out) + 1, lines)
                out.append(f"  {inline(item)},")
            out.append("]")
        else:
            _inline_lines(value, here, len(out) + 1, lines)
            out.append(f"{toml_key(key)} = {inline(value)}")
    for key, value in data.items():
        if isinstance(value, dict):
            here = (*path, key)
            lines[here] = len(out) + 1
            out.append("[" + ".".join(toml_key(str(k)) for k in here) + "]")
            _table(value, here, out, lines)


def _inline_lines(value: Any, path: KeyPath, line: int, lines: dict[KeyPath, int]) -> None:
    lines[path] = line
    if isinstance(value, dict):
        for key, item in value.items():
            _inline_lines(item, (*path, key), line, lines)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _inline_lines(item, (*path, i), line, lines)


keys = st.text(max_size=6)
scalars = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.datetimes(),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
    max_leaves=12,
)
documents = st.dictionaries(keys, values, max_size=4)


@given(documents)
def test_what_is_written_reads_back(data: dict[str, Any]) -> None:
    text, _ = emit(data)
    assert tomllib.loads(text) == data


def test_the_writer_records_lines() -> None:
    text, lines = emit({"a": 1, "b": [1, {"c": 2}], "t": {"x": "y", "u": {}}})
    assert text == 'a = 1\nb = [\n  1,\n  { c = 2 },\n]\n[t]\nx = "y"\n[t.u]\n'
    assert lines[("b", 1, "c")] == 4
    assert lines[("t", "u")] == 8
