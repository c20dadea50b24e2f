"""The line scanner: which line each key path of a TOML file starts on."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given

from pipework.registry._config_lines import scan_lines

from .test_config_emit import documents, emit

SAMPLE = '''\
# a comment with [brackets] and = signs
title = "x # not a comment [nor a table]"

[server]   # trailing comment
port = 8080
"quoted key" = 'lit\\eral'
"esc\\u0041ped" = 1
a.b.c = true

[routes.order]
chain = [
  "get_user",   # a comment inside an array
  { any_of = ["a", "b"], timeout = 1.5 },
  [
    "nested",
  ],
  { graph = { A = { pipe = "a", after = [] } } },
]
text = """
multi-line with "quotes" and [brackets] and ] and }
"""
raw = \'\'\'another
one\'\'\'
when = 1979-05-27 07:32:00Z
after = 1

[[arrays]]
x = 1

[[arrays]]
x = 2
'''


def test_sample_positions() -> None:
    lines = scan_lines(SAMPLE, strict=True)
    expected: dict[tuple[Any, ...], int] = {
        ("title",): 2,
        ("server",): 4,
        ("server", "port"): 5,
        ("server", "quoted key"): 6,
        ("server", "escAped"): 7,
        ("server", "a"): 8,
        ("server", "a", "b", "c"): 8,
        ("routes",): 10,
        ("routes", "order"): 10,
        ("routes", "order", "chain"): 11,
        ("routes", "order", "chain", 0): 12,
        ("routes", "order", "chain", 1): 13,
        ("routes", "order", "chain", 1, "any_of", 1): 13,
        ("routes", "order", "chain", 1, "timeout"): 13,
        ("routes", "order", "chain", 2): 14,
        ("routes", "order", "chain", 2, 0): 15,
        ("routes", "order", "chain", 3, "graph", "A", "after"): 17,
        ("routes", "order", "text"): 19,
        ("routes", "order", "raw"): 22,
        ("routes", "order", "when"): 24,
        ("routes", "order", "after"): 25,
        ("arrays",): 27,
        ("arrays", 0): 27,
        ("arrays", 0, "x"): 28,
        ("arrays", 1): 30,
        ("arrays", 1, "x"): 31,
    }
    assert {path: lines.get(path) for path in expected} == expected


def test_multi_line_strings_may_end_with_quotes() -> None:
    text = "a = \"\"\"x\"\"\"\"\nb = '''y'''''\nc = 3\n"
    assert scan_lines(text, strict=True)[("c",)] == 3


def test_line_continuation_in_multi_line_basic_strings() -> None:
    text = 'a = """one \\\n  two"""\nb = 2\n'
    assert scan_lines(text, strict=True)[("b",)] == 3


def test_a_path_is_placed_where_it_first_appears() -> None:
    text = "[a.b]\nx = 1\n[a]\ny = 2\n"
    lines = scan_lines(text, strict=True)
    assert lines[("a",)] == 1
    assert lines[("a", "y")] == 4


def test_text_it_cannot_follow_gives_what_it_has() -> None:
    # Not valid TOML (the loader never scans such text); the scanner must not raise.
    text = "a = 1\nb = [1, 2\n"
    assert scan_lines(text) == {("a",): 1, ("b",): 2, ("b", 0): 2, ("b", 1): 2}
    with pytest.raises(IndexError):
        scan_lines(text, strict=True)


@given(documents)
def test_every_written_path_is_found_on_its_line(data: dict[str, Any]) -> None:
    text, expected = emit(data)
    found = scan_lines(text, strict=True)
    assert {path: found.get(path) for path in expected} == expected


def test_windows_line_endings_and_tabs() -> None:
    text = '[a]\r\nx = 1\r\ny = [\r\n  1,\r\n  2\r\n]\r\n\t[b]  \r\nz="q"\r\n'
    assert scan_lines(text, strict=True) == {
        ("a",): 1,
        ("a", "x"): 2,
        ("a", "y"): 3,
        ("a", "y", 0): 4,
        ("a", "y", 1): 5,
        ("b",): 7,
        ("b", "z"): 8,
    }
